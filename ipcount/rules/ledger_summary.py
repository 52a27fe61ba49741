"""The ledger's summary: what every final epoch up to one id left behind, in one row (pure; docs/data-model.md).

An epoch is *final* once no row of it is planned: its rows never change again. The summary folds every final epoch up
to ``through`` (:class:`ipcount.rules.ledger.Folded`, per topic); a reader adds the *tail*: the rows of epochs above
``through`` and of the ``open`` ones at or below it, which holds every planned row. Summary and tail give exactly
what every row gives (the unit tests check it over random histories).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ipcount.rules.coverage import merge, subtract
from ipcount.rules.finality import ChainCommit, chain_commits
from ipcount.rules.ledger import (COMMITTED, LOST, PLANNED, Folded, LedgerState, Row, chain_passed, chain_positions,
                                  furthest, lane_watermarks, newest_chain_epoch, rows_by_epoch, state_of,
                                  unfinished_chain_epochs)

FORMAT = 1
# A plan folds the summary anew once its tail holds this many final epochs: the tail a reader reads stays a few
# epochs long (the open ones aside), and the summary changes once in so many.
FOLD_AFTER_EPOCHS = 16


@dataclass(frozen=True)
class LedgerSummary:
    through: int = 0              # every final epoch with an id up to this is folded
    last_epoch: int = 0           # the highest epoch id of any topic and status, folded or not
    open: tuple[int, ...] = ()    # epochs up to ``through`` that were planned when folded
    topics: Mapping[str, Folded] = field(default_factory=dict)

    def folded(self, topic: str) -> Folded:
        return self.topics.get(topic, Folded())

    def in_tail(self, epoch: int) -> bool:
        """Whether a reader must read ``epoch``'s rows: the summary does not hold them."""
        return epoch > self.through or epoch in self.open

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "through": self.through, "last_epoch": self.last_epoch,
                           "open": list(self.open),
                           "topics": {t: _folded_json(f) for t, f in sorted(self.topics.items())}},
                          separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> LedgerSummary | None:
        """The summary :meth:`to_json` wrote; None for none, for one of another format or a damaged one (a reader
        then reads every row, and the next plan folds a new one)."""
        if not text:
            return None
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                return None
            return cls(through=data["through"], last_epoch=data["last_epoch"], open=tuple(data["open"]),
                       topics={t: _folded_of(f) for t, f in data["topics"].items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def _folded_json(f: Folded) -> dict:
    return {"owned": {str(p): [list(i) for i in spans] for p, spans in sorted(f.owned.items())},
            "chain_until": {str(p): o for p, o in sorted(f.chain_until.items())},
            "committed_until": {str(p): o for p, o in sorted(f.committed_until.items())},
            "chain_last": list(f.chain_last) if f.chain_last is not None else None,
            "chain_commits": [list(c) for c in f.chain_commits], "lanes": dict(f.lanes)}


def _folded_of(data: Mapping) -> Folded:
    def positions(m: Mapping[str, int]) -> dict[int, int]:
        return {int(p): o for p, o in m.items()}
    return Folded(owned={int(p): tuple((a, b) for a, b in spans) for p, spans in data["owned"].items()},
                  chain_until=positions(data["chain_until"]), committed_until=positions(data["committed_until"]),
                  chain_last=tuple(data["chain_last"]) if data["chain_last"] is not None else None,
                  chain_commits=tuple((v, w) for v, w in data["chain_commits"]), lanes=dict(data["lanes"]))


def fold(summary: LedgerSummary | None, tail: Iterable[Row]) -> LedgerSummary:
    """``summary`` with the final epochs of its ``tail`` folded in: ``tail`` must be every row the summary does not
    hold (:meth:`LedgerSummary.in_tail`; every row when ``summary`` is None), and may add rows about to be recorded.
    Its planned epochs stay open."""
    summary = summary or LedgerSummary()
    by_epoch = rows_by_epoch(tail)
    still_open = {e for e, rows in by_epoch.items() if any(r["status"] == PLANNED for r in rows)}
    final: dict[str, list[Row]] = {}
    for epoch, rows in by_epoch.items():
        if epoch not in still_open:
            for r in rows:
                final.setdefault(r["topic"], []).append(r)
    topics = dict(summary.topics)
    for topic, rows in final.items():
        topics[topic] = _fold_topic(summary.folded(topic), rows)
    return LedgerSummary(through=max([summary.through, *by_epoch]), last_epoch=max([summary.last_epoch, *by_epoch]),
                         open=tuple(sorted(still_open)), topics=topics)


def fold_due(summary: LedgerSummary | None, epoch: int, tail: Iterable[Row]) -> bool:
    """Whether the plan of ``epoch`` must record a new summary with its rows: none yet; an id the summary counts as
    folded (a rebuild records the source's ids in its own order), which only a new summary can list as open; or a
    tail of :data:`FOLD_AFTER_EPOCHS` final epochs."""
    if summary is None or not summary.in_tail(epoch):
        return True
    return sum(all(r["status"] != PLANNED for r in rows) for rows in rows_by_epoch(tail).values()) >= FOLD_AFTER_EPOCHS


def _fold_topic(before: Folded, rows: list[Row]) -> Folded:
    """``before`` with one topic's rows of final epochs folded in."""
    commits = _newest_two([ChainCommit(v, w) for v, w in before.chain_commits], chain_commits(rows))
    return Folded(owned=_owned(before, rows),
                  chain_until=furthest(before.chain_until, chain_positions(rows, statuses=(COMMITTED, LOST))),
                  committed_until=furthest(before.committed_until, chain_positions(rows)),
                  chain_last=newest_chain_epoch(rows, before),
                  chain_commits=tuple((c.version, c.watermark_ms) for c in commits),
                  lanes=lane_watermarks(rows, before))


def _owned(folded: Folded, rows: Iterable[Row]) -> dict[int, tuple[tuple[int, int], ...]]:
    """Per partition, the merged offsets that ``folded`` and ``rows`` own."""
    owned: dict[int, list[tuple[int, int]]] = {p: list(spans) for p, spans in folded.owned.items()}
    for r in rows:
        owned.setdefault(r["partition"], []).append((r["from_offset"], r["until_offset"]))
    return {p: merge(spans) for p, spans in owned.items()}


def _newest_two(*commits: list[ChainCommit]) -> list[ChainCommit]:
    """The two newest counts commits (by table version) of the chain among ``commits``: all that
    :func:`ipcount.rules.finality.finalized_below` looks at."""
    by_version = {c.version: c for group in commits for c in group}
    return [by_version[v] for v in sorted(by_version, reverse=True)[:2]]


def of_topic(summary: LedgerSummary | None, topic: str, tail: Iterable[Row]) -> tuple[list[Row], Folded]:
    """``topic``'s rows of the tail, and what the summary (if any) folded of it."""
    return [r for r in tail if r["topic"] == topic], summary.folded(topic) if summary is not None else Folded()


def state(summary: LedgerSummary | None, topic: str, tail: Iterable[Row]) -> LedgerState:
    """:func:`ipcount.rules.ledger.state_of` from a summary and its tail."""
    if summary is None:
        return state_of(topic, tail)
    return state_of(topic, tail, summary.folded(topic), summary.last_epoch)


def chain_commits_of(summary: LedgerSummary | None, topic: str, tail: Iterable[Row]) -> list[ChainCommit]:
    """The scheduled chain's two newest counts commits, newest first, from a summary and its tail."""
    mine, folded = of_topic(summary, topic, tail)
    return _newest_two([ChainCommit(v, w) for v, w in folded.chain_commits], chain_commits(mine))


def chain_lag(summary: LedgerSummary | None, topic: str, tail: Iterable[Row], log_start: Mapping[int, int],
              log_end: Mapping[int, int]) -> dict[int, int]:
    """Per partition of ``log_end``, the offsets from the chain's position (or the log start, while it has none) to
    the log end that no committed or lost row owns: what is not counted yet. A backfill's committed chunk ahead of
    the chain is counted (the chain's next plan passes it), an unfinished epoch's offsets are not."""
    mine, folded = of_topic(summary, topic, tail)
    position = chain_passed(mine, folded)
    done = _owned(folded, (r for r in mine if r["status"] in (COMMITTED, LOST)))
    out = {}
    for p, end in log_end.items():
        start = position.get(p, log_start.get(p, 0))
        out[p] = sum(b - a for a, b in subtract((start, end), done.get(p, ()))) if end > start else 0
    return out


def committed_chain(summary: LedgerSummary | None, topic: str,
                    tail: Iterable[Row]) -> tuple[int, dict[int, int], list[int]]:
    """The scheduled chain's newest committed epoch (0 if none), its next offset per partition, and its unfinished
    (planned) epochs: what the group commit, the idle check and the lag follow. The positions are the planner's
    (:func:`ipcount.rules.ledger.chain_passed`): offsets the chain gave up as deleted are not waiting, and it never
    plans them again."""
    mine, folded = of_topic(summary, topic, tail)
    newest = newest_chain_epoch(mine, folded)
    return (newest[0] if newest is not None else 0, chain_passed(mine, folded), unfinished_chain_epochs(mine))
