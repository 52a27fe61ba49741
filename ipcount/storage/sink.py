"""The sink: counts, dead letters and late records, each written idempotently per epoch.

Every write carries Delta's transaction identifier (app id ``<pipeline id>/epoch-<n>``,
version n), recorded in the same commit as the data; a later write with that app id is
skipped, so replaying an epoch after a crash - at any point, even by two runners at once -
leaves each table exactly as one clean run would.

An epoch that read anything ends its sink writes with one commit to the counts table (its
MERGE, or an empty commit when it counted nothing), which records beside the epoch's own
transaction what the ledger needs of it: the counts version and the watermark. That commit
and a settling run's fence (:meth:`Sink.fence`) race for the same transaction id, and the
table keeps the winner, through checkpoints: so whether an epoch's data is in, and which
version holds it, is read from the table's own transactions (:meth:`Sink.epoch_commit`),
never from a window of its commit history. The app id is per epoch, not per
pipeline, because scheduled and backfill epochs commit concurrently and so not in epoch
order: one app id with rising versions would skip a lower epoch that commits after a
higher one.

An epoch's transactions stay until maintenance retires them (:meth:`Sink.retire`): once
the ledger holds every epoch up to N as final, one commit per table raises the floor
transaction ``<pipeline id>/retired-through`` to N and, in the same commit, expires every
transaction of those epochs (written again, dated 1970, under the tables'
:data:`TXN_RETENTION`). So at every version of a table, an epoch ever written there has its
transaction or lies under the floor, and a write of it is skipped either way; how many
transactions a table keeps no longer grows with its age. No clock decides anything: a
transaction written by an epoch never expires by itself.

delta-rs writes all three tables (:func:`ipcount.storage.delta.rs_commit_once` checks for
the transaction and commits as the next version of what it checked): Spark computes the
epoch's rows, which are few (counts per window and client, and the bad or late records),
and hands them over as Arrow. So every commit is put-if-absent across processes, on a
local file system and on object storage, with no log store of our own.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import EpochFenced
from ipcount.rules.finality import ChainCommit, adds_no_rows, finalized_below, gap_versions, merged_row
from ipcount.rules.publish import CHANGE_DATA_FEED, has_change_feed
from ipcount.rules.ledger import SCHEDULED, EpochPlan, PartitionMetrics
from ipcount.rules.maintenance import COUNTS_PARTITIONS, DAY_MS, log_properties, partition_value
from ipcount.storage.delta import (arrow_schema, check_fillable, commit_infos, latest, open_table, query_arrow,
                                   retry_on_conflict, rs_append_once, rs_commit_once, rs_concurrent_errors,
                                   rs_create_table, sql_timestamp, version_with_metadata, with_table_columns)
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
    # The window's hour (UTC, "2026-11-24T10"): the partition of counts tables made between
    # its addition and window_day's. Each new row carries both.
    ("window_hour", "string", True),
    ("window_day", "string", True),    # the window's day (UTC, "2026-11-24")
)
# A new counts table's partitions: a MERGE rewrites whole files, so the rows it may still
# update (not final) are kept apart from the rest, and a row moves once final (the MERGE
# that makes it final writes it into its day's final partition). An epoch then rewrites
# only rows within the allowed lateness, and a year of days packs into 365 files, where an
# hour partition made each MERGE rewrite the hour so far and a year 8,760 files (a snapshot
# lists every live file: their number is a cost of every commit).
COUNTS_PARTITION_BY = ("window_day", "is_final")
# How many commits since the chain's last but one a MERGE reads to see whether they changed
# rows (:func:`_row_neutral`); beyond, it takes a full pass.
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


# The facts an epoch's counts commit (or its fence) records as transactions of their own
# (app id ``<epoch's app id>/<name>``), in the same commit as the epoch's transaction.
COUNTS_VERSION, NO_COUNTS, WATERMARK, FENCED = "counts-version", "no-counts", "watermark", "fenced"
FACTS = (COUNTS_VERSION, NO_COUNTS, WATERMARK, FENCED)
# Expires only what retirement dates to 1970 (an epoch's transactions carry no date and never
# expire; delta-spark dated those it wrote, and ten years keeps them).
TXN_RETENTION = {"delta.setTransactionRetentionDuration": "interval 3650 days"}
RETIRED_DATE_MS = 1
# How many epochs one retirement commit expires at most (a first retirement of an old table
# takes several: each raises the floor over what it expired, so a kill between them is safe).
RETIRE_BATCH = 20_000
RETIRE_ATTEMPTS = 20  # commits lost to concurrent ones before a table's retirement waits for the next run


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
            # Publishing reads each counts version's changes from Delta's change data feed. A
            # table ever published keeps its log for the publisher even in a run with publish
            # off: turning the cleanup on would delete the versions it has yet to send.
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
        """Write the epoch's dead letters, late records and ``counts`` (its counts per window
        and client), each as Arrow (:class:`ipcount.jobs.tally.EpochTally`); return the
        counts table version that holds this epoch (None if it counted nothing). ``chain``:
        the scheduled chain's counts commits, newest first
        (:meth:`ipcount.storage.ledger.Ledger.chain_commits`). ``stages``, if given, gets the
        side tables' appends' seconds as ``side_tables``.

        Each write is skipped if a previous attempt of the epoch committed it. A side table
        write with no rows is not attempted at all (a replay finds none either); the counts
        commit always is, last, and decides the epoch: if a settling run's fence holds its
        transaction instead, :class:`EpochFenced` - this run must not commit the epoch.
        """
        epoch = plan.epoch
        started = time.monotonic()
        for path, columns, rows in ((self.cfg.dead_letter_path, DEAD_LETTER_COLUMNS, dead_letters),
                                    (self.cfg.late_path, LATE_COLUMNS, late_records)):
            if rows.num_rows:
                rs_append_once(path, _conform(rows, columns), self.txn_app_id(epoch), epoch, f"epoch={epoch}",
                               floor=self.floor_id)
        if stages is not None:
            stages["side_tables"] = time.monotonic() - started
        if not counts.num_rows:
            committed = self._commit_nothing_counted(epoch, watermark_after_ms)
        elif plan.kind == SCHEDULED:
            committed = self._merge_counts(epoch, counts, watermark_after_ms, finalize_untouched=True, chain=chain,
                                           watermark_after_ms=watermark_after_ms)
        else:
            # A backfill's windows are final only against the live chain's watermark (recorded in
            # the plan, so a replay marks the same): the chain may still count records into a
            # window the backfill's own watermark has passed. The chain's later epochs finalize
            # them as its watermark moves on.
            committed = self._merge_counts(epoch, counts, plan.chain_watermark_ms, finalize_untouched=False,
                                           watermark_after_ms=watermark_after_ms)
        return self._outcome(epoch, committed, counts.num_rows > 0)

    def _outcome(self, epoch: int, committed: int | None, counted: bool) -> int | None:
        """The counts version holding ``epoch`` after its counts commit was tried (``committed``:
        the version this run committed, None if the table held the transaction already)."""
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

    def write_from_spark(self, plan: EpochPlan, counts: DataFrame, dead_letters: DataFrame, late_records: DataFrame,
                         sizes: PartitionMetrics, *, counted_windows_ms: tuple[int, int] | None,
                         watermark_after_ms: int | None = None,
                         chain: Sequence[ChainCommit] = (), stages: dict[str, float] | None = None,
                         before_commit: Callable[[], None] = lambda: None) -> int | None:
        """:meth:`write` for rows left in Spark (:class:`ipcount.jobs.tally.SparkTally`; ``sizes``:
        the epoch's records counted, late and malformed; ``counted_windows_ms``: the starts of
        the first and last window ``counts`` holds): Spark's executors write the epoch's
        files into the tables and delta-rs commits them (:mod:`ipcount.storage.table_files`),
        each commit as idempotent as :meth:`write`'s. ``before_commit`` is called between the
        counts files' writes and their commit."""
        epoch = plan.epoch
        started = time.monotonic()
        for path, columns, rows, size in ((self.cfg.dead_letter_path, DEAD_LETTER_COLUMNS, dead_letters,
                                           sizes.records_malformed),
                                          (self.cfg.late_path, LATE_COLUMNS, late_records, sizes.records_late)):
            if size:
                self._append_files(path, columns, rows, epoch)
        if stages is not None:
            stages["side_tables"] = time.monotonic() - started
        if not sizes.records_counted:
            committed = self._commit_nothing_counted(epoch, watermark_after_ms)
        else:
            scheduled = plan.kind == SCHEDULED
            if counted_windows_ms is None:
                raise ValueError(f"epoch {epoch} counted {sizes.records_counted} records, but in no window")
            committed = self._merge_counts_in_spark(
                epoch, counts, counted_windows_ms, watermark_after_ms if scheduled else plan.chain_watermark_ms,
                finalize_untouched=scheduled, chain=chain, watermark_after_ms=watermark_after_ms,
                before_commit=before_commit)
        return self._outcome(epoch, committed, sizes.records_counted > 0)

    def _commit_nothing_counted(self, epoch: int, watermark_after_ms: int | None) -> int | None:
        """The counts commit of an epoch that counted nothing: no rows, its facts."""
        facts = self._facts(epoch, None, watermark_after_ms)
        return rs_append_once(self.cfg.counts_path, arrow_schema(COUNTS_COLUMNS).empty_table(),
                              self.txn_app_id(epoch), epoch, f"epoch={epoch}", markers=lambda _: facts,
                              floor=self.floor_id)

    def _append_files(self, path: str, columns: Columns, rows: DataFrame, epoch: int) -> int | None:
        """Append ``rows`` to the table at ``path`` once per epoch: Spark writes the files
        (only on the first try, and not at all if the table has the epoch already), delta-rs
        commits them."""
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
            return rs_append_once(path, _conform(rows.toArrow(), columns), self.txn_app_id(epoch), epoch,
                                  f"epoch={epoch}", floor=self.floor_id)

    def _merge_counts_in_spark(self, epoch: int, counts: DataFrame, windows_ms: tuple[int, int],
                               watermark_ms: int | None, finalize_untouched: bool, chain: Sequence[ChainCommit] = (),
                               watermark_after_ms: int | None = None,
                               before_commit: Callable[[], None] = lambda: None) -> int | None:
        """:meth:`_merge_counts` done by Spark's executors: they read the files the epoch's
        rows can change (:func:`_read_by_merge`), at exactly the snapshot the commit follows,
        merge the counts into them and write the merged rows as new files; the commit removes
        the files read and adds those written. Another commit first means
        a new snapshot and a new merge (the lost one's files are never referenced: vacuum
        removes them), unless the commits that came first changed none of the files the merge
        read or would read (a fence, a retirement, a backfill's commit to closed windows of
        other days, a compaction of other files): then the same files are committed again,
        as the merge of the new snapshot would write them. Columns this version does not know
        (a newer one's) are carried through as they are, NULL in new rows. A table in an
        older layout (:func:`counts_partition`), with a column Spark cannot carry, or asking
        what only delta-rs's writes honour (:func:`unenforced_features`), takes the MERGE of
        :meth:`_merge_counts`, with the counts collected here."""
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
        """The counts table's ``files`` with the epoch's ``counts`` merged in, written by
        Spark's executors as new files (not yet committed)."""
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
        """The rows of the counts table's ``files``, read by Spark's tasks, with the
        ``extra`` columns (:func:`_carried_columns`)."""
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
        """What the counts table's transactions say of ``epoch``: None if it holds neither
        the epoch's counts commit nor a fence of it."""
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
        """Add the epoch's counts and mark windows final (the rules of
        :func:`~ipcount.rules.finality.merged_row`) in one idempotent commit: its version, or
        None if the table holds the epoch's transaction already.

        A scheduled epoch also finalizes rows it does not touch. Where the chain's last
        commits allow (:func:`~ipcount.rules.finality.finalized_below`), those rows are found
        by a read bounded by the last watermark and merged as extra source rows that add
        nothing; otherwise through the NOT MATCHED BY SOURCE clause, which reads the whole
        table. The ON clause bounds the target's windows by the source's, so the MERGE reads
        only the files that can hold them."""
        import pyarrow as pa
        import pyarrow.compute as pc

        path, lateness_ms = self.cfg.counts_path, self.cfg.allowed_lateness_ms
        touched = _conform(_with_partitions(counts).append_column("touched", pa.repeat(True, counts.num_rows)),
                           MERGE_SOURCE_COLUMNS)
        final_until = None if watermark_ms is None else sql_timestamp(watermark_ms - lateness_ms)
        matched = merged_row(epoch, final_until, finalize_untouched, new=False, touched="s.touched", end="t.window_end")
        inserted = merged_row(epoch, final_until, finalize_untouched, new=True, touched="true", end="s.window_end")
        untouched = merged_row(epoch, final_until, finalize_untouched, new=False, touched="false", end="t.window_end")

        def merge(table, properties) -> None:
            check_fillable(table, (c[0] for c in COUNTS_COLUMNS))
            source, full_pass = touched, False
            # Where every row has its partition value, delta-rs reads and rewrites only the
            # partitions the source's rows name (outside a full pass). An older table's rows may
            # lack it, and so may rows a writer of an older version put into a partitioned table.
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
        """The rows of ``table`` (the counts snapshot merged into; ``column``: its partition
        column, if every row has its value) not yet final that the watermark's move from
        ``below_ms`` to ``watermark_ms`` makes final and ``touched`` (the epoch's counts) does
        not hold, as source rows that add nothing."""
        import pyarrow as pa

        lateness_ms, window_ms = self.cfg.allowed_lateness_ms, self.cfg.window_ms
        # (such windows start after below - lateness - window: partitions before are pruned)
        since = "" if column is None else \
            f"{column} >= '{partition_value(column, below_ms - lateness_ms - window_ms)}' AND "
        rows = query_arrow(table, "SELECT window_start, window_end, ip FROM t "
                                  f"WHERE {since}window_end > {sql_timestamp(below_ms - lateness_ms)} AND "
                                  f"window_end <= {sql_timestamp(watermark_ms - lateness_ms)} AND "
                                  "NOT coalesce(is_final, false)")
        rows = _conform(rows, MERGE_SOURCE_COLUMNS[:3])
        rows = rows.join(touched.select(["window_start", "ip"]), ["window_start", "ip"], join_type="left anti")
        return _conform(_with_partitions(rows)
                        .append_column("count", pa.repeat(pa.scalar(0, pa.int64()), rows.num_rows))
                        .append_column("touched", pa.repeat(False, rows.num_rows)), MERGE_SOURCE_COLUMNS)

    def fence(self, epoch: int) -> None:
        """Make sure no write of ``epoch`` lands from now on: an empty commit with its
        transaction id in each table (skipped where its write is in already), after which
        any write with that id is skipped - a runner still busy with the epoch included.
        The counts table's fence also says so (:meth:`epoch_commit`), so that runner does
        not commit the epoch in the ledger either."""
        for path, columns in self.tables():
            rs_append_once(path, arrow_schema(columns).empty_table(), self.txn_app_id(epoch), epoch,
                           f"fenced epoch={epoch}", markers=lambda _: {self._fact(epoch, FENCED): epoch},
                           floor=self.floor_id)

    def retire(self, through: int) -> dict[str, int]:
        """Raise each table's floor to ``through``, expiring the transactions of the epochs
        it passes - the caller makes sure that every epoch up to ``through`` is final in the
        ledger and no new epoch can take an id at or below it. Each commit adds no row, and
        is made only as the next version of the snapshot whose floor it read, so a floor
        never goes down (two maintenance runs may race). Returns each table's floor after."""
        from deltalake import CommitProperties, Transaction, write_deltalake

        self.ensure()  # (an older table gets TXN_RETENTION, without which nothing expires)
        floors = {}
        for path, columns in self.tables():
            conflicts = 0
            while True:
                table = latest(path)
                floor = table.transaction_version(self.floor_id) or 0
                if floor >= through or conflicts == RETIRE_ATTEMPTS:
                    break
                upto = min(through, floor + RETIRE_BATCH)
                dead = [Transaction(app, e, RETIRED_DATE_MS) for e in range(floor + 1, upto + 1)
                        for app in (self.txn_app_id(e), *(self._fact(e, f) for f in FACTS))]
                try:
                    empty = with_table_columns(arrow_schema(columns).empty_table(), table)
                    write_deltalake(table, empty, mode="append",
                                    commit_properties=CommitProperties(
                                        custom_metadata={"userMetadata": f"retired epochs {floor + 1}..{upto}"},
                                        max_commit_retries=0,
                                        app_transactions=[Transaction(self.floor_id, upto), *dead]))
                    log.info("%s: retired the transactions of epochs %d..%d", path, floor + 1, upto)
                except rs_concurrent_errors() as e:
                    conflicts += 1
                    log.info("%s: a concurrent commit came first (%s); retiring again (%d/%d)", path,
                             type(e).__name__, conflicts, RETIRE_ATTEMPTS)
                    time.sleep(min(0.05 * conflicts, 1.0))
            floors[path] = floor
        return floors

    def floors(self) -> dict[str, int]:
        """Each table's floor (0: nothing retired)."""
        return {path: latest(path).transaction_version(self.floor_id) or 0 for path in self.paths()}

    def remove_epoch_rows(self, epoch: int) -> None:
        """Delete what ``epoch`` wrote to the dead-letter and late-record tables (their rows
        carry the epoch): for an epoch given up before its counts were written."""
        for path in (self.cfg.dead_letter_path, self.cfg.late_path):
            retry_on_conflict(lambda path=path: latest(path).delete(f"epoch = {int(epoch)}"),
                              f"removing epoch {epoch} from {path}")


