"""What maintenance decides: which counts partitions are final, and how long a vacuum keeps
files for the publisher (pure rules)."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import ConfigError
from ipcount.rules.maintenance import (DAY_MS, HOUR_MS, MaintenanceRun, TableMaintenance, first_open_partition,
                                       log_cleanup_due, uncommitted_files_due,
                                       log_properties, retirement_floor, vacuum_retention_hours)

T10 = int(datetime(2026, 11, 21, 10, tzinfo=timezone.utc).timestamp() * 1000)  # 10:00


def first_open_hour(watermark_ms, window_ms, lateness_ms):
    return first_open_partition("window_hour", watermark_ms, window_ms, lateness_ms)


def test_no_watermark_makes_no_partition_final():
    assert first_open_hour(None, 5_000, 5_000) is None
    assert first_open_partition("window_day", None, 5_000, 5_000) is None


@pytest.mark.parametrize("watermark, first_open", [
    # hour 10 counts as final from 11:00:10 on: its last 5 s window (10:59:55-11:00:00) is
    # final at 11:00:05 with 5 s of lateness, and the rule allows a window more, since windows
    # need not align to hours
    (T10 + HOUR_MS + 10_000, "2026-11-21T11"),
    (T10 + HOUR_MS + 9_999, "2026-11-21T10"),
    (T10 + 30 * 60_000, "2026-11-21T10"),
    (T10 + 3 * HOUR_MS + 10_000, "2026-11-21T13"),
])
def test_an_hour_is_final_once_its_last_window_is(watermark, first_open):
    assert first_open_hour(watermark, 5_000, 5_000) == first_open


def test_windows_longer_than_the_lateness_push_the_first_open_hour_back():
    # a 10-minute window starting 10:55 ends 11:05: hour 10 is final at 11:05 + lateness
    assert first_open_hour(T10 + HOUR_MS + 5 * 60_000 + 4_999, 600_000, 5_000) == "2026-11-21T10"
    assert first_open_hour(T10 + HOUR_MS + 10 * 60_000 + 5_000, 600_000, 5_000) == "2026-11-21T11"


def test_hour_partitions_sort_as_time_does():
    hours = [first_open_hour(T10 + k * HOUR_MS + 10_000, 5_000, 5_000) for k in range(0, 30)]
    assert hours == sorted(hours) and len(set(hours)) == 30


@pytest.mark.parametrize("watermark, first_open", [
    # day 21 (UTC) is final once its last window, 23:59:55-00:00:00, is: at 00:00:05 on the
    # 22nd with 5 s of lateness, and a window more
    (T10 + 14 * HOUR_MS + 10_000, "2026-11-22"),
    (T10 + 14 * HOUR_MS + 9_999, "2026-11-21"),
    (T10, "2026-11-21"),
    (T10 + 14 * HOUR_MS + 40 * DAY_MS, "2026-12-31"),
])
def test_a_day_is_final_once_its_last_window_is(watermark, first_open):
    assert first_open_partition("window_day", watermark, 5_000, 5_000) == first_open


def test_day_partitions_sort_as_time_does():
    days = [first_open_partition("window_day", T10 + k * DAY_MS, 5_000, 5_000) for k in range(0, 400)]
    assert days == sorted(days) and len(set(days)) == 400


def test_the_vacuum_keeps_what_the_oldest_unpublished_version_reads():
    now = T10 + 1_000 * HOUR_MS
    assert vacuum_retention_hours(168, now, None) == 168                    # all published
    assert vacuum_retention_hours(168, now, now - 2 * HOUR_MS) == 168       # newer than the retention
    assert vacuum_retention_hours(168, now, now - 200 * HOUR_MS) == 201     # reaches back to it, and an hour
    assert vacuum_retention_hours(168, now, now - 200 * HOUR_MS - 1) == 202
    assert vacuum_retention_hours(168, now, 0) > 1_000                      # never published: keep every file


def test_a_run_reports_each_table_in_a_line_and_a_row():
    run = MaintenanceRun("m1", datetime(2026, 11, 27, tzinfo=timezone.utc))
    run.tables.append(TableMaintenance("counts", "/w/counts", files_before=40, files_after=3, bytes_after=2_500_000,
                                       compacted_files=38, vacuumed_files=12, log_bytes=900_000,
                                       checkpoint_bytes=40_000,
                                       notes=("vacuum kept 170 h of files for the publisher",)))
    run.tables.append(TableMaintenance("late_records", "/w/late", notes=("no table",)))
    assert run.lines() == [
        "counts: 40 -> 3 files (2.50 MB), compacted 38, vacuumed 12, _delta_log 0.90 MB (checkpoint 0.04 MB); "
        "vacuum kept 170 h of files for the publisher",
        "late_records: 0 -> 0 files (0.00 MB), compacted 0, vacuumed 0; no table"]
    rows = run.rows()
    assert [r["table"] for r in rows] == ["counts", "late_records"]
    assert rows[0]["finished_at"] == rows[0]["started_at"] and rows[1]["log_bytes"] is None
    assert run.to_dict()["tables"]["counts"]["compacted_files"] == 38


def test_maintenance_settings_are_checked():
    assert PipelineConfig().maintenance_schedule == "@hourly"
    assert PipelineConfig(warehouse="/w").maintenance_path == "/w/maintenance"
    assert PipelineConfig(warehouse="/w").for_target("audit").maintenance_path == "/w/replays/audit/maintenance"
    with pytest.raises(ConfigError, match="maintenance_schedule is empty"):
        PipelineConfig(maintenance_schedule=" ")
    with pytest.raises(ConfigError, match="vacuum_retention_hours"):
        PipelineConfig(vacuum_retention_hours=0)
    with pytest.raises(ConfigError, match="maintenance_table"):
        PipelineConfig(maintenance_table="ftp://x/y")


@pytest.mark.parametrize("floor, epochs, expected", [
    (0, [], (0, None)),                                               # an empty ledger
    (0, [(1, False), (2, False), (2, False), (3, False)], (3, None)),  # every row final
    (0, [(1, False), (2, False), (2, True), (3, False)], (1, 2)),     # a row of 2 still planned
    (0, [(1, False), (2, False), (4, False)], (2, 3)),                # 3 missing: a gap in a rebuilt ledger
    (10, [(11, False), (12, False), (13, True)], (12, 13)),
    (10, [(5, True), (11, False)], (11, None)),                      # (nothing at or below the floor counts)
    (10, [(12, False)], (10, 11)),
])
def test_retirement_stops_at_the_first_epoch_that_is_planned_or_missing(floor, epochs, expected):
    assert retirement_floor(floor, epochs) == expected


def test_files_of_no_commit_are_looked_for_only_while_the_publisher_waits_for_nothing():
    assert uncommitted_files_due(None, 500)     # not published
    assert uncommitted_files_due(501, 500)      # every version sent
    assert not uncommitted_files_due(500, 500)  # version 500 still to send: its files' tombstones may be gone
    assert not uncommitted_files_due(0, 500)


def test_a_published_log_is_cleaned_only_through_a_snapshot_whose_versions_are_all_sent():
    assert log_cleanup_due(None, 500)          # not published: the retention alone decides
    assert log_cleanup_due(501, 500)           # everything up to the snapshot sent
    assert log_cleanup_due(500, 500)           # (delta-rs deletes only below the snapshot's checkpoint)
    assert not log_cleanup_due(499, 500)
    assert not log_cleanup_due(0, 500)         # never published: every version is still to send
    assert log_properties(1) == {"delta.logRetentionDuration": "interval 1 hours",
                                 "delta.enableExpiredLogCleanup": "true"}
    assert log_properties(24, published=True)["delta.enableExpiredLogCleanup"] == "false"
    with pytest.raises(ConfigError, match="log_retention_hours"):
        PipelineConfig(log_retention_hours=0)
