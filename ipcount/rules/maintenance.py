"""What maintenance of a table set decides, apart from its I/O (:mod:`ipcount.storage.maintenance`).

Maintenance keeps a table set's cost flat as it ages: it packs the small files epochs leave
into few big ones, writes a checkpoint, lets delta-rs delete expired log files, and deletes
data files no version has referenced for the retention. None of it changes a row, and
every step is a commit that loses to a concurrent epoch's commit (the epoch retries on the
new version; maintenance tries again on its next run).

Two things here need care. The counts table is compacted only in partitions whose windows
are all final (a new table keeps final rows in partitions of their own; an older one, in
the hours the watermark has passed): the chain's MERGEs still rewrite the others every
epoch, so packing them would be undone at once and make epochs retry. And a vacuum must not delete a file
the publisher still reads: the change data feed of a version that only appended reads that
version's data files, which a later MERGE may have replaced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
# How much longer than the vacuum's retention checkpoints keep a removed file's tombstone
# (delta.deletedFileRetentionDuration): a vacuum deletes only files that still have one, so
# a maintenance run late by up to this much still meets every file that came due.
TOMBSTONE_MARGIN_HOURS = 48
# The counts table's partition columns: the span of event time a partition holds (from UTC
# midnight on), and the format of its values, which sort as time does. A new table is
# partitioned by the window's day, one made before that by its hour: a snapshot lists every
# live file, so a year of hours (8,760 files after compaction) was a cost of every commit.
COUNTS_PARTITIONS: dict[str, tuple[int, str]] = {
    "window_day": (DAY_MS, "%Y-%m-%d"),
    "window_hour": (HOUR_MS, "%Y-%m-%dT%H"),
}
LOG_RETENTION = "delta.logRetentionDuration"
EXPIRED_LOG_CLEANUP = "delta.enableExpiredLogCleanup"


def log_properties(retention_hours: int, published: bool = False) -> dict[str, str]:
    """The table properties that keep a table's ``_delta_log`` to ``retention_hours`` of
    commits: delta-rs deletes older ones after commits, below the last checkpoint (every
    commit lists the log, so its length is a cost of every epoch). A ``published`` table (a
    counts table with its change data feed on) keeps its log until the publisher has sent the
    versions in it: the publisher and maintenance clean it (:func:`log_cleanup_due`), never a
    writer's commit."""
    return {LOG_RETENTION: f"interval {int(retention_hours)} hours",
            EXPIRED_LOG_CLEANUP: "false" if published else "true"}


# How old a file that no commit names must be before a vacuum deletes it: the files of an
# attempt that died or lost its commit (executor writes: ipcount.storage.table_files). Far
# older than any attempt still writing, whose files its commit is about to name.
UNCOMMITTED_FILE_HOURS = 24


def uncommitted_files_due(next_unpublished: int | None, version: int) -> bool:
    """Whether a vacuum through a snapshot at ``version`` may look for files no commit names
    (a full listing of the table's location): only while no version is waiting for the
    publisher, whose change feed reads files whose tombstones may have left the checkpoint."""
    return next_unpublished is None or version < next_unpublished


def log_cleanup_due(next_unpublished: int | None, version: int) -> bool:
    """Whether the expired log of a table may be deleted through a snapshot at ``version``:
    delta-rs deletes only commits below the snapshot's last checkpoint, so it may if every
    version below ``version`` is published (``next_unpublished``: the oldest version not yet
    published; None: the table is not published). Versions, not commit times: no clock decides."""
    return next_unpublished is None or version <= next_unpublished


