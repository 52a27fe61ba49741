"""What the publisher sends to the sink topic, and the cursor that says how far it got (pure: no Kafka, no Delta).

Each counts version an epoch made is published as one Kafka transaction: a record per (window, ip) row it inserted or
updated, keyed by window and IP, with the row's count after it, so a compacted topic folded per key is the counts table.
The cursor (the next version) is committed as a publisher group's offset in the same transaction: published versions and
cursor cannot disagree. When Kafka expires that offset the topic's newest record says the same, so the topic must keep
its records (compacted only); a publisher that finds neither never starts over by itself once the topic shows it
published (``ipcount publish --resync`` does, on request).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping

from ipcount.rules.errors import ConfigError

CHANGE_DATA_FEED = "delta.enableChangeDataFeed"  # the counts table's property publishing needs
INSERT, PREIMAGE, POSTIMAGE, DELETE = "insert", "update_preimage", "update_postimage", "delete"
# What a published record says of a row: a change to any of these is published.
PUBLISHED_COLUMNS = ("window_end", "count", "is_final")
# A record's kind: the scheduled chain; a backfill request; the table as it was when publishing started (or restarted
# after a rebuild), before any change was published.
LIVE, BACKFILL, SNAPSHOT = "live", "backfill", "snapshot"
EPOCH_COMMIT = re.compile(r"^epoch=(\d+)$")  # the commit info of an epoch's counts MERGE (sink.py)
CURSOR_FORMAT = 1
SINK_CLEANUP_POLICY = "compact"  # the sink topic's only cleanup.policy: the newest record of each key stays
VERSION_HEADER, TABLE_HEADER, EPOCH_HEADER = "ipcount-version", "ipcount-table", "ipcount-epoch"


def has_change_feed(table_properties: Mapping[str, str]) -> bool:
    """Whether a counts table (its properties, or one version's) writes the change data feed."""
    return table_properties.get(CHANGE_DATA_FEED) == "true"


@dataclass(frozen=True)
class Cursor:
    """The next counts-table version to publish, of which table (a rebuilt table swapped in starts its versions again),
    and the epoch of the last one published."""

    table_id: str
    next_version: int
    last_epoch: int | None = None

    def metadata(self) -> str:
        """The committed offset's metadata (the offset itself is ``next_version``)."""
        return json.dumps({"format": CURSOR_FORMAT, "table_id": self.table_id, "last_epoch": self.last_epoch},
                          separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_committed(cls, offset: int, metadata: str) -> Cursor:
        try:
            meta = json.loads(metadata)
            return cls(str(meta["table_id"]), int(offset), meta.get("last_epoch"))
        except (ValueError, TypeError, KeyError):
            raise ConfigError(f"the publisher's committed cursor (offset {offset}) has metadata it does not "
                              f"understand: {metadata[:200]!r}") from None

    def check_table(self, table_id: str) -> None:
        if table_id != self.table_id:
            raise ConfigError(f"the publisher's cursor belongs to counts table {self.table_id}, but the table is "
                              f"now {table_id} (a rebuild swapped in?): republish it with `ipcount publish --resync`")


@dataclass(frozen=True)
class SinkRecord:
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...]


def _utc_iso(value: Any) -> str:
    """A CDF timestamp (datetime, naive = UTC, or epoch microseconds) as ISO-8601 in UTC."""
    if isinstance(value, (int, float)):
        value = datetime.fromtimestamp(value / 1_000_000, tz=timezone.utc)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def changed_rows(cdf_rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows one version inserted or updated, as they are after it, in (window, ip) order; ``correction``: the row
    was final before (a backfill counted into a closed window). A version whose files the executors replaced reads as
    its old rows deleted and new ones inserted: a row deleted and inserted again, or updated, with its published columns
    as they were is no change."""
    before: dict[tuple[Any, str], bool] = {}
    removed: dict[tuple[Any, str], Mapping[str, Any]] = {}  # a row as it was: deleted, or a preimage
    after: list[Mapping[str, Any]] = []
    for row in cdf_rows:
        change, key = row["_change_type"], (row["window_start"], row["ip"])
        if change == PREIMAGE:
            before[key] = bool(row.get("is_final"))
            removed[key] = row
        elif change == DELETE:
            removed[key] = row
        elif change in (INSERT, POSTIMAGE):
            after.append(row)
    for key, row in removed.items():  # (the pipeline never deletes a counts row for good)
        before.setdefault(key, bool(row.get("is_final")))
    after = [r for r in after if not _same_row(removed.get((r["window_start"], r["ip"])), r)]
    out = [{"window_start": _utc_iso(r["window_start"]), "window_end": _utc_iso(r["window_end"]), "ip": r["ip"],
            "count": int(r["count"]), "is_final": bool(r.get("is_final")),
            "correction": before.get((r["window_start"], r["ip"]), False)} for r in after]
    return sorted(out, key=lambda r: (r["window_start"], r["ip"]))


def _same_row(removed: Mapping[str, Any] | None, inserted: Mapping[str, Any]) -> bool:
    """Whether a row deleted and inserted by one version came back as it was."""
    return removed is not None and all(removed.get(c) == inserted.get(c) for c in PUBLISHED_COLUMNS)


def snapshot_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A table's rows as :func:`changed_rows` gives changes (none a correction)."""
    return changed_rows({**r, "_change_type": INSERT} for r in rows)


def epoch_of_commit(user_metadata: str | None) -> int | None:
    """The epoch whose counts MERGE made a commit with this commit info, or None (table creation, property changes,
    fences: nothing to publish)."""
    match = EPOCH_COMMIT.match(user_metadata or "")
    return int(match.group(1)) if match else None


def sink_records(rows: Iterable[Mapping[str, Any]], *, table_id: str, version: int, epoch: int | None, kind: str,
                 request_id: str | None = None) -> list[SinkRecord]:
    """The Kafka records of one published version: key = the row's identity, value = the row with where it came from
    (the same JSON bytes whenever the version is published again); headers name the version (:func:`cursor_after`)."""
    if kind not in (LIVE, BACKFILL, SNAPSHOT):
        raise ValueError(f"kind must be {LIVE}, {BACKFILL} or {SNAPSHOT}; got {kind!r}")
    headers = ((VERSION_HEADER, str(version).encode()), (TABLE_HEADER, table_id.encode()),
               ("ipcount-kind", kind.encode()),
               *(((EPOCH_HEADER, str(epoch).encode()),) if epoch is not None else ()))
    records = []
    for row in rows:
        key = json.dumps({"window_start": row["window_start"], "ip": row["ip"]}, separators=(",", ":"),
                         sort_keys=True).encode()
        value = json.dumps({**row, "epoch": epoch, "kind": kind, "request_id": request_id,
                            "counts_version": version}, separators=(",", ":"), sort_keys=True).encode()
        records.append(SinkRecord(key, value, headers))
    return records


def cursor_after(headers: Iterable[Iterable[tuple[str, bytes]]]) -> Cursor | None:
    """The cursor just past the newest version among published records (given their headers), or None. Versions are
    published in order: later versions sent nothing, and publishing them again only moves the cursor."""
    newest: tuple[int, str, int | None] | None = None
    for record_headers in headers:
        named = dict(record_headers)
        try:
            version, table_id = int(named[VERSION_HEADER]), named[TABLE_HEADER].decode()
            epoch = int(named[EPOCH_HEADER]) if EPOCH_HEADER in named else None
        except (KeyError, ValueError, UnicodeDecodeError):
            raise ConfigError(f"the sink topic holds a record without the publisher's headers ({VERSION_HEADER}, "
                              f"{TABLE_HEADER}): is another producer writing to it?") from None
        if newest is None or version > newest[0]:
            newest = (version, table_id, epoch)
    return None if newest is None else Cursor(newest[1], newest[0] + 1, newest[2])


def check_sink_policy(topic: str, policy: str | None, bootstrap_servers: str) -> None:
    """The sink topic must be compacted only: retention would delete published records (see the errors)."""
    fix = (f"`kafka-configs.sh --bootstrap-server {bootstrap_servers} --alter --entity-type topics --entity-name "
           f"{topic} --add-config cleanup.policy={SINK_CLEANUP_POLICY}`")
    if policy is None:
        raise ConfigError(f"the cleanup.policy of the sink topic {topic} could not be read (the publisher's login "
                          f"needs DescribeConfigs on it); it must be {SINK_CLEANUP_POLICY} only: {fix}")
    if {part.strip() for part in policy.split(",")} != {SINK_CLEANUP_POLICY}:
        raise ConfigError(f"the sink topic {topic} has cleanup.policy={policy}: Kafka deletes its records by "
                          "retention (retention.ms, retention.bytes), so consumers could no longer fold it into the "
                          "counts table and a publisher whose cursor expired would publish everything again. Make "
                          f"it compacted only: {fix}")


def check_never_published(topic: str, group: str, log_starts: Mapping[int, int]) -> None:
    """For a publisher without a cursor or records in the sink topic: records deleted from it (a log start past 0) were
    published under a cursor Kafka expired, and starting over would send every version again."""
    deleted = {p: start for p, start in sorted(log_starts.items()) if start > 0}
    if deleted:
        starts = ", ".join(f"partition {p} starts at offset {start}" for p, start in deleted.items())
        raise ConfigError(f"the publisher's cursor (group {group}) is gone and the sink topic {topic} holds none of "
                          f"its records, but records were deleted from it ({starts}): it published before. It will "
                          "not send every counts version again by itself; `ipcount publish --resync` sends the "
                          "table whole, once, and publishes on from it")
