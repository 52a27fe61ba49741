"""Alerts through Airflow's own mechanisms: the epoch DAG's ``check_freshness`` task (a
failed task fires whatever failure alerting the deployment configured: e-mail, a notifier in
a cluster policy, a listener) and a Deadline Alert on each run (``alert_run_seconds``)."""
from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any

from ipcount.rules.alerts import breaches
from ipcount.rules.config import PipelineConfig

log = logging.getLogger(__name__)


def alerts_on(cfg: PipelineConfig) -> bool:
    """Whether the epoch DAG has a check_freshness task."""
    return bool(cfg.alert_lag_records or cfg.alert_stale_seconds)


def freshness_breaches(cfg: PipelineConfig) -> list[str]:
    """The ``check_freshness`` task's look: what is over the alert thresholds now ([] when
    all is well), from the ledger and the broker's read_committed log ends as the monitor
    reads them (delta-rs and kafka-python: no JVM)."""
    from ipcount.orchestration.monitor.data import PipelineTables
    from ipcount.storage import broker
    from ipcount.storage.delta import DeltaReader

    tables = PipelineTables(cfg, DeltaReader())
    earliest, latest = broker.partition_offsets(cfg)
    lag = tables.chain_lag(earliest, latest)
    last = tables.last_committed()
    age = None if last is None else (datetime.now(timezone.utc) - last[1]).total_seconds()
    return breaches(lag, age, cfg.alert_lag_records, cfg.alert_stale_seconds)


def run_deadline(cfg: PipelineConfig):
    """The epoch DAG's Deadline Alert: each run done within ``alert_run_seconds`` of being
    queued, or :func:`run_overdue` is called (on the executor); None when off."""
    if not cfg.alert_run_seconds:
        return None
    from airflow.sdk import DeadlineAlert, DeadlineReference, SyncCallback

    return DeadlineAlert(reference=DeadlineReference.DAGRUN_QUEUED_AT,
                         interval=timedelta(seconds=cfg.alert_run_seconds),
                         callback=SyncCallback(run_overdue, kwargs={"pipeline_id": cfg.pipeline_id,
                                                                    "seconds": cfg.alert_run_seconds}))


def run_overdue(context: Any = None, pipeline_id: str = "", seconds: int = 0) -> str:
    """The Deadline Alert's callback: says which run is overdue, as an error in its log."""
    run = (context or {}).get("dag_run") or {}   # (the executor hands the run over as a dict)
    run_id = run.get("dag_run_id") or run.get("run_id") if isinstance(run, dict) else getattr(run, "run_id", None)
    message = (f"pipeline {pipeline_id}: DAG run {run_id or '?'} is not done {seconds} s after it was queued "
               "(alert_run_seconds): epochs are falling behind")
    log.error("%s", message)
    return message
