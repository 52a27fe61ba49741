"""
### Maintain the table set: compact, checkpoint, vacuum

Keeps what an epoch costs flat as the pipeline ages. Each run, for every table of the set
(counts, ledger, dead letters, late records, and this DAG's own log):

1. packs small files into big ones - the counts table only in its final partitions, which
   scheduled epochs add to but never rewrite;
2. retires the Delta transactions of epochs the ledger holds as final (a floor transaction
   covers them), writes a checkpoint and deletes log files older than the table's log
   retention;
3. deletes data files no version has referenced for `vacuum_retention_hours`, keeping
   every file the publisher still reads when `publish` is on.

Safe beside running epochs: nothing changes a row, and a step that loses to an epoch's
commit is left for the next run. What each run did is logged, returned to XCom, and kept a
row per table in the maintenance table (`ipcount maintain` does the same by hand).
Scheduled by `maintenance_schedule` (default `@hourly`; `none`: only when triggered).
"""
from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from ipcount.orchestration.dags import MAINTENANCE_DAG_ID, maintenance_schedule, task_defaults
from ipcount.orchestration.kafka_connection import resolved
from ipcount.orchestration.lineage import maintenance_asset
from ipcount.orchestration.operators import failing_fast, lineage_task
from ipcount.rules.config import PipelineConfig

CFG = PipelineConfig.load()

with DAG(
    dag_id=MAINTENANCE_DAG_ID,
    description=__doc__.strip().splitlines()[0].lstrip("# "),
    doc_md=__doc__,
    schedule=maintenance_schedule(CFG),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=task_defaults(CFG, retries=1),
    tags=["ipcount", "maintenance"],
):
    @lineage_task(outlets=[maintenance_asset(CFG)])
    @failing_fast()
    def maintain(run_id: str | None = None) -> dict:
        """Every table compacted, checkpointed and vacuumed once; what was done, to the log and XCom."""
        from ipcount.jobs.maintenance import run_maintenance  # (Delta and Kafka clients: not at parse time)

        with resolved(CFG) as cfg:
            return run_maintenance(cfg, run_id).to_dict()

    maintain()
