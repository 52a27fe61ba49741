"""A simulated Kafka topic for the model test of the ledger (tests/integration/test_ledger_model.py).

It stands in for the broker and for Spark's read as the epoch code sees them
(:class:`ipcount.jobs.epoch.Source`): log starts and last stable offsets per partition, the
offsets-for-times lookup, and an epoch's tally. The tally is built record by record with the
rules the Spark job implements (:mod:`ipcount.rules.records`), in the shape of
:func:`ipcount.jobs.transform.tally`'s rows, so the model never restates a rule of its own.

:class:`SimulatedSinkTopic` stands in for the sink topic that counts are published to.

The log holds what a read_committed consumer would see: an offset whose record is None is a
transaction marker or an aborted record, read by nobody.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Mapping

import pyarrow as pa

from ipcount.jobs.tally import EpochTally
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import DataLossError
from ipcount.rules.ledger import EpochPlan
from ipcount.rules.publish import Cursor, SinkRecord
from ipcount.rules.records import TOO_LARGE, Event, dead_letter_prefix_bytes, is_late, parse_value, window_start

TALLY_SCHEMA = pa.schema([
    ("totals", pa.bool_()), ("topic", pa.string()), ("partition", pa.int32()), ("reason", pa.string()),
    ("late", pa.bool_()), ("window_start_ms", pa.int64()), ("ip", pa.string()), ("offset", pa.int64()),
    ("timestamp", pa.timestamp("us", tz="UTC")), ("event_ms", pa.int64()), ("key", pa.binary()),
    ("value", pa.binary()), ("value_bytes", pa.int64()), ("value_sha256", pa.string()),
    ("records", pa.int64()), ("max_event_ms", pa.int64())])


@dataclass(frozen=True)
class Record:
    value: bytes | None
    timestamp_ms: int
    key: bytes | None = None


@dataclass
class SimulatedLog:
    """One topic: per partition its entries from offset 0 (None: a marker or an aborted
    record) and its log start (retention, ``delete_records``)."""

    cfg: PipelineConfig
    entries: dict[int, list[Record | None]] = field(default_factory=dict)
    start: dict[int, int] = field(default_factory=dict)
    reads: int = 0  # tallies made (what a re-run costs)

    def add_partitions(self, count: int) -> None:
        for p in range(len(self.entries), len(self.entries) + count):
            self.entries[p], self.start[p] = [], 0

    def append(self, partition: int, records: list[Record], aborted: bool = False) -> None:
        """``records`` in one transaction: committed (visible, then a marker) or aborted
        (offsets taken, nothing visible)."""
        log = self.entries[partition]
        log.extend(None if aborted else r for r in records)
        log.append(None)  # the transaction's marker

    def delete_records(self, partition: int, before: int) -> None:
        self.start[partition] = max(self.start[partition], min(before, len(self.entries[partition])))

    def record(self, partition: int, offset: int) -> Record | None:
        return self.entries[partition][offset]

    # -- the epoch code's view (ipcount.jobs.epoch.Source) --------------------------------

    def partition_offsets(self) -> tuple[dict[int, int], dict[int, int]]:
        return dict(self.start), {p: len(e) for p, e in self.entries.items()}

    def start_offsets(self, earliest: Mapping[int, int], latest: Mapping[int, int]) -> dict[int, int]:
        assert self.cfg.start_position == "earliest", "the model starts its chain at the log start"
        return dict(earliest)

    def offsets_for_time(self, timestamp_ms: int, latest: Mapping[int, int]) -> dict[int, int]:
        out = {}
        for p in latest:
            log = self.entries[p]
            out[p] = next((o for o in range(self.start[p], len(log))
                           if log[o] is not None and log[o].timestamp_ms >= timestamp_ms), len(log))
        return out

    def tally(self, plan: EpochPlan, cfg: PipelineConfig | None = None) -> EpochTally | None:
        """What transform.tally makes of the plan's ranges, as Arrow (None: nothing to read)."""
        cfg = cfg or self.cfg
        if not plan.nonempty_ranges:
            return None
        self.reads += 1
        rows, totals, counts = [], defaultdict(lambda: [0, None]), defaultdict(lambda: [0, None])
        for r in plan.nonempty_ranges:
            if r.from_offset < self.start[r.partition] or r.until_offset > len(self.entries[r.partition]):
                raise DataLossError(f"simulated read of {r}: the log holds [{self.start[r.partition]}, "
                                    f"{len(self.entries[r.partition])})")
            for offset in range(r.from_offset, r.until_offset):
                rec = self.entries[r.partition][offset]
                if rec is not None:
                    rows.extend(_classified(cfg, plan, r.topic, r.partition, offset, rec, totals, counts))
        for (window, ip), (n, newest) in counts.items():
            rows.append(_row(records=n, max_event_ms=newest, late=False, window_start_ms=window, ip=ip))
        for (partition, late), (n, newest) in totals.items():
            rows.append(_row(totals=True, partition=partition, late=late, records=n, max_event_ms=newest))
        return EpochTally(pa.Table.from_pylist(rows, schema=TALLY_SCHEMA))


