"""The on-data schedule with the real scheduler and triggerer: the source Asset's watcher
starts a run within seconds of new records, none while the log is idle, and records that
arrive while a run is active are counted by the next run, not left for the fallback clock."""
from __future__ import annotations

import time

import pytest

from ipcount_lab.generator import TrafficGenerator, produce
from ipcount.storage import broker as broker_io
from tests.airflow_services import airflow, airflow_services, asset_graph, metadata_rows, service_env
from tests.conftest import connect_connection, free_port
from tests.ground_truth import expected_tables
from tests.tables import counts, epoch_ranges, ledger, owned_offsets

pytestmark = pytest.mark.airflow


def _runs(env) -> list[tuple]:
    return metadata_rows(env, "SELECT run_id, run_type, state FROM dag_run WHERE dag_id = 'ipcount_epoch' ORDER BY id")


def _chain_end(cfg) -> dict[int, int]:
    """Where the committed scheduled chain ends, per partition (from the ledger)."""
    ends: dict[int, int] = {}
    for r in ledger(cfg):
        if r["status"] == "committed":
            ends[r["partition"]] = max(ends.get(r["partition"], 0), r["until_offset"])
    return ends


def _wait(what, check, timeout, env):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := check()):
            return found
        time.sleep(0.5)
    home = env["AIRFLOW_HOME"]
    raise AssertionError(f"{what} within {timeout} s; runs {_runs(env)}; see {home}/*.log and {home}/logs")


def _counted(cfg, env, timeout):
    """Waits until the chain reaches the log end, no run is active and no asset event waits
    for one; the time it took."""
    start = time.monotonic()
    _wait("the chain at the log end and every run finished",
          lambda: _chain_end(cfg) == broker_io.partition_offsets(cfg)[1]
          and all(state in ("success", "failed") for _, _, state in _runs(env))
          and metadata_rows(env, "SELECT count(*) FROM asset_dag_run_queue") == [(0,)], timeout, env)
    return time.monotonic() - start


def test_on_data_runs_when_records_arrive_and_never_while_idle(cfg, connect, tmp_path):
    # The fallback clock's first interval ends next year: every run here is the watcher's.
    # The alerts ride along: a freshness check that passes, and a Deadline Alert every run misses.
    cfg = cfg.replace(schedule="on-data", on_data_fallback="@yearly", on_data_poll_seconds=1,
                      spark_connect_connection="ipcount_connect", alert_stale_seconds=3600, alert_run_seconds=1)
    home = tmp_path / "airflow"
    home.mkdir()
    env = {**service_env(home, cfg, free_port()), **connect_connection(connect)}
    gen = TrafficGenerator(seed=38, events_per_second=50, malformed_share=0.02)

    def batch(n: int) -> list:
        return produce(cfg.bootstrap_servers, cfg.topic, gen.records(n, int(time.time() * 1000)),
                       partition_of=lambda i, r: i % 3)
    produced = batch(150)

    airflow(env, "db", "migrate")
    airflow(env, "dags", "reserialize")
    with airflow_services(home, env, services=("api-server", "scheduler", "triggerer")):
        # The records waiting at start: the watcher's first look starts a run.
        _counted(cfg, env, timeout=240)
        runs = _runs(env)
        assert runs and {kind for _, kind, _ in runs} == {"asset_triggered"}, runs
        graph = asset_graph(env, ("ipcount_epoch",))
        source = graph[f"kafka://{cfg.bootstrap_servers.split(',')[0]}/{cfg.topic}"]
        assert (source["scheduled"], source["watchers"]) == (["ipcount_epoch"], [f"{cfg.pipeline_id}_new_records"])

        # Idle: no run at all.
        settled = len(_runs(env))
        time.sleep(30)
        assert len(_runs(env)) == settled, _runs(env)[settled:]

        # New records: a run is queued within seconds, and counts them.
        produced += batch(60)
        start = time.monotonic()
        _wait("a run for the new records", lambda: len(_runs(env)) > settled, 15, env)
        queued_after = time.monotonic() - start
        _counted(cfg, env, timeout=180)
        assert [kind for _, kind, _ in _runs(env)[settled:]] == ["asset_triggered"], _runs(env)[settled:]

        # Records that arrive while a run is active, after its epoch committed: their event
        # waits in Airflow's queue (max_active_runs=1) and starts the next run when this one
        # ends. (The run may end before the second batch is in: then try again.)
        def committed_by_an_active_run():
            active = {run_id for run_id, _, state in _runs(env)[settled:] if state == "running"}
            return next((r["run_id"] for r in ledger(cfg) if r["status"] == "committed" and r["run_id"] in active),
                        None)
        for attempt in range(3):
            settled = len(_runs(env))
            produced += batch(40)
            active = _wait("a run that committed its epoch and is still running", committed_by_an_active_run, 30, env)
            produced += batch(40)
            caught = dict((run_id, state) for run_id, _, state in _runs(env))[active] == "running"
            late_batch = _counted(cfg, env, timeout=150)
            if caught:
                break
        assert caught, "no attempt produced records while a run was finishing"
        assert [kind for _, kind, _ in _runs(env)[settled:]] == ["asset_triggered"] * 2, _runs(env)[settled:]
        # Every run missed its one-second deadline: the callback ran on the executor and said so.
        deadlines = _wait("the deadline callbacks done", lambda: (rows := metadata_rows(
            env, "SELECT d.missed, c.state, r.run_id FROM deadline d JOIN callback c ON c.id = d.callback_id "
                 "JOIN dag_run r ON r.id = d.dagrun_id"))
            and all(state in ("success", "failed") for _, state, _ in rows) and rows, 90, env)
        assert [kind for _, kind, _ in _runs(env)[settled:]] == ["asset_triggered"] * 2, _runs(env)[settled:]
    runs = _runs(env)
    assert {state for _, _, state in runs} == {"success"}, runs
    assert deadlines and all(missed and state == "success" for missed, state, _ in deadlines), deadlines
    for _, _, run_id in deadlines:      # each callback's log names its run
        logs = home / "logs" / "executor_callbacks" / "ipcount_epoch" / run_id
        said = "".join(p.read_text() for p in logs.rglob("*") if p.is_file())
        assert f"DAG run {run_id} is not done 1 s after it was queued" in said, (run_id, said[-2000:])
    checks = metadata_rows(env, "SELECT state FROM task_instance WHERE task_id = 'check_freshness'")
    assert sorted(checks) == [("success",)] * len(runs), checks
    print(f"on-data: run queued {queued_after:.1f} s after new records; records produced during a run "
          f"counted {late_batch:.1f} s later; {len(runs)} runs")

    owned_offsets(cfg)                                              # no overlap
    assert counts(cfg) == expected_tables(produced, epoch_ranges(cfg)).counts
    assert sum(u - f for ranges in epoch_ranges(cfg) for f, u in ranges.values()) == len(produced)
