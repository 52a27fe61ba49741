"""Coverage arithmetic: which offsets of each partition a target's ledger already owns.

Pure functions over half-open intervals ``[from, until)``. The ledger's rows (planned, committed or lost, of any kind)
are the coverage; every new epoch - scheduled or backfill - may only take offsets outside it. That one rule is what
keeps scheduled epochs, backfills and replays from ever counting an offset twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ipcount.rules.offsets import OffsetRange, split_cap

Interval = tuple[int, int]


def merge(intervals: Iterable[Interval]) -> tuple[Interval, ...]:
    """Sorted, disjoint, non-adjacent intervals covering the same offsets (empty ones dropped)."""
    out: list[list[int]] = []
    for start, until in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], until)
        else:
            out.append([start, until])
    return tuple((a, b) for a, b in out)


def subtract(wanted: Interval, covered: Iterable[Interval]) -> tuple[Interval, ...]:
    """The parts of ``wanted`` outside ``covered``, in order."""
    start, until = wanted
    gaps = []
    for a, b in merge(covered):
        if b <= start or a >= until:
            continue
        if a > start:
            gaps.append((start, a))
        start = max(start, b)
    if start < until:
        gaps.append((start, until))
    return tuple(gaps)


def intersect(wanted: Interval, covered: Iterable[Interval]) -> tuple[Interval, ...]:
    """The parts of ``wanted`` inside ``covered``, in order."""
    return tuple((max(a, wanted[0]), min(b, wanted[1])) for a, b in merge(covered)
                 if min(b, wanted[1]) > max(a, wanted[0]))


@dataclass(frozen=True)
class Coverage:
    """Per partition of one topic, the merged intervals the ledger owns."""

    topic: str
    intervals: Mapping[int, tuple[Interval, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, topic: str, ranges: Iterable[OffsetRange]) -> Coverage:
        by_partition: dict[int, list[Interval]] = {}
        for r in ranges:
            if r.topic == topic:
                by_partition.setdefault(r.partition, []).append((r.from_offset, r.until_offset))
        # A partition whose rows own nothing (empty ranges) has no entry: one form per coverage.
        return cls(topic, {p: spans for p, iv in by_partition.items() if (spans := merge(iv))})

    def of_partition(self, partition: int) -> tuple[Interval, ...]:
        return self.intervals.get(partition, ())

    def gaps(self, wanted: OffsetRange) -> tuple[OffsetRange, ...]:
        """The uncovered parts of ``wanted``."""
        return tuple(OffsetRange(wanted.topic, wanted.partition, a, b)
                     for a, b in subtract((wanted.from_offset, wanted.until_offset),
                                          self.of_partition(wanted.partition)))

    def overlaps(self, wanted: OffsetRange) -> tuple[OffsetRange, ...]:
        """The covered parts of ``wanted``."""
        return tuple(OffsetRange(wanted.topic, wanted.partition, a, b)
                     for a, b in intersect((wanted.from_offset, wanted.until_offset),
                                           self.of_partition(wanted.partition)))

    def next_gap(self, partition: int, position: int, end: int) -> Interval:
        """The first uncovered run at or after ``position``, ending before ``end``: where a scheduled epoch continues
        when a backfill already counted offsets ahead of it. Empty (``(x, x)``) when everything up to ``end`` is
        covered."""
        start = position
        for a, b in self.of_partition(partition):
            if b <= start:
                continue
            if a <= start:
                start = b
                continue
            return (min(start, end), min(a, end))
        return (min(start, end), end) if start < end else (end, end)


def next_chunk(gaps: Iterable[OffsetRange], cap: int) -> tuple[OffsetRange, ...]:
    """One bounded epoch's worth of ``gaps``: per partition the head of its first gap, with ``cap`` split across
    partitions by the size of those heads. Call again (after the chunk is recorded) for the rest; empty when there are
    no gaps."""
    heads: dict[int, OffsetRange] = {}
    for g in sorted(gaps, key=lambda r: (r.partition, r.from_offset)):
        if g.size > 0 and g.partition not in heads:
            heads[g.partition] = g
    if not heads:
        return ()
    budgets = split_cap({p: g.size for p, g in heads.items()}, cap)
    return tuple(OffsetRange(g.topic, p, g.from_offset, g.from_offset + budgets[p])
                 for p, g in sorted(heads.items()) if budgets[p] > 0)


def chunks(gaps: Iterable[OffsetRange], cap: int) -> tuple[tuple[OffsetRange, ...], ...]:
    """All of ``gaps`` as bounded epochs, in order: :func:`next_chunk` until nothing is left."""
    left = [g for g in gaps if g.size > 0]
    out = []
    while chunk := next_chunk(left, cap):
        out.append(chunk)
        taken = {(c.partition, c.from_offset): c.until_offset for c in chunk}
        left = [OffsetRange(g.topic, g.partition, taken.get((g.partition, g.from_offset), g.from_offset),
                            g.until_offset) for g in left]
        left = [g for g in left if g.size > 0]
    return tuple(out)
