"""A real PostgreSQL server (Debian's packaged binaries, ``apt-get install postgresql-15``) on
127.0.0.1, for Airflow's metadata database when SQLite is not enough.

Its state lives under one directory, ``.local/postgres`` by default: ``password`` (the ``airflow``
role's, mode 0600) and ``server``, what the server itself reads and writes: ``data`` (the cluster),
``run`` (its unix socket) and ``postgres.log``. Clients log in over TCP with SCRAM only; the unix
socket (peer auth, in a 0700 directory) is for this module's own setup as the superuser. Airflow
finds it through :meth:`EmbeddedPostgres.airflow_environment`.

PostgreSQL refuses to run as root: run as root, the server and its tools run as the OS user
``postgres``, which must be able to reach the state directory.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from ipcount.rules.config import STATE_DIR
from ipcount_lab.errors import DatabaseStartError
from ipcount.rules.private_files import read_private_file, write_private_file
from ipcount_lab.service import log_tail, proc_stat

log = logging.getLogger(__name__)
DEBIAN_PG_ROOT = Path("/usr/lib/postgresql")
ROLE = DATABASE = "airflow"
# Airflow's sync engine takes these instead of embedded_airflow's SQLite ones (psycopg2 refuses
# SQLite's "timeout"). libpq would otherwise wait forever on a server that accepts but never answers.
POSTGRES_CONNECT_ARGS = {"connect_timeout": 10}


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def find_bin_dir(version: str | None = None) -> Path:
    """The server binaries of PostgreSQL ``version`` (an existing cluster's), or of the newest
    installed: Debian's /usr/lib/postgresql/<version>/bin, else ``pg_config --bindir``."""
    debian = {p.parent.name: p for p in DEBIAN_PG_ROOT.glob("*/bin") if (p / "initdb").is_file()}
    if version in debian:
        return debian[version]
    if debian and version is None:
        return debian[max(debian, key=_version_key)]
    if pg_config := shutil.which("pg_config"):
        out = subprocess.run([pg_config, "--bindir", "--version"], capture_output=True, text=True).stdout.split("\n")
        if len(out) > 1 and (Path(out[0]) / "initdb").is_file() and \
                (version is None or out[1].split()[1].split(".")[0] == version):
            return Path(out[0])
    raise DatabaseStartError(f"no PostgreSQL {version or ''} server binaries (initdb, pg_ctl, postgres) in "
                             f"{DEBIAN_PG_ROOT}/*/bin or pg_config --bindir; install them: "
                             f"apt-get install postgresql-{version or 15}")


def scram_verifier(password: str, iterations: int = 4096) -> str:
    """What PostgreSQL stores for a SCRAM-SHA-256 password (as psql's \\password computes it), so the
    password itself reaches neither the server nor its log."""
    salt = secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    stored_key = hashlib.sha256(hmac.digest(salted, b"Client Key", "sha256")).digest()
    server_key = hmac.digest(salted, b"Server Key", "sha256")
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def postmaster_pid(data_dir: Path) -> int | None:
    """The pid of the live postmaster of the cluster in ``data_dir``, from its postmaster.pid (a stale
    file after a crash may name some other process by now)."""
    try:
        pid = int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    state = proc_stat(pid)
    if state is None or state[0] == "Z" or str(data_dir).encode() not in cmdline:
        return None
    return pid


def _passable(user: pwd.struct_passwd, directories: list[Path]) -> bool:
    """Whether ``user`` may pass through every one of ``directories`` (search permission)."""
    groups = set(os.getgrouplist(user.pw_name, user.pw_gid))
    for d in directories:
        st = d.stat()
        need = stat.S_IXUSR if st.st_uid == user.pw_uid else stat.S_IXGRP if st.st_gid in groups else stat.S_IXOTH
        if not st.st_mode & need:
            return False
    return True


@dataclass(frozen=True)
class EmbeddedPostgres:
    state_dir: Path = STATE_DIR / "postgres"
    port: int = 5433  # not 5432, which a Debian "main" cluster takes when one runs
    os_user: str = "postgres"  # who runs the server when we are root
    bin_dir: Path | None = None  # None: find_bin_dir()

    def __post_init__(self) -> None:
        # The server gets absolute paths, and _make_server_dir checks the real ancestors.
        object.__setattr__(self, "state_dir", Path(self.state_dir).resolve())

    @property
    def server_dir(self) -> Path:
        """What the server reads and writes."""
        return self.state_dir / "server"

    @property
    def data_dir(self) -> Path:
        return self.server_dir / "data"

    @property
    def socket_dir(self) -> Path:
        return self.server_dir / "run"

    @property
    def log_file(self) -> Path:
        return self.server_dir / "postgres.log"

    @property
    def password_file(self) -> Path:
        return self.state_dir / "password"

    def password(self) -> str:
        """The ``airflow`` role's password, made once and kept in a private file (root's when root)."""
        if not self.password_file.exists():
            self.state_dir.mkdir(parents=True, exist_ok=True)
            write_private_file(self.password_file, secrets.token_urlsafe(24) + "\n", exclusive=True)
        return read_private_file(self.password_file, "the embedded PostgreSQL password")

    def sqlalchemy_url(self, driver: str = "psycopg2") -> str:
        return f"postgresql+{driver}://{ROLE}:{quote(self.password(), safe='')}@127.0.0.1:{self.port}/{DATABASE}"

    def airflow_environment(self) -> dict[str, str]:
        """Airflow's database settings for this server; apply them after embedded_airflow.airflow_env(),
        whose SQLite connect args they replace."""
        return {
            # Airflow 3 derives its async URL from this one (postgresql+asyncpg) and opens that
            # engine in every process, so asyncpg must be installed; docker-compose.yml relies on
            # the same derivation.
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.sqlalchemy_url("psycopg2"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": f"{__name__}.POSTGRES_CONNECT_ARGS",
        }

    # --- running the PostgreSQL tools -------------------------------------------------------------

    def _server_user(self) -> pwd.struct_passwd | None:
        """The OS user to run the server's tools as: ``os_user`` when we are root, else None (ourselves)."""
        if os.geteuid() != 0:
            return None
        try:
            return pwd.getpwnam(self.os_user)
        except KeyError:
            raise DatabaseStartError(f"PostgreSQL cannot run as root and there is no OS user {self.os_user!r}; "
                                     f"apt-get install postgresql-15 makes it") from None

    def _bin(self, name: str) -> str:
        version = None
        try:
            version = (self.data_dir / "PG_VERSION").read_text().strip()  # the binaries must match the cluster
        except OSError:
            pass
        return str((self.bin_dir or find_bin_dir(version)) / name)

    def _run(self, *args: str, stdin: str | None = None) -> str:
        user = self._server_user()
        # PGHOST, PGDATA, PGPASSWORD... of the caller's environment would steer the tools elsewhere.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        as_user = {}
        if user is not None:
            env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
            as_user = dict(user=user.pw_uid, group=user.pw_gid,
                           extra_groups=os.getgrouplist(user.pw_name, user.pw_gid))
        proc = subprocess.run(args, input=stdin, capture_output=True, text=True, env=env, cwd=self.server_dir,
                              stdin=None if stdin is not None else subprocess.DEVNULL, **as_user)
        if proc.returncode != 0:
            raise DatabaseStartError(f"{Path(args[0]).name} failed (exit {proc.returncode}): "
                                     f"{(proc.stderr or proc.stdout).strip()}\n"
                                     f"{self.log_file}:\n{log_tail(self.log_file)}")
        return proc.stdout

    def _own_dir(self, path: Path) -> None:
        """A directory only the server's user (and root) may use."""
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
        if (user := self._server_user()) is not None:
            os.chown(path, user.pw_uid, user.pw_gid)

    def _write(self, path: Path, text: str) -> None:
        write_private_file(path, text)  # mode 0600, as PostgreSQL keeps its files
        if (user := self._server_user()) is not None:
            os.chown(path, user.pw_uid, user.pw_gid)

    def _make_server_dir(self) -> None:
        """``<state_dir>/server``, owned by the server's user. Run as root, that user must be able to
        pass through every ancestor of state_dir: the server opens its files by absolute path for as
        long as it runs, so opening a closed ancestor for it would not last (pytest, for one, closes
        /tmp/pytest-of-root again whenever a session starts)."""
        user = self._server_user()
        if user is not None and not _passable(user, list(self.state_dir.parents)):
            raise DatabaseStartError(f"the OS user {user.pw_name} that runs PostgreSQL cannot reach {self.state_dir} "
                                     f"(a parent directory is closed to it); pick a state dir it can reach, "
                                     f"e.g. under /tmp or /var/lib/postgresql")
        self._own_dir(self.state_dir)
        self._own_dir(self.state_dir / "server")

    def _initdb(self) -> None:
        log.info("initdb: a new PostgreSQL cluster in %s", self.data_dir)
        started = time.monotonic()
        # UTF8 whatever the locale of this shell: Airflow wants a UTF-8 database.
        self._run(self._bin("initdb"), "-D", str(self.data_dir), "--encoding=UTF8", "--locale=C.UTF-8",
                  "--no-instructions")
        # Replaces initdb's "trust everyone local": the superuser only through the (0700) socket, as
        # its OS user; everyone else over TCP on 127.0.0.1 with a SCRAM password. No IPv6, no replication.
        self._write(self.data_dir / "pg_hba.conf", "local all all peer\nhost all all 127.0.0.1/32 scram-sha-256\n")
        log.info("initdb done in %.1f s", time.monotonic() - started)

    def _write_settings(self) -> None:
        """Our settings, in a file of their own that postgresql.conf includes (checked on every start, in
        case an earlier one stopped right after initdb), rewritten on every start: the port may differ."""
        conf = self.data_dir / "postgresql.conf"
        if "include 'ipcount.conf'" not in conf.read_text():
            with open(conf, "a") as out:  # appending keeps the file's owner and mode
                out.write("\ninclude 'ipcount.conf'\n")
        quoted = lambda s: "'" + str(s).replace("'", "''") + "'"  # noqa: E731
        self._write(self.data_dir / "ipcount.conf", "\n".join([
            "listen_addresses = '127.0.0.1'",
            f"port = {self.port}",
            f"unix_socket_directories = {quoted(self.socket_dir)}",
            "password_encryption = 'scram-sha-256'",
            "",
        ]))

    def _ensure_database(self) -> None:
        """The ``airflow`` role (password from the password file, so a new file takes effect on the next
        start) and its database. On PostgreSQL 15 only the database's owner may create tables in its
        ``public`` schema (owned by pg_database_owner), so owning the database is what lets Airflow
        create its tables: no GRANT on public is needed."""
        sql = f"""
            SELECT 'CREATE ROLE {ROLE}' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{ROLE}')\\gexec
            ALTER ROLE {ROLE} WITH LOGIN PASSWORD '{scram_verifier(self.password())}';
            SELECT 'CREATE DATABASE {DATABASE} OWNER {ROLE}'
                WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '{DATABASE}')\\gexec
        """
        self._run(self._bin("psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", str(self.socket_dir),
                  "-p", str(self.port), "-d", "postgres", "-f", "-", stdin=sql)

    # --- lifecycle ----------------------------------------------------------------------------------

    def pid(self) -> int | None:
        return postmaster_pid(self.data_dir)

    def is_listening(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def start(self, timeout: float = 60.0) -> None:
        """Start the server (making the cluster, role and database the first time) and wait until it
        accepts connections. Idempotent."""
        if (pid := self.pid()) is not None:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
            running_port = lines[3] if len(lines) > 3 else "?"
            if running_port != str(self.port):
                raise DatabaseStartError(f"this cluster already runs on port {running_port} (pid {pid}); stop it "
                                         f"first to move it to {self.port}")
            if self.is_listening():
                log.info("PostgreSQL already running at 127.0.0.1:%d (pid %d)", self.port, pid)
                return
        elif self.is_listening():
            raise DatabaseStartError(f"port {self.port} is taken by another process; pick another port")
        self._make_server_dir()
        self._own_dir(self.socket_dir)
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        self._write_settings()
        log.info("starting PostgreSQL at 127.0.0.1:%d (log: %s)", self.port, self.log_file)
        started = time.monotonic()
        try:
            # -w: pg_ctl returns once the server accepts connections (or fails, or the timeout
            # passes, when the server may still be starting: stopped below).
            self._run(self._bin("pg_ctl"), "start", "-D", str(self.data_dir), "-l", str(self.log_file), "-w",
                      "-t", str(int(timeout)), "-s")
            self._ensure_database()
        except BaseException:
            self.stop()
            raise
        log.info("PostgreSQL ready at 127.0.0.1:%d in %.1f s (pid %s)", self.port, time.monotonic() - started,
                 self.pid())

    def stop(self, timeout: float = 30.0) -> None:
        pid = self.pid()
        if pid is None:
            log.info("PostgreSQL is not running")
            return
        log.info("stopping PostgreSQL (pid %d)", pid)
        # What pg_ctl stop sends, without switching users: SIGINT is its "fast" shutdown, SIGQUIT its
        # "immediate" one, which stops the backends too (SIGKILL would orphan them) and leaves crash
        # recovery to the next start.
        for sig in (signal.SIGINT, signal.SIGQUIT):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + timeout
            while self.pid() is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.pid() is None:
                return
            log.warning("PostgreSQL did not stop on %s within %.0f s", sig.name, timeout)

    def is_running(self) -> bool:
        return self.pid() is not None and self.is_listening()

    def status(self) -> str:
        if self.is_running():
            return f"running at 127.0.0.1:{self.port} (pid {self.pid()}, state {self.state_dir})"
        return "not running"
