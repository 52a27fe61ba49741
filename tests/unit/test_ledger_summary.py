"""The ledger's summary and its tail give what every row gives (random ledger histories)."""
from __future__ import annotations

import random

from ipcount.rules.finality import chain_commits
from ipcount.rules.ledger import (BACKFILL, COMMITTED, LOST, PLANNED, SCHEDULED, chain_positions, state_of,
                                  unfinished_chain_epochs)
from ipcount.rules.ledger_summary import (FOLD_AFTER_EPOCHS, LedgerSummary, chain_commits_of, chain_lag,
                                          committed_chain, fold, fold_due, state)

TOPICS = ("a", "b")


class History:
    """A ledger's rows through the writers' operations: a plan appends planned (and lost)
    rows under a new epoch id, a commit turns an epoch's planned rows committed, a release
    turns them lost or drops them. Alongside, a summary folded as the ledger's plans fold it."""

    def __init__(self, rnd: random.Random) -> None:
        self.rnd = rnd
        self.rows: list[dict] = []
        self.summary: LedgerSummary | None = None
        self.sink_version = 0
        self.folds = 0

    def tail(self) -> list[dict]:
        return [r for r in self.rows if self.summary is None or self.summary.in_tail(r["epoch"])]

    def open_epochs(self) -> list[int]:
        return sorted({r["epoch"] for r in self.rows if r["status"] == PLANNED})

    def plan(self) -> None:
        rnd = self.rnd
        used = {r["epoch"] for r in self.rows}
        top = max(used, default=0)
        free_below = [e for e in range(1, top) if e not in used]
        # A rebuild's target records the source's ids in its own order: an id below others.
        epoch = rnd.choice(free_below) if free_below and rnd.random() < 0.15 else top + rnd.randint(1, 2)
        topic = rnd.choice(TOPICS)
        kind = SCHEDULED if rnd.random() < 0.7 else BACKFILL
        request = None if kind == SCHEDULED else rnd.choice(("r1", "r2", "r3"))
        mine = [r for r in self.rows if r["topic"] == topic]
        rows = []
        for partition in rnd.sample(range(3), rnd.randint(1, 3)):
            if kind == SCHEDULED:
                start = chain_positions(mine, statuses=(COMMITTED, LOST, PLANNED)).get(partition, 0)
            else:  # behind the chain, ahead of it, or on another backfill
                start = rnd.randint(0, 400)
            if rnd.random() < 0.15:  # a head that aged out before it was counted
                head = rnd.randint(1, 5)
                rows.append(self._row(epoch, topic, partition, start, start + head, LOST, kind, request))
                start += head
            rows.append(self._row(epoch, topic, partition, start, start + rnd.choice((0, 1, 5, 20)), PLANNED,
                                  kind, request))
        if fold_due(self.summary, epoch, self.tail()):
            self.summary = fold(self.summary, self.tail() + rows)
            self.folds += 1
        self.rows += rows

    def _row(self, epoch, topic, partition, start, until, status, kind, request):
        rnd = self.rnd
        return {"epoch": epoch, "topic": topic, "partition": partition, "from_offset": start, "until_offset": until,
                "status": status, "kind": rnd.choice((kind, None)) if kind == SCHEDULED else kind,
                "request_id": request, "watermark_before_ms": rnd.choice((None, 1_000)),
                "watermark_after_ms": None, "chain_watermark_ms": None, "planned_at": None, "sink_version": None}

    def commit(self, epoch: int) -> None:
        rnd = self.rnd
        watermark = rnd.choice((None, rnd.randint(0, 10_000)))
        version = None
        if rnd.random() < 0.8:
            self.sink_version += 1
            version = self.sink_version
        for r in self.rows:
            if r["epoch"] == epoch and r["status"] == PLANNED:
                r.update(status=COMMITTED, watermark_after_ms=watermark, sink_version=version)

    def release(self, epoch: int) -> None:
        """An epoch whose offsets aged out before it ran: a lost head on one partition at
        least (so the id stays taken), its other planned rows gone."""
        kept, lost = [], False
        for r in self.rows:
            if r["epoch"] == epoch and r["status"] == PLANNED:
                if r["until_offset"] > r["from_offset"] and (not lost or self.rnd.random() < 0.5):
                    kept.append({**r, "status": LOST, "until_offset": r["from_offset"] + 1})
                    lost = True
                continue
            kept.append(r)
        self.rows = kept

    def step(self) -> None:
        open_epochs = self.open_epochs()
        roll = self.rnd.random()
        if not open_epochs or roll < 0.45:
            self.plan()
        elif roll < 0.9:
            self.commit(self.rnd.choice(open_epochs))
        else:
            aged = sorted({r["epoch"] for r in self.rows
                           if r["status"] == PLANNED and r["until_offset"] > r["from_offset"]})
            if aged:
                self.release(self.rnd.choice(aged))


