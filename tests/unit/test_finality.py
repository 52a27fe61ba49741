"""When a scheduled epoch may finalize windows with a bounded read instead of a full pass."""
from __future__ import annotations

from ipcount.rules.finality import ChainCommit, chain_commits, finalized_below


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
