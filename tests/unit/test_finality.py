"""When a scheduled epoch may finalize windows with a bounded read instead of a full pass."""
from __future__ import annotations

from ipcount.rules.finality import ChainCommit, adds_no_rows, chain_commits, finalized_below, gap_versions


def row(epoch, version, watermark, status="committed", kind=None, partition=0):
    return {"epoch": epoch, "partition": partition, "kind": kind, "status": status, "sink_version": version,
            "watermark_after_ms": watermark}


def test_chain_commits_newest_first_one_per_epoch_scheduled_and_committed_only():
    rows = [row(1, 1, 100), row(1, 1, 100, partition=1), row(2, None, 100),  # epoch 2 counted nothing
            row(3, 2, 300, kind="scheduled"), row(4, 3, 250, kind="backfill"), row(5, 4, 500, status="planned")]
    assert chain_commits(rows) == [ChainCommit(2, 300), ChainCommit(1, 100)]


def test_two_back_to_back_chain_commits_and_nothing_since_allow_a_bounded_read():
    assert finalized_below([ChainCommit(8, 5_000), ChainCommit(7, 4_000)], latest_version=8) == 5_000


def test_a_commit_since_the_chain_last_committed_asks_for_a_full_pass():
    # a backfill (or a fence) after the chain's last commit
    assert finalized_below([ChainCommit(8, 5_000), ChainCommit(7, 4_000)], latest_version=9) is None


def test_a_commit_between_the_chain_last_two_asks_for_a_full_pass():
    # it may have committed while the last bounded read was in flight, unseen by it
    assert finalized_below([ChainCommit(9, 5_000), ChainCommit(7, 4_000)], latest_version=9) is None


def test_a_young_chain_or_no_watermark_asks_for_a_full_pass():
    assert finalized_below([], latest_version=0) is None
    assert finalized_below([ChainCommit(1, 5_000)], latest_version=1) is None
    assert finalized_below([ChainCommit(2, None), ChainCommit(1, None)], latest_version=2) is None
    assert finalized_below([ChainCommit(2, 5_000), ChainCommit(1, 4_000)], latest_version=None) is None


def test_commits_that_change_no_row_may_lie_in_the_gaps():
    chain = [ChainCommit(9, 5_000), ChainCommit(7, 4_000)]
    # maintenance between the chain's last two commits (8) and after them (10, 11)
    assert finalized_below(chain, latest_version=11, row_neutral=[8, 10, 11]) == 5_000
    assert finalized_below(chain, latest_version=11, row_neutral=[8, 11]) is None   # 10 changed rows
    assert finalized_below(chain, latest_version=9, row_neutral=[]) is None          # so did 8
    assert list(gap_versions(chain, 11)) == [8, 9, 10, 11] and not gap_versions(chain[:1], 11)


def commit(operation, mode=None, **metrics):
    return {"operation": operation, "operationParameters": {"mode": mode} if mode else {},
            "operationMetrics": metrics}


def test_which_commits_change_no_row():
    assert adds_no_rows(commit("OPTIMIZE", numFilesAdded=1, numFilesRemoved=4))
    assert adds_no_rows(commit("VACUUM END")) and adds_no_rows(commit("SET TBLPROPERTIES"))
    assert adds_no_rows(commit("WRITE", "Append", num_added_rows=0, num_removed_files=0))    # a fence, a retirement
    assert not adds_no_rows(commit("WRITE", "Append", num_added_rows=3, num_removed_files=0))  # a writer's rows
    assert not adds_no_rows(commit("WRITE", "Overwrite", num_added_rows=0, num_removed_files=2))
    assert not adds_no_rows(commit("WRITE", "Append"))                        # metrics that do not say
    assert not adds_no_rows(commit("MERGE", num_target_rows_inserted=0)) and not adds_no_rows(commit("DELETE"))
    assert not adds_no_rows({})
