"""Range planning: pure logic, literal inputs and outputs."""
from __future__ import annotations

import pytest

from ipcount.rules.errors import DataLossError
from ipcount.rules.ledger import EpochPlan
from ipcount.rules.offsets import (ONE_TASK_RECORDS, OffsetRange, plan_ranges, read_tasks, reads_in_one_task,
                                   split_at_log_start, split_cap)

T = "ip_count_source"


def r(p: int, f: int, u: int) -> OffsetRange:
    return OffsetRange(T, p, f, u)


def test_first_epoch_starts_at_earliest_by_default():
    got = plan_ranges(T, {}, earliest={0: 5, 1: 0}, latest={0: 9, 1: 3}, initial={}, max_records=100)
    assert got == (r(0, 5, 9), r(1, 0, 3))


def test_first_epoch_at_latest_is_empty_but_pins_positions():
    got = plan_ranges(T, {}, earliest={0: 0, 1: 0}, latest={0: 9, 1: 3}, initial={0: 9, 1: 3}, max_records=100)
    assert got == (r(0, 9, 9), r(1, 3, 3))


def test_specific_start_names_some_partitions_the_rest_start_at_earliest():
    got = plan_ranges(T, {}, earliest={0: 2, 1: 2, 2: 0}, latest={0: 9, 1: 9, 2: 9}, initial={1: 5},
                      max_records=100)
    assert got == (r(0, 2, 9), r(1, 5, 9), r(2, 0, 9))


def test_epochs_chain_from_ledger_positions_and_ignore_start_position():
    got = plan_ranges(T, {0: 7, 1: 3}, earliest={0: 0, 1: 0}, latest={0: 10, 1: 3}, initial={0: 10, 1: 3},
                      max_records=100)
    assert got == (r(0, 7, 10), r(1, 3, 3))


def test_partition_new_to_the_ledger_starts_at_its_earliest_offset():
    got = plan_ranges(T, {0: 7}, earliest={0: 0, 1: 2}, latest={0: 7, 1: 4}, initial={0: 7, 1: 4},
                      max_records=100)
    assert got == (r(0, 7, 7), r(1, 2, 4))


def test_cap_is_split_by_backlog_and_total_is_exact():
    got = plan_ranges(T, {0: 0, 1: 0, 2: 0}, earliest={0: 0, 1: 0, 2: 0}, latest={0: 600, 1: 300, 2: 100},
                      initial={}, max_records=100)
    assert got == (r(0, 0, 60), r(1, 0, 30), r(2, 0, 10))


def test_small_backlog_is_not_starved():
    assert split_cap({0: 10_000, 1: 1, 2: 0}, 50) == {0: 49, 1: 1, 2: 0}


def test_rounding_remainder_goes_to_largest_fraction():
    assert split_cap({0: 1, 1: 1, 2: 1}, 2) == {0: 1, 1: 1, 2: 0}
    assert split_cap({0: 5, 1: 3, 2: 2}, 7) == {0: 4, 1: 2, 2: 1}
    assert sum(split_cap({0: 7, 1: 11, 2: 13}, 17).values()) == 17


def test_under_the_cap_everything_is_read():
    assert split_cap({0: 3, 1: 4}, 100) == {0: 3, 1: 4}


def test_deleted_offsets_fail_loudly_naming_partition_and_range():
    with pytest.raises(DataLossError, match=r"ip_count_source-1: offsets \[3, 8\) were deleted"):
        plan_ranges(T, {0: 0, 1: 3}, earliest={0: 0, 1: 8}, latest={0: 5, 1: 20}, initial={},
                    max_records=100)


def test_offsets_going_backwards_fail_loudly():
    with pytest.raises(DataLossError, match=r"ip_count_source-0: the ledger has counted up to offset 50"):
        plan_ranges(T, {0: 50}, earliest={0: 0}, latest={0: 10}, initial={}, max_records=100)


def test_partition_missing_from_broker_fails_loudly():
    with pytest.raises(DataLossError, match=r"ip_count_source-2 are in the ledger but no longer exist"):
        plan_ranges(T, {0: 1, 2: 4}, earliest={0: 0}, latest={0: 1}, initial={}, max_records=10)


def test_offset_range_is_half_open_and_validated():
    assert r(0, 3, 7).size == 4
    with pytest.raises(ValueError, match=r"\[7, 3\)"):
        r(0, 7, 3)


def test_spark_offsets_json_is_sorted_and_skips_empty_ranges():
    plan = EpochPlan(4, (r(2, 5, 9), r(0, 1, 1), r(1, 0, 3)))
    assert plan.starting_offsets_json() == '{"ip_count_source":{"1":0,"2":5}}'
    assert plan.ending_offsets_json() == '{"ip_count_source":{"1":3,"2":9}}'
    assert plan.size == 7


