"""`airflow backfill create` on the epoch DAG, run by a real scheduler and api-server.

Each backfill run counts the records whose Kafka timestamps fall in its data interval and
that the ledger does not own yet; an interval the scheduled chain already counted is a
reported no-op. On SQLite and on PostgreSQL, where the backfill is created while the
scheduler runs.
"""
from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from ipcount_lab.generator import TrafficGenerator, produce
from tests.airflow_services import (airflow, airflow_database, airflow_services, asset_graph, metadata_rows,
                                   service_env)
from tests.conftest import connect_connection, free_port, run_until_idle
from tests.ground_truth import expected_tables
from tests.tables import counts, lanes, ledger, owned_offsets

pytestmark = pytest.mark.airflow


def _runs(env, run_type):
    return metadata_rows(env, "SELECT run_id, state, data_interval_start FROM dag_run WHERE dag_id = 'ipcount_epoch' "
                              "AND run_type = :run_type ORDER BY data_interval_start", run_type=run_type)


def _wait_for(env, run_type, count, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = _runs(env, run_type)
        if len(runs) >= count and all(state in ("success", "failed") for _, state, _ in runs):
            return runs
        time.sleep(3)
    home = env["AIRFLOW_HOME"]
    raise AssertionError(f"{run_type} runs did not finish: {_runs(env, run_type)}; see {home}/*.log and {home}/logs")


@pytest.fixture(params=["sqlite", "postgres"])
def database(request):
    with airflow_database(request.param) as settings:
        yield request.param, settings


def test_airflow_backfill_create_counts_each_interval_once(cfg, spark, tmp_path, connect, database):
    kind, settings = database
    # The runs' Spark commands run in their tasks on the Spark Connect server.
    cfg = cfg.replace(schedule="@daily", spark_connect_connection="ipcount_connect")
    home = tmp_path / "airflow"
    home.mkdir()
    env = {**service_env(home, cfg, free_port(), database=settings), **connect_connection(connect)}
    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    day = lambda n: int((today - timedelta(days=n)).timestamp() * 1000)  # noqa: E731
    gen = TrafficGenerator(seed=71, events_per_second=50, malformed_share=0.03)
    # Records stamped (Kafka timestamps) three days ago; the scheduled chain counts them.
    first = produce(cfg.bootstrap_servers, cfg.topic, gen.records(120, day(3) + 3_600_000),
                    partition_of=lambda i, r: i % 3, timestamp_of=lambda i, r: day(3) + 3_600_000 + i * 1000)
    run_until_idle(cfg, spark)

    airflow(env, "db", "migrate")
    airflow(env, "dags", "reserialize")
    with airflow_services(home, env):
        # The scheduler's own run (the latest interval) finds nothing new.
        (scheduled,) = _wait_for(env, "scheduled", 1)
        assert scheduled[1] == "success"
        # Airflow's asset graph, over its REST API: the source topic -> the tables
        graph = asset_graph(env, ("ipcount_epoch", "ipcount_backfill"))
        warehouse = f"file://{cfg.warehouse}"
        assert graph[f"kafka://{cfg.bootstrap_servers.split(',')[0]}/{cfg.topic}"]["consumers"] == [
            "ipcount_backfill.run_backfill", "ipcount_epoch.backfill_interval", "ipcount_epoch.run_epoch"]
        for table in ("ledger", "dead_letters", "late_records"):
            assert graph[f"{warehouse}/{table}"]["producers"] == [
                "ipcount_backfill.publish_summary", "ipcount_epoch.backfill_interval", "ipcount_epoch.run_epoch"]
        counts_table = graph[f"{warehouse}/counts"]
        assert counts_table["producers"] == ["ipcount_backfill.publish_summary", "ipcount_epoch.publish_summary"]
        assert counts_table["consumers"] == ["ipcount_backfill.publish_counts", "ipcount_epoch.publish_counts"]
        # Then history arrives that only a backfill will count: records stamped two days ago.
        second = produce(cfg.bootstrap_servers, cfg.topic, TrafficGenerator(seed=72, events_per_second=50)
                         .records(90, day(2) + 3_600_000), partition_of=lambda i, r: i % 3,
                         timestamp_of=lambda i, r: day(2) + 3_600_000 + i * 1000)
        start, end = today - timedelta(days=3), today - timedelta(days=2)
        backfill = ("backfill", "create", "--dag-id", "ipcount_epoch", "--from-date", start.isoformat(),
                    "--to-date", end.isoformat())
        if kind == "postgres":  # beside the running scheduler, as users do
            airflow(env, *backfill)
            runs = _wait_for(env, "backfill", 2)
    if kind == "sqlite":
        # With the scheduler stopped: on SQLite, `backfill create` racing a busy scheduler can
        # fail with "database is locked" (a snapshot conflict that no lock timeout waits out),
        # and Airflow's clean-up after it can crash the scheduler.
        airflow(env, *backfill)
        with airflow_services(home, env):
            runs = _wait_for(env, "backfill", 2)
    assert [state for _, state, _ in runs] == ["success", "success"], runs
    (covered_run, _, _), (new_run, _, _) = runs
    produced = first + second

    rows = ledger(cfg)
    backfill_rows = [r for r in rows if r["kind"] == "backfill"]
    # The covered interval planned nothing. (Its task, running beside the other's, may have
    # finished the other's planned epoch: run_id then names it, planned_by the planner.)
    assert {r["planned_by"] for r in backfill_rows} == {new_run}
    assert sum(r["until_offset"] - r["from_offset"] for r in backfill_rows) == len(second)
    log_dir = home / "logs" / "dag_id=ipcount_epoch" / f"run_id={covered_run}" / "task_id=backfill_interval"
    assert "skipping what the ledger already owns" in "".join(p.read_text() for p in log_dir.rglob("*.log"))

    owned_offsets(cfg)                                                 # no overlap
    want = sum((expected_tables(produced, epochs).counts for epochs in lanes(cfg).values()), start=type(counts(cfg))())
    assert counts(cfg) == want
