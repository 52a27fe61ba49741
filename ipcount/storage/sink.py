"""The sink: counts, dead letters and late records, each written idempotently per epoch.

Every write carries Delta's transaction identifier (``txnAppId`` = ``<pipeline id>/epoch-<n>``,
``txnVersion`` = n). Delta records it in the same commit as the data and skips any later
write with that app id, so replaying an epoch after a crash - at any point, even by two
runners at once - leaves each table exactly as one clean run would. The app id is per
epoch, not per pipeline, because scheduled and backfill epochs commit concurrently and so
not in epoch order: one app id with rising versions would skip a lower epoch that commits
after a higher one.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from pyspark.sql import functions as F
from pyspark.sql.types import (BinaryType, BooleanType, IntegerType, LongType, StringType, StructField, StructType,
                               TimestampType)

from ipcount.rules.config import PipelineConfig
from ipcount.rules.publish import CHANGE_DATA_FEED
from ipcount.rules.ledger import SCHEDULED, EpochPlan
from ipcount.rules.records import TOO_LARGE, dead_letter_prefix_bytes
from ipcount.storage.delta import ensure_table, retry_on_conflict, version_with_metadata

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
    StructField("value_bytes", LongType(), True),    # the whole value's size, and its hash
    StructField("value_sha256", StringType(), True),  # (a too_large value keeps a prefix only)
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

    def tables(self) -> tuple[tuple[str, StructType], ...]:
        """(location, schema) of each sink table."""
        return ((self.cfg.counts_path, COUNTS_SCHEMA), (self.cfg.dead_letter_path, DEAD_LETTER_SCHEMA),
                (self.cfg.late_path, LATE_SCHEMA))

    def ensure(self) -> None:
        for path, schema in self.tables():
            # Publishing reads each counts version's changes from Delta's change data feed.
            publishing = self.cfg.publish and path == self.cfg.counts_path
            ensure_table(self.spark, path, schema, {CHANGE_DATA_FEED: "true"} if publishing else None)

    def txn_app_id(self, epoch: int) -> str:
        return f"{self.cfg.pipeline_id}/epoch-{epoch}"

    def write(self, plan: EpochPlan, classified: DataFrame, counts: DataFrame,
              malformed: int, late: int, counted: int, watermark_after_ms: int | None = None) -> int | None:
        """Write the epoch's dead letters, late records and ``counts`` (its per-window counts,
        :func:`ipcount.jobs.transform.window_counts`); return the counts table version that holds
        this epoch (None if it counted nothing).

        Each write is skipped if a previous attempt of the epoch committed it. A write with
        no rows is not attempted at all: a replay finds no rows either, so skipping it is
        just as idempotent and saves a commit.
        """
        epoch, watermark_ms = plan.epoch, plan.watermark_ms
        if malformed:
            value, prefix = F.col("value"), dead_letter_prefix_bytes(self.cfg.max_value_bytes)
            self._append(epoch, self.cfg.dead_letter_path, classified.where(F.col("reason").isNotNull()).select(
                F.lit(epoch).cast("long").alias("epoch"), "topic", "partition", "offset",
                F.col("timestamp").alias("kafka_timestamp"), "key",
                F.when(F.col("reason") == TOO_LARGE, F.substring(value, 1, prefix)).otherwise(value).alias("value"),
                "reason", F.length(value).cast("long").alias("value_bytes"), F.sha2(value, 256).alias("value_sha256")))
        if late and watermark_ms is not None:  # before the first watermark nothing can be late
            self._append(epoch, self.cfg.late_path, classified.where(F.col("late")).select(
                F.lit(epoch).cast("long").alias("epoch"), "topic", "partition", "offset", "ip",
                F.timestamp_millis("event_ms").alias("event_time"),
                F.timestamp_millis("window_start_ms").alias("window_start"),
                F.timestamp_millis(F.col("window_start_ms") + self.cfg.window_ms).alias("window_end"),
                F.timestamp_millis(F.lit(watermark_ms)).alias("watermark")))
        if not counted:
            return None
        if plan.kind == SCHEDULED:
            return self._merge_counts(epoch, counts, watermark_after_ms, finalize_untouched=True)
        # A backfill's windows are final only against the live chain's watermark (recorded in
        # the plan, so a replay marks the same): the chain may still count records into a
        # window the backfill's own watermark has passed. The chain's later epochs finalize
        # them as its watermark moves on.
        return self._merge_counts(epoch, counts, plan.chain_watermark_ms, finalize_untouched=False)

    def _append(self, epoch: int, path: str, rows: DataFrame) -> None:
        retry_on_conflict(lambda: (rows.write.format("delta").mode("append")
                                   .option("txnAppId", self.txn_app_id(epoch)).option("txnVersion", epoch)
                                   .option("userMetadata", f"epoch={epoch}").save(path)),
                          f"appending epoch {epoch} to {path}")

    def _merge_counts(self, epoch: int, updates: DataFrame, watermark_ms: int | None,
                      finalize_untouched: bool) -> int | None:
        """Add the epoch's counts and mark windows final, in one idempotent commit.

        A window is final once the watermark has passed its end plus the allowed lateness:
        no later record of the live stream can be counted in it. Being final only ever goes
        from false to true. A scheduled epoch also finalizes rows it does not touch, through
        the NOT MATCHED BY SOURCE clause of the same MERGE; a backfill does not (that is the
        chain's watermark to move). ``first_epoch``/``last_epoch`` take the least/greatest
        epoch, so epochs that commit out of order leave the same row.
        """
        from delta.tables import DeltaTable

        def final(col: str):
            if watermark_ms is None:
                return F.lit(False)
            return F.unix_millis(F.col(col)) + self.cfg.allowed_lateness_ms <= F.lit(watermark_ms)

        def merge() -> None:
            was_final = F.coalesce(F.col("t.is_final"), F.lit(False))
            builder = (DeltaTable.forPath(self.spark, self.cfg.counts_path).alias("t")
                       .merge(updates.alias("s"), "t.window_start = s.window_start AND t.ip = s.ip")
                       .whenMatchedUpdate(set={"count": F.col("t.count") + F.col("s.count"),
                                               "first_epoch": F.least("t.first_epoch", F.lit(epoch).cast("long")),
                                               "last_epoch": F.greatest("t.last_epoch", F.lit(epoch).cast("long")),
                                               "is_final": was_final | final("t.window_end")})
                       .whenNotMatchedInsert(values={"window_start": "s.window_start", "window_end": "s.window_end",
                                                     "ip": "s.ip", "count": "s.count",
                                                     "first_epoch": F.lit(epoch).cast("long"),
                                                     "last_epoch": F.lit(epoch).cast("long"),
                                                     "is_final": final("s.window_end")}))
            if watermark_ms is not None and finalize_untouched:
                builder = builder.whenNotMatchedBySourceUpdate(condition=~was_final & final("t.window_end"),
                                                               set={"is_final": F.lit(True)})
            with self._idempotent_dml(epoch):
                builder.execute()
        retry_on_conflict(merge, f"merging epoch {epoch} into {self.cfg.counts_path}")
        return self.version_of_epoch(self.cfg.counts_path, epoch)

    @contextmanager
    def _idempotent_dml(self, epoch: int) -> Iterator[None]:
        conf = self.spark.conf
        conf.set(TXN_APP_ID, self.txn_app_id(epoch))
        conf.set(TXN_VERSION, str(epoch))
        conf.set(USER_METADATA, f"epoch={epoch}")
        try:
            yield
        finally:
            for key in (TXN_APP_ID, TXN_VERSION, USER_METADATA):
                conf.unset(key)

    def fence(self, epoch: int) -> None:
        """Make sure no write of ``epoch`` lands from now on: an empty commit with its
        transaction id in each table (skipped where its write is in already), after which
        Delta skips any write with that id - a runner still busy with the epoch included."""
        for path, schema in self.tables():
            retry_on_conflict(lambda path=path, schema=schema: (
                self.spark.createDataFrame([], schema).write.format("delta").mode("append")
                .option("txnAppId", self.txn_app_id(epoch)).option("txnVersion", epoch)
                .option("userMetadata", f"fenced epoch={epoch}").save(path)), f"fencing epoch {epoch} in {path}")

    def remove_epoch_rows(self, epoch: int) -> None:
        """Delete what ``epoch`` wrote to the dead-letter and late-record tables (their rows
        carry the epoch): for an epoch given up before its counts were written."""
        for path in (self.cfg.dead_letter_path, self.cfg.late_path):
            retry_on_conflict(lambda path=path: self.spark.sql(
                f"DELETE FROM delta.`{path}` WHERE epoch = {int(epoch)}"), f"removing epoch {epoch} from {path}")

    def version_of_epoch(self, path: str, epoch: int, search: int = 50) -> int | None:
        """The table version whose commit wrote ``epoch`` (None if the epoch wrote nothing,
        e.g. a MERGE with no source rows)."""
        return version_with_metadata(path, f"epoch={epoch}", search)
