"""Offset ranges and epoch planning: pure functions, no Kafka, Spark or Delta here.

An epoch reads, per partition, the half-open range ``[from_offset, until_offset)``. Planning takes what the ledger says
is committed and what the broker says is available, and returns the next epoch's ranges. Problems that mean data was
lost are raised as :class:`DataLossError` with the partition and both offsets, never papered over.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol

from ipcount.rules.errors import DataLossError


@dataclass(frozen=True, order=True)
class OffsetRange:
    """Offsets ``[from_offset, until_offset)`` of one topic-partition."""

    topic: str
    partition: int
    from_offset: int
    until_offset: int

    def __post_init__(self) -> None:
        if self.from_offset < 0 or self.until_offset < self.from_offset:
            raise ValueError(
                f"invalid offset range for {self.topic}-{self.partition}: "
                f"[{self.from_offset}, {self.until_offset})")

    @property
    def size(self) -> int:
        """Offsets spanned. An upper bound on records: transaction markers and aborted records occupy offsets that a
        read_committed read skips."""
        return self.until_offset - self.from_offset

    @property
    def span(self) -> str:
        """``p0[10,20)``: the range without its topic, as logs and summaries show it."""
        return span_text(self.partition, self.from_offset, self.until_offset)

    def __str__(self) -> str:
        return f"{self.topic}-{self.partition}[{self.from_offset},{self.until_offset})"


def span_text(partition: int, from_offset: int, until_offset: int) -> str:
    """``p0[10,20)``: one partition's half-open range, the one spelling every line uses."""
    return f"p{partition}[{from_offset},{until_offset})"


def describe(ranges: Iterable[OffsetRange], empty: str = "nothing") -> str:
    """``p0[0,10) p0[20,30) p2[5,9)``, sorted by partition and offset (``empty`` if none)."""
    return " ".join(r.span for r in sorted(ranges, key=lambda r: (r.partition, r.from_offset))) or empty


class OwnedOffsets(Protocol):
    """What planning needs to know of the offsets the ledger already owns (:class:`ipcount.rules.coverage.Coverage`)."""

    def next_gap(self, partition: int, position: int, end: int) -> tuple[int, int]: ...


def offsets_json(ranges: Iterable[OffsetRange], which: str) -> str:
    """Spark Kafka source offsets JSON, e.g. ``{"t":{"0":5,"1":7}}``, sorted for determinism."""
    by_topic: dict[str, dict[str, int]] = {}
    for r in sorted(ranges):
        by_topic.setdefault(r.topic, {})[str(r.partition)] = getattr(r, which)
    return json.dumps(by_topic, sort_keys=True, separators=(",", ":"))


def plan_ranges(topic: str, committed: Mapping[int, int], earliest: Mapping[int, int],
                latest: Mapping[int, int], initial: Mapping[int, int], max_records: int,
                coverage: OwnedOffsets | None = None) -> tuple[OffsetRange, ...]:
    """The next epoch's ranges: one per partition the broker has, sorted, maybe empty; :class:`DataLossError` when a
    committed position is no longer readable.

    ``committed``: partition -> first offset not yet counted, from the ledger (empty before its first commit).
    ``earliest``/``latest``: the broker's log start / last stable offsets. ``initial``: where an empty ledger starts
    (the resolved start position); a partition neither names starts at its earliest offset. ``max_records``: the epoch's
    cap, split across partitions by backlog (:func:`split_cap`). ``coverage``: offsets the ledger already owns
    (backfills ahead of the chain), which a range skips, stopping before the next owned offset.
    """
    check_partitions_exist(topic, committed, latest)
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    for p in sorted(latest):
        if p in committed:
            start = committed[p]
        elif not committed and p in initial:
            start = initial[p]
        else:
            start = earliest[p]
        check_readable(topic, p, start, min(start, earliest[p]), latest[p])  # offsets gone backwards?
        start, end = coverage.next_gap(p, start, latest[p]) if coverage is not None else (start, latest[p])
        check_readable(topic, p, start, earliest[p], latest[p])
        starts[p], ends[p] = start, end
    budgets = split_cap({p: ends[p] - starts[p] for p in starts}, max_records)
    return tuple(OffsetRange(topic, p, starts[p], starts[p] + budgets[p]) for p in sorted(starts))


def check_partitions_exist(topic: str, positions: Mapping[int, int], latest: Mapping[int, int]) -> None:
    """Raise :class:`DataLossError` if a partition the ledger reads from is gone."""
    missing = sorted(set(positions) - set(latest))
    if missing:
        raise DataLossError(
            f"partition(s) {', '.join(f'{topic}-{p}' for p in missing)} are in the ledger but no "
            f"longer exist on the broker; offsets from {', '.join(str(positions[p]) for p in missing)} "
            "onward can never be read (was the topic deleted or recreated?)")