def test_skip_policy_moves_overtaken_positions_and_reports_the_gaps():
    from ipcount.rules.offsets import skip_deleted

    moved, lost = skip_deleted(T, {0: 5, 1: 3, 2: 9}, earliest={0: 0, 1: 8, 2: 9})
    assert moved == {0: 5, 1: 8, 2: 9}
    assert lost == (r(1, 3, 8),)


def test_skip_policy_does_not_claim_offsets_a_backfill_owns():
    """A lost range that overlapped a backfill's rows made every plan conflict, for good."""
    from ipcount.rules.coverage import Coverage
    from ipcount.rules.offsets import skip_deleted

    owned = Coverage.of(T, [r(0, 10, 20), r(0, 25, 30), r(1, 0, 50)])
    moved, lost = skip_deleted(T, {0: 5, 1: 0}, earliest={0: 40, 1: 40}, coverage=owned)
    assert moved == {0: 40, 1: 40}
    assert lost == (r(0, 5, 10), r(0, 20, 25), r(0, 30, 40))  # partition 1: all owned, nothing lost


def test_a_large_read_gets_a_few_tasks_per_core_and_a_small_one_the_default():
    assert read_tasks(1_000_000, partitions=3, cores=2) == 6   # not 3 tasks on 2 cores
    assert read_tasks(99_999, partitions=3, cores=2) is None   # small: splitting costs more
    assert read_tasks(1_000_000, partitions=12, cores=2) is None  # already enough tasks
    assert read_tasks(1_000_000, partitions=1, cores=8) == 24


def test_split_at_log_start_keeps_what_the_broker_has_and_names_what_it_deleted():
    ranges = [OffsetRange("t", 0, 0, 30), OffsetRange("t", 1, 10, 20), OffsetRange("t", 2, 5, 9),
              OffsetRange("t", 3, 0, 4)]
    live, deleted = split_at_log_start(ranges, {0: 25, 1: 5, 2: 12})   # partition 3 is gone
    assert live == (OffsetRange("t", 0, 25, 30), OffsetRange("t", 1, 10, 20))
    assert deleted == (OffsetRange("t", 0, 0, 25), OffsetRange("t", 2, 5, 9), OffsetRange("t", 3, 0, 4))


def test_a_backfill_lanes_watermark_never_goes_back():
    """Two overlapping runs of one request: the later epoch was planned from an older
    watermark and committed a lower one; the lane keeps the highest."""
    from datetime import datetime, timezone

    from ipcount.rules.ledger import state_of

    at = datetime(2026, 11, 21, tzinfo=timezone.utc)
    rows = [{"epoch": e, "topic": "t", "partition": 0, "from_offset": f, "until_offset": u, "status": "committed",
             "kind": "backfill", "request_id": "r1", "watermark_before_ms": None, "watermark_after_ms": w,
             "chain_watermark_ms": None, "planned_at": at}
            for e, f, u, w in ((1, 0, 10, 5_000), (2, 10, 20, 9_000), (3, 20, 30, 7_000), (4, 30, 30, None))]
    assert state_of("t", rows).request_watermarks == {"r1": 9_000}


def test_every_planned_chain_epoch_is_unfinished_not_only_the_lowest():
    """A rebuild's target can hold two planned scheduled epochs (it replays in the source's
    commit order); the one chain runners re-run first is the lower, but both are unfinished."""
    from datetime import datetime, timezone

    from ipcount.rules.ledger import state_of

    at = datetime(2026, 11, 21, tzinfo=timezone.utc)
    rows = [{"epoch": e, "topic": "t", "partition": 0, "from_offset": f, "until_offset": u, "status": s,
             "kind": "scheduled", "request_id": None, "watermark_before_ms": None, "watermark_after_ms": None,
             "chain_watermark_ms": None, "planned_at": at}
            for e, f, u, s in ((1, 0, 10, "committed"), (2, 10, 20, "planned"), (3, 20, 30, "committed"),
                               (4, 30, 40, "planned"))]
    state = state_of("t", rows)
    assert state.pending.epoch == 2 and state.unfinished == [2, 4]


def test_small_epochs_read_in_one_task_and_larger_ones_spread():
    assert reads_in_one_task(2_000) and reads_in_one_task(ONE_TASK_RECORDS)
    assert not reads_in_one_task(ONE_TASK_RECORDS + 1)
    # one task stays below the size at which reads start splitting across cores
    assert read_tasks(ONE_TASK_RECORDS, partitions=1, cores=8) is None
