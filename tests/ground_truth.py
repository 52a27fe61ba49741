"""Expected tables computed in plain Python from what was produced (independent of Spark)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ipcount.rules.config import PipelineConfig
from ipcount.rules.records import Event, parse_value
from ipcount_lab.generator import Produced


@dataclass
class Expected:
    counts: Counter = field(default_factory=Counter)      # (window_start_ms, ip) -> count
    dead: set = field(default_factory=set)                # (partition, offset, reason)
    late: set = field(default_factory=set)                # (partition, offset, window_start_ms, watermark_ms)
    watermark_ms: int | None = None


def expected_tables(produced: Iterable[Produced], epochs: Iterable[Mapping[int, tuple[int, int]]],
                    window_ms: int = 5_000, lateness_ms: int = 5_000, max_value_bytes: int = 65_536,
                    event_time: str = "payload",
                    max_ahead_ms: int | None = PipelineConfig().max_event_time_ahead_ms) -> Expected:
    """Replay the documented rules epoch by epoch over the given per-partition ranges.

    Event times are bounded by the Kafka timestamps only: the tests' records are all in
    Kafka long before their epochs are planned, so the planning time bounds nothing more."""
    # Offsets with no produced record (transaction markers, aborted records) are skipped,
    # as a read_committed consumer skips them.
    by_position = {(p.partition, p.offset): p for p in produced}
    out = Expected()
    for ranges in epochs:
        epoch_max = None
        for partition, (start, until) in sorted(ranges.items()):
            for offset in range(start, until):
                rec = by_position.get((partition, offset))
                if rec is None:
                    continue
                parsed = parse_value(rec.value, max_value_bytes, event_time=event_time,
                                     kafka_timestamp_ms=rec.timestamp_ms, max_ahead_ms=max_ahead_ms)
                if not isinstance(parsed, Event):
                    out.dead.add((partition, rec.offset, parsed.reason))
                    continue
                epoch_max = parsed.event_ms if epoch_max is None else max(epoch_max, parsed.event_ms)
                start_ms = parsed.event_ms - parsed.event_ms % window_ms
                closed_at = start_ms + window_ms + lateness_ms
                if out.watermark_ms is not None and closed_at <= out.watermark_ms:
                    out.late.add((partition, offset, start_ms, out.watermark_ms))
                else:
                    out.counts[(start_ms, parsed.ip)] += 1
        if epoch_max is not None:
            out.watermark_ms = epoch_max if out.watermark_ms is None else max(out.watermark_ms, epoch_max)
    return out
