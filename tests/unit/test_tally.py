"""Splitting an epoch's tally (the Spark aggregation's rows, as Arrow) into what it writes."""
from __future__ import annotations

from datetime import datetime, timezone

import pyarrow as pa

from ipcount.jobs.tally import EpochTally
from ipcount.rules.ledger import PartitionMetrics
from ipcount.rules.records import BAD_JSON, TOO_LARGE

W = 10_000  # window, ms
T0 = 1_795_255_200_000


def ts(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, timezone.utc)


def row(partition, records, *, window=None, ip=None, late=False, reason=None, offset=None, event_ms=None,
        max_event_ms=None, value=None):
    """A row of one window and client (``partition`` None: counted over all partitions) or of
    one record not counted, as transform.tally makes it."""
    bad = reason is not None
    return {"totals": False, "topic": None if partition is None else "t", "partition": partition, "reason": reason,
            "late": None if bad else late, "window_start_ms": window, "ip": ip, "offset": offset,
            "timestamp": ts(T0) if bad else None, "event_ms": event_ms if late else None, "key": b"k" if bad else None,
            "value": value, "value_bytes": len(value) if bad else None,
            "value_sha256": "ab" * 32 if bad else None, "records": records, "max_event_ms": max_event_ms}


def totals(partition, late, records, max_event_ms=None):
    """A partition's row of totals for one outcome (late: false counted, true late, None malformed)."""
    return {**row(None, records, max_event_ms=max_event_ms), "totals": True, "partition": partition, "late": late}


SCHEMA = pa.schema([("totals", pa.bool_()), ("topic", pa.string()), ("partition", pa.int32()), ("reason", pa.string()),
                    ("late", pa.bool_()), ("window_start_ms", pa.int64()), ("ip", pa.string()), ("offset", pa.int64()),
                    ("timestamp", pa.timestamp("us", tz="UTC")), ("event_ms", pa.int64()), ("key", pa.binary()),
                    ("value", pa.binary()), ("value_bytes", pa.int64()), ("value_sha256", pa.string()),
                    ("records", pa.int64()), ("max_event_ms", pa.int64())])

ROWS = [
    # the same window and client counted in two partitions (3 and 2 records): one count of 5
    row(None, 5, window=T0, ip="1.2.3.4", max_event_ms=T0 + 9_000),
    row(None, 7, window=T0 + W, ip="::1", max_event_ms=T0 + W + 1),
    row(1, 1, window=T0 - 5 * W, ip="1.2.3.4", late=True, offset=41, event_ms=T0 - 5 * W + 3,
        max_event_ms=T0 - 5 * W + 3),
    row(0, 1, reason=BAD_JSON, offset=12, value=b"{"),
    row(2, 1, reason=TOO_LARGE, offset=3, value=b"x" * 4),
    totals(0, False, 3, T0 + 9_000), totals(0, None, 1),
    totals(1, False, 9, T0 + W + 1), totals(1, True, 1, T0 - 5 * W + 3),
    totals(2, None, 1),
]
TALLY = EpochTally(pa.Table.from_pylist(ROWS, schema=SCHEMA))


def test_metrics_per_partition_add_up_the_records_each_row_stands_for():
    assert TALLY.metrics() == {0: PartitionMetrics(4, 3, 0, 1), 1: PartitionMetrics(10, 9, 1, 0),
                               2: PartitionMetrics(1, 0, 0, 1)}
    assert TALLY.max_event_ms() == T0 + W + 1


def test_counts_are_the_rows_of_a_window_and_client_and_leave_out_totals_late_and_bad_rows():
    counts = TALLY.counts(W).to_pylist()
    assert sorted((r["window_start"], r["window_end"], r["ip"], r["count"]) for r in counts) == [
        (ts(T0), ts(T0 + W), "1.2.3.4", 5), (ts(T0 + W), ts(T0 + 2 * W), "::1", 7)]


def test_dead_letters_and_late_records_are_one_row_each_with_the_epoch():
    dead = sorted(TALLY.dead_letters(9).to_pylist(), key=lambda r: r["partition"])
    assert [(r["epoch"], r["partition"], r["offset"], r["reason"], r["value"], r["value_bytes"]) for r in dead] == [
        (9, 0, 12, BAD_JSON, b"{", 1), (9, 2, 3, TOO_LARGE, b"xxxx", 4)]
    assert dead[0]["kafka_timestamp"] == ts(T0) and dead[0]["key"] == b"k"
    late = TALLY.late_records(9, W, T0).to_pylist()
    assert late == [{"epoch": 9, "topic": "t", "partition": 1, "offset": 41, "ip": "1.2.3.4",
                     "event_time": ts(T0 - 5 * W + 3), "window_start": ts(T0 - 5 * W),
                     "window_end": ts(T0 - 4 * W), "watermark": ts(T0)}]


def test_an_empty_tally_writes_nothing():
    empty = EpochTally(SCHEMA.empty_table())
    assert empty.metrics() == {} and empty.max_event_ms() is None
    assert empty.counts(W).num_rows == empty.dead_letters(1).num_rows == empty.late_records(1, W, None).num_rows == 0
