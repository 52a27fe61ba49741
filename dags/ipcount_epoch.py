"""
### Exactly-once per-IP request counts: one checkpoint epoch per run

Each run reads the next bounded Kafka offset range of the source topic, counts requests per
client IP in tumbling event-time windows with allowed lateness, and commits the counts to
Delta Lake idempotently, with the ranges recorded in the Delta offset ledger.

1. `choose_path` - skip the run when the chain is at the log end (the ledger read with
   delta-rs, the log ends asked of the broker: no JVM is started for nothing).
2. `run_epoch` - with `spark_connect_connection` set, in this task's own process on that
   Spark Connect server (a warm Spark session: no JVM start per run), else spark-submit of
   `spark_jobs/epoch_job.py` with the run as its one argument (connection `spark_default`):
   plan from the ledger (or finish an unfinished epoch with its recorded ranges), read,
   count, merge into the counts table, commit the ledger.
   A run made by `airflow backfill create` takes `backfill_interval` instead: it counts the
   records whose Kafka timestamps fall in the run's data interval and that the ledger does
   not own yet (an interval the chain already counted is a no-op, and says so).
3. `commit_offsets` - copy the ledger's positions to the Kafka consumer group, for lag
   monitoring only; recovery never reads them.
4. `publish_counts` - when `publish` is on, send the counts rows the epoch changed to
   `publish_topic`, one Kafka transaction per counts version with the publisher's cursor
   (exactly once; read it with `isolation.level=read_committed`).
5. `publish_summary` - log the epoch, return it to XCom and put it in the counts Asset event.
6. `check_freshness` (with `alert_lag_records` or `alert_stale_seconds` set) - fail, so that
   Airflow's failure alerts fire, when the chain lags or is stale past them.

A permanent error (bad settings, a refused table set, data loss under `on_data_loss = fail`)
fails its task at once; a transient one (a service away, a lost commit race) is retried.

Configuration: `IPCOUNT_*` environment variables or the file named by `IPCOUNT_CONFIG`
(see docs/configuration.md). `max_active_runs=1`: scheduled epochs never overlap (and backfills that
do run beside them cannot double count: the ledger refuses overlapping plans).
"""
from __future__ import annotations

import logging

import pendulum
from airflow.sdk import DAG, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from ipcount.jobs import idle
from ipcount.jobs.group_commit import commit_group_offsets_from_ledger
from ipcount.orchestration.alerts import alerts_on, freshness_breaches, run_deadline
from ipcount.orchestration.dags import (EPOCH_DAG_ID, dag_params, dagrun_timeout, epoch_run, epoch_summary,
                                        epoch_timetable, interval_run, run_config, task_defaults)
from ipcount.orchestration.kafka_connection import resolved
from ipcount.orchestration.lineage import counts_asset, sink_assets, source_asset, table_assets
from ipcount.orchestration.operators import epoch_operator, failing_fast, lineage_task
from ipcount.rules.config import PipelineConfig

CFG = PipelineConfig.load()
log = logging.getLogger(__name__)
COUNTS = counts_asset(CFG)
# Lineage for Airflow's asset graph: source topic -> the epoch's tables -> the sink topic.
SOURCE, TABLES, SINK = source_asset(CFG), table_assets(CFG), sink_assets(CFG)

with DAG(
    dag_id=EPOCH_DAG_ID,
    description=__doc__.strip().splitlines()[0].lstrip("# "),
    doc_md=__doc__,
    schedule=epoch_timetable(CFG),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=task_defaults(CFG, retries=2),  # every task has a time limit
    dagrun_timeout=dagrun_timeout(CFG),
    deadline=run_deadline(CFG),  # alert_run_seconds: a run not done in time calls alerts.run_overdue
    tags=["ipcount", "exactly-once", "kafka", "delta"],
    params=dag_params(CFG),  # per-run overrides (trigger form / --conf), validated by JSON schema
):
    @task.branch
    @failing_fast()
    def choose_path(dag_run=None, params: dict | None = None) -> str | None:
        """Scheduled and manual runs advance the chain, unless it is at the log end (checked
        without Spark: then the run skips the rest); `airflow backfill create` runs count
        their data interval."""
        run_type = getattr(dag_run.run_type, "value", dag_run.run_type)
        if run_type == "backfill":
            return "backfill_interval"
        with resolved(run_config(CFG, params)) as cfg:
            verdict = idle.check(cfg)
        log.info("%s: %s", "running the epoch" if verdict.run else "skipping the epoch", verdict.why)
        return "run_epoch" if verdict.run else None

    # (OpenLineage: the epoch also writes the counts, whose Asset event publish_summary sends)
    run_epoch = epoch_operator(CFG, "run_epoch", epoch_run, inlets=[SOURCE], outlets=TABLES,
                               lineage_outputs=[COUNTS, *TABLES])
    backfill_interval = epoch_operator(CFG, "backfill_interval", interval_run, inlets=[SOURCE], outlets=TABLES,
                                       lineage_outputs=[COUNTS, *TABLES])

    @task(trigger_rule="none_failed_min_one_success")
    @failing_fast()
    def commit_offsets(params: dict | None = None) -> bool:
        """Ledger positions -> consumer group (warns, never fails, when the broker refuses)."""
        with resolved(run_config(CFG, params)) as cfg:
            return commit_group_offsets_from_ledger(cfg)

    @lineage_task(inlets=[COUNTS], outlets=SINK)
    @failing_fast()
    def publish_counts(params: dict | None = None) -> dict:
        """Counts versions not published yet -> the sink topic, one Kafka transaction each with
        the publisher's cursor (when publish is on; fails, and is retried, when Kafka refuses)."""
        from ipcount.jobs.publish import publish_step  # (Kafka and Delta clients: not at parse time)

        with resolved(run_config(CFG, params)) as cfg:
            return publish_step(cfg)

    @lineage_task(outlets=[COUNTS])
    @failing_fast()
    def publish_summary(run_id: str | None = None, outlet_events=None) -> dict:
        """The committed epoch to the log, XCom and the counts Asset event."""
        summary = epoch_summary(CFG, run_id)
        if not summary["epochs"]:
            raise AirflowSkipException("no new records: this run committed no epoch")
        outlet_events[COUNTS].extra = summary
        return summary

    committed = commit_offsets()
    choose_path() >> [run_epoch, backfill_interval] >> committed >> publish_counts() >> publish_summary()

    if alerts_on(CFG):
        @task(trigger_rule="all_done", retries=0)
        @failing_fast()
        def check_freshness(params: dict | None = None) -> None:
            """Fails (so Airflow's failure alerts fire) when the chain lags or is stale past
            alert_lag_records / alert_stale_seconds; runs after a failed epoch too."""
            with resolved(run_config(CFG, params)) as cfg:
                found = freshness_breaches(cfg)
            if found:
                raise AirflowFailException("the pipeline is falling behind: " + "; ".join(found))
            log.info("the chain keeps up (alert_lag_records %s, alert_stale_seconds %s)", CFG.alert_lag_records,
                     CFG.alert_stale_seconds)

        committed >> check_freshness()
