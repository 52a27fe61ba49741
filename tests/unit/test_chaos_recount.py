"""The chaos recount's ledger rule when retention rounds deleted records: below a partition's
deletion mark an offset is counted or lost, at or above it counted, once; where retention
rounds delete to; the backfill requests the finish runs again; final rows a live epoch changed."""
from __future__ import annotations

from ipcount_lab.chaos import check_ledger, deletion_point, live_changes_to_final_rows, live_requests


def row(epoch, partition, start, until, status="committed"):
    return {"epoch": epoch, "topic": "t", "partition": partition, "from_offset": start, "until_offset": until,
            "status": status}


def test_below_the_mark_an_offset_is_counted_or_lost_and_above_it_counted():
    # p0 deleted up to 6: [0,3) counted before it aged out, [3,6) recorded lost, [6,10) counted after.
    rows = [row(1, 0, 0, 3), row(2, 0, 3, 6, "lost"), row(2, 0, 6, 10)]
    check = check_ledger(rows, [(0, o) for o in range(10)], {0: 6})
    assert sorted(check.counted) == [(0, o) for o in (0, 1, 2, 6, 7, 8, 9)]
    assert check.counted[(0, 1)] is rows[0] and check.counted[(0, 7)] is rows[2]
    assert check.lost == {(0, 3), (0, 4), (0, 5)}
    assert not check.owners and not check.unowned and not check.lost_live


def test_a_lost_row_over_offsets_never_deleted_is_a_loss():
    # p0 deleted up to 4 only, yet [3,6) recorded lost; p1 never deleted at all.
    rows = [row(1, 0, 0, 3), row(2, 0, 3, 6, "lost"), row(2, 0, 6, 8), row(3, 1, 0, 2, "lost")]
    check = check_ledger(rows, [(0, o) for o in range(8)] + [(1, 0), (1, 1)], {0: 4})
    assert check.lost == {(0, 3)}
    assert check.lost_live == {(0, 4), (0, 5), (1, 0), (1, 1)}


def test_unowned_records_and_offsets_owned_twice():
    # (0, 4) is no record (a transaction marker): owned by none, it is no loss.
    rows = [row(1, 0, 0, 3), row(2, 0, 2, 4, "lost"), row(3, 0, 5, 7), row(4, 0, 6, 7, "planned")]
    check = check_ledger(rows, [(0, o) for o in (0, 1, 2, 3, 5, 6, 7)], {0: 4})
    assert check.owners == {(0, 2): 2, (0, 6): 2}
    assert check.unowned == {(0, 7)}
    assert (0, 3) in check.lost and (0, 5) in check.counted and (0, 6) not in check.counted


def test_retention_deletes_into_the_chains_newest_range_or_anywhere():
    assert deletion_point(10, 50, (20, 30), near=True, u=0.0) == 21
    assert deletion_point(10, 50, (20, 30), near=True, u=0.999) == 32  # a little past the range's end
    assert deletion_point(10, 50, (20, 30), near=False, u=0.0) == 11
    assert deletion_point(10, 50, (20, 30), near=False, u=0.999) == 50  # the whole partition
    assert deletion_point(40, 50, (20, 30), near=True, u=0.0) == 41  # the chain's range is gone already
    assert deletion_point(10, 25, (20, 30), near=True, u=0.999) == 25
    assert all(10 < deletion_point(10, 11, (0, 5), near, u) <= 11 for near in (True, False) for u in (0, 0.99))


def test_the_finish_runs_backfill_requests_from_the_log_start():
    earliest, latest = {0: 10, 1: 0, 2: 30}, {0: 40, 1: 40, 2: 40}
    assert live_requests(["0:5-20,1:3-9", "0:2-8,2:0-30", "2:31-35"], earliest, latest) == [
        "0:10-20,1:3-9", "2:31-35"]
    # Nothing of any request left: one over a partition's live log settles an unfinished chunk.
    assert live_requests(["0:2-8"], earliest, latest) == ["0:10-40"]
    assert live_requests(["0:2-8"], {0: 10, 1: 40}, {0: 10, 1: 40}) == []
    assert live_requests([], earliest, latest) == []


def sent(ip, count, final, kind="live", window="2026-11-21T10:00:00.000Z"):
    return {"window_start": window, "ip": ip, "count": count, "is_final": final, "kind": kind}


def test_a_live_epoch_that_changes_a_row_published_final_is_caught_and_a_backfill_correction_is_not():
    values = [sent("a", 1, False), sent("a", 2, True),           # counted, then closed by the watermark
              sent("a", 3, True, kind="backfill"),              # a backfill corrects the closed window
              sent("a", 3, True),                               # republished unchanged: no change
              sent("b", 5, True), sent("b", 6, True),           # a live epoch changed a final row
              sent("c", 1, True, window="2026-11-21T10:01:00.000Z"), sent("c", 1, False)]
    assert live_changes_to_final_rows(values) == [values[5]]
    assert live_changes_to_final_rows(values[:4]) == []