def skip_deleted(topic: str, committed: Mapping[int, int], earliest: Mapping[int, int],
                 coverage: OwnedOffsets | None = None) -> tuple[dict[int, int], tuple[OffsetRange, ...]]:
    """The ``on_data_loss = "skip"`` policy: move committed positions that retention has overtaken up to the log start,
    and return the skipped ranges so they can be recorded. Offsets other ledger rows own (a backfill counted them before
    they aged out) are not lost: the lost ranges are the gaps between them."""
    moved, lost = dict(committed), []
    for p, position in sorted(committed.items()):
        if p in earliest and position < earliest[p]:
            while position < earliest[p]:
                start, stop = (coverage.next_gap(p, position, earliest[p]) if coverage is not None
                               else (position, earliest[p]))
                if start == stop:  # owned up to the log start
                    break
                lost.append(OffsetRange(topic, p, start, stop))
                position = stop
            moved[p] = earliest[p]
    return moved, tuple(lost)


def split_at_log_start(ranges: Iterable[OffsetRange], earliest: Mapping[int, int]
                       ) -> tuple[tuple[OffsetRange, ...], tuple[OffsetRange, ...]]:
    """(what the broker still has, what retention deleted) of ``ranges``: each range split at its partition's log start;
    a partition the broker no longer has is deleted whole."""
    live, deleted = [], []
    for r in ranges:
        start = earliest.get(r.partition, r.until_offset)
        if r.from_offset < start:
            deleted.append(OffsetRange(r.topic, r.partition, r.from_offset, min(start, r.until_offset)))
        if max(start, r.from_offset) < r.until_offset:
            live.append(OffsetRange(r.topic, r.partition, max(start, r.from_offset), r.until_offset))
    return tuple(live), tuple(deleted)


def check_still_there(topic: str, ranges: Iterable[OffsetRange], earliest: Mapping[int, int],
                      latest: Mapping[int, int]) -> None:
    """Raise :class:`DataLossError` if the broker no longer has all of the (non-empty) ``ranges``."""
    ranges = [r for r in ranges if r.size > 0]
    check_partitions_exist(topic, {r.partition: r.from_offset for r in ranges}, latest)
    for r in ranges:
        check_readable(topic, r.partition, r.from_offset, earliest[r.partition], latest[r.partition])


def check_readable(topic: str, partition: int, from_offset: int, earliest: int, latest: int) -> None:
    """Raise :class:`DataLossError` if reading must start at ``from_offset`` but cannot."""
    if from_offset < earliest:
        raise DataLossError(
            f"data loss on {topic}-{partition}: offsets [{from_offset}, {earliest}) were deleted "
            f"before they were counted (log start offset is now {earliest}; retention or "
            "delete_records removed them)")
    if from_offset > latest:
        raise DataLossError(
            f"data loss on {topic}-{partition}: the ledger has counted up to offset {from_offset} "
            f"but the partition now ends at {latest}; offsets went backwards (was the topic recreated?)")


def split_cap(backlog: Mapping[int, int], cap: int) -> dict[int, int]:
    """Split ``cap`` records across partitions in proportion to their backlog.

    Largest-remainder rounding keeps the total exactly ``min(cap, sum(backlog))``. No partition with a backlog is
    starved while the cap allows one record per such partition: each gets at least one, taken from the largest share.
    """
    if cap < 1:
        raise ValueError(f"cap must be >= 1; found {cap}")
    total = sum(backlog.values())
    if total <= cap:
        return dict(backlog)
    exact = {p: cap * b / total for p, b in backlog.items()}
    shares = {p: min(backlog[p], int(x)) for p, x in exact.items()}
    leftover = cap - sum(shares.values())
    # Hand out the rounding remainder by largest fraction, ties to the lower partition.
    for p in sorted(backlog, key=lambda q: (-(exact[q] - int(exact[q])), q)):
        if leftover == 0:
            break
        if shares[p] < backlog[p]:
            shares[p] += 1
            leftover -= 1
    starving = [p for p in sorted(backlog) if backlog[p] > 0 and shares[p] == 0]
    for p in starving:
        donor = max(sorted(shares), key=lambda q: shares[q])
        if shares[donor] <= 1:
            break  # cap smaller than the number of partitions with a backlog
        shares[donor] -= 1
        shares[p] = 1
    return shares


# Up to this many records an epoch is read, parsed and tallied in one task (docs/performance.md).
ONE_TASK_RECORDS = 10_000


def reads_in_one_task(records: int) -> bool:
    """Whether an epoch of ``records`` records reads them all in one Spark task: a small epoch's time goes to
    scheduling, and in one partition the tally needs no shuffle."""
    return records <= ONE_TASK_RECORDS


# Below this many records an epoch reads one task per partition: splitting costs more than it saves.
SPLIT_READ_RECORDS = 100_000
TASKS_PER_CORE = 3


def read_tasks(records: int, partitions: int, cores: int) -> int | None:
    """How many Spark tasks to read ``records`` from ``partitions`` Kafka partitions with (``minPartitions``), or None
    for one per partition, which leaves cores idle when the partitions do not divide evenly among them: a few tasks per
    core keep every core busy to the end."""
    want = TASKS_PER_CORE * cores
    if records < SPLIT_READ_RECORDS or want <= partitions:
        return None
    return want
