"""Exactly once as a checked invariant: a model-based (stateful) test of the ledger protocol.

Hypothesis drives the real epoch code (:func:`ipcount.jobs.epoch.run_epoch`,
:func:`ipcount.jobs.backfill.run_backfill`, :func:`ipcount.jobs.rebuild.rebuild`,
:func:`ipcount.storage.maintenance.maintain`, :func:`ipcount.jobs.publish.publish_pending`)
on real delta-rs table sets, over random sequences of operations: records produced in and
out of event-time order, malformed and far-future ones, aborted transactions, retention and
``delete_records`` moving the log start, partitions added; the chain's epochs and backfill
requests (offset and time ranges) with caps and data-loss policies that change from run to
run; two runs racing (one paused at a step marker while the other runs); rebuilds,
maintenance and publishing; and a process death at any step marker (the run abandoned
there, its files and plans left as they are) or a commit whose answer was lost (it landed;
the caller sees it refused). A simulated topic (tests/model_log.py) stands in for Kafka and
Spark's read, and a simulated sink topic for the publisher's transactions.

After every step the tables are checked against a plain model of the log:

* no offset is owned by two ledger rows; ``lost`` rows only where the log start passed;
* every offset the chain has passed, and every offset of a backfill request that reported
  done, is owned by a committed, lost or planned row;
* the epochs whose data the tables hold (decided from the counts table's transaction ids)
  include every committed epoch and nothing else but planned ones;
* counts equal the records of those epochs' ranges, minus exactly the late ones (each late
  against its epoch's recorded watermark, and no counted one); dead letters are exactly
  the malformed records of those ranges; so in the replay target a rebuild writes, too;
* a count once final never changes, but by a backfill (history counted late; its MERGE says
  so in the commit);
* every counts version is published once and in order, and the sink topic folds to the
  table as of the last version published;
* the idle check agrees with what the chain's planner would plan;
* a run that was not killed leaves no unfinished epoch of its kind behind.

No JVM and no broker: the suite's budget is a few minutes (``IPCOUNT_MODEL_EXAMPLES`` and
``IPCOUNT_MODEL_STEPS`` raise it for a long run; docs/exactly-once.md).
"""
from __future__ import annotations

import contextvars
import functools
import json
import logging
import os
import random
import shutil
import tempfile
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ipcount.jobs import epoch as epoch_mod
from ipcount.jobs.backfill import run_backfill
from ipcount.jobs.epoch import run_epoch
from ipcount.jobs.idle import verdict
from ipcount.jobs.publish import publish_pending
from ipcount.jobs.rebuild import rebuild
from ipcount.rules.config import PipelineConfig
from ipcount.rules.coverage import merge
from ipcount.rules.errors import BadRequestError, CommitContention, DataLossError, EpochFenced
from ipcount.rules.ledger import COMMITTED, LOST, PLANNED, SUMMARY, is_scheduled, state_of, timestamp_ms
from ipcount.rules.ledger_summary import chain_lag, committed_chain
from ipcount.rules.offsets import OffsetRange
from ipcount.rules.records import Event, is_late, parse_value, window_start
from ipcount.storage.delta import open_table, read_rows
from ipcount.storage.ledger import Ledger
from ipcount.storage.maintenance import maintain
from ipcount.storage.sink import FENCED, Sink
from tests.model_log import Record, SimulatedLog, SimulatedSinkTopic
from tests.tables import owned_offsets

T0 = 1_780_000_000_000  # 2026-05-28: before any real planning time, so Kafka timestamps bound event times
POINTS = ("planning", "after_plan", "after_sink", "after_ledger")
COMMITS = ("write", "merge")  # (Delta commits a race may land between)
DONE, DIED, FAILED, REFUSED = "done", "died", "failed", "refused"  # how a run ends
EXAMPLES = int(os.environ.get("IPCOUNT_MODEL_EXAMPLES", "30"))
STEPS = int(os.environ.get("IPCOUNT_MODEL_STEPS", "40"))
REPLAY = "replay"  # the rebuilds' target
REPORT = os.environ.get("IPCOUNT_MODEL_REPORT")  # (bin/lab model)


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


