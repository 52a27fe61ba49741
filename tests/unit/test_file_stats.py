"""The statistics of a data file that Spark's executors write, as a Delta add action holds them."""
from __future__ import annotations

import json
from datetime import datetime, timezone

from ipcount.rules.file_stats import MAX_STRING_STAT, FileStats, partition_path, partition_text, stat_value


def test_stats_span_every_batch_and_count_nulls():
    stats = FileStats()
    t0, t1 = datetime(2026, 11, 24, 10, tzinfo=timezone.utc), datetime(2026, 11, 24, 11, 0, 0, 5, tzinfo=timezone.utc)
    stats.add(2, [("window_start", t1, t1, 0), ("ip", "10.0.0.9", "10.0.0.9", 0), ("count", 3, 7, 0),
                  ("is_final", None, None, 2)])
    stats.add(1, [("window_start", t0, t0, 0), ("ip", "10.0.0.1", "10.0.0.1", 0), ("count", 1, 1, 0),
                  ("is_final", False, False, 0)])
    got = json.loads(stats.json())
    assert got["numRecords"] == 3
    assert got["minValues"] == {"window_start": "2026-11-24T10:00:00.000000Z", "ip": "10.0.0.1", "count": 1,
                                "is_final": False}
    # microseconds are kept
    assert got["maxValues"]["window_start"] == "2026-11-24T11:00:00.000005Z"
    assert got["maxValues"]["count"] == 7
    assert got["nullCount"] == {"window_start": 0, "ip": 0, "count": 0, "is_final": 2}


def test_a_string_longer_than_delta_keeps_leaves_the_column_unbounded():
    stats = FileStats()
    stats.add(1, [("ip", "a", "a", 0)])
    stats.add(1, [("ip", "b" * (MAX_STRING_STAT + 1), "b" * (MAX_STRING_STAT + 1), 0)])
    stats.add(1, [("ip", "c", "c", 0)])  # a later short value does not bring a wrong maximum back
    got = json.loads(stats.json())
    assert "ip" not in got["minValues"] and "ip" not in got["maxValues"] and got["nullCount"]["ip"] == 0


def test_partition_values_and_directories_as_delta_rs_writes_them():
    assert partition_text(True) == "true" and partition_text(False) == "false" and partition_text(None) is None
    assert partition_text("2026-11-24") == "2026-11-24"
    assert partition_path({"window_day": "2026-11-24", "is_final": "false"}) == "window_day=2026-11-24/is_final=false"
    assert partition_path({}) == ""
    assert stat_value(datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)) == "2026-01-02T03:04:05.000000Z"
    assert stat_value(datetime(2026, 1, 2, 3, 4, 5)) == "2026-01-02T03:04:05.000000Z"  # naive: UTC
