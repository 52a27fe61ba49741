"""Publishing committed counts to the sink topic, exactly once (no JVM: delta-rs reads the counts table's change data
feed, kafka-python writes the topic).

The counts table's versions are published in order, each as one transaction with the cursor
(:mod:`ipcount.storage.publisher`): in version order, not epoch order, the last record of each key is its newest count.
A version an epoch made becomes the rows it inserted or updated; any other version only moves the cursor. A table's
first publish starts at version 0 if the change data feed was on from its creation, else it sends the table whole (kind
``snapshot``) and goes on from there. The counts log is kept until published, then cleaned here
(:func:`ipcount.rules.maintenance.log_cleanup_due`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ipcount.jobs.crash import Crash, no_crash
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import CommitContention, ConfigError
from ipcount.rules.ledger import BACKFILL as BACKFILL_EPOCH
from ipcount.rules.ledger import SUMMARY
from ipcount.rules.maintenance import EXPIRED_LOG_CLEANUP, log_cleanup_due
from ipcount.rules.publish import (BACKFILL, CHANGE_DATA_FEED, DELETE, INSERT, LIVE, PUBLISHED_COLUMNS, SNAPSHOT,
                                   Cursor, changed_rows, epoch_of_commit, has_change_feed,
                                   sink_records, snapshot_rows)
from ipcount.storage.delta import commit_infos, conform, has_table, read_rows, table_metadata
from ipcount.storage.publisher import KafkaSinkTopic, Publisher, SinkTopic

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)
COUNTS_COLUMNS = ("window_start", "window_end", "ip", "count", "is_final")


@dataclass
class PublishReport:
    published: list[tuple[int, int | None, int]] = field(default_factory=list)  # (version, epoch, records)
    cursor: Cursor | None = None

    @property
    def records(self) -> int:
        return sum(n for _, _, n in self.published)


def publish_pending(cfg: PipelineConfig, crash: Crash = no_crash, resync: bool = False,
                    topic: SinkTopic | None = None) -> PublishReport:
    """Publish every committed counts version the cursor has not passed yet. ``resync``: send the table whole and go on
    from it (after a rebuild was swapped in, or when the cursor and the versions after it are lost). ``topic``: where to
    (default ``publish_topic`` on the broker)."""
    from deltalake import DeltaTable

    path = cfg.counts_path
    table_id, properties = table_metadata(path)
    if not has_change_feed(properties):
        raise ConfigError(f"the counts table {path} has no change data feed ({CHANGE_DATA_FEED}); it is turned on "
                          "by the next epoch run with publish = true")
    if topic is None:
        topic = KafkaSinkTopic(cfg, cfg.publish_topic)
    topic.create()   # (or refuses one that retention empties)
    report = PublishReport()
    publisher = None
    try:
        publisher = topic.publisher()  # fences any publisher before it
        cursor = publisher.cursor()
        table = DeltaTable(path)
        latest = table.version()
        if resync:
            if cursor is not None:
                log.warning("resync: the cursor is at version %d of counts table %s; sending table %s whole",
                            cursor.next_version, cursor.table_id, table_id)
            cursor = None
        elif cursor is None:
            topic.check_never_published()
            if _feed_since_creation(path):
                cursor = Cursor(table_id, 0)   # every version has its changes: publish them all
        if cursor is None:
            rows = table.to_pyarrow_table(columns=list(COUNTS_COLUMNS)).to_pylist()   # (as of latest)
            cursor = Cursor(table_id, latest + 1)
            records = sink_records(snapshot_rows(rows), table_id=table_id, version=latest, epoch=None, kind=SNAPSHOT)
            report.published.append((latest, None, publisher.publish(records, cursor, crash)))
            log.info("published counts version %d whole (%d rows) to %s", latest, len(records), cfg.publish_topic)
        cursor.check_table(table_id)
        if cursor.next_version <= latest:
            cursor = _publish_versions(cfg, publisher, table, cursor, latest, report, crash)
        report.cursor = cursor
        if properties.get(EXPIRED_LOG_CLEANUP) == "false" and log_cleanup_due(cursor.next_version, latest):
            table.cleanup_metadata()  # (through the snapshot at ``latest``: only commits sent)
        return report
    finally:
        if publisher is not None:
            publisher.close()


def _publish_versions(cfg: PipelineConfig, publisher: Publisher, table, cursor: Cursor, latest: int,
                      report: PublishReport, crash: Crash) -> Cursor:
    """Versions ``cursor.next_version``..``latest``, one transaction each."""
    first = cursor.next_version
    infos = commit_infos(cfg.counts_path, first)   # (table.history() would misnumber them)
    if infos is None:
        raise CommitContention(f"commits to {cfg.counts_path} kept landing while its log was read; run again")
    missing = [v for v in range(first, latest + 1) if v not in infos]
    if missing:
        raise ConfigError(f"the counts table's log lacks the commit info of version(s) {missing[:5]}; publishing "
                          "cannot tell what they were (`ipcount publish --resync` sends the table whole)")
    epochs = {v: epoch_of_commit(infos[v].get("userMetadata")) for v in range(first, latest + 1)}
    kinds = _epoch_kinds(cfg, {e for e in epochs.values() if e is not None})
    for version in range(first, latest + 1):
        epoch = epochs[version]
        rows = changed_rows(without_unchanged_pairs(_changes_of(table, version, first)).to_pylist())
        if epoch is None and rows:  # only epochs change counts; anything else is not the pipeline's
            raise ConfigError(f"counts version {version} changed {len(rows)} row(s) but no epoch made it "
                              f"({infos[version].get('operation')}); published up to version {version - 1}")
        records = []
        if epoch is not None:
            kind, request_id = kinds.get(epoch, (LIVE, None))
            records = sink_records(rows, table_id=cursor.table_id, version=version, epoch=epoch, kind=kind,
                                   request_id=request_id)
        cursor = Cursor(cursor.table_id, version + 1, epoch if epoch is not None else cursor.last_epoch)
        report.published.append((version, epoch, publisher.publish(records, cursor, crash)))
        if records:
            log.info("published counts version %d (epoch %d): %d rows to %s", version, epoch, len(records),
                     cfg.publish_topic)
    return cursor


def plain_strings(table: pa.Table) -> pa.Table:
    """``table`` with its string_view columns (delta-rs reads strings so) as strings: this pyarrow's filters,
    comparisons and joins do not take string_view."""
    import pyarrow as pa

    if not any(f.type == pa.string_view() for f in table.schema):
        return table
    return table.cast(pa.schema([f.with_type(pa.string()) if f.type == pa.string_view() else f for f in table.schema]))


def _changes_of(table, version: int, first: int) -> pa.Table:
    """The change data of one counts version (one at a time: an executors' epoch's is every open row, twice), as Arrow,
    of only the columns changed_rows reads (a newer version's may be of types pyarrow cannot join). ``first``: the first
    version of this run."""
    import pyarrow

    try:
        feed = table.load_cdf(starting_version=version, ending_version=version,
                              columns=["window_start", "ip", *PUBLISHED_COLUMNS, "_change_type", "_commit_version"])
        return plain_strings(pyarrow.table(feed.read_all()))
    except Exception as e:  # e.g. the log of old versions cleaned up
        sent = f"; published up to version {version - 1}" if version > first else ""
        raise ConfigError(f"the counts table's change data feed of version {version} cannot be read ({e}){sent}; "
                          "`ipcount publish --resync` sends the table whole") from None


def without_unchanged_pairs(changes: pa.Table) -> pa.Table:
    """One version's change data without the rows deleted and inserted again as they were (an executors' epoch replaces
    whole files), which :func:`~ipcount.rules.publish.changed_rows` drops too: dropped in Arrow, they never become
    Python objects. A pair is dropped only when its key and published columns are equal and not null."""
    import pyarrow as pa
    import pyarrow.compute as pc

    changes = plain_strings(changes)
    kind = changes["_change_type"]
    is_delete, is_insert = pc.equal(kind, DELETE), pc.equal(kind, INSERT)
    deleted, inserted = changes.filter(is_delete), changes.filter(is_insert)
    if not deleted.num_rows or not inserted.num_rows:
        return changes
    same = ["window_start", "ip", *PUBLISHED_COLUMNS]
    rest = changes.filter(pc.invert(pc.or_(is_delete, is_insert)))
    def unpaired(left: pa.Table, right: pa.Table) -> pa.Table:  # (a join's output is all nullable)
        return conform(left.join(right.select(same), keys=same, join_type="left anti"), changes.schema)
    return pa.concat_tables([rest, unpaired(deleted, inserted), unpaired(inserted, deleted)])


def _feed_since_creation(path: str) -> bool:
    """Whether version 0 already had the change data feed (False if it is no longer in the log)."""
    from deltalake import DeltaTable

    try:
        return has_change_feed(DeltaTable(path, version=0).metadata().configuration)
    except Exception:
        return False


def publish_step(cfg: PipelineConfig, crash: Crash = no_crash) -> dict:
    """What the DAGs' publish task does: publish what is pending when publishing is on; a summary for the log and XCom
    either way."""
    if not cfg.publish:
        log.info("publishing is off (setting publish); nothing sent")
        return {"publish": False}
    if not has_table(cfg.counts_path) or not has_change_feed(table_metadata(cfg.counts_path)[1]):
        log.info("publishing waits for the counts table's change data feed (the next epoch turns it on)")
        return {"publish": True, "waiting": "the counts table's change data feed"}
    report = publish_pending(cfg, crash)
    summary = {"publish": True, "topic": cfg.publish_topic, "versions": len(report.published),
               "records": report.records, "next_version": report.cursor.next_version if report.cursor else None}
    log.info("published %(versions)d counts version(s), %(records)d record(s), to %(topic)s", summary)
    return summary


def _epoch_kinds(cfg: PipelineConfig, epochs: set[int]) -> dict[int, tuple[str, str | None]]:
    """The record kind (live or backfill) and backfill request of each of ``epochs``, from the ledger rows of their id
    span only (other files are skipped by their statistics, however old the ledger)."""
    out: dict[int, tuple[str, str | None]] = {}
    if not epochs:
        return out
    span = [("epoch", ">=", min(epochs)), ("epoch", "<=", max(epochs)), ("status", "!=", SUMMARY)]
    for row in read_rows(cfg.ledger_path, ("epoch", "kind", "request_id"), filters=span):
        out[row["epoch"]] = (BACKFILL, row["request_id"]) if row["kind"] == BACKFILL_EPOCH else (LIVE, None)
    return out