def partition_value(column: str, ms: int) -> str:
    """The value of the counts partition ``column`` (a key of :data:`COUNTS_PARTITIONS`) for
    windows starting at ``ms``."""
    span, fmt = COUNTS_PARTITIONS[column]
    return datetime.fromtimestamp((ms // span) * span / 1000, timezone.utc).strftime(fmt)


def first_open_partition(column: str, watermark_ms: int | None, window_ms: int, lateness_ms: int) -> str | None:
    """The counts partition (a value of ``column``) from which on windows may still change:
    every partition that sorts before it holds only final windows. None: no watermark, none
    is final.

    A window starting at ``s`` is final once ``s + window + lateness <= watermark``; a
    partition's windows start before its end, so it is final once its end is at most
    ``watermark - lateness - window`` (windows need not align to hours or days)."""
    if watermark_ms is None:
        return None
    return partition_value(column, watermark_ms - lateness_ms - window_ms)


def vacuum_retention_hours(retention_hours: int, now_ms: int, oldest_unpublished_ms: int | None) -> int:
    """The retention a vacuum of the counts table may use: ``retention_hours``, or longer if
    the oldest counts version not yet published (committed at ``oldest_unpublished_ms``) is
    older. A file its change data feed reads was unreferenced no earlier than that commit,
    so a retention reaching back to it keeps every such file."""
    if oldest_unpublished_ms is None:
        return retention_hours
    age_hours = math.ceil(max(0, now_ms - oldest_unpublished_ms) / HOUR_MS) + 1
    return max(retention_hours, age_hours)


def retirement_floor(floor: int, epochs: Iterable[tuple[int, bool]]) -> tuple[int, int | None]:
    """How far the sink tables' transactions may be retired (:meth:`ipcount.storage.sink.Sink.retire`),
    from ``floor`` (retired so far) and ``epochs``, the ledger's (epoch id, planned) pairs
    above it (an id with several rows may come several times; planned if any row is).

    Returns (N, the epoch that stops it or None): N is the highest id such that every id in
    (floor, N] has rows and none is planned; N + 1 stops it if any epoch lies above. No
    planner takes an id at or below N again: new ids are above every id in the ledger, and
    a rebuild, which records its source's ids in its own order, fills only gaps - which
    stop N below them (for good where its source gave the epoch up: a rebuild copies no
    released epoch)."""
    planned: dict[int, bool] = {}
    for epoch, is_planned in epochs:
        if epoch > floor:
            planned[epoch] = planned.get(epoch, False) or bool(is_planned)
    n = floor
    while n + 1 in planned and not planned[n + 1]:
        n += 1
    return n, (n + 1 if any(e > n for e in planned) else None)


@dataclass(frozen=True)
class TableMaintenance:
    """What one maintenance run did to one table, and the table's size after it."""

    table: str                    # the table's role: counts, ledger, dead_letters, late_records
    location: str
    files_before: int = 0         # data files in the latest version before the run
    files_after: int = 0
    bytes_after: int = 0          # their total size after the run
    compacted_files: int = 0      # files compaction replaced
    vacuumed_files: int = 0       # unreferenced files deleted
    log_bytes: int | None = None  # _delta_log's size after the run (None: not listed, object storage)
    checkpoint_bytes: int | None = None
    transactions: int | None = None  # app transactions in the newest checkpoint (None: not read)
    notes: tuple[str, ...] = ()   # steps skipped or lost, and why

    def line(self) -> str:
        sizes = "" if self.log_bytes is None else f", _delta_log {_mb(self.log_bytes)} " \
                                                    f"(checkpoint {_mb(self.checkpoint_bytes or 0)}" + \
            ("" if self.transactions is None else f", {self.transactions} transactions") + ")"
        notes = "".join(f"; {n}" for n in self.notes)
        return (f"{self.table}: {self.files_before} -> {self.files_after} files ({_mb(self.bytes_after)}), "
                f"compacted {self.compacted_files}, vacuumed {self.vacuumed_files}{sizes}{notes}")

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TableMaintenance:
        """A row of the maintenance log back as what it reports."""
        return cls(row["table"], row["location"], files_before=row["files_before"], files_after=row["files_after"],
                   bytes_after=row["bytes_after"], compacted_files=row["compacted_files"],
                   vacuumed_files=row["vacuumed_files"], log_bytes=row["log_bytes"],
                   checkpoint_bytes=row["checkpoint_bytes"], transactions=row.get("transactions"),
                   notes=tuple(n for n in (row["notes"] or "").split("; ") if n))

    def to_row(self, run_id: str, started_at: datetime, finished_at: datetime) -> dict[str, Any]:
        return {"run_id": run_id, "started_at": started_at, "finished_at": finished_at, "table": self.table,
                "location": self.location, "files_before": self.files_before, "files_after": self.files_after,
                "bytes_after": self.bytes_after, "compacted_files": self.compacted_files,
                "vacuumed_files": self.vacuumed_files, "log_bytes": self.log_bytes,
                "checkpoint_bytes": self.checkpoint_bytes, "transactions": self.transactions,
                "notes": "; ".join(self.notes)}


# The maintenance log's columns (name, Spark SQL type, nullable): a row per table and run.
MAINTENANCE_COLUMNS = (
    ("run_id", "string", False),
    ("started_at", "timestamp", False),
    ("finished_at", "timestamp", False),
    ("table", "string", False),
    ("location", "string", False),
    ("files_before", "bigint", False),
    ("files_after", "bigint", False),
    ("bytes_after", "bigint", False),
    ("compacted_files", "bigint", False),
    ("vacuumed_files", "bigint", False),
    ("log_bytes", "bigint", True),
    ("checkpoint_bytes", "bigint", True),
    ("notes", "string", False),
    ("transactions", "bigint", True),
)


@dataclass
class MaintenanceRun:
    """One run of maintenance over a table set."""

    run_id: str
    started_at: datetime
    finished_at: datetime | None = None
    tables: list[TableMaintenance] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [t.line() for t in self.tables]

    def rows(self) -> list[dict[str, Any]]:
        finished = self.finished_at or self.started_at
        return [t.to_row(self.run_id, self.started_at, finished) for t in self.tables]

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "started_at": self.started_at.isoformat(),
                "finished_at": (self.finished_at or self.started_at).isoformat(),
                "tables": {t.table: {k: v for k, v in t.to_row(self.run_id, self.started_at, self.started_at).items()
                                     if k not in ("run_id", "started_at", "finished_at", "table")}
                           for t in self.tables}}


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"
