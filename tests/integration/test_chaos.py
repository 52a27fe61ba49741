"""The chaos command's short run: runners SIGKILLed at random, racing each other, the DAGs
killed mid-run, the broker SIGKILLed and restarted under the chain, records deleted under the
chain and a backfill, a partition added mid-run, the run paused and resumed, rebuilds, commit
answers lost; the recount finds no duplicate and no loss."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ipcount.rules.errors import ConfigError
from ipcount_lab.chaos import PHASES, run_chaos
from ipcount_lab.chaos_state import DELETED_FILE, STATE_FILE, RunState
from ipcount_lab.embedded_connect import EmbeddedSparkConnect

pytestmark = pytest.mark.airflow  # the dag scenario runs `airflow dags test`


def test_random_kills_and_a_broker_restart_leave_no_duplicate_and_no_loss(cfg, broker, tmp_path):
    # Scenarios take turns, each at least once, however many a round kills. (The CLI backfill
    # scenario is left out for time; the DAG round races a backfill DAG run half the time.)
    # Publishing is on: the sink topic is checked too (no version twice, folds to the table).
    # Two sittings, as a long run takes them: paused after the first kill, resumed for two more.
    first = run_chaos(cfg.replace(publish=True), kills=1, records=80, seed=5, workdir=tmp_path, max_seconds=300,
                      scenarios=("race", "dag", "retention", "broker"), kill_window=(6.0, 20.0),
                      max_records_per_epoch=100, broker_to_restart=broker, pause=True)
    assert first.paused and not first.ok and first.kills >= 1 and first.records == 0, first.line()
    assert "--resume" in first.line() and Path(first.run_dir).parent == tmp_path
    saved = json.loads((Path(first.run_dir) / STATE_FILE).read_text())
    assert (saved["kills"], saved["rounds"]) == (first.kills, first.rounds) and saved["batch"] == 40
    assert saved["order"] == ["race", "dag", "broker", "retention"], saved

    report = run_chaos(cfg, kills=first.kills + 2, max_seconds=420, broker_to_restart=broker, resume=first.run_dir)
    assert report.sittings == 2 and report.rounds > first.rounds and not report.paused, report.line()
    assert report.kills >= 3, report.line()
    assert sum(report.by_phase.values()) == report.kills and set(report.by_phase) <= set(PHASES), report.line()
    assert all(report.by_scenario[s] >= 1 for s in ("race", "dag", "retention", "broker")), report.line()
    assert report.partitions_added == 1 and report.records > 100 and report.epochs > 0
    # Every deleted record was counted before it aged out or is recorded lost (the recount's rule).
    assert 0 < report.deleted and 0 <= report.lost <= report.deleted, report.line()
    kept = (Path(first.run_dir) / DELETED_FILE).read_text().splitlines()
    assert json.loads((Path(first.run_dir) / STATE_FILE).read_text())["deleted"] and len(kept) >= report.deleted
    assert (report.duplicates, report.losses) == (0, 0), report.problems
    # maintenance raced the rounds: compaction, checkpoints and vacuum beside the kills
    assert report.maintenance.startswith("maintenance ran ") and " ran 0 time" not in report.maintenance
    assert not report.problems, report.problems
    assert report.counted > 0 and report.published > 0
    assert report.executor_rounds > 0, report.line()  # rounds whose epochs' files Spark's executors wrote
    # No connect rounds: the finish ran on a Spark Connect server of its own, stopped after it.
    finisher = EmbeddedSparkConnect(state_dir=Path(report.run_dir) / "spark-connect")
    assert finisher.token_file.exists() and finisher.pid() is None
    assert broker.pid() is not None  # restarted, for the tests after this one


def test_rebuilds_lost_commit_answers_and_connect_kills_leave_no_duplicate_and_no_loss(cfg, tmp_path):
    # The run's tables on its own S3 store behind the lossy proxy; the rebuild is completed
    # before retention deletes anything, and the replay target is recounted with the rest;
    # epochs on the run's Spark Connect server, which may be SIGKILLed under the chain.
    report = run_chaos(cfg.replace(publish=True), kills=3, records=90, seed=8, workdir=tmp_path, max_seconds=900,
                       scenarios=("rebuild", "answers", "retention", "connect"), kill_window=(6.0, 20.0),
                       max_records_per_epoch=100)
    assert report.warehouse.startswith("s3://") and not report.paused, report.line()
    assert [s for s in ("rebuild", "answers", "retention", "connect") if not report.by_scenario[s]] == [], report.line()
    assert report.answers_lost > 0 and report.rebuilt > 0 and report.deleted > 0, report.line()
    assert report.executor_rounds > 0, report.line()
    assert report.published > 0 and report.final_changes == 0, report.problems
    assert (report.duplicates, report.losses) == (0, 0) and not report.problems, report.problems
    saved = json.loads((Path(report.run_dir) / STATE_FILE).read_text())
    assert saved["rebuilt"] and report.rebuilt == len(saved["rebuilt"]), saved


def test_maintenance_beside_the_rounds_outlives_a_table_set_not_made_yet(tmp_path):
    """Chaos starts its maintenance thread before the first epoch makes the tables: a run
    that finds none is counted as failed, and the thread goes on."""
    from ipcount.rules.config import PipelineConfig
    from ipcount_lab.chaos_maintenance import PAUSE_SECONDS, MaintenanceBeside

    beside = MaintenanceBeside(PipelineConfig(warehouse=str(tmp_path / "warehouse")))
    with beside:
        time.sleep(2.5 * PAUSE_SECONDS)
        assert beside._thread.is_alive()
    assert beside.runs + len(beside.failures) >= 2, beside.line()


def test_chaos_refuses_unknown_scenarios_and_broker_restarts_without_an_embedded_broker(cfg, tmp_path):
    with pytest.raises(ConfigError, match="unknown tornado"):
        run_chaos(cfg, scenarios=("chain", "tornado"), workdir=tmp_path)
    with pytest.raises(ConfigError, match="leave out broker"):
        run_chaos(cfg, scenarios=("broker",), workdir=tmp_path, broker_to_restart=None)


def test_a_run_resumes_only_where_its_topic_is(cfg, tmp_path):
    RunState(name="chaos_9_gone00", seed=9, kills_wanted=2, scenarios=["chain"], order=["chain"], batch=10,
             clock_ms=0, max_records_per_epoch=20).save(tmp_path / STATE_FILE)
    with pytest.raises(ConfigError, match="topic chaos_9_gone00 is not on .*the broker it started on"):
        run_chaos(cfg, resume=tmp_path)
