"""Which rows of the counts table a scheduled epoch must look at to mark windows final.

Each scheduled epoch's counts commit marks every row that has become final (the chain's watermark past its end plus the
allowed lateness), touched by its records or not. Looking at every row (a full pass) costs more with every epoch; this
rule says when a bounded look is enough.

The invariant a chain's counts commit leaves: every row the table held when the commit read it, whose window_end +
lateness <= the commit's watermark W, is final. If the chain's last counts commit (version v, watermark W) was the only
commit that may have changed rows since the chain's commit before it, and none since v did either, no other writer can
have added a not-final row below W, so the next commit needs only the rows with W < window_end + lateness <= its own
watermark. Anything else (a foreign commit, fewer than two chain commits) asks for a full pass, after which the
invariant holds again. Commits that change no row (:func:`adds_no_rows`, from their commit infos) may lie in those gaps.
The second chain commit is a margin: a MERGE that let another writer's commit land between its read and its own would
leave that commit between the chain's two.
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
    """The scheduled chain's counts commits among ledger rows (one topic's), newest first: its committed epochs that
    wrote counts."""
    commits = {r["sink_version"]: ChainCommit(r["sink_version"], r["watermark_after_ms"]) for r in rows
               if is_scheduled(r) and r["status"] == COMMITTED and r["sink_version"] is not None}
    return [commits[v] for v in sorted(commits, reverse=True)]


# Operations whose commits change no row of a table (delta-rs's names): OPTIMIZE rewrites files with dataChange=false;
# the others add no data file.
ROW_NEUTRAL_OPERATIONS = frozenset({"OPTIMIZE", "VACUUM START", "VACUUM END", "SET TBLPROPERTIES", "ADD COLUMN"})


def adds_no_rows(commit_info: Mapping[str, Any]) -> bool:
    """Whether a commit (its commit info, as ``DeltaTable.history()`` gives it) added, removed and changed no row: a
    :data:`ROW_NEUTRAL_OPERATIONS` one, or an append that wrote no row. Anything else, or a commit info that does not
    say, is taken to have."""
    operation = commit_info.get("operation")
    if operation in ROW_NEUTRAL_OPERATIONS:
        return True
    metrics = commit_info.get("operationMetrics") or {}
    return (operation == "WRITE" and (commit_info.get("operationParameters") or {}).get("mode") == "Append"
            and metrics.get("num_added_rows") == 0 and metrics.get("num_removed_files") == 0)


def gap_versions(chain: Sequence[ChainCommit], latest_version: int | None) -> range:
    """The versions :func:`finalized_below` needs to know of (those between the chain's last two commits and after the
    newest; empty if it needs none)."""
    if len(chain) < 2 or latest_version is None:
        return range(0)
    return range(chain[1].version + 1, latest_version + 1)


def finalized_below(chain: Sequence[ChainCommit], latest_version: int | None,
                    row_neutral: Iterable[int] = ()) -> int | None:
    """The watermark below which every row of the counts table is already final, or None when the next scheduled commit
    must take a full pass. ``chain``: the chain's counts commits, newest first (two are enough); ``latest_version``: the
    table's version now; ``row_neutral``: versions known to have changed no row (:func:`adds_no_rows`)."""
    if len(chain) < 2 or latest_version is None:
        return None
    newest, before = chain[0], chain[1]
    if newest.watermark_ms is None or not before.version < newest.version <= latest_version:
        return None
    neutral = set(row_neutral)
    if any(v not in neutral for v in gap_versions(chain, latest_version) if v != newest.version):
        return None
    return newest.watermark_ms


# -- what a counts merge does to a row ------------------------------------------------------
# Stated once, as SQL both of the sink's writers evaluate: delta-rs's MERGE (DataFusion) and
# the executors' rewrite of the files an epoch touches (Spark SQL). t is the table's row, s
# the epoch's; the parity tests (tests/integration/test_executor_writes.py) compare them.

def merged_row(epoch: int, final_until: str | None, finalize_untouched: bool, *, new: bool | str, touched: str,
               end: str) -> dict[str, str]:
    """The counts row after the merge, column by column. ``count`` adds the epoch's; ``first_epoch``/``last_epoch`` are
    the least/greatest epoch counted into the row, so epochs committed out of order leave the same row; ``is_final``
    (also the row's partition) turns true, and never back, once the window's ``end`` is at or before ``final_until``
    (SQL: the watermark less the allowed lateness; None, nothing is final yet), for rows the epoch counted into
    (``touched``, a SQL predicate) and, where ``finalize_untouched`` (a scheduled epoch: a backfill leaves that to the
    chain's watermark), for the others too. ``new``: True for a row the table lacks (its values come from s alone),
    False for one it holds, or a SQL predicate saying which."""
    e = f"CAST({epoch} AS BIGINT)"
    final = "false" if final_until is None else f"({end} <= {final_until})"
    if new is True:
        return {"count": "s.count", "first_epoch": e, "last_epoch": e, "is_final": final}
    new = "false" if new is False else new
    ripe = f"({final} AND ({touched} OR {str(finalize_untouched).lower()}))"
    return {"count": "coalesce(t.count, 0) + coalesce(s.count, 0)",
            "first_epoch": f"CASE WHEN {new} OR ({touched} AND t.first_epoch > {e}) THEN {e} ELSE t.first_epoch END",
            "last_epoch": f"CASE WHEN {new} OR ({touched} AND t.last_epoch < {e}) THEN {e} ELSE t.last_epoch END",
            "is_final": f"CASE WHEN {new} THEN {final} ELSE coalesce(t.is_final, false) OR {ripe} END"}
