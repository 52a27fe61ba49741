"""Coverage arithmetic and backfill requests: pure logic, no I/O."""
from __future__ import annotations

import pytest

from ipcount.rules.coverage import Coverage, chunks, intersect, merge, next_chunk, subtract
from ipcount.rules.errors import BadRequestError
from ipcount.rules.offsets import OffsetRange, plan_ranges
from ipcount.rules.requests import BackfillRequest, check_against_log, check_target, parse_offsets, parse_time


def r(p, f, u, topic="t"):
    return OffsetRange(topic, p, f, u)


def test_merge_joins_overlapping_and_adjacent_and_drops_empty():
    assert merge([(5, 9), (0, 3), (3, 4), (8, 12), (20, 20)]) == ((0, 4), (5, 12))
    assert merge([]) == ()


@pytest.mark.parametrize("wanted, covered, gaps", [
    ((0, 10), [], ((0, 10),)),
    ((0, 10), [(0, 10)], ()),
    ((0, 10), [(2, 4), (6, 8)], ((0, 2), (4, 6), (8, 10))),
    ((5, 15), [(0, 7), (12, 30)], ((7, 12),)),
    ((5, 15), [(15, 20), (0, 5)], ((5, 15),)),
])
def test_subtract_and_intersect_partition_the_wanted_range(wanted, covered, gaps):
    assert subtract(wanted, covered) == gaps
    inside = intersect(wanted, covered)
    # together they tile the wanted range exactly once
    assert merge(gaps + inside) == (wanted,)
    assert sum(b - a for a, b in gaps) + sum(b - a for a, b in inside) == wanted[1] - wanted[0]


def test_coverage_gaps_overlaps_and_next_gap():
    cov = Coverage.of("t", [r(0, 0, 10), r(0, 10, 20), r(0, 30, 40), r(1, 5, 6), r(2, 0, 5, topic="other")])
    assert cov.of_partition(0) == ((0, 20), (30, 40))
    assert cov.gaps(r(0, 15, 50)) == (r(0, 20, 30), r(0, 40, 50))
    assert cov.overlaps(r(0, 15, 50)) == (r(0, 15, 20), r(0, 30, 40))
    assert cov.of_partition(2) == ()                      # other topics do not count
    assert cov.next_gap(0, 20, 100) == (20, 30)          # stops before the next owned offset
    assert cov.next_gap(0, 5, 100) == (20, 30)           # skips what is owned
    assert cov.next_gap(0, 35, 100) == (40, 100)
    assert cov.next_gap(0, 35, 38) == (38, 38)           # everything up to the end is owned
    assert cov.next_gap(1, 0, 9) == (0, 5)


def test_next_chunk_takes_each_partitions_first_gap_within_the_cap():
    gaps = [r(0, 100, 200), r(0, 300, 400), r(1, 0, 50)]
    chunk = next_chunk(gaps, 90)
    assert chunk == (r(0, 100, 160), r(1, 0, 30))
    assert sum(c.size for c in chunk) == 90
    assert next_chunk(gaps, 1000) == (r(0, 100, 200), r(1, 0, 50))
    assert next_chunk([], 10) == ()


def test_chunks_cover_every_gap_exactly_once():
    wanted = [r(0, 0, 100), r(1, 10, 73)]
    owned = [r(0, 50, 60)]  # a range some other epoch already counted
    seen = []
    for _ in range(100):
        gaps = [g for w in wanted for g in Coverage.of("t", owned).gaps(w)]
        chunk = next_chunk(gaps, 17)
        if not chunk:
            break
        assert sum(c.size for c in chunk) <= 17
        owned += chunk
        seen += chunk
    assert Coverage.of("t", seen).of_partition(0) == ((0, 50), (60, 100))
    assert Coverage.of("t", seen).of_partition(1) == ((10, 73),)
    assert sum(c.size for c in seen) == 90 + 63          # nothing twice


def test_chunks_split_all_of_the_gaps_into_capped_epochs_in_order():
    gaps = [r(0, 5, 20), r(0, 30, 33), r(1, 0, 4)]
    out = chunks(gaps, 6)
    assert out[0] == (r(0, 5, 10), r(1, 0, 1))  # the cap split by the first gaps' sizes
    assert all(sum(c.size for c in chunk) <= 6 for chunk in out)
    taken = [c for chunk in out for c in chunk]
    assert Coverage.of("t", taken).of_partition(0) == ((5, 20), (30, 33))
    assert Coverage.of("t", taken).of_partition(1) == ((0, 4),)
    assert sum(c.size for c in taken) == 15 + 3 + 4  # nothing twice
    assert chunks([], 6) == () and chunks([r(0, 3, 3)], 6) == ()


