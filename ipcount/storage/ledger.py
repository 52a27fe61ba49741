"""The offset ledger's I/O: the write-ahead of a plan and the commit after the sink (both
Delta MERGEs, through Spark), and the reads (through delta-rs, no JVM: the DAG's tasks, the
CLI's watcher and the idle check use them too). What the ledger's rows mean - statuses,
kinds, how rows become plans, chain positions and summaries - is :mod:`ipcount.rules.ledger`.

Whatever the kind, the rows of one ledger never overlap: every planner takes only offsets
no row covers, and :meth:`Ledger.record_plan` refuses - atomically, through Delta's
optimistic concurrency - a plan that a concurrent planner's rows overlap.
"""
from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Mapping

from ipcount.rules.errors import PlanConflict
from ipcount.rules.offsets import OffsetRange
from ipcount.rules.ledger import (COLUMNS, COMMITTED, LOST, PLANNED, SCHEDULED, STATE_COLUMNS, EpochPlan, EpochSummary,
                                  LedgerState, PartitionMetrics, chain_positions, committed_summaries, is_scheduled,
                                  plan_from_rows, rows_by_epoch, state_of)
from ipcount.storage.delta import concurrent_errors, ensure_table, read_rows, retry_on_conflict, spark_schema

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

log = logging.getLogger(__name__)


def ledger_schema() -> StructType:
    """The ledger's Spark schema (:data:`ipcount.rules.ledger.COLUMNS`)."""
    return spark_schema(COLUMNS)

# Each epoch adds a few tiny files to the ledger (the plan, then the commit's rewrite).
# Delta's auto compaction folds them together after a write once enough pile up, so a full
# read of the ledger - planning here, the monitoring pages there - stays a few files long
# however many epochs it holds.
LEDGER_PROPERTIES = {"delta.autoOptimize.autoCompact": "true"}

# Marker of the error the write-ahead MERGE raises when a concurrent plan got there first.
_CONFLICT = "ipcount-plan-conflict"


