"""Exactly once as a checked invariant: a model-based (stateful) test of the ledger protocol.

Hypothesis drives the real epoch code (:func:`ipcount.jobs.epoch.run_epoch`,
:func:`ipcount.jobs.backfill.run_backfill`) on real delta-rs table sets, over random
sequences of operations: records produced in and out of event-time order, malformed and
far-future ones, aborted transactions, retention and ``delete_records`` moving the log start,
partitions added; the chain's epochs and backfill requests (offset and time ranges) with caps
and data-loss policies that change from run to run; and a process death at any step marker
(the run abandoned there, its files and plans left as they are) or a commit whose answer
was lost (it landed; the caller sees it refused). A simulated topic
(tests/model_log.py) stands in for Kafka and Spark's read.

After every step the tables are checked against a plain model of the log:

* no offset is owned by two ledger rows; ``lost`` rows only where the log start passed;
* every offset the chain has passed, and every offset of a backfill request that reported
  done, is owned by a committed, lost or planned row;
* the epochs whose data the tables hold (decided from the counts table's transaction ids)
  include every committed epoch and nothing else but planned ones;
* counts equal the records of those epochs' ranges, minus exactly the late ones (each late
  against its epoch's recorded watermark, and no counted one); dead letters are exactly
  the malformed records of those ranges;
* a count once final never changes, but by a backfill (history counted late; its MERGE says
  so in the commit);
* the idle check agrees with what the chain's planner would plan;
* a run that was not killed leaves no unfinished epoch of its kind behind.

No JVM and no broker: the suite's budget is a few minutes (``IPCOUNT_MODEL_EXAMPLES`` and
``IPCOUNT_MODEL_STEPS`` raise it for a long run; docs/operations.md).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ipcount.jobs import epoch as epoch_mod
from ipcount.jobs.backfill import run_backfill
from ipcount.jobs.epoch import run_epoch
from ipcount.jobs.idle import verdict
from ipcount.rules.config import PipelineConfig
from ipcount.rules.coverage import merge
from ipcount.rules.errors import BadRequestError, CommitContention, DataLossError, EpochFenced
from ipcount.rules.ledger import COMMITTED, LOST, PLANNED, SUMMARY, is_scheduled, state_of, timestamp_ms
from ipcount.rules.ledger_summary import committed_chain
from ipcount.rules.offsets import OffsetRange
from ipcount.rules.records import Event, is_late, parse_value, window_start
from ipcount.storage.delta import open_table, read_rows
from ipcount.storage.ledger import Ledger
from ipcount.storage.sink import FENCED, Sink
from tests.model_log import Record, SimulatedLog
from tests.tables import owned_offsets

T0 = 1_780_000_000_000  # 2026-05-28: before any real planning time, so Kafka timestamps bound event times
POINTS = ("planning", "after_plan", "after_sink", "after_ledger")
EXAMPLES = int(os.environ.get("IPCOUNT_MODEL_EXAMPLES", "45"))
STEPS = int(os.environ.get("IPCOUNT_MODEL_STEPS", "40"))


class ProcessDeath(BaseException):
    """The run dies here: nothing after this point of it happens (not an Exception: no
    handler of the product's may catch it, as none catches SIGKILL)."""


@contextmanager
def answers_lost(kind: str | None, nth: int):
    """The ``nth`` Delta commit of ``kind`` (``write``: an append, ``merge``) lands, and its
    caller sees it refused (an object store that stored the PUT but lost its answer)."""
    if kind is None:
        yield
        return
    import deltalake
    from deltalake.exceptions import CommitFailedError
    from deltalake.table import TableMerger

    owner, name = {"write": (deltalake, "write_deltalake"), "merge": (TableMerger, "execute")}[kind]
    original, calls = getattr(owner, name), Counter()

    def lands_then_lost(*args, **kwargs):
        out = original(*args, **kwargs)
        calls[kind] += 1
        if calls[kind] == nth:
            raise CommitFailedError(f"simulated: {kind} {nth} landed, and its answer was lost")
        return out
    setattr(owner, name, lands_then_lost)
    try:
        yield
    finally:
        setattr(owner, name, original)


def crash_at(point: str | None, nth: int = 1):
    seen = Counter()

    def hook(at: str) -> None:
        seen[at] += 1
        if at == point and seen[at] == nth:
            raise ProcessDeath(at)
    return hook


LOST_ANSWERS = st.sampled_from([None, None, None, None, "write", "merge"])
# How a run may fail when a commit's answer was lost: it says so, and the next run goes on.
RUN_FAILURES = (CommitContention, EpochFenced)
RECORD_KINDS = st.sampled_from(["ok", "ok", "ok", "ok", "disordered", "late", "malformed", "ahead"])


class LedgerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ledger-model-")
        self.cfg = PipelineConfig(warehouse=self.dir, topic="model", window_seconds=5, allowed_lateness_seconds=5,
                                  start_position="earliest", max_records_per_epoch=10)
        self.log = SimulatedLog(self.cfg)
        self.log.add_partitions(2)
        self.clock = T0
        self.done_requests: list[tuple[OffsetRange, ...]] = []  # backfills that reported done
        self.final: dict[tuple[int, str], int] = {}              # (window, ip) -> its final count
        self.checked_in: set[int] = set()                        # committed epochs seen in the sink
        self.backfilled: dict[int, set[int]] = {}                # offsets a backfill epoch ever owned
        self.backfill_ran = False  # a backfill may add to a final count (history; docs/data-model.md)
        self.tables = TablesSeen()
        self.seen: tuple | None = None  # the table versions (and requests done) last checked
        self.rows: list[dict] = []       # the ledger's rows as last read

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- the log ----------------------------------------------------------------------

    @rule(partition=st.integers(0, 7), kinds=st.lists(RECORD_KINDS, min_size=1, max_size=8),
          aborted=st.sampled_from([False, False, False, True]), advance=st.integers(0, 4_000))
    def produce(self, partition, kinds, aborted, advance):
        self.clock += advance
        records = [self._record(kind, i) for i, kind in enumerate(kinds)]
        self.log.append(partition % len(self.log.entries), records, aborted)

    def _record(self, kind: str, i: int) -> Record:
        ip = f"10.0.0.{i % 3}"
        event = {"ok": self.clock, "disordered": self.clock - 3_000, "late": self.clock - 60_000,
                 "ahead": self.clock + 10 * self.cfg.max_event_time_ahead_ms}.get(kind)
        if event is None:
            return Record(b'{"ip": "not an ip", "ts": 1}', self.clock, key=b"bad")
        return Record(json.dumps({"ip": ip, "ts": event}).encode(), self.clock)

    @rule(partition=st.integers(0, 7), by=st.integers(1, 12))
    def delete_records(self, partition, by):
        p = partition % len(self.log.entries)
        self.log.delete_records(p, self.log.start[p] + by)

    @precondition(lambda self: len(self.log.entries) < 4)
    @rule()
    def add_partition(self):
        self.log.add_partitions(1)

    # -- the runs ---------------------------------------------------------------------

    def _cfg(self, cap: int, policy: str) -> PipelineConfig:
        return self.cfg.replace(max_records_per_epoch=cap, on_data_loss=policy)

    @rule(cap=st.sampled_from([2, 5, 10, 1000]), policy=st.sampled_from(["fail", "skip"]),
          crash=st.sampled_from([None, None, *POINTS]), lost=LOST_ANSWERS, nth=st.integers(1, 3))
    def chain_epoch(self, cap, policy, crash, lost, nth):
        try:
            with answers_lost(lost, nth):
                run_epoch(self._cfg(cap, policy), None, crash=crash_at(crash), source=self.log)
        except (ProcessDeath, *RUN_FAILURES):
            return
        except DataLossError:
            assert policy == "fail", "skip records what aged out instead of failing"
            return
        assert not self._ledger_state().pending_chain, "a chain run that was not killed left its epoch unfinished"

    @rule(partition=st.integers(0, 7), a=st.floats(0, 1), b=st.floats(0, 1), cap=st.sampled_from([2, 5, 10, 1000]),
          policy=st.sampled_from(["fail", "skip"]), crash=st.sampled_from([None, None, *POINTS]),
          nth=st.integers(1, 3), lost=LOST_ANSWERS)
    def backfill_offsets(self, partition, a, b, cap, policy, crash, nth, lost):
        p = partition % len(self.log.entries)
        start, end = self.log.start[p], len(self.log.entries[p])
        lo, hi = sorted((start + int(a * (end - start)), start + int(b * (end - start))))
        if hi <= lo:
            return
        self._backfill({"offsets": f"{p}:{lo}-{hi}"}, cap, policy, crash, nth, lost)

    @rule(a=st.integers(-20_000, 0), length=st.integers(1, 20_000), cap=st.sampled_from([2, 5, 10, 1000]),
          policy=st.sampled_from(["fail", "skip"]), crash=st.sampled_from([None, None, *POINTS]),
          nth=st.integers(1, 3), lost=LOST_ANSWERS)
    def backfill_time(self, a, length, cap, policy, crash, nth, lost):
        def iso(ms: int) -> str:
            return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat()
        start = self.clock + a
        self._backfill({"from_time": iso(start), "until_time": iso(start + length)}, cap, policy, crash, nth, lost)

    def _backfill(self, fields: dict, cap: int, policy: str, crash: str | None, nth: int, lost: str | None) -> None:
        from ipcount.jobs.backfill import resolve
        from ipcount.rules.requests import request_from_fields

        cfg = self._cfg(cap, policy)
        self.backfill_ran = True
        request = request_from_fields(fields, cfg.topic)
        try:
            resolved = resolve(cfg, request, self.log)
        except BadRequestError:
            return  # refused before anything was written
        try:
            with answers_lost(lost, nth):
                run_backfill(cfg, None, request, crash=crash_at(crash, nth), resolved=resolved, source=self.log)
        except (ProcessDeath, *RUN_FAILURES):
            return
        except DataLossError:
            assert policy == "fail", "skip records what aged out instead of failing"
            return
        self.done_requests.append(resolved.ranges)
        assert not self._ledger_state().pending_backfills, \
            "a backfill that reported done left unfinished backfill epochs behind"

    # -- the invariants ---------------------------------------------------------------

    def _ledger_state(self):
        return state_of(self.cfg.topic, self._rows())

    def _rows(self) -> list[dict]:
        return [r for r in self.tables.rows(self.cfg.ledger_path) if r["status"] != SUMMARY]

    @invariant()
    def tables_match_the_log(self):
        # The tables' checks again only when a table changed or a request reported done since
        # (the log only grows and its start only moves on: what held of the tables holds).
        paths = (self.cfg.ledger_path, self.cfg.counts_path, self.cfg.late_path, self.cfg.dead_letter_path)
        seen = (tuple(self.tables.version(p) for p in paths), len(self.done_requests))
        if seen == self.seen:
            self._check_idle_agrees(self.rows, *self.log.partition_offsets())
            return
        self.seen = seen
        self.rows = rows = self._rows()
        if not rows:
            return
        earliest, latest = self.log.partition_offsets()
        owned = self._check_ownership(rows, earliest)
        self._check_chain_passed(rows, owned)
        self._check_backfills_keep_theirs(rows, owned)
        for ranges in self.done_requests:
            for r in ranges:
                missing = [o for o in range(r.from_offset, r.until_offset) if o not in owned.get(r.partition, {})]
                assert not missing, f"backfill reported done but offsets {missing[:5]}... of {r} have no ledger row"
        in_tables = self._epochs_in_tables(rows)
        self._check_counts(rows, in_tables)
        self._check_idle_agrees(rows, earliest, latest)

    def _check_ownership(self, rows, earliest) -> dict[int, dict[int, dict]]:
        owned: dict[int, dict[int, dict]] = {}
        for r in rows:
            if r["status"] == LOST:
                assert r["until_offset"] <= earliest[r["partition"]], \
                    f"lost row {r['partition']}:[{r['from_offset']}, {r['until_offset']}) of epoch {r['epoch']} " \
                    f"is not behind the log start {earliest[r['partition']]}"
            mine = owned.setdefault(r["partition"], {})
            for o in range(r["from_offset"], r["until_offset"]):
                assert o not in mine, f"offset {r['partition']}:{o} owned by epochs {mine[o]['epoch']} and {r['epoch']}"
                mine[o] = r
        return owned

    def _check_chain_passed(self, rows, owned) -> None:
        for p in {r["partition"] for r in rows if is_scheduled(r)}:
            chain = [r for r in rows if is_scheduled(r) and r["partition"] == p and r["status"] in (COMMITTED, LOST)]
            if not chain:
                continue
            first = min(r["from_offset"] for r in chain)
            passed = max(r["until_offset"] for r in chain)
            gaps = [o for o in range(first, passed) if o not in owned[p]]
            assert not gaps, f"the chain passed {p}:{gaps[:5]}... but no ledger row owns them"

    def _check_backfills_keep_theirs(self, rows, owned) -> None:
        """An offset a backfill epoch once owned stays owned (committed, lost, or planned
        again): nothing else would plan it again, since its request may never run again."""
        for p, offsets in self.backfilled.items():
            gone = sorted(o for o in offsets if o not in owned.get(p, {}))
            assert not gone, f"offsets {p}:{gone[:5]}... were a backfill epoch's and no ledger row owns them now"
        for r in rows:
            if not is_scheduled(r):
                self.backfilled.setdefault(r["partition"], set()).update(range(r["from_offset"], r["until_offset"]))

    def _epochs_in_tables(self, rows) -> set[int]:
        """The epochs whose data the tables hold, from the counts table's transactions."""
        sink = Sink(self.cfg)
        counts = self.tables.get(self.cfg.counts_path)
        status: dict[int, set[str]] = {}
        reads: set[int] = set()  # epochs with a range to read (one that reads nothing writes nothing)
        for r in rows:
            status.setdefault(r["epoch"], set()).add(r["status"])
            if r["status"] != LOST and r["until_offset"] > r["from_offset"]:
                reads.add(r["epoch"])
        in_tables = set()
        for epoch, statuses in status.items():
            if COMMITTED in statuses and epoch in self.checked_in:
                in_tables.add(epoch)
                continue
            holds = (counts is not None and counts.transaction_version(sink.txn_app_id(epoch)) is not None
                     and counts.transaction_version(f"{sink.txn_app_id(epoch)}/{FENCED}") is None)
            if COMMITTED in statuses and epoch in reads:
                assert holds, f"epoch {epoch} is committed in the ledger but its counts commit is not in the table"
                self.checked_in.add(epoch)
            if holds:
                assert statuses & {COMMITTED, PLANNED}, f"epoch {epoch}'s data is in the tables but its rows are gone"
                in_tables.add(epoch)
        return in_tables

    def _check_counts(self, rows, in_tables: set[int]) -> None:
        cfg = self.cfg
        late = self.tables.rows(cfg.late_path, ["epoch", "partition", "offset", "watermark"])
        dead = self.tables.rows(cfg.dead_letter_path, ["epoch", "partition", "offset", "reason"])
        late_at = {(r["partition"], r["offset"]): r for r in late}
        assert len(late_at) == len(late), "a late record appears twice"
        watermark = {r["epoch"]: r["watermark_before_ms"] for r in rows if r["status"] != LOST}
        planned_at = {r["epoch"]: r["planned_at"] for r in rows if r["status"] != LOST}
        expected, malformed = Counter(), Counter()
        for r in rows:
            if r["epoch"] not in in_tables or r["status"] == LOST:
                continue
            for offset in range(r["from_offset"], r["until_offset"]):
                rec = self.log.record(r["partition"], offset)
                if rec is None:
                    continue
                parsed = parse_value(rec.value, cfg.max_value_bytes, kafka_timestamp_ms=rec.timestamp_ms,
                                     planned_at_ms=timestamp_ms(planned_at[r["epoch"]]),
                                     max_ahead_ms=cfg.max_event_time_ahead_ms)
                if not isinstance(parsed, Event):
                    malformed[(r["epoch"], r["partition"], offset, parsed.reason)] += 1
                    continue
                was_late = is_late(parsed.event_ms, cfg.window_ms, cfg.allowed_lateness_ms, watermark[r["epoch"]])
                row = late_at.pop((r["partition"], offset), None)
                assert was_late == (row is not None), \
                    f"record {r['partition']}:{offset} of epoch {r['epoch']}: late {was_late}, in the late table " \
                    f"{row is not None}"
                if row is None:
                    expected[(window_start(parsed.event_ms, cfg.window_ms), parsed.ip)] += 1
                else:
                    assert row["epoch"] == r["epoch"]
                    assert _ms(row["watermark"]) == watermark[r["epoch"]]
        assert not late_at, f"late rows of records no epoch in the tables read: {sorted(late_at)[:5]}"
        assert Counter({(r["epoch"], r["partition"], r["offset"], r["reason"]): 1 for r in dead}) == malformed \
            and len(dead) == sum(malformed.values()), "dead letters differ from the malformed records read"
        found, final = Counter(), {}
        for r in self.tables.rows(cfg.counts_path, ["window_start", "ip", "count", "is_final"]):
            key = (_ms(r["window_start"]), r["ip"])
            assert key not in found, f"two count rows of window {key}"
            found[key] = r["count"]
            if r["is_final"]:
                final[key] = r["count"]
        assert found == expected, f"counts differ from the records of the epochs in the tables: " \
                                  f"{dict(found - expected)} over, {dict(expected - found)} under"
        for key, n in self.final.items():
            assert found.get(key) == n or self.backfill_ran, f"final count {key} changed from {n} to {found.get(key)}"
        self.final.update(final)
        self.backfill_ran = False

    def _check_idle_agrees(self, rows, earliest, latest) -> None:
        # From every row, as from a summary and its tail (tests/unit/test_ledger_summary.py),
        # the state idle.check reads.
        state = state_of(self.cfg.topic, rows)
        unfinished = [p.epoch for p in state.pending_chain]
        said = verdict(state.committed, unfinished, earliest, latest, state.coverage)
        if unfinished:
            assert said.run
            return
        for policy in ("fail", "skip"):
            try:
                plan = epoch_mod._plan_next(self.cfg.replace(on_data_loss=policy), state, earliest, latest, self.log)
            except DataLossError:
                assert policy == "fail" and said.run, f"the idle check says {said.why!r}, but a run fails"
                continue
            if said.run:
                assert plan is not None, f"the idle check says {said.why!r}, but the planner plans nothing"
            else:
                assert plan is None, f"the idle check says {said.why!r}, but the planner would plan {plan.describe()}"


class TablesSeen:
    """The checker's own view of the tables: each loaded once and then brought up to date
    (a load replays the log; the product's runs load their own)."""

    def __init__(self) -> None:
        self.loaded: dict[str, object] = {}

    def get(self, path: str):
        table = self.loaded.get(path)
        if table is None:
            table = open_table(path)
            if table is not None:
                self.loaded[path] = table
            return table
        table.update_incremental()
        return table

    def version(self, path: str) -> int | None:
        table = self.get(path)
        return None if table is None else table.version()

    def rows(self, path: str, columns: list[str] | None = None) -> list[dict]:
        table = self.get(path)
        return [] if table is None else table.to_pyarrow_table(columns=columns).to_pylist()


def _table(path: str, columns: list[str] | None) -> list[dict]:
    table = open_table(path)
    return [] if table is None else table.to_pyarrow_table(columns=columns).to_pylist()


def _ms(value: datetime) -> int:
    return round(value.timestamp() * 1000)


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("ipcount").setLevel(logging.ERROR)
    yield
    logging.getLogger("ipcount").setLevel(logging.NOTSET)


LedgerModel.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                         suppress_health_check=list(HealthCheck))
# A long run (docs/operations.md) outlasts the suite's per-test timeout: its own scales with it.
test_ledger_model = pytest.mark.timeout(max(900, EXAMPLES * STEPS))(LedgerModel.TestCase)


