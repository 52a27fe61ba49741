"""The chaos command's short run: runners SIGKILLed at random, racing each other, the DAGs
killed mid-run, the broker SIGKILLed and restarted under the chain, a partition added
mid-run; the recount finds no duplicate and no loss."""
from __future__ import annotations

import pytest

from ipcount.devtools.chaos import PHASES, run_chaos
from ipcount.rules.errors import ConfigError

pytestmark = pytest.mark.airflow  # the dag scenario runs `airflow dags test`


def test_random_kills_and_a_broker_restart_leave_no_duplicate_and_no_loss(cfg, broker, tmp_path):
    # Scenarios take turns, each at least once, however many a round kills. (The CLI backfill
    # scenario is left out for time; the DAG round races a backfill DAG run half the time.)
    # Publishing is on: the sink topic is checked too (no version twice, folds to the table).
    report = run_chaos(cfg.replace(publish=True), kills=3, records=160, seed=3, workdir=tmp_path, max_seconds=420,
                       scenarios=("race", "dag", "broker"), kill_window=(6.0, 20.0),
                       max_records_per_epoch=100, broker_to_restart=broker)
    assert report.kills >= 3, report.line()
    assert sum(report.by_phase.values()) == report.kills and set(report.by_phase) <= set(PHASES), report.line()
    assert all(report.by_scenario[s] >= 1 for s in ("race", "dag", "broker")), report.line()
    assert report.partitions_added == 1 and report.records > 100 and report.epochs > 0
    assert (report.duplicates, report.losses) == (0, 0), report.problems
    assert not report.problems, report.problems
    assert report.counted > 0 and report.published > 0
    assert broker.pid() is not None  # restarted, for the tests after this one


def test_chaos_refuses_unknown_scenarios_and_broker_restarts_without_an_embedded_broker(cfg, tmp_path):
    with pytest.raises(ConfigError, match="unknown tornado"):
        run_chaos(cfg, scenarios=("chain", "tornado"), workdir=tmp_path)
    with pytest.raises(ConfigError, match="leave out broker"):
        run_chaos(cfg, scenarios=("broker",), workdir=tmp_path, broker_to_restart=None)
