"""The publisher's Arrow filter of a version's change data (jobs.publish.without_unchanged_pairs):
the rows it drops are exactly pairs that changed_rows would drop, and what it keeps gives
changed_rows' answer. Strings as delta-rs reads them (string_view), a column not null."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pyarrow as pa

from ipcount.jobs.publish import without_unchanged_pairs
from ipcount.rules.publish import changed_rows

W0 = datetime(2026, 11, 21, 10, 0, 0, tzinfo=timezone.utc)
SCHEMA = pa.schema([pa.field("window_start", pa.timestamp("us", tz="UTC"), nullable=False),
                    ("window_end", pa.timestamp("us", tz="UTC")),
                    ("ip", pa.string_view()), ("count", pa.int64()), ("is_final", pa.bool_()),
                    ("first_epoch", pa.int64()), ("last_epoch", pa.int64()), ("_change_type", pa.string_view()),
                    ("_commit_version", pa.int64())])


def row(change, ip, count, final, minute=0, last_epoch=1):
    start = W0 + timedelta(minutes=minute)
    return {"window_start": start, "window_end": start + timedelta(minutes=1), "ip": ip, "count": count,
            "is_final": final, "first_epoch": 1, "last_epoch": last_epoch, "_change_type": change,
            "_commit_version": 7}


def test_a_rewrite_of_whole_files_keeps_only_the_rows_it_changed():
    rows = [
        # rewritten as they were (an executors' epoch replaces whole files): dropped in Arrow
        *(r for i in range(50)
          for r in (row("delete", f"10.0.0.{i}", 3, False), row("insert", f"10.0.0.{i}", 3, False))),
        # counted into: a changed pair
        row("delete", "10.0.1.1", 3, False), row("insert", "10.0.1.1", 5, False, last_epoch=2),
        # finalized only: changed
        row("delete", "10.0.1.2", 4, False), row("insert", "10.0.1.2", 4, True),
        # a closed window corrected: the correction flag comes from the deleted row
        row("delete", "10.0.1.3", 4, True, minute=1), row("insert", "10.0.1.3", 6, True, minute=1),
        # new
        row("insert", "10.0.1.4", 1, False),
        # a null is_final on both sides: left to changed_rows, which compares in Python
        row("delete", "10.0.1.5", 2, None), row("insert", "10.0.1.5", 2, None),
        # an ordinary MERGE's update
        row("update_preimage", "10.0.1.6", 1, False), row("update_postimage", "10.0.1.6", 2, False),
    ]
    changes = pa.Table.from_pylist(rows, schema=SCHEMA)
    kept = without_unchanged_pairs(changes)
    assert kept.num_rows == len(rows) - 100
    assert not {r["ip"] for r in kept.to_pylist()} & {f"10.0.0.{i}" for i in range(50)}
    assert changed_rows(kept.to_pylist()) == changed_rows(rows)
    published = {r["ip"]: (r["count"], r["is_final"], r["correction"]) for r in changed_rows(kept.to_pylist())}
    assert published == {"10.0.1.1": (5, False, False), "10.0.1.2": (4, True, False), "10.0.1.3": (6, True, True),
                         "10.0.1.4": (1, False, False), "10.0.1.6": (2, False, False)}


def test_a_version_without_both_deletes_and_inserts_is_left_as_it_is():
    for rows in ([row("insert", "10.0.0.1", 1, False)], [row("delete", "10.0.0.1", 1, False)],
                 [row("update_preimage", "10.0.0.1", 1, False), row("update_postimage", "10.0.0.1", 2, False)]):
        changes = pa.Table.from_pylist(rows, schema=SCHEMA)
        assert without_unchanged_pairs(changes).to_pylist() == rows
