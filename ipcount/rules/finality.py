"""Which rows of the counts table a scheduled epoch must look at to mark windows final.

A window is final once the chain's watermark has passed its end plus the allowed lateness.
Each scheduled epoch's counts commit marks every row that has become final, touched by
its records or not. Looking at every row of the table (a full pass) costs more with
every epoch; this rule says when a bounded look is enough.

The invariant a counts commit of the chain leaves: every row the table held when the
commit read it, whose window_end + lateness <= the commit's watermark W, is final. If the
chain's last counts commit (version v, watermark W) was the table's only commit since the
chain's commit before it (version v - 1), and nothing committed since v, then no other
writer (a backfill, a fence, a hand-made change) can have added a not-final row below W
behind the chain's back, so the next commit needs only the rows with
W < window_end + lateness <= its own watermark. Anything else (a foreign commit, or fewer
than two chain commits) asks for a full pass, which reads the whole table and so conflicts
with any commit racing it: after it the invariant holds again.

Why two commits and not one: a MERGE whose commit let another writer's land between its
read and its own (as Spark's did, for a commit on windows it did not read) would leave that
writer's rows unchecked; that commit sits between the chain's two, so the next epoch sees
the gap and takes a full pass. The sink's commits now never let one through (each is the
next version of the snapshot it read, or fails and reads again), so the second commit is a
margin, which costs a full pass only after another writer's commit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ipcount.rules.ledger import COMMITTED, is_scheduled


@dataclass(frozen=True)
class ChainCommit:
    """One counts commit of the scheduled chain, from the ledger."""

    version: int                # the counts table version the epoch's MERGE made
    watermark_ms: int | None    # the watermark it marked windows final against


def chain_commits(rows: Iterable[Mapping[str, Any]]) -> list[ChainCommit]:
    """The scheduled chain's counts commits among ledger rows (one topic's), newest first:
    its committed epochs that wrote counts."""
    commits = {r["sink_version"]: ChainCommit(r["sink_version"], r["watermark_after_ms"]) for r in rows
               if is_scheduled(r) and r["status"] == COMMITTED and r["sink_version"] is not None}
    return [commits[v] for v in sorted(commits, reverse=True)]


def finalized_below(chain: Sequence[ChainCommit], latest_version: int | None) -> int | None:
    """The watermark below which every row of the counts table is already final, or None
    when the next scheduled commit must take a full pass. ``chain``: the chain's counts
    commits, newest first (two are enough); ``latest_version``: the table's version now."""
    if len(chain) < 2 or latest_version is None:
        return None
    newest, before = chain[0], chain[1]
    if newest.watermark_ms is None:
        return None
    if latest_version != newest.version or newest.version != before.version + 1:
        return None
    return newest.watermark_ms
