"""The offset ledger: a Delta table saying which offsets each epoch covers and whether it
committed. It is the pipeline's only recovery state (like a Flink checkpoint, or Spark's
offsets/commits logs), written ahead of the sink and marked committed after it.

One row per (epoch, partition). ``status`` is ``planned`` from the write-ahead until the
sink commit is done, then ``committed``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Mapping

from pyspark.sql import functions as F
from pyspark.sql.types import (DoubleType, IntegerType, LongType, StringType, StructField,
                               StructType, TimestampType)

from ipcount.offsets import EpochPlan, OffsetRange

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PLANNED, COMMITTED = "planned", "committed"

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
])


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
        from delta.tables import DeltaTable

        (DeltaTable.createIfNotExists(self.spark).location(self.path)
         .addColumns(LEDGER_SCHEMA).execute())

    def _rows(self, topic: str):
        return self.spark.read.format("delta").load(self.path).where(F.col("topic") == topic)

    def state(self, topic: str) -> LedgerState:
        all_rows = self.spark.read.format("delta").load(self.path)
        last_epoch = all_rows.agg(F.max("epoch")).first()[0] or 0
        rows = self._rows(topic)
        committed_rows = rows.where(F.col("status") == COMMITTED)
        committed = {r.partition: r.until for r in committed_rows.groupBy("partition")
                     .agg(F.max("until_offset").alias("until")).collect()}
        last = committed_rows.orderBy(F.desc("epoch")).select("watermark_after_ms").first()
        watermark = last.watermark_after_ms if last is not None else None
        pending_rows = rows.where(F.col("status") == PLANNED).collect()
        pending = None
        if pending_rows:
            epochs = sorted({r.epoch for r in pending_rows})
            if len(epochs) > 1:
                raise RuntimeError(f"ledger {self.path} has several unfinished epochs {epochs}; "
                                   "only one can be in flight")
            epoch_rows = sorted(pending_rows, key=lambda r: r.partition)
            pending = EpochPlan(
                epoch=epochs[0],
                ranges=tuple(OffsetRange(r.topic, r.partition, r.from_offset, r.until_offset)
                             for r in epoch_rows),
                watermark_ms=epoch_rows[0].watermark_before_ms)
        return LedgerState(last_epoch=last_epoch, committed=committed, watermark_ms=watermark,
                           pending=pending)

    def record_plan(self, plan: EpochPlan, run_id: str | None) -> None:
        """The write-ahead: the epoch's ranges are durable before anything is read or written."""
        now = datetime.now(timezone.utc)
        rows = [(plan.epoch, r.topic, r.partition, r.from_offset, r.until_offset, PLANNED, now,
                 None, None, None, None, None, plan.watermark_ms, None, None, None, run_id)
                for r in plan.ranges]
        self.spark.createDataFrame(rows, LEDGER_SCHEMA).write.format("delta").mode("append").save(self.path)

    def commit(self, plan: EpochPlan, metrics: Mapping[int, PartitionMetrics], watermark_after_ms: int | None,
               sink_version: int | None, duration_seconds: float, run_id: str | None) -> None:
        """Mark the epoch committed. Matches only ``planned`` rows, so a replay after a crash
        that happened after this commit changes nothing."""
        from delta.tables import DeltaTable

        now = datetime.now(timezone.utc)
        rows = []
        for r in plan.ranges:
            m = metrics.get(r.partition, PartitionMetrics())
            rows.append((plan.epoch, r.topic, r.partition, r.from_offset, r.until_offset, COMMITTED, now,
                         now, m.records_read, m.records_counted, m.records_late, m.records_malformed,
                         plan.watermark_ms, watermark_after_ms, sink_version, duration_seconds, run_id))
        updates = self.spark.createDataFrame(rows, LEDGER_SCHEMA)
        set_cols = ["status", "committed_at", "records_read", "records_counted", "records_late",
                    "records_malformed", "watermark_after_ms", "sink_version", "duration_seconds", "run_id"]
        (DeltaTable.forPath(self.spark, self.path).alias("t")
         .merge(updates.alias("s"), "t.epoch = s.epoch AND t.topic = s.topic AND t.partition = s.partition "
                                    f"AND t.status = '{PLANNED}'")
         .whenMatchedUpdate(set={c: f"s.{c}" for c in set_cols})
         .execute())
