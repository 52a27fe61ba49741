"""What the embedded services share: each of their processes starts in a session of its own
with a log and a pid file under the service's state directory, readiness is waited for
with an error that carries the log's tail, and a stop asks (SIGTERM to the process group)
before it forces (SIGKILL). A service can also run in the foreground, as a container's main
process, until it is signalled or dies.

A pid file holds the process's start time too: after a reboot (or long after a crash) the
same pid may belong to some other process, which must never be taken for the service's,
let alone killed.
"""
from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for local services)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` both free on 127.0.0.1 (a broker and its controller),
    below the kernel's ephemeral range: an ephemeral port found free can be taken by any outgoing
    connection before the broker binds it; one below the range cannot."""
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(10_000, first_ephemeral - 1), 200):
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no two free adjacent ports below {first_ephemeral}")


def listening(port: int) -> bool:
    """Whether something takes connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...);
    None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a server's log, for an error message that says why it did not start."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def exited(pid: int) -> bool:
    """Whether every thread of the process is gone. A SIGKILLed process's main thread turns
    zombie before its other threads have finished dying, and its files (its listening sockets)
    close only when the last of them has: a JVM with a large heap takes up to a second more."""
    stat = proc_stat(pid)
    if stat is None:
        return True
    try:
        return stat[0] == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def started_at(pid: int) -> str | None:
    """The process's start time (clock ticks after boot), or None if it is gone or a zombie
    (exited; not reaped here: its exit status is its parent's to read)."""
    stat = proc_stat(pid)
    return None if stat is None or stat[0] == "Z" else stat[19]  # field 22 of /proc/PID/stat


@dataclass(frozen=True)
class Processes:
    """The processes of one service, each by name: ``<name>.pid`` and ``<name>.log`` under
    ``state_dir``."""

    state_dir: Path

    def log_file(self, name: str) -> Path:
        return self.state_dir / f"{name}.log"

    def launch(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv`` in a session of its own, its output appended to its log."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file(name), "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=None if env is None else dict(env), start_new_session=True)
        (self.state_dir / f"{name}.pid").write_text(f"{proc.pid} {started_at(proc.pid) or ''}\n")
        return proc

    def pid(self, name: str) -> int | None:
        """The live process the pid file names, if it is still the one started (a file without
        the start time, from an older version or a process gone before it was read, is stale)."""
        try:
            pid_text, started = (self.state_dir / f"{name}.pid").read_text().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            return None
        return pid if started_at(pid) == started else None

    def names(self) -> list[str]:
        return sorted(f.stem for f in self.state_dir.glob("*.pid"))

    def pids(self) -> list[int]:
        return [pid for pid in map(self.pid, self.names()) if pid is not None]

    def wait_ready(self, ready: Callable[[], bool], timeout: float, error: type[Exception], what: str,
                   name: str, proc: subprocess.Popen | None = None) -> None:
        """Until ``ready()``; ``error`` (with the log's tail of process ``name``) if ``proc``
        exits first or ``timeout`` passes, after stopping what was started."""
        deadline = time.monotonic() + timeout
        while not ready():
            if proc is not None and proc.poll() is not None:
                self.stop()
                raise error(f"{what} exited with code {proc.returncode} at start; {self.log_file(name)}:\n"
                            f"{log_tail(self.log_file(name))}")
            if time.monotonic() > deadline:
                self.stop()
                raise error(f"{what} was not ready within {timeout:.0f} s; {self.log_file(name)}:\n"
                            f"{log_tail(self.log_file(name))}")
            time.sleep(0.2)

    def serve(self, name: str, start: Callable[[], None], stop: Callable[[], None], poll: float = 0.5) -> int:
        """Run a service in the foreground (a container's main process): ``start()``, then wait
        until its process ``name`` exits, or until SIGTERM or SIGINT, which ``stop()`` it. A
        signal during the start stops the service once it is up rather than leave it running
        without its parent. The exit code: 0 when stopped by a signal, 1 when the process died
        (its log's tail logged: a container's log has only this process's output)."""
        signalled: list[int] = []
        previous = {sig: signal.signal(sig, lambda signum, _: signalled.append(signum))
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            start()
            pid = self.pid(name)
            while not signalled and pid is not None and self.pid(name) == pid:
                time.sleep(poll)
        finally:
            stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if signalled:
            log.info("%s stopped on %s", name, signal.Signals(signalled[0]).name)
            return 0
        log.error("%s exited; %s:\n%s", name, self.log_file(name), log_tail(self.log_file(name)))
        return 1

    def kill(self, name: str, timeout: float = 30.0) -> None:
        """SIGKILL the process group of ``name``, as a crashed machine would stop it, and wait
        (up to ``timeout``) until it has exited, its ports closed."""
        pid = self.pid(name)
        if pid is None:
            return
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while not exited(pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self, timeout: float = 20.0, force: bool = True) -> None:
        """SIGTERM every process group, wait up to ``timeout``, then SIGKILL what is left
        (unless not ``force``); the pid files of processes gone are removed."""
        self.wait_stopped(self.terminate(), timeout, force)

    def terminate(self) -> dict[str, int]:
        """SIGTERM every process group without waiting; the pids signalled, by name (several
        services' processes can then stop together: :meth:`wait_stopped`)."""
        running = {}
        for name in self.names():
            pid = self.pid(name)
            if pid is None:
                continue
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            running[name] = pid
        return running

    def wait_stopped(self, running: Mapping[str, int], timeout: float = 20.0, force: bool = True) -> None:
        """Wait up to ``timeout`` for the ``running`` processes :meth:`terminate` signalled to
        exit, then SIGKILL what is left (unless not ``force``) and wait for that too."""
        deadline = time.monotonic() + timeout
        while not all(map(exited, running.values())) and time.monotonic() < deadline:
            time.sleep(0.2)
        for name, pid in running.items():
            if not exited(pid) and force:
                log.warning("%s (pid %d) still runs %.0f s after SIGTERM: SIGKILL", name, pid, timeout)
                self.kill(name)
        self.forget_gone()

    def forget_gone(self) -> None:
        """Remove the pid files of processes no longer running."""
        for name in self.names():
            if self.pid(name) is None:
                (self.state_dir / f"{name}.pid").unlink(missing_ok=True)