@contextmanager
def before_commits(hook):
    """``hook("write")`` before each append and ``hook("merge")`` before each MERGE of a
    Delta table is made (the table object, loaded before, does not see what the hook did)."""
    import deltalake
    from deltalake.table import TableMerger

    patched = [(deltalake, "write_deltalake", "write"), (TableMerger, "execute", "merge")]
    originals = [getattr(owner, name) for owner, name, _ in patched]
    for (owner, name, kind), original in zip(patched, originals):
        def call(*args, _original=original, _kind=kind, **kwargs):
            hook(_kind)
            return _original(*args, **kwargs)
        setattr(owner, name, call)
    try:
        yield
    finally:
        for (owner, name, _), original in zip(patched, originals):
            setattr(owner, name, original)


def crash_at(point: str | None, nth: int = 1):
    seen = Counter()

    def hook(at: str) -> None:
        seen[at] += 1
        if at == point and seen[at] == nth:
            raise ProcessDeath(at)
    return hook


@dataclass(frozen=True)
class Run:
    kind: str                   # "chain" (run_epoch) or "backfill" (run_backfill)
    cap: int                    # max_records_per_epoch of this run
    policy: str                 # on_data_loss of this run
    fields: dict | None = None  # a backfill's request (None: nothing to ask for)
    seed: int = 0               # (a racing backfill's request is drawn from it)


CAPS = st.sampled_from([2, 5, 10, 1000])
POLICIES = st.sampled_from(["fail", "skip"])
DEATHS = st.sampled_from([None, None, *POINTS])
RUNS = st.builds(Run, kind=st.sampled_from(["chain", "backfill"]), cap=CAPS, policy=POLICIES,
                 seed=st.integers(0, 2**32))
LOST_ANSWERS = st.sampled_from([None, None, None, None, "write", "merge"])
# How a run may fail when a commit's answer was lost: it says so, and the next run goes on.
RUN_FAILURES = (CommitContention, EpochFenced)
RECORD_KINDS = st.sampled_from(["ok", "ok", "ok", "ok", "disordered", "late", "malformed", "ahead"])


def counted(step):
    """A rule whose runs a sequence counts (for ``bin/lab model``'s figures)."""
    @functools.wraps(step)
    def run(self, *args, **kwargs):
        if not self.in_step:
            self.steps += 1
        self.operations[step.__name__] += 1
        self.in_step += 1
        try:
            return step(self, *args, **kwargs)
        finally:
            self.in_step -= 1
    return run


class LedgerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ledger-model-")
        self.cfg = PipelineConfig(warehouse=self.dir, topic="model", window_seconds=5, allowed_lateness_seconds=5,
                                  start_position="earliest", max_records_per_epoch=10, publish=True)
        self.log = SimulatedLog(self.cfg)
        self.log.add_partitions(2)
        self.sink_topic = SimulatedSinkTopic()
        self.published_rows: dict[int, list[dict]] = {}  # counts version -> its rows, as a publish began
        self.clock = T0
        self.done_requests: list[tuple[OffsetRange, ...]] = []  # backfills that reported done
        self.final: dict[tuple[int, str], int] = {}              # (window, ip) -> its final count
        self.checked_in: dict[str, set[int]] = {}                # per counts table: committed epochs seen in it
        self.backfilled: dict[int, set[int]] = {}                # offsets a backfill epoch ever owned
        self.backfill_ran = False  # a backfill may add to a final count (history; docs/data-model.md)
        self.operations: Counter = Counter()  # rules run, by name (a publish after an epoch too)
        self.steps = self.in_step = 0
        self.tables = TablesSeen()
        self.seen: tuple | None = None  # the table versions (and requests done) last checked
        self.rows: list[dict] = []       # the ledger's rows as last read

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        if REPORT:  # one line per sequence: what bin/lab model adds up
            with open(REPORT, "a") as out:
                out.write(json.dumps({"steps": self.steps, "operations": self.operations}) + "\n")

    # -- the log ----------------------------------------------------------------------

    @rule(partition=st.integers(0, 7), kinds=st.lists(RECORD_KINDS, min_size=1, max_size=8),
          aborted=st.sampled_from([False, False, False, True]), advance=st.integers(0, 4_000))
    @counted
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
    @counted
    def delete_records(self, partition, by):
        p = partition % len(self.log.entries)
        self.log.delete_records(p, self.log.start[p] + by)

    @precondition(lambda self: len(self.log.entries) < 4)
    @rule()
    @counted
    def add_partition(self):
        self.log.add_partitions(1)

    # -- the runs ---------------------------------------------------------------------

    def _cfg(self, cap: int, policy: str) -> PipelineConfig:
        return self.cfg.replace(max_records_per_epoch=cap, on_data_loss=policy)

    @rule(cap=CAPS, policy=POLICIES, crash=DEATHS, lost=LOST_ANSWERS, nth=st.integers(1, 3), then_publish=st.booleans())
    @counted
    def chain_epoch(self, cap, policy, crash, lost, nth, then_publish):
        if self._run(Run("chain", cap, policy), crash_at(crash), lost, nth) == DONE:
            self._check_nothing_left("chain")
            if then_publish:  # as `ipcount epoch` does with publish on
                self.publish(None)

    @rule(partition=st.integers(0, 7), a=st.floats(0, 1), b=st.floats(0, 1), cap=CAPS, policy=POLICIES,
          crash=DEATHS, nth=st.integers(1, 3), lost=LOST_ANSWERS)
    @counted
    def backfill_offsets(self, partition, a, b, cap, policy, crash, nth, lost):
        if self._run(Run("backfill", cap, policy, self._offsets(partition, a, b)), crash_at(crash, nth), lost,
                     nth) == DONE:
            self._check_nothing_left("backfill")

    @rule(a=st.integers(-20_000, 0), length=st.integers(1, 20_000), cap=CAPS, policy=POLICIES, crash=DEATHS,
          nth=st.integers(1, 3), lost=LOST_ANSWERS)
    @counted
    def backfill_time(self, a, length, cap, policy, crash, nth, lost):
        if self._run(Run("backfill", cap, policy, self._times(a, length)), crash_at(crash, nth), lost, nth) == DONE:
            self._check_nothing_left("backfill")

    @rule(first=RUNS, second=RUNS, at=st.sampled_from([*POINTS, *COMMITS]), nth=st.sampled_from([1, 1, 2]),
          dies=DEATHS)
    @counted
    def race(self, first, second, at, nth, dies):
        """Two runs at once: the first is paused at a step marker, or just before one of its
        Delta commits (``write``: an append, ``merge``) goes through, and the second runs
        there from start to end (or to its death), loading tables of its own as another
        process would; then the first goes on (a commit of it then lands on a snapshot the
        second has moved past: the conflict checks' and retries' turn)."""
        self.produce(first.seed, ["ok", "ok", "disordered"], False, 500)  # (so that both have work)
        first, second = self._requested(first), self._requested(second)
        seen, outcome = Counter(), []

        def second_runs(point: str) -> None:
            seen[point] += 1
            if point == at and seen[point] == nth and not outcome:
                outcome.append(DIED)  # (until it ends: its own commits and markers pass through)
                outcome[0] = contextvars.Context().run(self._run, second, crash_at(dies), None, 1)
        with before_commits(second_runs):
            done = self._run(first, second_runs, None, 1)
        event(f"race: {second.kind} at {first.kind}'s {at}: {outcome[0] if outcome else 'did not meet'}")
        if done == DONE and not (outcome and outcome[0] in (DIED, FAILED) and second.kind == first.kind):
            self._check_nothing_left(first.kind)

    @rule(retention=st.sampled_from([0, None]))
    @counted
    def maintain(self, retention):
        """Compaction, transaction retirement, checkpoints and vacuum (0: every file no
        version references, but what the publisher has yet to read)."""
        run = maintain(self.cfg, retention_hours=retention, next_unpublished=self.sink_topic.next_version)
        if any("transactions retired" in n for t in run.tables for n in t.notes):
            event("maintain: transactions retired")
        if any(t.compacted_files for t in run.tables):
            event("maintain: files compacted")
        if any(t.vacuumed_files for t in run.tables):
            event("maintain: files vacuumed")

    @rule(crash=DEATHS, nth=st.integers(1, 3))
    @counted
    def rebuild(self, crash, nth):
        """Replay the committed epochs into the replay target (resumed by the next rebuild)."""
        committed = {r["epoch"] for r in self._rows() if r["status"] == COMMITTED}
        try:
            rebuild(self.cfg, None, REPLAY, crash=crash_at(crash, nth), log_source=self.log)
        except ProcessDeath:
            event("rebuild: died")
            return
        except (DataLossError, BadRequestError):
            event("rebuild: refused")
            return  # no ledger yet, or a committed epoch's offsets aged out: refused before any write
        event("rebuild: done")
        replay = self.cfg.for_target(REPLAY)
        rebuilt = {r["epoch"] for r in self.tables.rows(replay.ledger_path) if r["status"] == COMMITTED}
        assert rebuilt == committed, f"the rebuild reported done: epochs {sorted(committed ^ rebuilt)} differ"

    @rule(crash=st.sampled_from([None, None, "publish_before_commit", "publish_after_commit"]))
    @counted
    def publish(self, crash):
        """Publish the counts versions not published yet to the sink topic."""
        if self.tables.get(self.cfg.counts_path) is None:
            return
        latest = self.tables.get(self.cfg.counts_path)
        # The rows as of the version about to be published last (a vacuum may delete its
        # files once it is published; nothing writes while this runs).
        self.published_rows[latest.version()] = latest.to_pyarrow_table(
            columns=["window_start", "ip", "count", "is_final"]).to_pylist()
        try:
            report = publish_pending(self.cfg, crash_at(crash), topic=self.sink_topic)
        except ProcessDeath:
            event("publish: died")
            return
        event(f"publish: {'some' if report.records else 'no'} records")
        assert self.sink_topic.next_version() == self.tables.version(self.cfg.counts_path) + 1

    # -- a run, as the command line or a DAG task would start it ------------------------

    def _requested(self, run: Run) -> Run:
        """``run`` with a request of its own, if it is a backfill: a random partition's
        offsets from a random one to the end of the log (the seed says which)."""
        if run.kind != "backfill":
            return run
        r = random.Random(run.seed)
        return replace(run, fields=self._offsets(r.randrange(8), r.random(), 1.0))

    def _offsets(self, partition: int, a: float, b: float) -> dict | None:
        p = partition % len(self.log.entries)
        start, end = self.log.start[p], len(self.log.entries[p])
        lo, hi = sorted((start + int(a * (end - start)), start + int(b * (end - start))))
        return {"offsets": f"{p}:{lo}-{hi}"} if hi > lo else None

    def _times(self, a: int, length: int) -> dict:
        def iso(ms: int) -> str:
            return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat()
        return {"from_time": iso(self.clock + a), "until_time": iso(self.clock + a + length)}

    def _run(self, run: Run, crash, lost: str | None, nth: int) -> str:
        """Run ``run`` to its end: DONE if it reported done; DIED; FAILED as it may after a
        lost commit answer or a race, or refusing to lose data under ``fail``; REFUSED
        before anything was written (nothing to ask for, a request the log refuses)."""
        from ipcount.jobs.backfill import resolve
        from ipcount.rules.requests import request_from_fields

        cfg = self._cfg(run.cap, run.policy)
        try:
            if run.kind == "chain":
                with answers_lost(lost, nth):
                    run_epoch(cfg, None, crash=crash, source=self.log)
                return DONE
            if run.fields is None:
                return REFUSED
            request = request_from_fields(run.fields, cfg.topic)
            try:
                resolved = resolve(cfg, request, self.log)
            except BadRequestError:
                return REFUSED
            self.backfill_ran = True
            with answers_lost(lost, nth):
                run_backfill(cfg, None, request, crash=crash, resolved=resolved, source=self.log)
            self.done_requests.append(resolved.ranges)
            return DONE
        except ProcessDeath:
            return DIED
        except RUN_FAILURES:
            return FAILED
        except DataLossError:
            assert run.policy == "fail", "skip records what aged out instead of failing"
            return FAILED

    def _check_nothing_left(self, kind: str) -> None:
        state = self._ledger_state()
        if kind == "chain":
            assert not state.pending_chain, "a chain run that was not killed left its epoch unfinished"
        else:
            assert not state.pending_backfills, "a backfill that reported done left unfinished backfill epochs behind"

    # -- the invariants ---------------------------------------------------------------

    def _ledger_state(self):
        return state_of(self.cfg.topic, self._rows())

    def _rows(self) -> list[dict]:
        return [r for r in self.tables.rows(self.cfg.ledger_path) if r["status"] != SUMMARY]

    @invariant()
    def tables_match_the_log(self):
        # The tables' checks again only when a table changed or a request reported done since
        # (the log only grows and its start only moves on: what held of the tables holds).
        paths = [p for cfg in (self.cfg, self.cfg.for_target(REPLAY))
                 for p in (cfg.ledger_path, cfg.counts_path, cfg.late_path, cfg.dead_letter_path)]
        seen = (tuple(self.tables.version(p) for p in paths), len(self.done_requests),
                len(self.sink_topic.transactions))
        if seen == self.seen:
            self.backfill_ran = False  # (it wrote nothing: no count of it to excuse)
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
        in_tables = self._epochs_in_tables(self.cfg, rows)
        self._check_counts(self.cfg, rows, in_tables)
        self._check_idle_agrees(rows, earliest, latest)
        self._check_replay(earliest)
        self._check_published()

    def _check_published(self) -> None:
        """Every counts version published once, in order, and the sink topic's newest record
        per key is the table's row as of the last version published; a count once final is
        published again only changed by a backfill (a correction)."""
        if not self.sink_topic.transactions:
            return
        newest: dict[tuple[int, str], dict] = {}
        next_version = None
        for records, cursor in self.sink_topic.transactions:
            kinds = {dict(r.headers)["ipcount-kind"] for r in records}
            if next_version is not None:
                assert cursor.next_version == next_version + 1, \
                    f"published version {cursor.next_version - 1} after {next_version - 1}"
                assert kinds <= {b"live", b"backfill"}
            for r in records:
                assert int(dict(r.headers)["ipcount-version"]) == cursor.next_version - 1
                value = json.loads(r.value)
                key = (_ms(datetime.fromisoformat(value["window_start"])), value["ip"])
                before = newest.get(key)
                assert before is None or not before["is_final"] or value["kind"] == "backfill" \
                    or (before["count"], value["is_final"]) == (value["count"], True), \
                    f"final count {key} published again as {value['count']} (final: {value['is_final']})"
                newest[key] = value
            next_version = cursor.next_version
        then = self.published_rows.get(next_version - 1)
        if then is None:
            return  # a publish died past a version before its last: the next one goes on from it
        assert {(_ms(r["window_start"]), r["ip"]): (r["count"], r["is_final"]) for r in then} == \
            {k: (v["count"], v["is_final"]) for k, v in newest.items()}, \
            f"the sink topic differs from counts version {next_version - 1}"

    def _check_replay(self, earliest) -> None:
        """The replay target holds what the source's committed epochs it replayed counted:
        the same checks of its own tables (a rebuilt ledger lacks the epochs its source gave
        up, so no chain check there)."""
        replay = self.cfg.for_target(REPLAY)
        rows = [r for r in self.tables.rows(replay.ledger_path) if r["status"] != SUMMARY]
        if rows:
            self._check_ownership(rows, earliest)
            self._check_counts(replay, rows, self._epochs_in_tables(replay, rows))

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

    def _epochs_in_tables(self, cfg: PipelineConfig, rows) -> set[int]:
        """The epochs whose data the tables hold, from the counts table's transactions (an
        epoch at or below the floor had its transaction retired: only final ones are)."""
        sink = Sink(cfg)
        counts = self.tables.get(cfg.counts_path)
        floor = (counts.transaction_version(sink.floor_id) if counts is not None else None) or 0
        checked_in = self.checked_in.setdefault(cfg.counts_path, set())
        status: dict[int, set[str]] = {}
        reads: set[int] = set()  # epochs with a range to read (one that reads nothing writes nothing)
        for r in rows:
            status.setdefault(r["epoch"], set()).add(r["status"])
            if r["status"] != LOST and r["until_offset"] > r["from_offset"]:
                reads.add(r["epoch"])
        in_tables = set()
        for epoch, statuses in status.items():
            if COMMITTED in statuses and epoch in checked_in:
                in_tables.add(epoch)
                continue
            if epoch <= floor:
                assert PLANNED not in statuses, f"epoch {epoch}'s transactions were retired while it was planned"
                if COMMITTED in statuses:
                    in_tables.add(epoch)
                continue
            holds = (counts is not None and counts.transaction_version(sink.txn_app_id(epoch)) is not None
                     and counts.transaction_version(f"{sink.txn_app_id(epoch)}/{FENCED}") is None)
            if COMMITTED in statuses and epoch in reads:
                assert holds, f"epoch {epoch} is committed in the ledger but its counts commit is not in the table"
                checked_in.add(epoch)
            if holds:
                assert statuses & {COMMITTED, PLANNED}, f"epoch {epoch}'s data is in the tables but its rows are gone"
                in_tables.add(epoch)
        return in_tables

    def _check_counts(self, cfg: PipelineConfig, rows, in_tables: set[int]) -> None:
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
        if cfg.counts_path != self.cfg.counts_path:
            return
        for key, n in self.final.items():
            assert found.get(key) == n or self.backfill_ran, f"final count {key} changed from {n} to {found.get(key)}"
        self.final.update(final)
        self.backfill_ran = False

    def _check_lag(self, rows, earliest, latest, run: bool) -> None:
        """The lag the monitor, the metrics and the freshness alert show: per partition the
        offsets from where the chain is to the log end that no committed or lost row owns
        (counted here offset by offset). When the idle check says there is nothing to run,
        all of it waits for an unfinished backfill, if any."""
        lag = chain_lag(None, self.cfg.topic, rows, earliest, latest)
        owner: dict[tuple[int, int], dict] = {}
        for r in rows:
            for o in range(r["from_offset"], r["until_offset"]):
                owner[(r["partition"], o)] = r
        for p, end in latest.items():
            chain = [r["until_offset"] for r in rows if is_scheduled(r) and r["partition"] == p
                     and r["status"] in (COMMITTED, LOST)]
            waiting = [o for o in range(max(chain, default=earliest[p]), end)
                       if (p, o) not in owner or owner[(p, o)]["status"] == PLANNED]
            assert lag[p] == len(waiting), f"partition {p}: lag {lag[p]}, but {len(waiting)} offsets wait"
            if not run:
                idle = [o for o in waiting if (p, o) not in owner or is_scheduled(owner[(p, o)])]
                assert not idle, f"idle, but offsets {p}:{idle[:5]} wait for no backfill"

    def _check_idle_agrees(self, rows, earliest, latest) -> None:
        # From every row, as from a summary and its tail (tests/unit/test_ledger_summary.py),
        # the state idle.check reads.
        state = state_of(self.cfg.topic, rows)
        unfinished = [p.epoch for p in state.pending_chain]
        said = verdict(state.committed, unfinished, earliest, latest, state.coverage)
        self._check_lag(rows, earliest, latest, said.run)
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