# -- regressions: sequences the model (or a review) found, kept as named examples ------------

def _aged_out_backfill_chunk(tmp_path) -> tuple[PipelineConfig, SimulatedLog]:
    """A backfill of 0:0-20 killed after planning its one chunk; then retention deletes
    offsets 0-4 of partition 0."""
    cfg = PipelineConfig(warehouse=str(tmp_path), topic="model", start_position="earliest", on_data_loss="skip",
                         max_records_per_epoch=100)
    log = SimulatedLog(cfg)
    log.add_partitions(2)
    log.append(0, [Record(json.dumps({"ip": "10.0.0.1", "ts": T0 + i}).encode(), T0 + i) for i in range(20)])
    log.append(1, [Record(json.dumps({"ip": "10.0.0.2", "ts": T0}).encode(), T0)])
    from ipcount.rules.requests import request_from_fields
    with pytest.raises(ProcessDeath):
        run_backfill(cfg, None, request_from_fields({"offsets": "0:0-20"}, cfg.topic), crash=crash_at("after_plan"),
                     source=log)
    log.delete_records(0, 5)
    return cfg, log


def test_settling_an_aged_out_chunk_with_a_smaller_cap_keeps_all_its_rest_owned(tmp_path):
    """Review finding 1(a): a settling run whose cap is smaller than the chunk planned part of
    the rest; the offsets past it were owned by no row and never counted."""
    from ipcount.rules.requests import request_from_fields
    cfg, log = _aged_out_backfill_chunk(tmp_path)
    run_backfill(cfg.replace(max_records_per_epoch=4), None, request_from_fields({"offsets": "1:0-1"}, cfg.topic),
                 source=log)
    assert merge(owned_offsets(cfg)[0]) == ((0, 20),)
    assert not Ledger(cfg.ledger_path).state(cfg.topic).unfinished


