"""
### Backfill an offset or time range, exactly once

Counts what the request names and the target's ledger does not own yet - history the
scheduled chain never covered, a gap skipped after data loss, or a range reprocessed into a
replay table set for an audit - in epochs of at most *Max records per epoch* offsets, each
committed on its own. Asking twice counts once: what is already counted is reported as
skipped. Trigger it from the form, or:

`airflow dags trigger ipcount_backfill --conf '{"offsets": "0:0-5000,1:0-4200"}'`
`airflow dags trigger ipcount_backfill --conf '{"from_time": "2026-11-20T00:00:00Z", "until_time": "2026-11-21T00:00:00Z", "target": "audit"}'`

1. `check_request` - parse and check the request against the broker; a bad one fails here,
   before anything is written, with a message that says what to fix.
2. `run_backfill` - in this task's own process on the Spark Connect server of
   `spark_connect_connection` when that is set, else spark-submit of
   `spark_jobs/epoch_job.py` with the run as its one argument.
3. `publish_counts` - when `publish` is on, send the main counts rows the backfill changed to
   `publish_topic` (kind `backfill`), exactly once; replay targets are never published.
4. `publish_summary` - log the epochs, return them to XCom (and, for the main target, put
   them in the counts Asset event).

A permanent error (a bad request or settings, data loss under `on_data_loss = fail`) fails
its task at once; a transient one is retried. A failed run can simply be cleared and re-run:
the same request finishes its unfinished epoch and continues where it stopped.
"""
from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task
from airflow.sdk.exceptions import AirflowSkipException

from ipcount.orchestration.dags import (BACKFILL_DAG_ID, backfill_params, check_backfill_request, dagrun_timeout,
                                        epoch_summary, request_run, task_defaults)
from ipcount.orchestration.kafka_connection import resolved
from ipcount.orchestration.lineage import counts_asset, sink_assets, source_asset, table_assets
from ipcount.orchestration.operators import epoch_operator, failing_fast, lineage_task
from ipcount.rules.config import PipelineConfig

CFG = PipelineConfig.load()
COUNTS = counts_asset(CFG)
# Lineage: the main tables are outlets of publish_summary, which skips for a replay target
# (its tables are its own, under <warehouse>/replays/) and for a request with nothing new.
SOURCE, TABLES, SINK = source_asset(CFG), table_assets(CFG), sink_assets(CFG)

with DAG(
    dag_id=BACKFILL_DAG_ID,
    description=__doc__.strip().splitlines()[0].lstrip("# "),
    doc_md=__doc__,
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    default_args=task_defaults(CFG, retries=1),  # every task has a time limit
    dagrun_timeout=dagrun_timeout(CFG),
    tags=["ipcount", "exactly-once", "backfill"],
    params=backfill_params(CFG),
):
    @task(retries=0)
    @failing_fast()
    def check_request(params: dict | None = None) -> dict:
        """The request, parsed and checked against the broker (fails before any write)."""
        return check_backfill_request(CFG, params)

    run_backfill = epoch_operator(CFG, "run_backfill", request_run, inlets=[SOURCE])

    @lineage_task(inlets=[COUNTS], outlets=SINK)
    @failing_fast()
    def publish_counts() -> dict:
        """The main counts' versions not published yet (this backfill's, as kind backfill) ->
        the sink topic, exactly once (when publish is on). Replay targets are never published."""
        from ipcount.jobs.publish import publish_step  # (Kafka and Delta clients: not at parse time)

        with resolved(CFG) as cfg:
            return publish_step(cfg)

    @lineage_task(outlets=[COUNTS, *TABLES])
    @failing_fast()
    def publish_summary(run_id: str | None = None, params: dict | None = None, outlet_events=None) -> dict:
        """The epochs this run committed, to the log, XCom and (main target) the counts Asset."""
        summary = epoch_summary(CFG, run_id, params["target"])
        if not summary["epochs"]:
            raise AirflowSkipException("nothing new: the ledger already owned the whole request")
        if params["target"] != "main":
            raise AirflowSkipException(f"replay target {params['target']}: {len(summary['epochs'])} epoch(s) "
                                       "committed; the counts Asset is the main table's")
        outlet_events[COUNTS].extra = summary
        return summary

    check_request() >> run_backfill >> publish_counts() >> publish_summary()
