"""When the pipeline falls behind enough to alert (ipcount.rules.alerts), and the Deadline
Alert's wiring (ipcount.orchestration.alerts)."""
from __future__ import annotations

from datetime import timedelta

from ipcount.orchestration.alerts import alerts_on, run_deadline, run_overdue
from ipcount.rules.alerts import breaches
from ipcount.rules.config import PipelineConfig


def test_off_thresholds_never_alert():
    assert breaches({0: 10**9}, 10**9, lag_records=0, stale_seconds=0) == []


def test_lag_over_its_threshold_names_the_partitions():
    assert breaches({0: 600, 1: 0, 2: 500}, 1.0, lag_records=1000, stale_seconds=0) == [
        "1100 records wait past the chain, over alert_lag_records 1000 (p0 600, p2 500)"]
    assert breaches({0: 600, 2: 400}, 1.0, lag_records=1000, stale_seconds=0) == []   # at it, not over


def test_stale_needs_waiting_records_and_an_old_commit():
    assert breaches({0: 5}, 301, lag_records=0, stale_seconds=300) == [
        "5 records wait and the chain's last commit was 301 s ago, over alert_stale_seconds 300"]
    assert breaches({0: 0}, 10**6, lag_records=0, stale_seconds=300) == []      # idle log: no alert
    assert breaches({0: 5}, 299, lag_records=0, stale_seconds=300) == []
    assert breaches({0: 5}, None, lag_records=0, stale_seconds=300) == []       # nothing committed yet


def test_the_check_task_and_the_deadline_only_when_set():
    assert not alerts_on(PipelineConfig()) and run_deadline(PipelineConfig()) is None
    assert alerts_on(PipelineConfig(alert_stale_seconds=60))
    deadline = run_deadline(PipelineConfig(alert_run_seconds=90, pipeline_id="p"))
    assert deadline.interval == timedelta(seconds=90)
    assert deadline.callback.path == "ipcount.orchestration.alerts.run_overdue"
    assert deadline.callback.kwargs == {"pipeline_id": "p", "seconds": 90}
    assert run_overdue({"dag_run": {"dag_run_id": "r1"}}, "p", 90) == (
        "pipeline p: DAG run r1 is not done 90 s after it was queued (alert_run_seconds): epochs are falling behind")