def test_a_death_right_after_the_settle_leaves_the_rest_owned(tmp_path, monkeypatch):
    """Review finding 1(b): the release and the plan of the rest were two commits; a run that
    died between them left the rest owned by no row."""
    from ipcount.rules.requests import request_from_fields
    cfg, log = _aged_out_backfill_chunk(tmp_path)
    released, record_plan = [], Ledger.record_plan

    def release(self, *args, **kwargs):
        released.append(True)
        return Ledger.release.__wrapped__(self, *args, **kwargs)

    def dies_after_a_release(self, *args, **kwargs):
        if released:
            raise ProcessDeath("the first plan after the release")
        return record_plan(self, *args, **kwargs)
    release.__wrapped__ = Ledger.release
    monkeypatch.setattr(Ledger, "release", release)
    monkeypatch.setattr(Ledger, "record_plan", dies_after_a_release)
    with pytest.raises(ProcessDeath):
        run_backfill(cfg, None, request_from_fields({"offsets": "1:0-1"}, cfg.topic), source=log)
    assert merge(owned_offsets(cfg)[0]) == ((0, 20),)


def test_after_a_settle_under_skip_an_idle_topic_is_idle(tmp_path):
    """Review finding 2: after the chain gave up an epoch whose offsets aged out, the idle
    check (and the lag, the watcher, the freshness alert: all from committed_chain) judged
    from committed rows only, and saw the deleted offsets as waiting for good."""
    cfg = PipelineConfig(warehouse=str(tmp_path), topic="model", start_position="earliest", on_data_loss="skip")
    log = SimulatedLog(cfg)
    log.add_partitions(1)
    log.append(0, [Record(json.dumps({"ip": "10.0.0.1", "ts": T0 + i}).encode(), T0 + i) for i in range(5)])
    run_epoch(cfg, None, source=log)
    log.append(0, [Record(json.dumps({"ip": "10.0.0.1", "ts": T0 + i}).encode(), T0 + i) for i in range(5)])
    with pytest.raises(ProcessDeath):
        run_epoch(cfg, None, crash=crash_at("after_plan"), source=log)
    log.delete_records(0, 12)
    assert run_epoch(cfg, None, source=log) is None  # settled: all of epoch 2's offsets lost, nothing to count
    view = Ledger(cfg.ledger_path).view()
    _, positions, unfinished = committed_chain(view.summary, cfg.topic, view.tail)
    said = verdict(positions, unfinished, *log.partition_offsets())
    assert not said.run, said.why
    assert positions == {0: 12}


