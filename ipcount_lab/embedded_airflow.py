"""The environment Airflow runs in on the embedded stack (SQLite, or PostgreSQL from
:mod:`ipcount_lab.embedded_postgres`; LocalExecutor; this repo's DAGs and plugins). Used
by ``bin/lab airflow ...``, bin/run and the tests alike."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Mapping

from ipcount.rules.config import REPO_ROOT, STATE_DIR

DEFAULT_AIRFLOW_HOME = STATE_DIR / "airflow"
ADMIN_USER = "admin"
# SQLite lets one writer in at a time and, by default, gives up after 5 s. The scheduler, the
# api-server and CLI commands such as `airflow backfill create` write concurrently; when one
# gave up, `backfill create` deleted the runs it had made while the scheduler was looking at
# them, which crashed the scheduler. Waiting longer for the lock avoids both.
SQLITE_CONNECT_ARGS = {"timeout": 60}


def airflow_env(home: Path = DEFAULT_AIRFLOW_HOME, api_port: int = 8080, spark_master: str = "local[*]",
                base: Mapping[str, str] | None = None, database: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) plus Airflow's settings. ``IPCOUNT_*``
    variables in ``base`` pass through to the DAG, which reads its config from them.
    ``database``: the metadata database's settings (EmbeddedPostgres.airflow_environment());
    default SQLite in ``home``."""
    env = dict(os.environ if base is None else base)
    venv_bin = str(Path(sys.executable).parent)
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO_ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO_ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": f"{__name__}.SQLITE_CONNECT_ARGS",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{api_port}/execution/",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{api_port}",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "15",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        # spark-submit runs the epoch; the connection names the master (local mode here).
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": spark_master}),
        "PATH": venv_bin + os.pathsep + env.get("PATH", ""),
        **(database or {}),
    })
    return env


def passwords_file(home: Path = DEFAULT_AIRFLOW_HOME) -> Path:
    """Where Airflow's simple auth manager keeps the passwords it generates."""
    return home / "simple_auth_manager_passwords.json.generated"


def keep_passwords_private(home: Path = DEFAULT_AIRFLOW_HOME) -> Path:
    """Create the passwords file, readable by its owner only, before Airflow first writes it:
    Airflow appends to it (mode "a+"), so it keeps this mode instead of the umask's 0644."""
    home.mkdir(parents=True, exist_ok=True)
    path = passwords_file(home)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    os.chmod(path, 0o600)
    return path


def admin_password(home: Path = DEFAULT_AIRFLOW_HOME) -> str | None:
    """The password Airflow's simple auth manager generated for the admin user."""
    path = passwords_file(home)
    try:
        return json.loads(path.read_text()).get(ADMIN_USER)
    except (FileNotFoundError, ValueError):
        return None
