"""The chaos command's short run: runners SIGKILLed at random, racing each other, a
partition added mid-run; the recount finds no duplicate and no loss."""
from __future__ import annotations

from ipcount.devtools.chaos import run_chaos


def test_random_kills_of_racing_runners_leave_no_duplicate_and_no_loss(cfg, tmp_path):
    report = run_chaos(cfg, kills=2, records=240, seed=3, workdir=tmp_path, max_seconds=240,
                       scenarios=("chain", "race", "backfill"), kill_window=(6.0, 20.0), max_records_per_epoch=100)
    assert report.kills >= 2, report.line()
    assert report.partitions_added == 1 and report.records > 150 and report.epochs > 0
    assert (report.duplicates, report.losses) == (0, 0), report.problems
    assert not report.problems, report.problems
    assert report.counted > 0