def test_a_backfill_finishes_the_chains_unfinished_epoch_before_its_own_chunk(tmp_path):
    """Review finding 3: a backfill waited at most 30 s for the chain's unfinished epoch, then
    committed its chunk first; a chain epoch slower than that lost its counts commit to every
    chunk. Now the chunk's run finishes the chain's epoch first, and the chain's own runner,
    still on it, loses nothing and counts nothing twice."""
    import threading
    from ipcount.rules.requests import request_from_fields

    cfg = PipelineConfig(warehouse=str(tmp_path), topic="model", start_position="earliest")
    log = SimulatedLog(cfg)
    log.add_partitions(1)

    def produce(n: int) -> None:
        log.append(0, [Record(json.dumps({"ip": "10.0.0.1", "ts": T0 + i}).encode(), T0 + i) for i in range(n)])
    produce(10)
    run_epoch(cfg, None, source=log)
    produce(10)
    go_on, reading = threading.Event(), threading.Event()

    class SlowRead:  # the chain runner's view of the log: its read takes as long as the test says
        def __getattr__(self, name):
            return getattr(log, name)

        def tally(self, plan):
            reading.set()
            go_on.wait(120)
            return log.tally(plan)
    chain = threading.Thread(target=run_epoch, args=(cfg, None), kwargs={"source": SlowRead()})
    chain.start()
    try:
        assert reading.wait(30), "the chain's epoch was not planned"
        produce(5)
        run_backfill(cfg, None, request_from_fields({"offsets": "0:22-28"}, cfg.topic), source=log)
    finally:
        go_on.set()
        chain.join(120)
    epochs = {r["epoch"]: r for r in read_rows(cfg.ledger_path) if r["status"] == COMMITTED}
    assert sorted(epochs) == [1, 2, 3]
    assert epochs[2]["sink_version"] < epochs[3]["sink_version"], "the backfill's chunk committed before the chain"
    counts = _table(cfg.counts_path, ["count"])
    assert sum(r["count"] for r in counts) == 25