def is_published(counts_path: str) -> bool:
    """Whether a counts table is (or was) published: its change data feed is on, which only
    a run with publish on turns on."""
    table = open_table(counts_path)
    return table is not None and has_change_feed(table.metadata().configuration)


def _row_neutral(path: str, table, chain: Sequence[ChainCommit]) -> list[int]:
    """The versions of the snapshot ``table`` (of the table at ``path``) that
    :func:`~ipcount.rules.finality.finalized_below` asks about and that changed no row
    (maintenance's, a fence's), from their commit infos (:func:`commit_infos`): none are
    read when the chain's commits are the only ones in between."""
    gap = gap_versions(chain, table.version())
    if len(gap) <= 1 or len(gap) > NEUTRAL_LOOKBACK:
        return []
    infos = commit_infos(path, gap.start) or {}
    return [v for v in gap if v in infos and adds_no_rows(infos[v])]


def counts_partition(table) -> str | None:
    """The column of :data:`~ipcount.rules.maintenance.COUNTS_PARTITIONS` by which the counts
    snapshot ``table`` is partitioned in time: ``window_day`` (:data:`COUNTS_PARTITION_BY`),
    ``window_hour`` (an older table), or None (older still, unpartitioned)."""
    column = next(iter(table.metadata().partition_columns), None)
    return column if column in COUNTS_PARTITIONS else None