def _ms(value: datetime) -> int:
    return round(value.timestamp() * 1000)


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("ipcount").setLevel(logging.ERROR)
    yield
    logging.getLogger("ipcount").setLevel(logging.NOTSET)


LedgerModel.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                         suppress_health_check=list(HealthCheck))
# A long run (docs/exactly-once.md) outlasts the suite's per-test timeout: its own scales with it.
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


def test_settling_the_chains_aged_out_epoch_with_a_smaller_cap_keeps_all_its_rest_owned(tmp_path):
    """Model run, seed 60: the chain gave up its aged-out epoch and planned the rest afresh,
    cut by the settling run's cap; the offsets past the cut, which the chain had passed (and
    a backfill reported done on, as the chain's), were owned by no row until the chain came
    back to them."""
    from ipcount.rules.requests import request_from_fields
    cfg = PipelineConfig(warehouse=str(tmp_path), topic="model", start_position="earliest", on_data_loss="skip")
    log = SimulatedLog(cfg)
    log.add_partitions(1)

    def produce(first: int, n: int) -> None:
        log.append(0, [Record(json.dumps({"ip": "10.0.0.1", "ts": T0 + i}).encode(), T0 + i)
                       for i in range(first, first + n)])
    produce(0, 5)
    run_epoch(cfg, None, source=log)
    (_, passed), = Ledger(cfg.ledger_path).state(cfg.topic).committed.items()
    produce(5, 20)
    end = log.partition_offsets()[1][0]
    with pytest.raises(ProcessDeath):
        run_epoch(cfg, None, crash=crash_at("after_plan"), source=log)  # epoch 2: all of the new records
    done = run_backfill(cfg, None, request_from_fields({"offsets": f"0:{passed}-{end}"}, cfg.topic), source=log)
    assert done.epochs == [] and [(r.from_offset, r.until_offset) for r in done.skipped] == [(passed, end)]
    log.delete_records(0, passed + 2)
    run_epoch(cfg.replace(max_records_per_epoch=4), None, source=log)
    assert merge(owned_offsets(cfg)[0]) == ((0, end),)
    lost = [(r["from_offset"], r["until_offset"]) for r in read_rows(cfg.ledger_path) if r["status"] == LOST]
    assert lost == [(passed, passed + 2)]


