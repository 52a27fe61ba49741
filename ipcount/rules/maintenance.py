"""What maintenance of a table set decides, apart from its I/O (:mod:`ipcount.storage.maintenance`).

Maintenance keeps a table set's cost flat as it ages (compaction, checkpoints, expired logs, vacuum) and changes no row.
The counts table is compacted only in partitions whose windows are all final: the chain's MERGEs rewrite the others
every epoch. And a vacuum must not delete a file the publisher still reads: the change data feed of a version that only
appended reads that version's data files, which a later MERGE may have replaced.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, Iterable

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
# How much longer than the vacuum's retention checkpoints keep a removed file's tombstone: a vacuum deletes only files
# that still have one, so a maintenance run late by up to this much still meets every file that came due.
TOMBSTONE_MARGIN_HOURS = 48
# The counts table's partition columns: the span of event time a partition holds (from UTC midnight on), and the format
# of its values, which sort as time does. A new table is partitioned by day, an older one by hour.
COUNTS_PARTITIONS: dict[str, tuple[int, str]] = {
    "window_day": (DAY_MS, "%Y-%m-%d"),
    "window_hour": (HOUR_MS, "%Y-%m-%dT%H"),
}
LOG_RETENTION = "delta.logRetentionDuration"
EXPIRED_LOG_CLEANUP = "delta.enableExpiredLogCleanup"


def log_properties(retention_hours: int, published: bool = False) -> dict[str, str]:
    """The table properties that keep a table's ``_delta_log`` to ``retention_hours`` of commits (every commit lists the
    log). A ``published`` counts table keeps its log until the publisher has sent it: the publisher and maintenance
    clean it (:func:`log_cleanup_due`), never a writer's commit."""
    return {LOG_RETENTION: f"interval {int(retention_hours)} hours",
            EXPIRED_LOG_CLEANUP: "false" if published else "true"}


# How old a file no commit names (of an executors' attempt that died or lost its commit) must be before a vacuum deletes
# it: far older than any attempt still writing.
UNCOMMITTED_FILE_HOURS = 24


def uncommitted_files_due(next_unpublished: int | None, version: int) -> bool:
    """Whether a vacuum through a snapshot at ``version`` may delete files no commit names: only while no version waits
    for the publisher, whose change feed reads files whose tombstones may have left the checkpoint."""
    return next_unpublished is None or version < next_unpublished


def log_cleanup_due(next_unpublished: int | None, version: int) -> bool:
    """Whether the expired log may be deleted through a snapshot at ``version`` (delta-rs deletes only commits below its
    last checkpoint): if every version below it is published (``next_unpublished`` None: the table is not published)."""
    return next_unpublished is None or version <= next_unpublished


def partition_value(column: str, ms: int) -> str:
    """The value of the counts partition ``column`` for windows starting at ``ms``."""
    span, fmt = COUNTS_PARTITIONS[column]
    return datetime.fromtimestamp((ms // span) * span / 1000, timezone.utc).strftime(fmt)


def first_open_partition(column: str, watermark_ms: int | None, window_ms: int, lateness_ms: int) -> str | None:
    """The counts partition (a value of ``column``) from which on windows may still change (None: no watermark). A
    window starting at ``s`` is final once ``s + window + lateness <= watermark``, so a partition is final once its end
    is at most ``watermark - lateness - window``."""
    if watermark_ms is None:
        return None
    return partition_value(column, watermark_ms - lateness_ms - window_ms)


def vacuum_retention_hours(retention_hours: int, now_ms: int, oldest_unpublished_ms: int | None) -> int:
    """The counts table's vacuum retention: ``retention_hours``, or back to the oldest unpublished version's commit
    (``oldest_unpublished_ms``), before which no file its change data feed reads was unreferenced."""
    if oldest_unpublished_ms is None:
        return retention_hours
    age_hours = math.ceil(max(0, now_ms - oldest_unpublished_ms) / HOUR_MS) + 1
    return max(retention_hours, age_hours)


def retirement_floor(floor: int, epochs: Iterable[tuple[int, bool]]) -> tuple[int, int | None]:
    """How far the sink tables' transactions may be retired (:meth:`ipcount.storage.sink.Sink.retire`), from ``floor``
    and the ledger's (epoch id, planned) pairs above it: (N, the epoch that stops it or None), N the highest id such
    that every id in (floor, N] has rows and none is planned. No planner takes an id at or below N again: new ids are
    above every id in the ledger, and a rebuild fills only gaps, which stop N below them."""
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
        return cls(**{f.name: row.get(f.name) for f in fields(cls) if f.name != "notes"},
                   notes=tuple(n for n in (row["notes"] or "").split("; ") if n))

    def to_row(self, run_id: str, started_at: datetime, finished_at: datetime) -> dict[str, Any]:
        return {"run_id": run_id, "started_at": started_at, "finished_at": finished_at, **asdict(self),
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
