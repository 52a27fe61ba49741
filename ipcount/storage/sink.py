"""The sink: counts, dead letters and late records, each written idempotently per epoch.

Every write carries Delta's transaction identifier (app id ``<pipeline id>/epoch-<n>``,
version n), recorded in the same commit as the data; a later write with that app id is
skipped, so replaying an epoch after a crash - at any point, even by two runners at once -
leaves each table exactly as one clean run would. The app id is per epoch, not per
pipeline, because scheduled and backfill epochs commit concurrently and so not in epoch
order: one app id with rising versions would skip a lower epoch that commits after a
higher one.

The counts table is Spark's (a MERGE, with ``txnAppId``/``txnVersion`` set for it); the
dead-letter and late-record tables are delta-rs's (:func:`ipcount.storage.delta.rs_append_once`
checks for the transaction and commits as the next version of what it checked). One
engine writes each table.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Sequence

from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType, TimestampType

from ipcount.rules.config import PipelineConfig
from ipcount.rules.finality import ChainCommit, finalized_below
from ipcount.rules.publish import CHANGE_DATA_FEED
from ipcount.rules.ledger import SCHEDULED, EpochPlan
from ipcount.rules.records import TOO_LARGE, dead_letter_prefix_bytes
from ipcount.storage.delta import (arrow_schema, ensure_table, latest_version, retry_on_conflict, rs_append_once,
                                   rs_concurrent_errors, rs_create_table, sql_timestamp, version_with_metadata)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

COUNTS_SCHEMA = StructType([
    StructField("window_start", TimestampType(), False),
    StructField("window_end", TimestampType(), False),
    StructField("ip", StringType(), False),
    StructField("count", LongType(), False),
    StructField("first_epoch", LongType(), False),
    StructField("last_epoch", LongType(), False),
    StructField("is_final", BooleanType(), True),
])
# The side tables, written with delta-rs (one engine per table): (name, Spark SQL type, nullable).
Columns = tuple[tuple[str, str, bool], ...]
# Which record of which epoch a side-table row is: both tables start with these.
RECORD_COLUMNS: Columns = (
    ("epoch", "bigint", False),
    ("topic", "string", False),
    ("partition", "int", False),
    ("offset", "bigint", False),
)
DEAD_LETTER_COLUMNS: Columns = (
    *RECORD_COLUMNS,
    ("kafka_timestamp", "timestamp", True),
    ("key", "binary", True),
    ("value", "binary", True),
    ("reason", "string", False),
    ("value_bytes", "bigint", True),     # the whole value's size, and its hash
    ("value_sha256", "string", True),    # (a too_large value keeps a prefix only)
)
LATE_COLUMNS: Columns = (
    *RECORD_COLUMNS,
    ("ip", "string", False),
    ("event_time", "timestamp", False),
    ("window_start", "timestamp", False),
    ("window_end", "timestamp", False),
    ("watermark", "timestamp", False),
)

# Delta's session settings for idempotent DML (MERGE has no writer options).
TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
TXN_VERSION = "spark.databricks.delta.write.txnVersion"
USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"


class Sink:
    def __init__(self, spark: SparkSession, cfg: PipelineConfig) -> None:
        self.spark, self.cfg = spark, cfg

    def side_tables(self) -> tuple[tuple[str, Columns], ...]:
        """(location, columns) of the dead-letter and late-record tables."""
        return ((self.cfg.dead_letter_path, DEAD_LETTER_COLUMNS), (self.cfg.late_path, LATE_COLUMNS))

    def ensure(self) -> None:
        # Publishing reads each counts version's changes from Delta's change data feed.
        ensure_table(self.spark, self.cfg.counts_path, COUNTS_SCHEMA,
                     {CHANGE_DATA_FEED: "true"} if self.cfg.publish else None)
        for path, columns in self.side_tables():
            rs_create_table(path, arrow_schema(columns))

    def txn_app_id(self, epoch: int) -> str:
        return f"{self.cfg.pipeline_id}/epoch-{epoch}"

    def write(self, plan: EpochPlan, classified: DataFrame, counts: DataFrame,
              malformed: int, late: int, counted: int, watermark_after_ms: int | None = None,
              chain: Sequence[ChainCommit] = ()) -> int | None:
        """Write the epoch's dead letters, late records and ``counts`` (its per-window counts,
        :func:`ipcount.jobs.transform.window_counts`); return the counts table version that holds
        this epoch (None if it counted nothing). ``chain``: the scheduled chain's counts
        commits, newest first (:meth:`ipcount.storage.ledger.Ledger.chain_commits`).

        Each write is skipped if a previous attempt of the epoch committed it. A write with
        no rows is not attempted at all: a replay finds no rows either, so skipping it is
        just as idempotent and saves a commit.
        """
        epoch, watermark_ms = plan.epoch, plan.watermark_ms
        record = (F.lit(epoch).cast("long").alias("epoch"), "topic", "partition", "offset")  # RECORD_COLUMNS
        if malformed:
            value, prefix = F.col("value"), dead_letter_prefix_bytes(self.cfg.max_value_bytes)
            bad = classified.where(F.col("reason").isNotNull())
            self._append(epoch, self.cfg.dead_letter_path, DEAD_LETTER_COLUMNS, bad.select(
                *record, F.col("timestamp").alias("kafka_timestamp"), "key",
                F.when(F.col("reason") == TOO_LARGE, F.substring(value, 1, prefix)).otherwise(value).alias("value"),
                "reason", F.length(value).cast("long").alias("value_bytes"), F.sha2(value, 256).alias("value_sha256")))
        if late and watermark_ms is not None:  # before the first watermark nothing can be late
            self._append(epoch, self.cfg.late_path, LATE_COLUMNS, classified.where(F.col("late")).select(
                *record, "ip",
                F.timestamp_millis("event_ms").alias("event_time"),
                F.timestamp_millis("window_start_ms").alias("window_start"),
                F.timestamp_millis(F.col("window_start_ms") + self.cfg.window_ms).alias("window_end"),
                F.timestamp_millis(F.lit(watermark_ms)).alias("watermark")))
        if not counted:
            return None
        if plan.kind == SCHEDULED:
            return self._merge_counts(epoch, counts, watermark_after_ms, finalize_untouched=True, chain=chain)
        # A backfill's windows are final only against the live chain's watermark (recorded in
        # the plan, so a replay marks the same): the chain may still count records into a
        # window the backfill's own watermark has passed. The chain's later epochs finalize
        # them as its watermark moves on.
        return self._merge_counts(epoch, counts, plan.chain_watermark_ms, finalize_untouched=False)

    def _append(self, epoch: int, path: str, columns: Columns, rows: DataFrame) -> None:
        """Append the epoch's rows (few: a share of its records) once, with delta-rs: a Spark
        Delta append costs seconds of fixed work, this one Spark job to collect them."""
        import pyarrow as pa

        schema = arrow_schema(columns)
        data = rows.toArrow()
        data = pa.table([data.column(f.name).cast(f.type) for f in schema], schema=schema)
        rs_append_once(path, data, self.txn_app_id(epoch), epoch, f"epoch={epoch}")

    def _merge_counts(self, epoch: int, updates: DataFrame, watermark_ms: int | None, finalize_untouched: bool,
                      chain: Sequence[ChainCommit] = ()) -> int | None:
        """Add the epoch's counts and mark windows final, in one idempotent commit.

        A window is final once the watermark has passed its end plus the allowed lateness:
        no later record of the live stream can be counted in it. Being final only ever goes
        from false to true. A scheduled epoch also finalizes rows it does not touch; a
        backfill does not (that is the chain's watermark to move). Where the chain's last
        commits allow (:func:`ipcount.rules.finality.finalized_below`), those rows are found
        by a read bounded by the last watermark and merged as extra source rows that add
        nothing; otherwise through the NOT MATCHED BY SOURCE clause, which reads the whole
        table. The ON clause bounds the target's windows by the source's, so the MERGE reads
        only the files that can hold them. ``first_epoch``/``last_epoch`` take the
        least/greatest epoch of the rows an epoch counts into, so epochs that commit out of
        order leave the same row.
        """
        from delta.tables import DeltaTable

        path, lateness_ms = self.cfg.counts_path, self.cfg.allowed_lateness_ms

        def final(col: str):
            if watermark_ms is None:
                return F.lit(False)
            return F.unix_millis(F.col(col)) + lateness_ms <= F.lit(watermark_ms)

        def merge() -> None:
            source, newly_final, full_pass = updates.withColumn("touched", F.lit(True)), None, False
            if watermark_ms is not None and finalize_untouched:
                below = finalized_below(chain, latest_version(path))
                full_pass = below is None
                if below is not None and below < watermark_ms:
                    newly_final = self._newly_final(updates, below, watermark_ms)
                    source = source.unionByName(newly_final)
            lo, hi = source.agg(F.min(F.unix_millis("window_start")), F.max(F.unix_millis("window_start"))).first()
            if lo is None:
                return
            log.info("epoch %d: merging counts into windows %s..%s%s", epoch, sql_timestamp(lo), sql_timestamp(hi),
                     ", finalizing untouched rows in a full pass" if full_pass else "")
            touched, was_final = F.col("s.touched"), F.coalesce(F.col("t.is_final"), F.lit(False))
            builder = (DeltaTable.forPath(self.spark, path).alias("t")
                       .merge(source.alias("s"), "t.window_start = s.window_start AND t.ip = s.ip AND "
                              f"t.window_start BETWEEN {sql_timestamp(lo)} AND {sql_timestamp(hi)}")
                       .whenMatchedUpdate(set={
                           "count": F.col("t.count") + F.col("s.count"),
                           "first_epoch": F.when(touched, F.least("t.first_epoch", F.lit(epoch).cast("long")))
                                           .otherwise(F.col("t.first_epoch")),
                           "last_epoch": F.when(touched, F.greatest("t.last_epoch", F.lit(epoch).cast("long")))
                                          .otherwise(F.col("t.last_epoch")),
                           "is_final": was_final | final("t.window_end")})
                       .whenNotMatchedInsert(condition=touched, values={
                           "window_start": "s.window_start", "window_end": "s.window_end", "ip": "s.ip",
                           "count": "s.count", "first_epoch": F.lit(epoch).cast("long"),
                           "last_epoch": F.lit(epoch).cast("long"), "is_final": final("s.window_end")}))
            if full_pass:
                builder = builder.whenNotMatchedBySourceUpdate(condition=~was_final & final("t.window_end"),
                                                               set={"is_final": F.lit(True)})
            try:
                with self._idempotent_dml(epoch):
                    builder.execute()
            finally:
                if newly_final is not None:
                    newly_final.unpersist()
        retry_on_conflict(merge, f"merging epoch {epoch} into {path}")
        return self.version_of_epoch(path, epoch)

    def _newly_final(self, updates: DataFrame, below_ms: int, watermark_ms: int) -> DataFrame:
        """The counts table's rows not yet final that the watermark's move from ``below_ms``
        to ``watermark_ms`` makes final and ``updates`` does not touch, as source rows that
        add nothing (``touched`` false). Materialized, so the MERGE sees the rows read here."""
        lateness_ms = self.cfg.allowed_lateness_ms
        rows = (self.spark.read.format("delta").load(self.cfg.counts_path)
                .where(f"window_end > {sql_timestamp(below_ms - lateness_ms)} AND "
                       f"window_end <= {sql_timestamp(watermark_ms - lateness_ms)} AND NOT coalesce(is_final, false)")
                .select("window_start", "window_end", "ip", F.lit(0).cast("long").alias("count"))
                .join(updates.select("window_start", "ip"), ["window_start", "ip"], "left_anti")
                .withColumn("touched", F.lit(False))
                .persist())
        rows.count()
        return rows

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
        path = self.cfg.counts_path
        retry_on_conflict(lambda: (
            self.spark.createDataFrame([], COUNTS_SCHEMA).write.format("delta").mode("append")
            .option("txnAppId", self.txn_app_id(epoch)).option("txnVersion", epoch)
            .option("userMetadata", f"fenced epoch={epoch}").save(path)), f"fencing epoch {epoch} in {path}")
        for path, columns in self.side_tables():
            rs_append_once(path, arrow_schema(columns).empty_table(), self.txn_app_id(epoch), epoch,
                           f"fenced epoch={epoch}")

    def remove_epoch_rows(self, epoch: int) -> None:
        """Delete what ``epoch`` wrote to the dead-letter and late-record tables (their rows
        carry the epoch): for an epoch given up before its counts were written."""
        from deltalake import DeltaTable

        for path, _ in self.side_tables():
            retry_on_conflict(lambda path=path: DeltaTable(path).delete(f"epoch = {int(epoch)}"),
                              f"removing epoch {epoch} from {path}", rs_concurrent_errors())

    def version_of_epoch(self, path: str, epoch: int, search: int = 50) -> int | None:
        """The table version whose commit wrote ``epoch`` (None if the epoch wrote nothing,
        e.g. a MERGE with no source rows)."""
        return version_with_metadata(path, f"epoch={epoch}", search)
