"""The offset ledger: a Delta table saying which offsets each epoch covers and whether it
committed. It is the pipeline's only recovery state (like a Flink checkpoint, or Spark's
offsets/commits logs), written ahead of the sink and marked committed after it.

One row per (epoch, partition). ``status`` is ``planned`` from the write-ahead until the
sink commit is done, then ``committed``. With ``on_data_loss = "skip"``, offsets deleted
before they were counted get a row of their own with status ``lost``, so that per
partition the committed and lost ranges still chain without a gap.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Mapping

from pyspark.sql import functions as F
from pyspark.sql.types import (DoubleType, IntegerType, LongType, MapType, StringType, StructField,
                               StructType, TimestampType)

from ipcount.offsets import EpochPlan, OffsetRange

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PLANNED, COMMITTED, LOST = "planned", "committed", "lost"

LEDGER_SCHEMA = StructType([
    StructField("epoch", LongType(), False),
    StructField("topic", StringType(), False),
    StructField("partition", IntegerType(), False),
    StructField("from_offset", LongType(), False),
    StructField("until_offset", LongType(), False),
    StructField("status", StringType(), False),
    StructField("planned_at", TimestampType(), False),
    StructField("committed_at", TimestampType(), True),
    StructField("records_read", LongType(), True),
    StructField("records_counted", LongType(), True),
    StructField("records_late", LongType(), True),
    StructField("records_malformed", LongType(), True),
    StructField("watermark_before_ms", LongType(), True),
    StructField("watermark_after_ms", LongType(), True),
    StructField("sink_version", LongType(), True),
    StructField("duration_seconds", DoubleType(), True),
    StructField("run_id", StringType(), True),
    StructField("lag_after", LongType(), True),
    StructField("stage_seconds", MapType(StringType(), DoubleType()), True),
])


def ensure_table(spark: SparkSession, path: str, schema: StructType) -> None:
    """Create an empty Delta table at ``path`` unless one is there (checked first: creating
    is a commit, checking is a cheap look at the log). A table made by an older version
    gets the nullable columns it lacks."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, path):
        DeltaTable.createIfNotExists(spark).location(path).addColumns(schema).execute()
        return
    have = set(spark.read.format("delta").load(path).schema.fieldNames())
    missing = [f for f in schema.fields if f.name not in have]
    if missing:
        columns = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in missing)
        spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS ({columns})")


@dataclass(frozen=True)
class LedgerState:
    """What planning needs from the ledger for one topic."""

    last_epoch: int = 0                       # highest epoch id, planned or committed
    committed: Mapping[int, int] = field(default_factory=dict)  # partition -> next offset
    watermark_ms: int | None = None           # left by the last committed epoch
    pending: EpochPlan | None = None          # planned but not committed: must be re-run


@dataclass(frozen=True)
class PartitionMetrics:
    records_read: int = 0
    records_counted: int = 0
    records_late: int = 0
    records_malformed: int = 0


class Ledger:
    def __init__(self, spark: SparkSession, path: str) -> None:
        self.spark, self.path = spark, path

    def ensure(self) -> None:
        ensure_table(self.spark, self.path, LEDGER_SCHEMA)

    def state(self, topic: str) -> LedgerState:
        """One aggregate over the ledger (plus a look at the rows of an unfinished epoch)."""
        table = self.spark.read.format("delta").load(self.path)
        groups = table.groupBy("topic", "status", "partition").agg(
            F.max("epoch").alias("epoch"), F.max("until_offset").alias("until"),
            F.max_by("watermark_after_ms", "epoch").alias("watermark")).collect()
        last_epoch = max((g.epoch for g in groups), default=0)
        mine = [g for g in groups if g.topic == topic]
        committed = {g.partition: g.until for g in mine if g.status == COMMITTED}
        latest = max((g for g in mine if g.status == COMMITTED), key=lambda g: g.epoch, default=None)
        pending = None
        if any(g.status == PLANNED for g in mine):
            pending = self._pending_plan(table.where((F.col("topic") == topic) & (F.col("status") == PLANNED)))
        return LedgerState(last_epoch=last_epoch, committed=committed,
                           watermark_ms=latest.watermark if latest is not None else None, pending=pending)

    def _pending_plan(self, planned) -> EpochPlan:
        rows = sorted(planned.collect(), key=lambda r: r.partition)
        epochs = sorted({r.epoch for r in rows})
        if len(epochs) > 1:
            raise RuntimeError(f"ledger {self.path} has several unfinished epochs {epochs}; "
                               "only one can be in flight")
        return EpochPlan(epoch=epochs[0],
                         ranges=tuple(OffsetRange(r.topic, r.partition, r.from_offset, r.until_offset) for r in rows),
                         watermark_ms=rows[0].watermark_before_ms)

    def record_plan(self, plan: EpochPlan, run_id: str | None) -> None:
        """The write-ahead: the epoch's ranges are durable before anything is read or written."""
        now = datetime.now(timezone.utc)
        rows = [(plan.epoch, r.topic, r.partition, r.from_offset, r.until_offset, status, now,
                 None, None, None, None, None, plan.watermark_ms, None, None, None, run_id, None, None)
                for status, ranges in ((LOST, plan.lost), (PLANNED, plan.ranges)) for r in ranges]
        self.spark.createDataFrame(rows, LEDGER_SCHEMA).write.format("delta").mode("append").save(self.path)

    def commit(self, plan: EpochPlan, metrics: Mapping[int, PartitionMetrics], watermark_after_ms: int | None,
               sink_version: int | None, duration_seconds: float, run_id: str | None,
               lag_after: Mapping[int, int] | None = None, stage_seconds: Mapping[str, float] | None = None) -> None:
        """Mark the epoch committed. Matches only ``planned`` rows, so a replay after a crash
        that happened after this commit changes nothing."""
        from delta.tables import DeltaTable

        now = datetime.now(timezone.utc)
        rows = []
        for r in plan.ranges:
            m = metrics.get(r.partition, PartitionMetrics())
            rows.append((plan.epoch, r.topic, r.partition, r.from_offset, r.until_offset, COMMITTED, now,
                         now, m.records_read, m.records_counted, m.records_late, m.records_malformed,
                         plan.watermark_ms, watermark_after_ms, sink_version, duration_seconds, run_id,
                         (lag_after or {}).get(r.partition), dict(stage_seconds or {})))
        updates = self.spark.createDataFrame(rows, LEDGER_SCHEMA)
        set_cols = ["status", "committed_at", "records_read", "records_counted", "records_late",
                    "records_malformed", "watermark_after_ms", "sink_version", "duration_seconds", "run_id",
                    "lag_after", "stage_seconds"]
        (DeltaTable.forPath(self.spark, self.path).alias("t")
         .merge(updates.alias("s"), "t.epoch = s.epoch AND t.topic = s.topic AND t.partition = s.partition "
                                    f"AND t.status = '{PLANNED}'")
         .whenMatchedUpdate(set={c: f"s.{c}" for c in set_cols})
         .execute())