class Ledger:
    def __init__(self, spark: SparkSession, path: str) -> None:
        self.spark, self.path = spark, path

    def ensure(self) -> None:
        ensure_table(self.spark, self.path, ledger_schema(), LEDGER_PROPERTIES)

    def _table(self):
        from pyspark.sql import functions as F

        return self.spark.read.format("delta").load(self.path).withColumn(
            "kind", F.coalesce(F.col("kind"), F.lit(SCHEDULED)))

    def state(self, topic: str) -> LedgerState:
        """Read with delta-rs, not Spark: the ledger is a few rows per epoch in a few files
        (auto compaction), and three Spark queries over it cost seconds per epoch. A
        snapshot is enough: :meth:`record_plan` re-checks overlaps against the latest."""
        return state_of(topic, read_rows(self.path, columns=STATE_COLUMNS))

    def epochs(self, topic: str, statuses: tuple[str, ...] = (COMMITTED, LOST)) -> list[tuple[EpochPlan, int | None]]:
        """Every epoch with rows of the given statuses, as (plan, counts sink version), in the
        order its sink commits happened: what a rebuild replays."""
        from pyspark.sql import functions as F

        rows = [r.asDict() for r in
                self._table().where((F.col("topic") == topic) & F.col("status").isin(*statuses)).collect()]
        out = []
        for group in rows_by_epoch(rows).values():
            if not any(r["status"] == COMMITTED for r in group):
                continue  # lost rows of an epoch still in flight
            versions = [r["sink_version"] for r in group if r["sink_version"] is not None]
            out.append((plan_from_rows(group), versions[0] if versions else None))
        # Epochs that wrote no counts have no sink version; their place does not matter.
        return sorted(out, key=lambda pv: (pv[1] if pv[1] is not None else -1, pv[0].epoch))

    def record_plan(self, plan: EpochPlan, run_id: str | None) -> None:
        """The write-ahead: the epoch's ranges are durable before anything is read or written.

        A MERGE, not an append, so that it is also the guard against concurrent planners: a
        row already there that overlaps one of these ranges (or holds this epoch id) makes
        the MERGE raise, and a plan committed by another planner after this MERGE read the
        ledger makes Delta's conflict check refuse the commit. Either way :class:`PlanConflict`:
        nothing of this plan was written, and the caller plans again from the new state.
        """
        from delta.tables import DeltaTable
        from pyspark.sql import functions as F

        planned_at = (datetime.now(timezone.utc) if plan.planned_at_ms is None
                      else datetime.fromtimestamp(plan.planned_at_ms / 1000, timezone.utc))
        rows = (_uncommitted_rows(plan, LOST, plan.lost, planned_at, run_id)
                + _uncommitted_rows(plan, PLANNED, plan.ranges, planned_at, run_id))
        # One source row answers for the epoch id, so the id check matches each target row once.
        anchor = plan.ranges[0].partition
        condition = (f"(t.epoch = s.epoch AND s.status = '{PLANNED}' AND s.partition = {int(anchor)}) OR "
                     "(t.topic = s.topic AND t.partition = s.partition "
                     " AND t.from_offset < s.until_offset AND s.from_offset < t.until_offset)")
        source = self.spark.createDataFrame(rows, ledger_schema())
        merge = (DeltaTable.forPath(self.spark, self.path).alias("t").merge(source.alias("s"), condition)
                 .whenMatchedUpdate(set={"status": F.raise_error(F.lit(_CONFLICT))})
                 .whenNotMatchedInsertAll())
        try:
            merge.execute()
        except concurrent_errors() as e:
            raise PlanConflict(f"a concurrent commit to the ledger ({type(e).__name__})") from e
        except Exception as e:  # the MERGE's own refusal comes back as a JVM error
            text = str(e)
            if _CONFLICT in text or "MULTIPLE_SOURCE_ROW_MATCHING_TARGET_ROW" in text:
                raise PlanConflict("ledger rows that overlap the plan (or hold its epoch id) exist") from e
            raise

    def release(self, plan: EpochPlan, lost: tuple[OffsetRange, ...]) -> None:
        """Give up an unfinished epoch whose offsets aged out before it was run, in one
        commit: each of its partitions' lost head (``lost``, one range per partition at
        most, starting where its planned range does) becomes a ``lost`` row of the epoch,
        and its other planned rows go, so a new plan takes those offsets. The lost rows keep
        the epoch id taken: its transaction id may be in the sink tables' logs already."""
        from delta.tables import DeltaTable
        from pyspark.sql import functions as F

        rows = _uncommitted_rows(plan, LOST, lost, datetime.now(timezone.utc), None)
        source = self.spark.createDataFrame(rows, ledger_schema())
        mine = f"t.epoch = {int(plan.epoch)} AND t.status = '{PLANNED}'"

        def merge() -> None:
            (DeltaTable.forPath(self.spark, self.path).alias("t")
             .merge(source.alias("s"), f"{mine} AND t.topic = s.topic AND t.partition = s.partition")
             .whenMatchedUpdate(set={"status": F.lit(LOST), "from_offset": "s.from_offset",
                                     "until_offset": "s.until_offset"})
             .whenNotMatchedBySourceDelete(condition=mine)
             .execute())
        retry_on_conflict(merge, f"releasing epoch {plan.epoch} in the ledger")

    def commit(self, plan: EpochPlan, metrics: Mapping[int, PartitionMetrics] | None,
               watermark_after_ms: int | None,
               sink_version: int | None, duration_seconds: float, run_id: str | None,
               lag_after: Mapping[int, int] | None = None, stage_seconds: Mapping[str, float] | None = None) -> None:
        """Mark the epoch committed. Matches only ``planned`` rows, so a replay after a crash
        that happened after this commit changes nothing. ``metrics`` None: not known (the
        record counts stay empty)."""
        from delta.tables import DeltaTable

        now = datetime.now(timezone.utc)
        rows = []
        for r in plan.ranges:
            m = metrics.get(r.partition, PartitionMetrics()) if metrics is not None else None
            counted = (None,) * 4 if m is None else (m.records_read, m.records_counted, m.records_late,
                                                     m.records_malformed)
            rows.append((plan.epoch, r.topic, r.partition, r.from_offset, r.until_offset, COMMITTED, now,
                         now, *counted,
                         plan.watermark_ms, watermark_after_ms, sink_version, duration_seconds, run_id,
                         (lag_after or {}).get(r.partition), dict(stage_seconds or {}),
                         plan.kind, plan.request_id, plan.chain_watermark_ms))
        updates = self.spark.createDataFrame(rows, ledger_schema())
        set_cols = ["status", "committed_at", "records_read", "records_counted", "records_late",
                    "records_malformed", "watermark_after_ms", "sink_version", "duration_seconds", "run_id",
                    "lag_after", "stage_seconds"]

        def merge() -> None:
            (DeltaTable.forPath(self.spark, self.path).alias("t")
             .merge(updates.alias("s"), "t.epoch = s.epoch AND t.topic = s.topic AND t.partition = s.partition "
                                        f"AND t.status = '{PLANNED}'")
             .whenMatchedUpdate(set={c: f"s.{c}" for c in set_cols})
             .execute())
        retry_on_conflict(merge, f"committing epoch {plan.epoch} to the ledger")


def _uncommitted_rows(plan: EpochPlan, status: str, ranges: tuple[OffsetRange, ...], planned_at: datetime,
                      run_id: str | None) -> list[tuple]:
    """Ledger rows (in :data:`ipcount.rules.ledger.COLUMNS` order) of ``plan``'s ``ranges``
    with a status before the commit (planned or lost): no counts, no commit time."""
    return [(plan.epoch, r.topic, r.partition, r.from_offset, r.until_offset, status, planned_at,
             None, None, None, None, None, plan.watermark_ms, None, None, None, run_id, None, None,
             plan.kind, plan.request_id, plan.chain_watermark_ms) for r in ranges]


# -- reads without a JVM ------------------------------------------------------------------

def committed_epochs(ledger_path: str, after_epoch: int = 0, run_id: str | None = None) -> list[EpochSummary]:
    """Committed epochs with id > ``after_epoch`` (optionally only those a run committed),
    oldest first."""
    filters = [("status", "=", COMMITTED), ("epoch", ">", after_epoch)]
    if run_id is not None:
        filters.append(("run_id", "=", run_id))
    return committed_summaries(read_rows(ledger_path, filters=filters))


def committed_positions(ledger_path: str, topic: str) -> tuple[int, dict[int, int]]:
    """(last committed epoch, partition -> next offset) of the scheduled chain for ``topic``;
    (0, {}) if none. The consumer group follows the chain."""
    rows = [r for r in read_rows(ledger_path, filters=[("topic", "=", topic), ("status", "=", COMMITTED)])
            if is_scheduled(r)]
    return max((r["epoch"] for r in rows), default=0), chain_positions(rows)
