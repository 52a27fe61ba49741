"""Real Airflow services for tests: an Airflow home with this repo's DAGs and plugin, and an
api-server (and scheduler) started in their own process groups and stopped afterwards."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from ipcount_lab.embedded_airflow import (ADMIN_USER, admin_password, airflow_env, keep_passwords_private,
                                               passwords_file)
from ipcount.rules.config import PipelineConfig

AIRFLOW = str(Path(sys.executable).parent / "airflow")


def service_env(home: Path, cfg: PipelineConfig, port: int, database: dict | None = None) -> dict[str, str]:
    env = airflow_env(home, api_port=port, spark_master=cfg.spark_master, database=database)
    env.update(cfg.to_env())
    return env


def airflow(env: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([AIRFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (args, (proc.stdout + proc.stderr)[-4000:])
    return proc


@contextmanager
def airflow_services(home: Path, env: dict, services: tuple[str, ...] = ("api-server", "scheduler")):
    """The given services (api-server first), each logging to ``home/<name>.log``."""
    procs = []
    keep_passwords_private(home)
    try:
        for name in services:
            # A triggerer's log server would take the port of any other stack's triggerer.
            args = (["api-server", "--port", env["AIRFLOW__API__PORT"]] if name == "api-server" else
                    ["triggerer", "--skip-serve-logs"] if name == "triggerer" else [name])
            log = open(home / f"{name}.log", "w")
            procs.append(subprocess.Popen([AIRFLOW, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        health = f"{env['AIRFLOW__API__BASE_URL']}/api/v2/monitor/health"
        for _ in range(180):
            try:
                with urllib.request.urlopen(health, timeout=2):
                    break
            except OSError:
                time.sleep(1)
        else:
            raise AssertionError(f"api-server did not come up; see {home / 'api-server.log'}")
        yield
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def access_token(base_url: str, home: Path, user: str = ADMIN_USER) -> str:
    """A JWT for ``user`` (its password as the simple auth manager generated it), from the
    api-server's token endpoint."""
    password = admin_password(home) if user == ADMIN_USER else json.loads(passwords_file(home).read_text())[user]
    body = json.dumps({"username": user, "password": password}).encode()
    request = urllib.request.Request(f"{base_url}/auth/token", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["access_token"]


@contextmanager
def airflow_database(kind: str):
    """Settings for a fresh metadata database (``airflow_env(database=...)``): ``"sqlite"``, a
    file in the Airflow home (no settings), or ``"postgres"``, a PostgreSQL server of its own
    (Debian's, through the project's module; it starts in about a second), removed afterwards.
    Its state dir is under /tmp, which the server's OS user can reach when the tests run as root."""
    if kind == "sqlite":
        yield {}
        return
    from ipcount_lab.embedded_postgres import EmbeddedPostgres
    from tests.conftest import free_port

    server = EmbeddedPostgres(state_dir=Path(tempfile.mkdtemp(prefix="ipcount-airflow-db-")), port=free_port())
    try:
        server.start()
        yield server.airflow_environment()
    finally:
        server.stop()
        shutil.rmtree(server.state_dir, ignore_errors=True)


def metadata_rows(env: dict, sql: str, **params) -> list[tuple]:
    """Rows of a query on the Airflow metadata database ``env`` points at (PostgreSQL, or the
    SQLite file in AIRFLOW_HOME); ``:name`` placeholders take ``params``."""
    from sqlalchemy import create_engine, text

    engine = create_engine(env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")
                           or f"sqlite:///{env['AIRFLOW_HOME']}/airflow.db")
    try:
        with engine.connect() as connection:
            return [tuple(row) for row in connection.execute(text(sql), params)]
    finally:
        engine.dispose()


def asset_graph(env: dict, dag_ids: tuple[str, ...]) -> dict[str, dict]:
    """Airflow's asset graph over its REST API, by asset URI: the DAGs scheduled on each
    asset, the tasks that produce and consume it (``dag.task`` names) and its watchers."""
    base = env["AIRFLOW__API__BASE_URL"]
    request = urllib.request.Request(f"{base}/api/v2/assets?dag_ids={','.join(dag_ids)}&limit=100",
                                     headers={"Authorization": f"Bearer {access_token(base, Path(env['AIRFLOW_HOME']))}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assets = json.load(response)["assets"]
    return {a["uri"]: {"name": a["name"],
                       "scheduled": sorted(d["dag_id"] for d in a["scheduled_dags"]),
                       "producers": sorted(f"{t['dag_id']}.{t['task_id']}" for t in a["producing_tasks"]),
                       "consumers": sorted(f"{t['dag_id']}.{t['task_id']}" for t in a["consuming_tasks"]),
                       "watchers": sorted(w["name"] for w in a["watchers"])} for a in assets}
