"""
### Exactly-once per-IP request counts: one checkpoint epoch per run

Each run reads the next bounded Kafka offset range of the source topic, counts requests per
client IP in tumbling event-time windows with allowed lateness, and commits the counts to
Delta Lake idempotently, with the ranges recorded in the Delta offset ledger.

1. `run_epoch` - spark-submit of `spark_jobs/epoch_job.py` (connection `spark_default`):
   plan from the ledger (or finish an unfinished epoch with its recorded ranges), read, count,
   merge into the counts table, commit the ledger.
2. `commit_offsets` - copy the ledger's positions to the Kafka consumer group, for lag
   monitoring only; recovery never reads them.
3. `publish_summary` - log the epoch, return it to XCom and put it in the counts Asset event.

Configuration: `IPCOUNT_*` environment variables or the file named by `IPCOUNT_CONFIG`
(see the README). `max_active_runs=1`: epochs of one pipeline never overlap.
"""
from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import DAG, Asset, task
from airflow.sdk.exceptions import AirflowSkipException

from ipcount.config import PipelineConfig
from ipcount.epoch import commit_group_offsets_from_ledger
from ipcount.orchestration import dag_params, epoch_summary, run_config, spark_submit_kwargs

CFG = PipelineConfig.load()
COUNTS = Asset(name=f"{CFG.pipeline_id}_counts", uri=f"file://{CFG.counts_path}")

with DAG(
    dag_id="ipcount_epoch",
    description=__doc__.strip().splitlines()[0].lstrip("# "),
    doc_md=__doc__,
    schedule=CFG.schedule,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=15)},
    tags=["ipcount", "exactly-once", "kafka", "delta"],
    params=dag_params(CFG),  # per-run overrides (trigger form / --conf), validated by JSON schema
):
    run_epoch = SparkSubmitOperator(task_id="run_epoch", **spark_submit_kwargs(CFG))

    @task
    def commit_offsets(params: dict | None = None) -> bool:
        """Ledger positions -> consumer group (warns, never fails, when the broker refuses)."""
        return commit_group_offsets_from_ledger(run_config(CFG, params))

    @task(outlets=[COUNTS])
    def publish_summary(run_id: str | None = None, outlet_events=None) -> dict:
        """The committed epoch to the log, XCom and the counts Asset event."""
        summary = epoch_summary(CFG, run_id)
        if not summary["epochs"]:
            raise AirflowSkipException("no new records: this run committed no epoch")
        outlet_events[COUNTS].extra = summary
        return summary

    run_epoch >> commit_offsets() >> publish_summary()
