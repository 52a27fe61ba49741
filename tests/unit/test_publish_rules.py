"""What the publisher sends for one counts-table version, and its cursor."""
from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from ipcount.rules.errors import ConfigError
from ipcount.rules.publish import (BACKFILL, LIVE, Cursor, changed_rows, check_never_published, check_sink_policy,
                                   cursor_after, has_change_feed, sink_records)

W0 = datetime(2026, 11, 21, 10, 0, 0)           # naive: Delta's timestamps are UTC
W1 = datetime(2026, 11, 21, 10, 0, 5, tzinfo=timezone.utc)


def cdf(change, start, ip, count, final, end=None):
    return {"_change_type": change, "window_start": start, "window_end": end or start, "ip": ip, "count": count,
            "is_final": final, "first_epoch": 1, "last_epoch": 2, "_commit_version": 7}


def test_a_version_s_inserts_and_updates_are_published_as_they_are_after_it():
    rows = changed_rows([
        cdf("update_preimage", W0, "10.0.0.2", 3, False), cdf("update_postimage", W0, "10.0.0.2", 5, False),
        cdf("insert", W1, "10.0.0.1", 1, False),
        # a row only finalized (the watermark passed its window): count unchanged, now final
        cdf("update_preimage", W0, "10.0.0.1", 4, False), cdf("update_postimage", W0, "10.0.0.1", 4, True),
    ])
    assert [(r["window_start"], r["ip"], r["count"], r["is_final"], r["correction"]) for r in rows] == [
        ("2026-11-21T10:00:00.000Z", "10.0.0.1", 4, True, False),
        ("2026-11-21T10:00:00.000Z", "10.0.0.2", 5, False, False),
        ("2026-11-21T10:00:05.000Z", "10.0.0.1", 1, False, False)]


def test_a_count_added_to_a_final_window_is_a_correction():
    (row,) = changed_rows([cdf("update_preimage", W0, "10.0.0.9", 2, True),
                           cdf("update_postimage", W0, "10.0.0.9", 3, True)])
    assert row["correction"] and row["count"] == 3


def test_files_replaced_whole_publish_only_the_rows_that_changed():
    # A Spark-merged version: every row of the removed files deleted, every row of the added ones inserted.
    rows = changed_rows([
        cdf("delete", W0, "10.0.0.1", 4, False), cdf("insert", W0, "10.0.0.1", 4, False),   # rewritten as it was
        cdf("delete", W0, "10.0.0.2", 3, False), cdf("insert", W0, "10.0.0.2", 5, False),   # counted into
        cdf("delete", W0, "10.0.0.3", 1, False), cdf("insert", W0, "10.0.0.3", 1, True),    # finalized
        cdf("insert", W1, "10.0.0.4", 2, False),                                             # new
        cdf("insert", W1, "10.0.0.9", 7, True), cdf("delete", W1, "10.0.0.9", 6, True),      # a correction
    ])
    assert [(r["ip"], r["count"], r["is_final"], r["correction"]) for r in rows] == [
        ("10.0.0.2", 5, False, False), ("10.0.0.3", 1, True, False), ("10.0.0.4", 2, False, False),
        ("10.0.0.9", 7, True, True)]


def test_an_update_that_leaves_every_published_column_as_it_was_publishes_nothing():
    # e.g. a newer version's UPDATE of a column of its own: images of rows whose published
    # columns did not change, beside a real update of the same version.
    rows = changed_rows([
        cdf("update_preimage", W0, "10.0.0.1", 4, True), cdf("update_postimage", W0, "10.0.0.1", 4, True),
        cdf("update_preimage", W0, "10.0.0.2", 3, False), cdf("update_postimage", W0, "10.0.0.2", 3, True),
    ])
    assert [(r["ip"], r["count"], r["is_final"]) for r in rows] == [("10.0.0.2", 3, True)]