def check(history: History) -> None:
    summary, tail = history.summary, history.tail()
    assert LedgerSummary.from_json(summary.to_json() if summary else None) == summary
    for topic in TOPICS:
        mine = [r for r in history.rows if r["topic"] == topic]
        assert state(summary, topic, tail) == state_of(topic, history.rows)
        assert chain_commits_of(summary, topic, tail) == chain_commits(mine)[:2]
        newest = max((r["epoch"] for r in mine if r["status"] == COMMITTED and (r["kind"] or SCHEDULED) == SCHEDULED),
                     default=0)
        assert committed_chain(summary, topic, tail) == (newest, chain_positions(mine, (COMMITTED, LOST)),
                                                    unfinished_chain_epochs(mine))
        starts, ends = {0: 3, 1: 0, 2: 50}, {0: 300, 1: 450, 2: 60, 3: 7}
        assert chain_lag(summary, topic, tail, starts, ends) == chain_lag(None, topic, history.rows, starts, ends)


def test_a_summary_and_its_tail_give_what_every_row_gives():
    folds = tail_rows = 0
    for seed in range(120):
        history = History(random.Random(seed))
        for _ in range(80):
            history.step()
            check(history)
        folds += history.folds
        tail_rows = max(tail_rows, len(history.tail()))
    # the histories fold often, and the tail stays short however long the history
    assert folds > 120 * 3
    assert tail_rows < 80


def test_the_tail_stays_bounded_and_holds_every_planned_row():
    history = History(random.Random(7))
    for _ in range(2_000):
        history.step()
        tail = history.tail()
        assert {r["epoch"] for r in history.rows if r["status"] == PLANNED} <= {r["epoch"] for r in tail}
    final_in_tail = {r["epoch"] for r in history.tail()} - set(history.open_epochs())
    assert len(final_in_tail) <= FOLD_AFTER_EPOCHS + 1
    assert len(history.rows) > 20 * len(history.tail())


def test_an_id_below_the_summary_is_folded_as_open_or_its_plan_would_vanish():
    rows = [{"epoch": e, "topic": "a", "partition": 0, "from_offset": 10 * e, "until_offset": 10 * e + 10,
             "status": COMMITTED, "kind": SCHEDULED, "request_id": None, "watermark_before_ms": None,
             "watermark_after_ms": 100 * e, "chain_watermark_ms": None, "planned_at": None, "sink_version": e}
            for e in (1, 2, 4)]
    summary = fold(None, rows)
    late = {**rows[0], "epoch": 3, "from_offset": 40, "until_offset": 50, "status": PLANNED,
            "watermark_after_ms": None, "sink_version": None}
    assert summary.through == 4 and not summary.in_tail(3)
    assert fold_due(summary, 3, [])  # the plan of epoch 3 must fold a new summary
    refolded = fold(summary, [late])
    assert refolded.open == (3,) and refolded.in_tail(3)
    assert state(refolded, "a", [late]).pending.epoch == 3
    assert state(summary, "a", []).pending is None  # what a reader of the old summary would miss


def test_a_summary_of_another_format_or_damaged_reads_as_none():
    """None: readers then read every row (exact), and the next plan folds a new summary."""
    assert LedgerSummary.from_json('{"format": 99, "through": 5}') is None
    assert LedgerSummary.from_json(None) is None
    good = fold(None, [{"epoch": 1, "topic": "t", "partition": 0, "from_offset": 0, "until_offset": 5,
                        "status": "committed", "kind": None, "request_id": None, "watermark_after_ms": 9,
                        "sink_version": 3}]).to_json()
    assert LedgerSummary.from_json(good) is not None
    for damaged in (good[: len(good) // 2], "[1, 2]", good.replace('"through"', '"thru"'), '"text"'):
        assert LedgerSummary.from_json(damaged) is None, damaged


def _row(epoch, partition, start, until, status, kind=SCHEDULED):
    return {"epoch": epoch, "topic": "a", "partition": partition, "from_offset": start, "until_offset": until,
            "status": status, "kind": kind, "request_id": None if kind == SCHEDULED else "r1",
            "watermark_before_ms": None, "watermark_after_ms": None, "chain_watermark_ms": None,
            "planned_at": None, "sink_version": None}


def test_the_lag_leaves_out_what_a_backfill_counted_ahead_of_the_chain():
    """The lag was the log end less the chain's position: offsets a backfill had counted
    ahead of the chain, which the chain's next plan passes, stayed "waiting" for good on an
    idle topic (in the monitor, the metrics and the freshness alert)."""
    rows = [_row(1, 0, 0, 10, COMMITTED), _row(2, 0, 10, 30, COMMITTED, BACKFILL), _row(3, 0, 40, 45, PLANNED, BACKFILL),
            _row(4, 1, 0, 5, LOST), _row(5, 1, 5, 8, PLANNED)]
    # (no chain in partition 2 yet: from its log start)
    assert chain_lag(None, "a", rows, {0: 0, 1: 5, 2: 1}, {0: 50, 1: 8, 2: 4}) == {0: 20, 1: 3, 2: 3}
    assert chain_lag(None, "a", rows, {0: 0, 1: 5}, {0: 30, 1: 5}) == {0: 0, 1: 0}