def test_plan_ranges_skips_offsets_a_backfill_owns():
    cov = Coverage.of("t", [r(0, 10, 30), r(1, 0, 100)])
    ranges = plan_ranges("t", {0: 10, 1: 0}, {0: 0, 1: 0}, {0: 50, 1: 100}, {}, 1000, coverage=cov)
    assert ranges == (r(0, 30, 50), r(1, 100, 100))


def test_parse_offsets():
    assert parse_offsets(" 2:5-9, 0:0-10,0:20-30 ", "t") == (r(0, 0, 10), r(0, 20, 30), r(2, 5, 9))
    for bad, message in [("0:10-5", "must be greater"), ("0:5-5", "must be greater"), ("0:1", "partition:from-until"),
                         ("x:1-2", "partition:from-until"), ("", "empty"), ("0:0-10,0:5-20", "overlap"),
                         ("0:-1-5", "partition:from-until")]:
        with pytest.raises(BadRequestError, match=message):
            parse_offsets(bad, "t")


def test_parse_time():
    assert parse_time("2026-11-21T10:00:00Z", "from") == 1_795_255_200_000
    assert parse_time("2026-11-21T10:00:00", "from") == 1_795_255_200_000      # no zone: UTC
    assert parse_time("2026-11-21T11:00:00+01:00", "from") == 1_795_255_200_000
    assert parse_time("1795255200000", "from") == 1_795_255_200_000
    with pytest.raises(BadRequestError, match="not an ISO 8601"):
        parse_time("yesterday", "--from-time")
    assert parse_time("0", "from") == 0 and parse_time("9999-12-31T23:59:59.999Z", "until") == 253_402_300_799_999
    for far in ("9999999999999999", "-1", "1969-12-31T23:59:59Z", 10**20, "1" * 30):
        with pytest.raises(BadRequestError, match=r"--until-time .* is out of range: a time must lie between 1970"):
            parse_time(far, "--until-time")


@pytest.mark.parametrize("name", ["../etc", "Main2", "a b", "x;drop table", "", "1abc", "a" * 64, "a-b", "a.b"])
def test_target_must_be_a_plain_identifier(name):
    with pytest.raises(BadRequestError, match="plain identifier"):
        check_target(name)


def test_request_checks_and_stable_id():
    a = BackfillRequest(offsets=(r(0, 0, 5),))
    assert a.request_id == BackfillRequest(offsets=(r(0, 0, 5),)).request_id
    assert a.request_id != BackfillRequest(offsets=(r(0, 0, 6),)).request_id
    assert a.request_id != BackfillRequest(target="audit", offsets=(r(0, 0, 5),)).request_id
    with pytest.raises(BadRequestError, match="must be after"):
        BackfillRequest(from_ms=10, until_ms=10)
    with pytest.raises(BadRequestError, match="either offsets or a time range"):
        BackfillRequest(offsets=(r(0, 0, 5),), from_ms=1, until_ms=2)
    with pytest.raises(BadRequestError, match="either offsets or a time range"):
        BackfillRequest()
    with pytest.raises(BadRequestError, match="ends in the future"):
        BackfillRequest(from_ms=1_000, until_ms=10_000).check_time(now_ms=5_000)
    BackfillRequest(from_ms=1_000, until_ms=5_000).check_time(now_ms=5_000)


def test_check_against_log_names_the_problem():
    earliest, latest = {0: 10, 1: 0}, {0: 100, 1: 50}
    check_against_log("t", (r(0, 10, 100), r(1, 0, 50)), earliest, latest)
    with pytest.raises(BadRequestError, match="has no partition 7"):
        check_against_log("t", (r(7, 0, 1),), earliest, latest)
    with pytest.raises(BadRequestError, match=r"offsets \[0, 10\) of t-0 were already deleted"):
        check_against_log("t", (r(0, 0, 20),), earliest, latest)
    with pytest.raises(BadRequestError, match="beyond the end of the log: t-1 ends at 50"):
        check_against_log("t", (r(1, 0, 51),), earliest, latest)
