"""The sink: counts, dead letters and late records, each written idempotently per epoch.

Every write carries Delta's transaction identifier (``txnAppId`` = pipeline id,
``txnVersion`` = epoch). Delta records it in the same commit as the data and skips any
later write whose version is not above the recorded one, so replaying an epoch after a
crash - at any point - leaves each table exactly as one clean run would.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from pyspark.sql import functions as F
from pyspark.sql.types import (BinaryType, BooleanType, IntegerType, LongType, StringType, StructField,
                               StructType, TimestampType)

from ipcount.config import PipelineConfig
from ipcount.ledger import ensure_table

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

COUNTS_SCHEMA = StructType([
    StructField("window_start", TimestampType(), False),
    StructField("window_end", TimestampType(), False),
    StructField("ip", StringType(), False),
    StructField("count", LongType(), False),
    StructField("first_epoch", LongType(), False),
    StructField("last_epoch", LongType(), False),
    StructField("is_final", BooleanType(), True),
])
DEAD_LETTER_SCHEMA = StructType([
    StructField("epoch", LongType(), False),
    StructField("topic", StringType(), False),
    StructField("partition", IntegerType(), False),
    StructField("offset", LongType(), False),
    StructField("kafka_timestamp", TimestampType(), True),
    StructField("key", BinaryType(), True),
    StructField("value", BinaryType(), True),
    StructField("reason", StringType(), False),
])
LATE_SCHEMA = StructType([
    StructField("epoch", LongType(), False),
    StructField("topic", StringType(), False),
    StructField("partition", IntegerType(), False),
    StructField("offset", LongType(), False),
    StructField("ip", StringType(), False),
    StructField("event_time", TimestampType(), False),
    StructField("window_start", TimestampType(), False),
    StructField("window_end", TimestampType(), False),
    StructField("watermark", TimestampType(), False),
])

# Delta's session settings for idempotent DML (MERGE has no writer options).
TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
TXN_VERSION = "spark.databricks.delta.write.txnVersion"
USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"


class Sink:
    def __init__(self, spark: SparkSession, cfg: PipelineConfig) -> None:
        self.spark, self.cfg = spark, cfg

    def ensure(self) -> None:
        for path, schema in ((self.cfg.counts_path, COUNTS_SCHEMA),
                             (self.cfg.dead_letter_path, DEAD_LETTER_SCHEMA),
                             (self.cfg.late_path, LATE_SCHEMA)):
            ensure_table(self.spark, path, schema)

    def write(self, epoch: int, classified: DataFrame, counts: DataFrame, watermark_ms: int | None,
              malformed: int, late: int, counted: int, watermark_after_ms: int | None = None) -> int | None:
        """Write the epoch's dead letters, late records and ``counts`` (its per-window counts,
        :func:`ipcount.transform.window_counts`); return the counts table version that holds
        this epoch (None if it counted nothing).

        Each write is skipped if a previous attempt of the epoch committed it. A write with
        no rows is not attempted at all: a replay finds no rows either, so skipping it is
        just as idempotent and saves a commit.
        """
        if malformed:
            self._append(epoch, self.cfg.dead_letter_path, classified.where(F.col("reason").isNotNull()).select(
                F.lit(epoch).cast("long").alias("epoch"), "topic", "partition", "offset",
                F.col("timestamp").alias("kafka_timestamp"), "key", "value", "reason"))
        if late and watermark_ms is not None:  # before the first watermark nothing can be late
            self._append(epoch, self.cfg.late_path, classified.where(F.col("late")).select(
                F.lit(epoch).cast("long").alias("epoch"), "topic", "partition", "offset", "ip",
                F.timestamp_millis("event_ms").alias("event_time"),
                F.timestamp_millis("window_start_ms").alias("window_start"),
                F.timestamp_millis(F.col("window_start_ms") + self.cfg.window_ms).alias("window_end"),
                F.timestamp_millis(F.lit(watermark_ms)).alias("watermark")))
        return self._merge_counts(epoch, counts, watermark_after_ms) if counted else None

    def _append(self, epoch: int, path: str, rows: DataFrame) -> None:
        (rows.write.format("delta").mode("append")
         .option("txnAppId", self.cfg.pipeline_id).option("txnVersion", epoch)
         .option("userMetadata", f"epoch={epoch}").save(path))

    def _merge_counts(self, epoch: int, updates: DataFrame, watermark_ms: int | None) -> int | None:
        """Add the epoch's counts and mark windows final, in one idempotent commit.

        A window is final once the watermark this epoch leaves has passed its end plus the
        allowed lateness: no later record can be counted in it. Rows this epoch does not
        touch become final through the NOT MATCHED BY SOURCE clause of the same MERGE.
        """
        from delta.tables import DeltaTable

        def final(col: str):
            if watermark_ms is None:
                return F.lit(False)
            return F.unix_millis(F.col(col)) + self.cfg.allowed_lateness_ms <= F.lit(watermark_ms)

        target = DeltaTable.forPath(self.spark, self.cfg.counts_path)
        merge = (target.alias("t")
                 .merge(updates.alias("s"), "t.window_start = s.window_start AND t.ip = s.ip")
                 .whenMatchedUpdate(set={"count": F.col("t.count") + F.col("s.count"),
                                         "last_epoch": F.lit(epoch).cast("long"),
                                         "is_final": final("t.window_end")})
                 .whenNotMatchedInsert(values={"window_start": "s.window_start", "window_end": "s.window_end",
                                               "ip": "s.ip", "count": "s.count",
                                               "first_epoch": F.lit(epoch).cast("long"),
                                               "last_epoch": F.lit(epoch).cast("long"),
                                               "is_final": final("s.window_end")}))
        if watermark_ms is not None:
            merge = merge.whenNotMatchedBySourceUpdate(
                condition=~F.coalesce(F.col("t.is_final"), F.lit(False)) & final("t.window_end"),
                set={"is_final": F.lit(True)})
        with self._idempotent_dml(epoch):
            merge.execute()
        return self.version_of_epoch(self.cfg.counts_path, epoch)

    @contextmanager
    def _idempotent_dml(self, epoch: int) -> Iterator[None]:
        conf = self.spark.conf
        conf.set(TXN_APP_ID, self.cfg.pipeline_id)
        conf.set(TXN_VERSION, str(epoch))
        conf.set(USER_METADATA, f"epoch={epoch}")
        try:
            yield
        finally:
            for key in (TXN_APP_ID, TXN_VERSION, USER_METADATA):
                conf.unset(key)

    def version_of_epoch(self, path: str, epoch: int, search: int = 50) -> int | None:
        """The table version whose commit wrote ``epoch`` (None if the epoch wrote nothing,
        e.g. a MERGE with no source rows)."""
        from delta.tables import DeltaTable

        row = (DeltaTable.forPath(self.spark, path).history(search)
               .where(F.col("userMetadata") == f"epoch={epoch}").select("version").first())
        return row.version if row is not None else None
