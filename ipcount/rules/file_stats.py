"""A data file's statistics as a Delta add action records them (pure: no Arrow, no Delta).

Readers skip files by these (delta-rs prunes a MERGE's or a query's files by each column's minimum and maximum): a file
that Spark's executors write into a table (:mod:`ipcount.storage.table_files`) carries them as delta-rs's own writer
would.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping

# Delta truncates string statistics; a longer value's minimum and maximum are left out (the column is then never skipped
# by), which is always correct, where a truncated maximum is not.
MAX_STRING_STAT = 32


@dataclass
class ColumnStats:
    """One column's minimum, maximum and null count over the batches of one file."""

    low: Any = None
    high: Any = None
    nulls: int = 0
    comparable: bool = True  # False once a value could not be recorded (a long string)

    def add(self, low: Any, high: Any, nulls: int) -> None:
        self.nulls += nulls
        if low is None or not self.comparable:
            return
        if isinstance(low, str) and max(len(low), len(high)) > MAX_STRING_STAT:
            self.comparable, self.low, self.high = False, None, None
            return
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)


@dataclass
class FileStats:
    """The statistics of one file being written, batch by batch."""

    records: int = 0
    columns: dict[str, ColumnStats] = field(default_factory=dict)

    def add(self, rows: int, columns: Iterable[tuple[str, Any, Any, int]]) -> None:
        """A batch of ``rows`` rows: per column (name, minimum, maximum, null count), the minimum and maximum None where
        the batch has no value (or none is kept)."""
        self.records += rows
        for name, low, high, nulls in columns:
            self.columns.setdefault(name, ColumnStats()).add(low, high, nulls)

    def json(self) -> str:
        """The add action's ``stats``."""
        bounded = {n: c for n, c in self.columns.items() if c.comparable and c.low is not None}
        return json.dumps({"numRecords": self.records,
                           "minValues": {n: stat_value(c.low) for n, c in bounded.items()},
                           "maxValues": {n: stat_value(c.high) for n, c in bounded.items()},
                           "nullCount": {n: c.nulls for n, c in self.columns.items()}},
                          separators=(",", ":"), sort_keys=True)


def stat_value(value: Any) -> Any:
    """A minimum or maximum as Delta's statistics spell it (timestamps in UTC, to the microsecond, which the tables'
    timestamps hold exactly)."""
    if isinstance(value, datetime):
        utc = value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)
        return utc.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return value


def partition_text(value: Any) -> str | None:
    """A partition value as an add action records it."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def partition_path(values: Mapping[str, str | None]) -> str:
    """The Hive-style directory of a partition (``window_day=2026-11-24/is_final=false``), as delta-rs lays its files
    out; empty for an unpartitioned table. Values here are dates and booleans, which need no escaping; a null is Hive's
    default partition."""
    return "/".join(f"{k}={'__HIVE_DEFAULT_PARTITION__' if v is None else v}" for k, v in values.items())
