"""``bin/ipcount latency``: how long records wait to be counted, measured after the fact.

A record's latency is from its Kafka timestamp (CreateTime) to the commit of the counts version holding the epoch that
read it, when its count became visible. Over the scheduled chain's committed epochs, from the ledger, the counts table's
log and the topic: nothing in the measured path is instrumented. Under a schedule a record waits for the next run (half
an interval on average), then for that run's start-up and epoch.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import CommitContention
from ipcount.rules.ledger import COMMITTED, is_scheduled

if TYPE_CHECKING:
    from deltalake import DeltaTable


@dataclass(frozen=True)
class EpochLatency:
    epoch: int
    commit_ms: int
    timestamps_ms: tuple[int, ...]


@dataclass(frozen=True)
class LatencyReport:
    epochs: int
    records: int
    p50_seconds: float | None
    p95_seconds: float | None
    max_seconds: float | None
    first_epoch: int | None
    last_epoch: int | None

    def line(self) -> str:
        if not self.records:
            return f"latency: no counted records in {self.epochs} epoch(s)"
        return (f"latency over epochs {self.first_epoch}-{self.last_epoch} ({self.epochs} epochs, "
                f"{self.records:,} records), produce -> counts visible: p50 {self.p50_seconds:.1f} s, "
                f"p95 {self.p95_seconds:.1f} s, max {self.max_seconds:.1f} s")

    def as_dict(self) -> dict:
        return asdict(self)


def percentile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of values in ascending order."""
    if not ordered:
        raise ValueError("no values")
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def report(epochs: Iterable[EpochLatency]) -> LatencyReport:
    """Percentiles over every record of ``epochs`` (pure)."""
    epochs = sorted(epochs, key=lambda e: e.epoch)
    waits = sorted((e.commit_ms - t) / 1000 for e in epochs for t in e.timestamps_ms)
    pick = (lambda q: round(percentile(waits, q), 3)) if waits else (lambda q: None)
    return LatencyReport(len(epochs), len(waits), pick(50), pick(95), pick(100),
                         epochs[0].epoch if epochs else None, epochs[-1].epoch if epochs else None)


def chain_epochs(ledger_rows: Iterable[Mapping], commit_ms: Mapping[int, int],
                 last: int | None = None) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """(epoch, counts commit time, [(partition, from, until)]) of the scheduled chain's committed epochs that wrote
    counts, the last ``last`` of them (pure)."""
    by_epoch: dict[int, list[Mapping]] = {}
    for r in ledger_rows:
        if r["status"] == COMMITTED and is_scheduled(r):
            by_epoch.setdefault(r["epoch"], []).append(r)
    out = []
    for epoch, rows in sorted(by_epoch.items()):
        versions = {r["sink_version"] for r in rows if r["sink_version"] is not None}
        if len(versions) == 1 and next(iter(versions)) in commit_ms:
            out.append((epoch, commit_ms[next(iter(versions))],
                        [(r["partition"], r["from_offset"], r["until_offset"]) for r in rows
                         if r["until_offset"] > r["from_offset"]]))
    return out[-last:] if last else out


def commit_times(counts_path: str, first: int,
                 load_counts: Callable[[], DeltaTable] | None = None) -> dict[int, int]:
    """The commit time (ms) of each counts version from ``first`` on (:func:`~ipcount.storage.delta.commit_infos`).
    ``load_counts`` loads the table (by default from ``counts_path``)."""
    from ipcount.storage.delta import commit_infos

    infos = commit_infos(counts_path, first, load=load_counts)
    if infos is None:
        raise CommitContention(f"commits to {counts_path} kept landing while its log was read; run again")
    return {v: int(h["timestamp"]) for v, h in infos.items()}


def measure(cfg: PipelineConfig, last: int | None = None) -> LatencyReport:
    """Read the ledger, the counts table's log and the records' timestamps; the report."""
    from ipcount.storage.broker import partition_offsets, read_range
    from ipcount.storage.delta import read_rows
    from ipcount.storage.tableset import existing

    existing(cfg, command="latency")
    partition_offsets(cfg)  # the broker and the topic answer, or the error says which does not
    rows = read_rows(cfg.ledger_path, columns=("epoch", "partition", "from_offset", "until_offset", "status",
                                               "kind", "sink_version"), filters=[("topic", "=", cfg.topic)])
    # Only the commits of the epochs measured: on object storage each is a read.
    versions = sorted({r["sink_version"] for r in rows
                       if r["status"] == COMMITTED and is_scheduled(r) and r["sink_version"] is not None})
    measured_versions = versions[-last:] if last else versions
    commit_ms = commit_times(cfg.counts_path, measured_versions[0]) if measured_versions else {}
    measured = []
    for epoch, committed, ranges in chain_epochs(rows, commit_ms, last):
        stamps = tuple(rec.timestamp for p, start, until in ranges for rec in read_range(cfg, p, start, until))
        measured.append(EpochLatency(epoch, committed, stamps))
    return report(measured)