def partition_values(table) -> tuple[str, pa.ChunkedArray] | None:
    """The counts snapshot's partition column and each live file's value of it, if no file
    lacks one (from the snapshot's file list: no data is read); else None."""
    import pyarrow as pa

    column = counts_partition(table)
    if column is None:
        return None
    values = pa.table(table.get_add_actions(flatten=True)).column(f"partition.{column}")
    return (column, values) if values.null_count == 0 else None


def has_open_partitions(table) -> bool:
    """Whether the counts snapshot ``table`` is partitioned by :data:`COUNTS_PARTITION_BY` and
    every live file has its values: the layout whose open rows Spark can merge apart."""
    import pyarrow as pa

    if tuple(table.metadata().partition_columns) != COUNTS_PARTITION_BY:
        return False
    actions = pa.table(table.get_add_actions(flatten=True))
    return all(actions.column(f"partition.{c}").null_count == 0 for c in COUNTS_PARTITION_BY)


def _merge_still_holds(attempt: dict, files: Sequence[TableFile], extra, may_read: Callable[[TableFile], bool]
                       ) -> bool:
    """Whether a Spark merge attempt's files (``attempt``: the snapshot it followed, the
    files it read and wrote) are what a merge of the snapshot of ``files`` would write: the
    same columns, every file it replaces still live, and no file it would read or rule out
    added since (nor removed: a removed one's rows are in an added one)."""
    live = {f.path for f in files}
    return (attempt["extra"] == extra and all(f.path in live for f in attempt["rewrite"])
            and not any(may_read(f) for f in files if f.path not in attempt["files"]))