def _classified(cfg: PipelineConfig, plan: EpochPlan, topic: str, partition: int, offset: int, rec: Record,
                totals: dict, counts: dict) -> list[dict]:
    """One record's share of the tally: its rows (a late or malformed record keeps one of its
    own), and what it adds to its partition's totals and to its window's count."""
    parsed = parse_value(rec.value, cfg.max_value_bytes, event_time=cfg.event_time,
                         kafka_timestamp_ms=rec.timestamp_ms, planned_at_ms=plan.planned_at_ms,
                         max_ahead_ms=cfg.max_event_time_ahead_ms)
    if not isinstance(parsed, Event):
        _add(totals, (partition, None), None)
        value = rec.value
        kept = value[:dead_letter_prefix_bytes(cfg.max_value_bytes)] if parsed.reason == TOO_LARGE else value
        return [_row(topic=topic, partition=partition, reason=parsed.reason, offset=offset,
                     timestamp=datetime.fromtimestamp(rec.timestamp_ms / 1000, timezone.utc), key=rec.key,
                     value=kept, value_bytes=None if value is None else len(value),
                     value_sha256=None if value is None else hashlib.sha256(value).hexdigest(), records=1)]
    start = window_start(parsed.event_ms, cfg.window_ms)
    late = is_late(parsed.event_ms, cfg.window_ms, cfg.allowed_lateness_ms, plan.watermark_ms)
    _add(totals, (partition, late), parsed.event_ms)
    if not late:
        _add(counts, (start, parsed.ip), parsed.event_ms)
        return []
    return [_row(topic=topic, partition=partition, late=True, window_start_ms=start, ip=parsed.ip, offset=offset,
                 event_ms=parsed.event_ms, records=1, max_event_ms=parsed.event_ms)]


def _add(sums: dict, key: tuple, event_ms: int | None) -> None:
    entry = sums[key]
    entry[0] += 1
    if event_ms is not None:
        entry[1] = event_ms if entry[1] is None else max(entry[1], event_ms)


def _row(**values) -> dict:
    return {"totals": False, **values}


@dataclass
class SimulatedSinkTopic:
    """The sink topic and its one publisher (:class:`ipcount.storage.publisher.SinkTopic`):
    the committed transactions, each its records and the cursor committed with them. A
    death before the commit leaves nothing, as an aborted Kafka transaction would."""

    transactions: list[tuple[list[SinkRecord], Cursor]] = field(default_factory=list)

    def create(self) -> None:
        pass

    def check_never_published(self) -> None:
        assert not self.transactions, "asked with a cursor there: a publisher that lost it"

    def publisher(self) -> SimulatedSinkTopic:
        return self

    def cursor(self) -> Cursor | None:
        return self.transactions[-1][1] if self.transactions else None

    def next_version(self) -> int:
        return self.transactions[-1][1].next_version if self.transactions else 0

    def publish(self, records, after: Cursor, crash=lambda point: None) -> int:
        records = list(records)
        if records:
            crash("publish_before_commit")
        self.transactions.append((records, after))
        if records:
            crash("publish_after_commit")
        return len(records)

    def close(self) -> None:
        pass