def test_settling_the_chains_first_epoch_keeps_its_start_positions(tmp_path):
    """Review of the chain's settle: the release dropped the given-up epoch's empty ranges,
    which in a first epoch are the start positions it pinned; a partition left without a
    row then started at its log start, counting history the start position had passed."""
    cfg = PipelineConfig(warehouse=str(tmp_path), topic="model", start_position="earliest", on_data_loss="skip")
    log = SimulatedLog(cfg)
    log.add_partitions(2)
    for p in (0, 1):
        log.append(p, [Record(json.dumps({"ip": "10.0.0.1", "ts": T0 + i}).encode(), T0 + i) for i in range(10)])
    history = log.partition_offsets()[1][0]

    class StartsAtOffsets:  # start_position "specific": partition 0 at its end, partition 1 at 2
        def __getattr__(self, name):
            return getattr(log, name)

        def start_offsets(self, earliest, latest):
            return {0: latest[0], 1: 2}
    starting = cfg.replace(start_position="specific", start_offsets=f"0:{history},1:2")
    with pytest.raises(ProcessDeath):
        run_epoch(starting, None, crash=crash_at("after_plan"), source=StartsAtOffsets())
    log.delete_records(1, 4)
    run_epoch(starting, None, source=StartsAtOffsets())     # settles epoch 1: [2, 4) of partition 1 lost
    log.append(0, [Record(json.dumps({"ip": "10.0.0.1", "ts": T0 + 20}).encode(), T0 + 20)])
    run_epoch(starting, None, source=StartsAtOffsets())
    assert merge(owned_offsets(cfg)[0]) == ((history, log.partition_offsets()[1][0]),)


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
    counts = TablesSeen().rows(cfg.counts_path, ["count"])
    assert sum(r["count"] for r in counts) == 25


