"""Verify a counts table against Kafka: recount every offset its ledger says is counted, in plain Python (the record
specification in :mod:`ipcount.rules.records`, not the Spark job), with the watermark each epoch recorded, and compare
window by window, IP by IP.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import BadRequestError
from ipcount.rules.ledger import COMMITTED, timestamp_ms
from ipcount.rules.records import Event, is_late, parse_value, window_start
from ipcount.rules.requests import format_ms
from ipcount.rules.tableset import recorded_settings
from ipcount.storage import broker
from ipcount.storage import tableset as tableset_io
from ipcount.storage.delta import read_rows


@dataclass(frozen=True)
class Difference:
    window_start_ms: int
    ip: str
    expected: int   # recounted from Kafka
    actual: int     # in the table

    def line(self) -> str:
        return (f"window {format_ms(self.window_start_ms)} ip {self.ip}: Kafka has {self.expected}, "
                f"table has {self.actual}")


@dataclass
class VerifyReport:
    target: str
    counts_table: str
    topic: str = ""
    ranged: bool = False   # only windows in a time range were compared
    epochs: int = 0
    offsets: int = 0
    records: int = 0
    windows: int = 0       # (window, ip) pairs compared
    differences: list[Difference] = field(default_factory=list)

    @property
    def checked(self) -> bool:
        """Whether there was anything to compare: a verify of nothing is no pass."""
        return self.offsets > 0 and (self.windows > 0 or not self.ranged)

    @property
    def ok(self) -> bool:
        return self.checked and not self.differences

    def line(self) -> str:
        if self.differences:
            verdict = f"MISMATCH: {len(self.differences)} difference(s)"
        elif not self.offsets:
            verdict = f"NOTHING TO VERIFY: the ledger has no committed offsets of topic {self.topic}"
        elif not self.checked:
            verdict = "NOTHING TO VERIFY: no counted window starts in the time range"
        else:
            verdict = "OK: table matches Kafka"
        return (f"verify {self.target} ({self.counts_table}): recounted {self.records} records from {self.offsets} "
                f"offsets of {self.epochs} committed epoch(s), compared {self.windows} (window, ip) counts - {verdict}")


# What the recount says of one record: dead-lettered (key: the reason), late (key: the window start) or counted (key:
# (window start ms, ip)).
MALFORMED, LATE, COUNTED = "malformed", "late", "counted"


def recount_record(t: PipelineConfig, row: Mapping[str, Any], rec) -> tuple[str, Any]:
    """One record of a committed ledger ``row`` classified by the record spec, as its epoch did: with the row's recorded
    watermark and planning time and the settings ``t`` of the table set. ``rec`` is a Kafka consumer record (value,
    timestamp)."""
    parsed = parse_value(rec.value, t.max_value_bytes, event_time=t.event_time, kafka_timestamp_ms=rec.timestamp,
                         planned_at_ms=timestamp_ms(row["planned_at"]), max_ahead_ms=t.max_event_time_ahead_ms)
    if not isinstance(parsed, Event):
        return MALFORMED, parsed.reason
    start = window_start(parsed.event_ms, t.window_ms)
    if is_late(parsed.event_ms, t.window_ms, t.allowed_lateness_ms, row["watermark_before_ms"]):
        return LATE, start
    return COUNTED, (start, parsed.ip)


def table_counts(counts_path: str) -> Counter:
    """(window start ms, ip) -> count, as the counts table holds them."""
    out: Counter = Counter()
    for row in read_rows(counts_path, ["window_start", "ip", "count"]):
        out[(int(row["window_start"].timestamp() * 1000), row["ip"])] += row["count"]
    return out


def verify(cfg: PipelineConfig, target: str = "main", from_ms: int | None = None,
           until_ms: int | None = None) -> VerifyReport:
    """Compare the target's counts with a recount; only windows starting in ``[from_ms, until_ms)`` when given. Refused
    before anything is read when the target's tables do not exist, the range is empty, or the broker or the topic does
    not answer."""
    if from_ms is not None and until_ms is not None and until_ms <= from_ms:
        raise BadRequestError(f"the time range is empty: --until-time ({format_ms(until_ms)}) is not after "
                              f"--from-time ({format_ms(from_ms)})")
    t = tableset_io.existing(cfg, target, "verify")
    broker.partition_offsets(cfg)  # the broker and the topic answer, or the error says which does not
    t = t.replace(**recorded_settings(tableset_io.recorded(t)))  # what the tables mean, not today's settings
    report = VerifyReport(target, t.counts_path, cfg.topic, ranged=from_ms is not None or until_ms is not None)
    rows = [r for r in read_rows(t.ledger_path, ["epoch", "topic", "partition", "from_offset", "until_offset",
                                                 "status", "watermark_before_ms", "planned_at"])
            if r["status"] == COMMITTED and r["topic"] == cfg.topic]
    in_range = (lambda w: (from_ms is None or w >= from_ms) and (until_ms is None or w < until_ms))
    expected: Counter = Counter()
    for r in sorted(rows, key=lambda r: (r["epoch"], r["partition"])):
        report.offsets += r["until_offset"] - r["from_offset"]
        for rec in broker.read_range(cfg, r["partition"], r["from_offset"], r["until_offset"]):
            report.records += 1
            outcome, key = recount_record(t, r, rec)
            if outcome == COUNTED and in_range(key[0]):
                expected[key] += 1
    report.epochs = len({r["epoch"] for r in rows})
    actual = Counter({key: n for key, n in table_counts(t.counts_path).items() if in_range(key[0])})
    keys = sorted(set(expected) | set(actual))
    report.windows = len(keys)
    report.differences = [Difference(w, ip, expected[(w, ip)], actual[(w, ip)]) for w, ip in keys
                          if expected[(w, ip)] != actual[(w, ip)]]
    return report
