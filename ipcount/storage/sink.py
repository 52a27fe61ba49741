"""The sink: counts, dead letters and late records, each written idempotently per epoch.

Every write carries Delta's transaction ``<pipeline id>/epoch-<n>`` and is skipped if the table holds it
(:func:`ipcount.storage.delta.rs_commit_once`): a replay, even by two runners at once, leaves each table as one clean
run would. The app id is per epoch because scheduled and backfill epochs commit out of epoch order. The counts commit
comes last, records the epoch's :data:`FACTS` and races a settling run's fence for the same id; maintenance retires
final epochs' transactions under a floor. docs/data-model.md ("Epoch transactions and their retirement") has the detail.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import EpochFenced
from ipcount.rules.finality import ChainCommit, adds_no_rows, finalized_below, gap_versions, merged_row
from ipcount.rules.publish import CHANGE_DATA_FEED, has_change_feed
from ipcount.rules.ledger import SCHEDULED, EpochPlan, PartitionMetrics
from ipcount.rules.maintenance import COUNTS_PARTITIONS, DAY_MS, log_properties, partition_value
from ipcount.storage.delta import (arrow_schema, check_fillable, commit_infos, commit_race_pause, conform, latest,
                                   open_table, query_arrow, retry_on_conflict, rs_append_once, rs_commit_once,
                                   rs_concurrent_errors, rs_create_table, sql_timestamp, version_with_metadata,
                                   with_table_columns)
from ipcount.storage.retry import retrying
from ipcount.storage.spark import spark_ddl, task_slots
from ipcount.storage.table_files import (TableFile, WrittenFile, add_actions, all_present, live_files, read_files,
                                         remove_actions, write_files)

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

# The tables' columns: (name, Spark SQL type, nullable).
Columns = tuple[tuple[str, str, bool], ...]
COUNTS_COLUMNS: Columns = (
    ("window_start", "timestamp", False),
    ("window_end", "timestamp", False),
    ("ip", "string", False),
    ("count", "bigint", False),
    ("first_epoch", "bigint", False),
    ("last_epoch", "bigint", False),
    ("is_final", "boolean", True),
    ("window_hour", "string", True),   # the window's hour (UTC, "2026-11-24T10"): an older table's partition
    ("window_day", "string", True),    # the window's day (UTC, "2026-11-24")
)
# A new counts table's partitions: a MERGE rewrites whole files, so rows it may still update (not final) are kept apart,
# and a year of days packs into 365 files (a snapshot lists every live file: a cost of every commit).
COUNTS_PARTITION_BY = ("window_day", "is_final")
# How many commits since the chain's last but one a MERGE reads for rows they changed (:func:`_row_neutral`).
NEUTRAL_LOOKBACK = 64
# A counts MERGE's source: the epoch's counts, and (``touched`` false) rows it makes final.
MERGE_SOURCE_COLUMNS: Columns = (*COUNTS_COLUMNS[:4], *((c, "string", False) for c in COUNTS_PARTITIONS),
                                 ("touched", "boolean", False))
# Which record of which epoch a side-table row is: both side tables start with these.
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


# The facts an epoch's counts commit (or its fence) records as transactions of their own (app id
# ``<epoch's app id>/<name>``), in the same commit as the epoch's transaction.
COUNTS_VERSION, NO_COUNTS, WATERMARK, FENCED = "counts-version", "no-counts", "watermark", "fenced"
FACTS = (COUNTS_VERSION, NO_COUNTS, WATERMARK, FENCED)
# Expires only what retirement dates to 1970 (delta-spark dated the transactions it wrote: ten years keeps them).
TXN_RETENTION = {"delta.setTransactionRetentionDuration": "interval 3650 days"}
RETIRED_DATE_MS = 1
# How many epochs one retirement commit expires at most (each raises the floor: a kill between them is safe).
RETIRE_BATCH = 20_000
RETIRE_ATTEMPTS = 20  # commits lost to concurrent ones before a table's retirement waits for the next run
SideRows = Any  # a side table's rows: Arrow (Sink.write) or a DataFrame (Sink.write_from_spark)


@dataclass(frozen=True)
class EpochCommit:
    """What the counts table says of an epoch whose transaction it holds."""

    fenced: bool                        # a settling run's fence came first: nothing of it is in
    version: int | None = None          # the counts version holding its counts (None: none counted)
    watermark_ms: int | None = None     # the watermark after the epoch, as its MERGE used it
    known: bool = True                  # False: committed by an older version that recorded no facts
    retired: bool = False               # under the floor: final in the ledger, its transactions expired


class Sink:
    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg

    def tables(self) -> tuple[tuple[str, Columns], ...]:
        """(location, columns) of the counts, dead-letter and late-record tables."""
        return ((self.cfg.counts_path, COUNTS_COLUMNS), (self.cfg.dead_letter_path, DEAD_LETTER_COLUMNS),
                (self.cfg.late_path, LATE_COLUMNS))

    def ensure(self) -> None:
        for path, columns in self.tables():
            # A table ever published keeps its change data feed and log for the publisher, publish on or off.
            counts = path == self.cfg.counts_path
            published = counts and (self.cfg.publish or is_published(path))
            wanted = {**TXN_RETENTION, **log_properties(self.cfg.log_retention_hours, published),
                      **({CHANGE_DATA_FEED: "true"} if published else {})}
            # Only a new table is partitioned: an older one keeps its layout (and gains the column).
            rs_create_table(path, arrow_schema(columns), wanted,
                            partition_by=list(COUNTS_PARTITION_BY) if counts else None)

    def paths(self) -> tuple[str, ...]:
        return tuple(path for path, _ in self.tables())

    def txn_app_id(self, epoch: int) -> str:
        return f"{self.cfg.pipeline_id}/epoch-{epoch}"

    @property
    def floor_id(self) -> str:
        """The transaction whose version is the highest retired epoch (:meth:`retire`)."""
        return f"{self.cfg.pipeline_id}/retired-through"

    def write(self, plan: EpochPlan, counts: pa.Table, dead_letters: pa.Table, late_records: pa.Table,
              watermark_after_ms: int | None = None, chain: Sequence[ChainCommit] = (),
              stages: dict[str, float] | None = None) -> int | None:
        """Write the epoch's dead letters, late records and ``counts`` (per window and client), as Arrow
        (:class:`ipcount.jobs.tally.EpochTally`); the counts version holding the epoch (None if it counted nothing).
        ``chain``: the chain's counts commits, newest first (:meth:`ipcount.storage.ledger.Ledger.chain_commits`);
        ``stages`` gets the side tables' seconds. Each write is skipped if an earlier attempt made it; the counts
        commit, last, decides the epoch: :class:`EpochFenced` if a settling run's fence holds its transaction."""
        epoch = plan.epoch
        self._write_side_tables(epoch, ((dead_letters, dead_letters.num_rows), (late_records, late_records.num_rows)),
                                self._append_rows, stages)
        return self._write_counts(plan, counts.num_rows, watermark_after_ms, lambda watermark_ms: self._merge_counts(
            epoch, counts, watermark_ms, plan.kind == SCHEDULED, chain, watermark_after_ms))

    def write_from_spark(self, plan: EpochPlan, counts: DataFrame, dead_letters: DataFrame, late_records: DataFrame,
                         sizes: PartitionMetrics, *, counted_windows_ms: tuple[int, int] | None,
                         watermark_after_ms: int | None = None,
                         chain: Sequence[ChainCommit] = (), stages: dict[str, float] | None = None,
                         before_commit: Callable[[], None] = lambda: None) -> int | None:
        """:meth:`write` for rows left in Spark (:class:`ipcount.jobs.tally.SparkTally`; ``counted_windows_ms``: the
        first and last window start of ``counts``): the executors write the files, delta-rs commits them
        (:mod:`ipcount.storage.table_files`). ``before_commit`` runs between the counts files' writes and commit."""
        epoch = plan.epoch
        self._write_side_tables(epoch, ((dead_letters, sizes.records_malformed), (late_records, sizes.records_late)),
                                self._append_files, stages)

        def merge(watermark_ms: int | None) -> int | None:
            if counted_windows_ms is None:
                raise ValueError(f"epoch {epoch} counted {sizes.records_counted} records, but in no window")
            return self._merge_counts_in_spark(epoch, counts, counted_windows_ms, watermark_ms,
                                               finalize_untouched=plan.kind == SCHEDULED, chain=chain,
                                               watermark_after_ms=watermark_after_ms, before_commit=before_commit)
        return self._write_counts(plan, sizes.records_counted, watermark_after_ms, merge)

    def _write_side_tables(self, epoch: int, rows: tuple[tuple[SideRows, int], tuple[SideRows, int]],
                           append: Callable[[str, Columns, SideRows, int], object],
                           stages: dict[str, float] | None) -> None:
        """Append the epoch's dead letters and late records (each with its row count) with ``append``, skipping empty
        ones (a replay finds none either)."""
        started = time.monotonic()
        for (path, columns), (part, size) in zip(self.tables()[1:], rows):
            if size:
                append(path, columns, part, epoch)
        if stages is not None:
            stages["side_tables"] = time.monotonic() - started

    def _write_counts(self, plan: EpochPlan, counted: int, watermark_after_ms: int | None,
                      merge: Callable[[int | None], int | None]) -> int | None:
        """The epoch's counts commit: ``merge(watermark)``, or an empty commit if it counted nothing; the counts version
        holding the epoch, whichever attempt committed it."""
        epoch = plan.epoch
        if not counted:
            committed = self._commit_nothing_counted(epoch, watermark_after_ms)
        else:
            # A backfill's windows are final only against the chain's watermark (recorded in the plan): the chain may
            # still count into a window the backfill's own watermark has passed.
            committed = merge(watermark_after_ms if plan.kind == SCHEDULED else plan.chain_watermark_ms)
        if committed is not None:  # this call's commit: its version holds the counts, if any
            return committed if counted else None
        # An earlier attempt's commit, or a settling run's fence, holds the transaction.
        done = self.epoch_commit(epoch)
        if done is not None and done.retired:
            raise EpochFenced(f"epoch {epoch} is final in the ledger and retired in {self.cfg.counts_path} (its "
                              "transactions expired under the floor): this run of it is a stray, and writes nothing")
        if done is None or done.fenced:
            raise EpochFenced(f"epoch {epoch} was settled by another run while this one ran it (its offsets aged "
                              f"out): {self.cfg.counts_path} holds that run's fence, so nothing more of the epoch "
                              "is written and this run leaves the ledger to it")
        return done.version

    def _commit_nothing_counted(self, epoch: int, watermark_after_ms: int | None) -> int | None:
        facts = self._facts(epoch, None, watermark_after_ms)
        return rs_append_once(self.cfg.counts_path, arrow_schema(COUNTS_COLUMNS).empty_table(),
                              self.txn_app_id(epoch), epoch, f"epoch={epoch}", markers=lambda _: facts,
                              floor=self.floor_id)

    def _append_rows(self, path: str, columns: Columns, rows: pa.Table, epoch: int) -> int | None:
        """Append ``rows`` (Arrow) to the table at ``path`` once per epoch."""
        return rs_append_once(path, conform(rows, arrow_schema(columns)), self.txn_app_id(epoch), epoch,
                              f"epoch={epoch}", floor=self.floor_id)

    def _append_files(self, path: str, columns: Columns, rows: DataFrame, epoch: int) -> int | None:
        """Append ``rows`` once per epoch: Spark writes the files (on the first try only), delta-rs commits them."""
        written: list[list[WrittenFile]] = []

        def append(table, properties) -> None:
            _check_executors_may_write(table, columns)
            if not written:
                written.append(write_files(rows, path, arrow_schema(columns), tag=f"epoch-{epoch}"))
            table.create_write_transaction(add_actions(written[0]), mode="append", schema=table.schema(),
                                           partition_by=list(table.metadata().partition_columns),
                                           commit_properties=properties)
        try:
            return rs_commit_once(path, self.txn_app_id(epoch), epoch, f"epoch={epoch}", append,
                                  floor=self.floor_id)
        except _NotForExecutors as why:  # raised before this attempt wrote anything
            log.warning("epoch %d: %s, so its rows are appended by this process", epoch, why)
            return self._append_rows(path, columns, rows.toArrow(), epoch)

    def _merge_counts_in_spark(self, epoch: int, counts: DataFrame, windows_ms: tuple[int, int],
                               watermark_ms: int | None, finalize_untouched: bool, chain: Sequence[ChainCommit] = (),
                               watermark_after_ms: int | None = None,
                               before_commit: Callable[[], None] = lambda: None) -> int | None:
        """:meth:`_merge_counts` done by Spark's executors: they read the files the epoch can change
        (:func:`_read_by_merge`) at the snapshot the commit follows and write the merged rows as new files; the commit
        swaps them. Another commit first means a new merge, unless it changed no file this merge read or would read.
        Unknown (newer) columns are carried through. A table the executors cannot write (an older layout, a column Spark
        cannot carry, :func:`unenforced_features`) takes :meth:`_merge_counts` instead."""
        spark = counts.sparkSession
        path = self.cfg.counts_path
        lo_ms, hi_ms = windows_ms
        days = {partition_value("window_day", ms) for ms in range(lo_ms - lo_ms % DAY_MS, hi_ms + 1, DAY_MS)}

        def may_read(f: TableFile) -> bool:
            return _read_by_merge(f, days, lo_ms, hi_ms, finalize_untouched)

        attempt: dict = {}  # the last attempt's snapshot (its files' paths), files read and written, columns

        def merge(table, properties) -> None:
            _check_executors_may_write(table, COUNTS_COLUMNS)
            if not has_open_partitions(table):
                raise _NotForExecutors(f"{path} version {table.version()} predates the (window_day, is_final) "
                                       "partitions")
            extra = _carried_columns(table)
            files = live_files(table, bounds_of="window_start")
            if attempt and _merge_still_holds(attempt, files, extra, may_read) \
                    and all_present(path, attempt["written"]):
                log.info("epoch %d: the commit(s) that came first changed no file its merge read: committing its "
                         "files at version %d", epoch, table.version() + 1)
            else:
                rewrite = [f for f in files if f.partition_values["is_final"] == "false" and may_read(f)]
                closed = [f for f in files if f.partition_values["is_final"] == "true" and may_read(f)]
                rewrite += self._files_with_rows_of(spark, closed, counts)
                log.info("epoch %d: merging counts into windows %s..%s in Spark: rewriting %d of %d files", epoch,
                         sql_timestamp(lo_ms), sql_timestamp(hi_ms), len(rewrite), len(files))
                written = self._rewrite(rewrite, counts, epoch, watermark_ms, finalize_untouched, extra)
                attempt.update(files={f.path for f in files}, rewrite=rewrite, written=written, extra=extra)
            rewrite, written = attempt["rewrite"], attempt["written"]
            before_commit()
            table.create_write_transaction([*remove_actions(rewrite), *add_actions(written)], mode="append",
                                           schema=table.schema(), partition_by=list(COUNTS_PARTITION_BY),
                                           commit_properties=properties)
        try:
            return rs_commit_once(path, self.txn_app_id(epoch), epoch, f"epoch={epoch}", merge,
                                  markers=lambda version: self._facts(epoch, version, watermark_after_ms),
                                  floor=self.floor_id)
        except _NotForExecutors as why:  # raised before this attempt wrote anything
            log.warning("epoch %d: %s, so its counts are merged by this process, which keeps what it does not "
                        "know", epoch, why)
            return self._merge_counts(epoch, counts.toArrow(), watermark_ms, finalize_untouched, chain,
                                      watermark_after_ms)

    def _rewrite(self, files: Sequence[TableFile], counts: DataFrame, epoch: int, watermark_ms: int | None,
                 finalize_untouched: bool, extra: Sequence[tuple[pa.Field, str]]) -> list[WrittenFile]:
        """``files`` with the epoch's ``counts`` merged in, written by the executors as new (uncommitted) files."""
        import pyarrow as pa

        spark = counts.sparkSession
        old = self._read_counts(spark, files, extra=extra) if files else None
        merged = _merged_counts(old, counts, epoch, watermark_ms, self.cfg.allowed_lateness_ms, finalize_untouched,
                                extra)
        schema = pa.schema([*arrow_schema(_unpartitioned(COUNTS_COLUMNS)), *(f for f, _ in extra)])
        return write_files(merged, self.cfg.counts_path, schema, partition_by=COUNTS_PARTITION_BY,
                           tag=f"epoch-{epoch}")

    def _read_counts(self, spark: SparkSession, files: Sequence[TableFile], with_path: bool = False,
                     extra: Sequence[tuple[pa.Field, str]] = ()) -> DataFrame:
        """The rows of the counts table's ``files``, read by Spark's tasks, with the ``extra`` columns."""
        import pyarrow as pa

        schema = (*COUNTS_COLUMNS, *((f.name, kind, True) for f, kind in extra),
                  *((("_file", "string", False),) if with_path else ()))
        arrow = pa.schema([*arrow_schema(COUNTS_COLUMNS), *(f for f, _ in extra)])
        return read_files(spark, self.cfg.counts_path, files, arrow, spark_ddl(schema),
                          tasks=task_slots(spark) or 2, with_path=with_path)

    def _files_with_rows_of(self, spark: SparkSession, files: Sequence[TableFile], counts: DataFrame
                            ) -> list[TableFile]:
        """Those of ``files`` that hold a (window, client) of ``counts``."""
        if not files:
            return []
        keys = self._read_counts(spark, files, with_path=True).select("window_start", "ip", "_file")
        hit = {r["_file"] for r in keys.join(counts.select("window_start", "ip"), ["window_start", "ip"], "left_semi")
               .select("_file").distinct().collect()}
        return [f for f in files if f.path in hit]

    def _facts(self, epoch: int, counts_version: int | None, watermark_after_ms: int | None) -> dict[str, int]:
        """The transactions an epoch's counts commit records beside its own."""
        facts = {self._fact(epoch, NO_COUNTS if counts_version is None else COUNTS_VERSION):
                 epoch if counts_version is None else counts_version}
        if watermark_after_ms is not None:
            facts[self._fact(epoch, WATERMARK)] = watermark_after_ms
        return facts

    def _fact(self, epoch: int, name: str) -> str:
        return f"{self.txn_app_id(epoch)}/{name}"

    def epoch_commit(self, epoch: int) -> EpochCommit | None:
        """What the counts table's transactions say of ``epoch``: None if it holds neither the epoch's counts commit nor
        a fence of it."""
        table = latest(self.cfg.counts_path)
        if table.transaction_version(self.txn_app_id(epoch)) is None:
            floor = table.transaction_version(self.floor_id)
            return EpochCommit(fenced=False, retired=True) if floor is not None and floor >= epoch else None
        if table.transaction_version(self._fact(epoch, FENCED)) is not None:
            return EpochCommit(fenced=True)
        watermark = table.transaction_version(self._fact(epoch, WATERMARK))
        version = table.transaction_version(self._fact(epoch, COUNTS_VERSION))
        if version is not None or table.transaction_version(self._fact(epoch, NO_COUNTS)) is not None:
            return EpochCommit(fenced=False, version=version, watermark_ms=watermark)
        # Committed by a version that recorded no facts: its commit info, if still in the log.
        found = version_with_metadata(self.cfg.counts_path, f"epoch={epoch}", search=1000)
        if found is None and version_with_metadata(self.cfg.counts_path, f"fenced epoch={epoch}", search=1000):
            return EpochCommit(fenced=True)
        return EpochCommit(fenced=False, version=found, known=False)

    def _merge_counts(self, epoch: int, counts: pa.Table, watermark_ms: int | None, finalize_untouched: bool,
                      chain: Sequence[ChainCommit] = (), watermark_after_ms: int | None = None) -> int | None:
        """Add the epoch's counts and mark windows final (:func:`~ipcount.rules.finality.merged_row`) in one idempotent
        MERGE: its version, or None if the table holds the epoch's transaction already. A scheduled epoch also finalizes
        untouched rows: found by a read bounded by the last watermark where the chain's commits allow
        (:func:`~ipcount.rules.finality.finalized_below`), else by NOT MATCHED BY SOURCE, a full pass."""
        import pyarrow as pa
        import pyarrow.compute as pc

        path, lateness_ms = self.cfg.counts_path, self.cfg.allowed_lateness_ms
        touched = conform(_with_partitions(counts).append_column("touched", pa.repeat(True, counts.num_rows)),
                          arrow_schema(MERGE_SOURCE_COLUMNS))
        final_until = None if watermark_ms is None else sql_timestamp(watermark_ms - lateness_ms)
        matched = merged_row(epoch, final_until, finalize_untouched, new=False, touched="s.touched", end="t.window_end")
        inserted = merged_row(epoch, final_until, finalize_untouched, new=True, touched="true", end="s.window_end")
        untouched = merged_row(epoch, final_until, finalize_untouched, new=False, touched="false", end="t.window_end")

        def merge(table, properties) -> None:
            check_fillable(table, (c[0] for c in COUNTS_COLUMNS))
            source, full_pass = touched, False
            # Where every row has its partition value (older writers' may not), delta-rs rewrites only the partitions
            # the source's rows name.
            column = partition_of(table)
            if watermark_ms is not None and finalize_untouched:
                below = finalized_below(chain, table.version(), _row_neutral(path, table, chain))
                full_pass = below is None
                if below is not None and below < watermark_ms:
                    source = pa.concat_tables([source, self._newly_final(table, column, touched, below,
                                                                         watermark_ms)])
            bounds = pc.min_max(source["window_start"])
            lo, hi = (sql_timestamp(b.value // 1000) for b in (bounds["min"], bounds["max"]))  # us -> ms
            log.info("epoch %d: merging counts into windows %s..%s%s", epoch, lo, hi,
                     ", finalizing untouched rows in a full pass" if full_pass else "")
            same_partition = f"t.{column} = s.{column} AND " if column else ""
            merger = (table.merge(source, f"{same_partition}t.window_start = s.window_start AND t.ip = s.ip AND "
                                  f"t.window_start BETWEEN {lo} AND {hi}", source_alias="s", target_alias="t",
                                  streamed_exec=False, commit_properties=properties)
                      .when_matched_update(matched)
                      .when_not_matched_insert({"window_start": "s.window_start", "window_end": "s.window_end",
                                                "ip": "s.ip", **inserted, **{c: f"s.{c}" for c in COUNTS_PARTITIONS}},
                                               predicate="s.touched"))
            if full_pass:  # (only the rows it turns final: the others' files stay as they are)
                merger = merger.when_not_matched_by_source_update(
                    {"is_final": untouched["is_final"]},
                    predicate=f"NOT coalesce(t.is_final, false) AND {untouched['is_final']}")
            merger.execute()
        return rs_commit_once(path, self.txn_app_id(epoch), epoch, f"epoch={epoch}", merge,
                              markers=lambda version: self._facts(epoch, version, watermark_after_ms),
                              floor=self.floor_id)

    def _newly_final(self, table, column: str | None, touched: pa.Table, below_ms: int,
                     watermark_ms: int) -> pa.Table:
        """The not yet final rows of ``table`` that the watermark's move from ``below_ms`` to ``watermark_ms`` makes
        final and ``touched`` lacks, as source rows that add nothing (``column``: the partition column, if complete)."""
        import pyarrow as pa

        lateness_ms, window_ms = self.cfg.allowed_lateness_ms, self.cfg.window_ms
        # (such windows start after below - lateness - window: partitions before are pruned)
        since = "" if column is None else \
            f"{column} >= '{partition_value(column, below_ms - lateness_ms - window_ms)}' AND "
        rows = query_arrow(table, "SELECT window_start, window_end, ip FROM t "
                                  f"WHERE {since}window_end > {sql_timestamp(below_ms - lateness_ms)} AND "
                                  f"window_end <= {sql_timestamp(watermark_ms - lateness_ms)} AND "
                                  "NOT coalesce(is_final, false)")
        rows = conform(rows, arrow_schema(MERGE_SOURCE_COLUMNS[:3]))
        rows = rows.join(touched.select(["window_start", "ip"]), ["window_start", "ip"], join_type="left anti")
        return conform(_with_partitions(rows)
                       .append_column("count", pa.repeat(pa.scalar(0, pa.int64()), rows.num_rows))
                       .append_column("touched", pa.repeat(False, rows.num_rows)), arrow_schema(MERGE_SOURCE_COLUMNS))

    def fence(self, epoch: int) -> None:
        """Make sure no write of ``epoch`` lands from now on, a runner still busy with it included: an empty commit with
        its transaction id in each table, which the counts table marks fenced (:meth:`epoch_commit`)."""
        for path, columns in self.tables():
            rs_append_once(path, arrow_schema(columns).empty_table(), self.txn_app_id(epoch), epoch,
                           f"fenced epoch={epoch}", markers=lambda _: {self._fact(epoch, FENCED): epoch},
                           floor=self.floor_id)

    def retire(self, through: int) -> dict[str, int]:
        """Raise each table's floor to ``through`` (every epoch up to it final in the ledger: the caller's check),
        expiring the passed epochs' transactions; each table's floor after. Each commit is the next version of the
        snapshot whose floor it read, so a floor never goes down."""
        from deltalake import CommitProperties, Transaction, write_deltalake

        self.ensure()  # (an older table gets TXN_RETENTION, without which nothing expires)
        floors = {}
        for path, columns in self.tables():
            def raise_floor(path: str = path, columns: Columns = columns) -> int:
                while True:
                    table = latest(path)  # (the snapshot whose floor is read is the one committed to)
                    floor = table.transaction_version(self.floor_id) or 0
                    if floor >= through:
                        return floor
                    upto = min(through, floor + RETIRE_BATCH)
                    dead = [Transaction(app, e, RETIRED_DATE_MS) for e in range(floor + 1, upto + 1)
                            for app in (self.txn_app_id(e), *(self._fact(e, f) for f in FACTS))]
                    note = {"userMetadata": f"retired epochs {floor + 1}..{upto}"}
                    properties = CommitProperties(custom_metadata=note, max_commit_retries=0,
                                                  app_transactions=[Transaction(self.floor_id, upto), *dead])
                    write_deltalake(table, with_table_columns(arrow_schema(columns).empty_table(), table),
                                    mode="append", commit_properties=properties)
                    log.info("%s: retired the transactions of epochs %d..%d", path, floor + 1, upto)
            try:
                floors[path] = retrying(raise_floor, rs_concurrent_errors(), f"{path}: a concurrent commit came first",
                                        RETIRE_ATTEMPTS, pause=commit_race_pause, again="retiring again")
            except rs_concurrent_errors():  # left for the next run
                floors[path] = latest(path).transaction_version(self.floor_id) or 0
        return floors

    def floors(self) -> dict[str, int]:
        """Each table's floor (0: nothing retired)."""
        return {path: latest(path).transaction_version(self.floor_id) or 0 for path in self.paths()}

    def remove_epoch_rows(self, epoch: int) -> None:
        """Delete ``epoch``'s rows from the side tables: for an epoch given up before its counts were written."""
        for path in (self.cfg.dead_letter_path, self.cfg.late_path):
            retry_on_conflict(lambda path=path: latest(path).delete(f"epoch = {int(epoch)}"),
                              f"removing epoch {epoch} from {path}")


def is_published(counts_path: str) -> bool:
    """Whether a counts table is (or was) published: its change data feed is on."""
    table = open_table(counts_path)
    return table is not None and has_change_feed(table.metadata().configuration)


def _row_neutral(path: str, table, chain: Sequence[ChainCommit]) -> list[int]:
    """The versions :func:`~ipcount.rules.finality.finalized_below` asks about that changed no row, from their commit
    infos (none read when only the chain committed in between)."""
    gap = gap_versions(chain, table.version())
    if len(gap) <= 1 or len(gap) > NEUTRAL_LOOKBACK:
        return []
    infos = commit_infos(path, gap.start) or {}
    return [v for v in gap if v in infos and adds_no_rows(infos[v])]


def counts_partition(table) -> str | None:
    """The time partition column of the counts snapshot: ``window_day``, ``window_hour`` (older), or None."""
    column = next(iter(table.metadata().partition_columns), None)
    return column if column in COUNTS_PARTITIONS else None


def partition_values(table) -> tuple[str, pa.ChunkedArray] | None:
    """The counts snapshot's partition column and each live file's value of it, if none lacks one."""
    import pyarrow as pa

    column = counts_partition(table)
    if column is None:
        return None
    values = pa.table(table.get_add_actions(flatten=True)).column(f"partition.{column}")
    return (column, values) if values.null_count == 0 else None


def has_open_partitions(table) -> bool:
    """Whether every live file of the counts snapshot has the values of :data:`COUNTS_PARTITION_BY`, its partitions."""
    import pyarrow as pa

    if tuple(table.metadata().partition_columns) != COUNTS_PARTITION_BY:
        return False
    actions = pa.table(table.get_add_actions(flatten=True))
    return all(actions.column(f"partition.{c}").null_count == 0 for c in COUNTS_PARTITION_BY)


def _merge_still_holds(attempt: dict, files: Sequence[TableFile], extra, may_read: Callable[[TableFile], bool]
                       ) -> bool:
    """Whether an earlier merge attempt's files are what a merge of the snapshot of ``files`` would write: the same
    columns, every file it replaces still live, no file it would read added since."""
    live = {f.path for f in files}
    return (attempt["extra"] == extra and all(f.path in live for f in attempt["rewrite"])
            and not any(may_read(f) for f in files if f.path not in attempt["files"]))


class _NotForExecutors(Exception):
    """Spark's executors must not write the snapshot's rows (why: the message); nothing was written."""


def _check_executors_may_write(table, columns: Columns) -> None:
    """Refuse executor writes to ``table``: :func:`check_fillable`, and :class:`_NotForExecutors` for
    :func:`unenforced_features`."""
    check_fillable(table, (c[0] for c in columns))
    if unenforced := unenforced_features(table):
        raise _NotForExecutors(f"{table.table_uri} has {', '.join(unenforced)}, which only delta-rs's own writes "
                               "honour")


def _carried_columns(table) -> list[tuple[pa.Field, str]]:
    """The counts snapshot's columns a newer version added, as (Arrow field, Spark type): rewritten files keep them."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_type

    known = {c[0] for c in COUNTS_COLUMNS}
    carried = []
    for field in pa.schema(table.schema().to_arrow()):
        if field.name in known:
            continue
        why = None
        if not all(_PLAIN_NAME.fullmatch(name) for name in _field_names(field)):
            why = "a name Spark's type strings would need quoted"
        else:
            try:
                carried.append((field.with_nullable(True), from_arrow_type(field.type).simpleString()))
            except Exception as e:  # e.g. a view type; PySparkTypeError, a TypeError here
                why = f"no Spark type ({e})"
        if why:
            raise _NotForExecutors(f"{table.table_uri} has column {field.name} of type {field.type}, with {why}")
    return carried


_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _field_names(field) -> Iterator[str]:
    """``field``'s name and those of the fields nested in it."""
    import pyarrow as pa

    yield field.name
    kind = field.type
    if pa.types.is_struct(kind):
        for i in range(kind.num_fields):
            yield from _field_names(kind.field(i))
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
        yield from _field_names(kind.value_field)
    elif pa.types.is_map(kind):
        yield from _field_names(kind.key_field)
        yield from _field_names(kind.item_field)


def unenforced_features(table) -> list[str]:
    """What ``table`` asks of every write that files written by the executors would not honour (constraints, generated,
    identity or default columns, invariants, column mapping, deletion vectors)."""
    config = table.metadata().configuration
    found = [key for key in config if key.startswith("delta.constraints.")]
    if config.get("delta.columnMapping.mode", "none") != "none":
        found.append("delta.columnMapping.mode")
    if config.get("delta.enableDeletionVectors", "false") == "true":
        found.append("delta.enableDeletionVectors")
    found += [f"{f.name} {key}" for f in table.schema().fields for key in f.metadata
              if key.startswith(("delta.generationExpression", "delta.identity", "delta.invariants",
                                 "CURRENT_DEFAULT"))]
    return found


def _may_hold(file: TableFile, lo_ms: int, hi_ms: int) -> bool:
    """Whether a counts file may hold windows starting in ``lo_ms..hi_ms`` (by its statistics)."""
    if file.bounds is None:
        return True
    low, high = (int(b.timestamp() * 1000) if hasattr(b, "timestamp") else int(b) // 1000 for b in file.bounds)
    return low <= hi_ms and high >= lo_ms


def _unpartitioned(columns: Columns) -> Columns:
    """The columns a counts data file holds (the partition columns are in its path)."""
    return tuple(c for c in columns if c[0] not in COUNTS_PARTITION_BY)


def _read_by_merge(f: TableFile, days: set[str], lo_ms: int, hi_ms: int, finalize_untouched: bool) -> bool:
    """Whether the executors' merge of an epoch with windows in [lo_ms, hi_ms] on ``days`` reads counts file ``f``: the
    open partitions it may change, and final files its windows may hit (a backfill correcting a closed window)."""
    if f.partition_values["is_final"] == "false":
        return finalize_untouched or f.partition_values["window_day"] in days
    return f.partition_values["window_day"] in days and _may_hold(f, lo_ms, hi_ms)


def _merged_counts(old: DataFrame | None, counts: DataFrame, epoch: int, watermark_ms: int | None,
                   lateness_ms: int, finalize_untouched: bool,
                   extra: Sequence[tuple[pa.Field, str]] = ()) -> DataFrame:
    """``old`` counts rows (None: no file to rewrite) with the epoch's ``counts`` merged in, as
    :meth:`Sink._merge_counts` leaves them; ``extra`` columns kept, NULL in new rows."""
    from pyspark.sql import functions as F

    final_until = None if watermark_ms is None else f"timestamp_millis(CAST({watermark_ms - lateness_ms} AS BIGINT))"
    s = counts.alias("s")
    if old is None:  # every row new: what the join would leave, without it
        joined, t = s, (lambda name: F.lit(None))
        row = merged_row(epoch, final_until, finalize_untouched, new=True, touched="true", end="s.window_end")
    else:
        joined = old.alias("t").join(
            s, (F.col("t.window_start") == F.col("s.window_start")) & (F.col("t.ip") == F.col("s.ip")), "full_outer")
        t = (lambda name: F.col(f"t.{name}"))
        row = merged_row(epoch, final_until, finalize_untouched, new="t.count IS NULL", touched="s.count IS NOT NULL",
                         end="coalesce(t.window_end, s.window_end)")
    start = F.coalesce(t("window_start"), F.col("s.window_start"))
    return joined.select(
        start.alias("window_start"), F.coalesce(t("window_end"), F.col("s.window_end")).alias("window_end"),
        F.coalesce(t("ip"), F.col("s.ip")).alias("ip"),
        *(F.expr(row[name]).cast(kind).alias(name) for name, kind in (
            ("count", "long"), ("first_epoch", "long"), ("last_epoch", "long"), ("is_final", "boolean"))),
        F.date_format(start, "yyyy-MM-dd'T'HH").alias("window_hour"),
        F.date_format(start, "yyyy-MM-dd").alias("window_day"),
        *((F.lit(None).cast(kind) if old is None else t(f.name)).alias(f.name) for f, kind in extra))


def partition_of(table) -> str | None:
    """The counts snapshot's partition column if no file of it lacks its value, else None."""
    found = partition_values(table)
    return found[0] if found else None


def _with_partitions(rows: pa.Table) -> pa.Table:
    """``rows`` with every column of :data:`~ipcount.rules.maintenance.COUNTS_PARTITIONS`, from ``window_start``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    start = rows["window_start"].cast(pa.timestamp("us", tz="UTC"))
    for column, (_, fmt) in COUNTS_PARTITIONS.items():
        rows = rows.append_column(column, pc.strftime(start, format=fmt))
    return rows