def test_an_idle_topic_whose_tail_a_backfill_counted_shows_no_lag(tmp_path):
    """The model's lag check: the monitor, the metrics and the freshness alert took the lag
    as the log end less the chain's position, so offsets a backfill had counted ahead of the
    chain (which its next plan passes) showed as waiting for good on an idle topic."""
    from ipcount.orchestration.monitor.data import PipelineTables
    from ipcount.rules.requests import request_from_fields
    from ipcount.storage.delta import DeltaReader

    cfg = PipelineConfig(warehouse=str(tmp_path), topic="model", start_position="earliest")
    log = SimulatedLog(cfg)
    log.add_partitions(1)
    log.append(0, [Record(json.dumps({"ip": "10.0.0.1", "ts": T0 + i}).encode(), T0 + i) for i in range(10)])
    run_epoch(cfg, None, source=log)
    log.append(0, [Record(json.dumps({"ip": "10.0.0.1", "ts": T0 + i}).encode(), T0 + i) for i in range(10, 20)])
    run_backfill(cfg, None, request_from_fields({"offsets": "0:11-22"}, cfg.topic), source=log)
    tables = PipelineTables(cfg, DeltaReader())
    assert tables.chain_positions() == {0: 11}   # the chain's own position stays where it was
    assert tables.chain_lag(*log.partition_offsets()) == {0: 0}
    assert run_epoch(cfg, None, source=log) is None  # and the chain has nothing to plan


def test_the_lab_runs_the_model_and_adds_up_what_it_ran():
    """``bin/lab model``: the sequences the test ran and their steps, from its own report."""
    from ipcount_lab.model_run import run_model

    seen = []
    run = run_model(sequences=2, steps=6, seed=3, progress=lambda n, steps: seen.append((n, steps)),
                    every_seconds=0.5)
    assert run.passed, run.failure
    assert seen and all(0 <= n <= 2 and 0 <= steps <= 12 for n, steps in seen)  # told how far it got
    assert run.sequences == 2 and 2 <= run.steps <= 12 and sum(run.operations.values()) >= run.steps
    assert "2 sequences of up to 6 steps" in run.line() and "0 invariant violations" in run.line()