class _NotForExecutors(Exception):
    """The snapshot is one whose rows Spark's executors must not write (why: the message);
    nothing of the attempt was written."""


def _check_executors_may_write(table, columns: Columns) -> None:
    """Before the executors write files for the snapshot ``table`` with ``columns``: a
    ConfigError for a NOT NULL column they cannot fill (:func:`check_fillable`),
    :class:`_NotForExecutors` where only delta-rs's own writes honour what the table asks
    (:func:`unenforced_features`)."""
    check_fillable(table, (c[0] for c in columns))
    if unenforced := unenforced_features(table):
        raise _NotForExecutors(f"{table.table_uri} has {', '.join(unenforced)}, which only delta-rs's own writes "
                               "honour")


def _carried_columns(table) -> list[tuple[pa.Field, str]]:
    """The counts snapshot's columns that :data:`COUNTS_COLUMNS` does not name (a newer
    version's), each as its Arrow field and Spark SQL type: rewritten files keep them.
    :class:`_NotForExecutors` if Spark has no type for one."""
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
    """What the snapshot ``table`` asks of every write that a commit of files written by
    Spark's executors would not honour: CHECK constraints, generated, identity or default
    columns, invariants (delta-rs's writes check or fill them), column mapping and deletion
    vectors (which the executors' reads and writes do not know)."""
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
    """Whether the executors' merge of an epoch whose windows start in [lo_ms, hi_ms], on
    ``days``, reads counts file ``f``, or reads it to rule it out: the open partitions
    (``is_final=false``: all of them where untouched rows are to be finalized, else the
    epoch's days) and a final file that may hold a row the epoch counts into (a backfill
    correcting a closed window: the files' statistics rule out the rest without reading)."""
    if f.partition_values["is_final"] == "false":
        return finalize_untouched or f.partition_values["window_day"] in days
    return f.partition_values["window_day"] in days and _may_hold(f, lo_ms, hi_ms)