def test_records_are_keyed_by_window_and_ip_and_the_same_every_time():
    rows = changed_rows([cdf("insert", W0, "10.0.0.1", 2, False, end=datetime(2026, 11, 21, 10, 0, 5))])
    first = sink_records(rows, table_id="tbl-1", version=7, epoch=3, kind=LIVE)
    assert first == sink_records(rows, table_id="tbl-1", version=7, epoch=3, kind=LIVE)  # a republish sends the same bytes
    (record,) = first
    assert json.loads(record.key) == {"window_start": "2026-11-21T10:00:00.000Z", "ip": "10.0.0.1"}
    assert json.loads(record.value) == {
        "window_start": "2026-11-21T10:00:00.000Z", "window_end": "2026-11-21T10:00:05.000Z", "ip": "10.0.0.1",
        "count": 2, "is_final": False, "correction": False, "epoch": 3, "kind": "live", "request_id": None,
        "counts_version": 7}
    assert dict(record.headers) == {"ipcount-version": b"7", "ipcount-table": b"tbl-1", "ipcount-epoch": b"3",
                                    "ipcount-kind": b"live"}
    backfill = sink_records(rows, table_id="tbl-1", version=8, epoch=9, kind=BACKFILL, request_id="r1")
    assert json.loads(backfill[0].value)["request_id"] == "r1" and backfill[0].key == record.key
    with pytest.raises(ValueError, match="kind must be"):
        sink_records(rows, table_id="tbl-1", version=7, epoch=3, kind="replay")


def test_the_cursor_round_trips_through_the_offset_metadata_and_knows_its_table():
    cursor = Cursor("tbl-1", next_version=12, last_epoch=5)
    assert Cursor.from_committed(12, cursor.metadata()) == cursor
    cursor.check_table("tbl-1")
    with pytest.raises(ConfigError, match="belongs to counts table tbl-1, but the table is now tbl-2.*--resync"):
        cursor.check_table("tbl-2")
    with pytest.raises(ConfigError, match="metadata it does not understand"):
        Cursor.from_committed(3, "epoch=3")


def test_the_topic_alone_says_where_publishing_got_when_the_cursor_is_gone():
    rows = changed_rows([cdf("insert", W0, "10.0.0.1", 2, False), cdf("insert", W1, "10.0.0.2", 1, False)])
    published = [*sink_records(rows, table_id="tbl-1", version=9, epoch=4, kind=LIVE),
                 *sink_records(rows[:1], table_id="tbl-1", version=3, epoch=None, kind="snapshot"),
                 *sink_records(rows[1:], table_id="tbl-1", version=12, epoch=2, kind=BACKFILL, request_id="r")]
    assert cursor_after(r.headers for r in published) == Cursor("tbl-1", next_version=13, last_epoch=2)
    assert cursor_after(r.headers for r in published[:3]) == Cursor("tbl-1", next_version=10, last_epoch=4)
    assert cursor_after([]) is None
    with pytest.raises(ConfigError, match="without the publisher's headers"):
        cursor_after([[("ipcount-version", b"3")], [("traceparent", b"00-ab")]])


def test_only_the_property_true_turns_the_change_feed_on():
    assert has_change_feed({"delta.enableChangeDataFeed": "true"})
    assert not has_change_feed({"delta.enableChangeDataFeed": "false"}) and not has_change_feed({})


@pytest.mark.parametrize("policy", ["delete", "compact,delete", "delete, compact"])
def test_only_a_compacted_only_sink_topic_is_published_to(policy):
    check_sink_policy("sink", "compact", "k1:9092")
    with pytest.raises(ConfigError, match=rf"sink topic sink has cleanup.policy={policy}: .*`kafka-configs.sh "
                                          r"--bootstrap-server k1:9092 .*--entity-name sink "
                                          r"--add-config cleanup.policy=compact`"):
        check_sink_policy("sink", policy, "k1:9092")
    with pytest.raises(ConfigError, match="cleanup.policy of the sink topic sink could not be read.*DescribeConfigs"):
        check_sink_policy("sink", None, "k1:9092")


def test_a_publisher_without_a_cursor_starts_over_only_on_a_topic_that_never_lost_records():
    check_never_published("sink", "p-publisher", {0: 0, 1: 0, 2: 0})   # new, or only aborted records in it
    check_never_published("sink", "p-publisher", {})
    with pytest.raises(ConfigError, match=r"cursor \(group p-publisher\) is gone.*\(partition 2 starts at offset "
                                          r"41\).*`ipcount publish --resync`"):
        check_never_published("sink", "p-publisher", {0: 0, 1: 0, 2: 41})