def _merged_counts(old: DataFrame | None, counts: DataFrame, epoch: int, watermark_ms: int | None,
                   lateness_ms: int, finalize_untouched: bool,
                   extra: Sequence[tuple[pa.Field, str]] = ()) -> DataFrame:
    """The rows of ``old`` (counts rows) with the epoch's ``counts`` merged in by the rules
    of :func:`~ipcount.rules.finality.merged_row`, as the MERGE of :meth:`Sink._merge_counts`
    leaves them; new rows for windows and clients not in ``old``. Partition columns from
    ``window_start``. No ``old`` (no file to rewrite): the epoch's rows as new ones, with no
    join. The ``extra`` columns (:func:`_carried_columns`) as ``old`` has them, NULL in new
    rows."""
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
    """``rows`` with every partition column of :data:`~ipcount.rules.maintenance.COUNTS_PARTITIONS`,
    from ``window_start`` in UTC."""
    import pyarrow as pa
    import pyarrow.compute as pc

    start = rows["window_start"].cast(pa.timestamp("us", tz="UTC"))
    for column, (_, fmt) in COUNTS_PARTITIONS.items():
        rows = rows.append_column(column, pc.strftime(start, format=fmt))
    return rows


def _conform(rows: pa.Table, columns: Columns) -> pa.Table:
    """``rows`` with exactly the Arrow types (and order) of ``columns``: Spark's and
    DataFusion's answers differ from the tables' in details (nullability, time zones)."""
    import pyarrow as pa

    schema = arrow_schema(columns)
    return pa.table([rows.column(f.name).cast(f.type) for f in schema], schema=schema)
