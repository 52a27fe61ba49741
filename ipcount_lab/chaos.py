"""``bin/lab chaos``: the exactly-once claim, tried against your own broker.

It makes a topic and a warehouse of its own (never the pipeline's), produces a known data
set - out of order, late, malformed, committed and aborted transactions - and then runs the
real commands as separate processes, the way a scheduler, an operator and a crash would: the
chain (``ipcount epoch``), a hand-run epoch racing it, backfills over random offset ranges
racing both, and the DAGs (``airflow dags test`` of ``ipcount_epoch``, with
``ipcount_backfill`` racing it half the time, in an Airflow home of its own). Each round
produces a batch of new records first, so every round has work to interrupt, then SIGKILLs
one of its processes (the whole process group, the Spark JVM with it) at a moment of its
own, and each other one with probability 1/2 - or, in the ``broker`` scenario, SIGKILLs the
embedded Kafka broker under a running chain and starts it again. Half the moments are a
random time after the process started; the other half are aimed at the write-ahead window: a
random time after the process logs an epoch's recorded plan (before its ledger commit, often
after its sink commit), the crash the design exists for, which a JVM that starts slowly
seldom reaches by chance. The report says where each kill landed, read from the victim's
log. It adds a partition half way.

The ``retention`` scenario is retention passing ranges not yet counted: the chain and a
backfill run under ``on_data_loss`` ``skip`` or ``fail`` (the round's draw; an exit 3, data
loss, is an expected outcome), and soon after the chain recorded a plan the head of one or
more partitions it planned is deleted (``delete_records``) up to a point mostly inside or just
past the chain's newest range, so that epochs planned there age out before they are done. The
records are read back first and kept with the run's state, as is how far each partition was
deleted. The other rounds run under ``fail`` until something is deleted, then under ``skip``
(under ``fail`` a chain that met deleted offsets could only fail from then on).

The ``rebuild`` scenario is ``ipcount rebuild --into replay`` racing the chain, killed like the
rest and resumed by the next rebuild round. A rebuild replays only offsets Kafka still holds,
so when a run has both, retention waits until every other scenario has had its round and
half the kills are made (then takes the next round), and the rebuild is then run to its end
once, without kills, before the first records are deleted (or at the finish, if none are);
from then on rebuild has no rounds. The ``answers`` scenario is the chain and a backfill
racing while commit answers are lost: a run with it keeps its warehouse on an S3 store of
its own (s3proxy) behind :mod:`ipcount_lab.lossy_proxy`, which in those rounds lets the store
take every third commit and closes the connection instead of answering. The ``connect``
scenario runs the chain and a backfill on the run's own Spark Connect server
(``spark_remote``), and half the time SIGKILLs the server under the chain and starts it again.

Then it lets the chain and every backfill finish without kills, each a process on the run's
Spark Connect server (one is started for the finish when the run has no connect rounds),
under ``skip`` if anything was deleted, so that what was left unfinished over deleted
offsets settles (each backfill request cut at the log start, as one reaching below it is
refused), and recounts everything in plain Python (:mod:`ipcount.rules.records`, not Spark)
from Kafka and the kept copies:

* **duplicates**: counts above the recount, dead-letter or late rows of an offset more
  than once or of an offset that should have none, ledger ranges that overlap;
* **losses**: counts below the recount, missing dead-letter or late rows, records that no
  ledger row covers, ``lost`` rows over offsets that were never deleted;
* the replay target, if rebuilt: the source's epochs of the moment it was completed, with the
  same ranges, and tables that equal a recount of them (the same two counts);
* with publishing on, the sink topic: no version sent twice, the last value per key the
  table's row, and no row that was published final changed afterwards by a live epoch.

All must be 0: an offset below its partition's deletion mark must be counted (it was before
it aged out) or covered by a ``lost`` row, one at or above it counted, once
(:func:`check_ledger`); the recount covers exactly the offsets committed ledger rows cover.
Scenarios take turns (in a shuffled order), each at least once, so a run
of ``n`` kills tries each of ``k`` scenarios at least once and about ``n / k`` times.

A long run may take several sittings: ``pause`` stops it without finishing and keeps its
state (:mod:`ipcount_lab.chaos_state`) for ``resume``; the last sitting finishes and
recounts everything.
"""
from __future__ import annotations

import base64
import json
import logging
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Iterator, Mapping, NamedTuple

from ipcount.jobs import crash
from ipcount.jobs.crash import STEP_MARKER
from ipcount.jobs.verify import LATE, MALFORMED, recount_record, table_counts
from ipcount.rules.config import REPO_ROOT, STATE_DIR, PipelineConfig, location_scheme
from ipcount.rules.errors import EXIT_DATA_LOSS, ConfigError, UnknownTopicError
from ipcount.rules.ledger import COMMITTED, LOST, Row, is_scheduled
from ipcount.rules.offsets import split_at_log_start
from ipcount.rules.publish import LIVE
from ipcount.rules.requests import parse_offsets
from ipcount.storage import broker
from ipcount.storage.delta import read_rows
from ipcount_lab.chaos_maintenance import MaintenanceBeside
from ipcount_lab.chaos_state import DELETED_FILE, REBUILD, RETENTION, SCENARIOS, STATE_FILE, RunState, round_rng
from ipcount_lab.embedded_airflow import airflow_env
from ipcount_lab.embedded_connect import EmbeddedSparkConnect
from ipcount_lab.embedded_kafka import EmbeddedKafka
from ipcount_lab.embedded_s3 import EmbeddedS3
from ipcount_lab.generator import TrafficGenerator, produce
from ipcount_lab.service import free_port, proc_stat

log = logging.getLogger(__name__)

REPLAY_TARGET = "replay"  # what the rebuild scenario rebuilds the run's tables into
LOSE_EVERY = 3  # in answers rounds, the store's answer to every third commit it takes is lost
AIRFLOW = Path(sys.executable).parent / "airflow"
AIRFLOW_START_SECONDS = 10.0  # `airflow dags test` imports and parses before spark-submit starts
BASE_MS = 1_795_255_200_000  # 2026-11-21T10:00:00Z: event times, well behind any Kafka timestamp
PARTITIONS = 3  # a run's topic starts with these; the run adds one half way
BATCH_GAP_MS = 15 * 60_000  # event time between two batches' records (see _Source.produce)
SPARED_SECONDS = 120.0  # how long a round waits for a process it did not kill (then kills it)
GIVE_UP_SECONDS = 240.0  # a kill aimed at the write-ahead window that never opens comes then

# Where an epoch had got to when its process died, from the last step marker in its log
# (ipcount.jobs.crash.step_line): nothing yet (starting), reading the ledger (planning), plan
# recorded but the ledger commit not made (writing: the write-ahead window), ledger commit
# made (committed).
PHASES = (STARTING, PLANNING, WRITING, DONE) = ("starting", "planning", "writing", "committed")
_PHASE_LINES = ((re.compile(rf"{STEP_MARKER} {crash.PLANNING}\b"), PLANNING),
                (re.compile(rf"{STEP_MARKER} after_(plan|sink)\b"), WRITING),
                (re.compile(rf"{STEP_MARKER} after_ledger\b"), DONE))


def phase_of(log_text: str) -> str:
    """The phase (:data:`PHASES`) a process was in, from its log so far."""
    phase, at = STARTING, -1
    for pattern, name in _PHASE_LINES:
        for m in pattern.finditer(log_text):
            if m.start() > at:
                phase, at = name, m.start()
    return phase


@dataclass
class ChaosReport:
    topic: str
    warehouse: str
    run_dir: str = ""
    paused: bool = False         # stopped to go on later (--pause): no finish, no recount yet
    kills_wanted: int = 0
    sittings: int = 1            # how many invocations the run took (paused and resumed between)
    kills: int = 0
    rounds: int = 0
    by_scenario: Counter = field(default_factory=Counter)
    by_phase: Counter = field(default_factory=Counter)  # where the kills landed (PHASES)
    partitions_added: int = 0
    strays: int = 0              # processes of the run still alive after their round, killed
    records: int = 0             # committed records produced (in Kafka, or deleted by retention rounds)
    deleted: int = 0             # of them deleted by retention rounds
    lost: int = 0                # of those recorded lost by the ledger (the rest was counted before)
    epochs: int = 0              # committed epochs in the ledger
    counted: int = 0
    published: int = 0           # records in the sink topic (publish on), read_committed
    rebuilt: int = 0             # epochs in the replay target (rebuild scenario)
    answers_lost: int = 0        # commit answers the store's proxy lost (answers scenario)
    executor_rounds: int = 0     # rounds whose epochs Spark's executors wrote (max_driver_tally_rows 0)
    duplicates: int = 0
    losses: int = 0
    final_changes: int = 0       # published final rows a live epoch changed afterwards
    maintenance: str = ""        # what maintenance racing this sitting's rounds did (chaos_maintenance)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.paused and self.duplicates == 0 and self.losses == 0 and self.final_changes == 0

    def line(self) -> str:
        scenarios = ", ".join(f"{k} {v}" for k, v in sorted(self.by_scenario.items()))
        phases = ", ".join(f"{p} {self.by_phase[p]}" for p in PHASES)
        if self.paused:
            return (f"chaos paused: {self.kills} of {self.kills_wanted} kills in {self.rounds} rounds ({scenarios}; "
                    f"epochs killed while {phases}); no verdict before the finish: go on with "
                    f"`bin/lab chaos --resume {self.run_dir}` (the same broker, running)")
        verdict = "OK" if self.ok else "FAILED"
        sittings = f" in {self.sittings} sittings" if self.sittings > 1 else ""
        return (f"chaos {verdict}: {self.kills} kills survived in {self.rounds} rounds{sittings} ({scenarios}; "
                f"epochs killed while {phases}); "
                f"{self.partitions_added} partition(s) added; {self.strays} stray process(es) killed; "
                f"{self.records} records in Kafka"
                + (f" ({self.deleted} of them deleted by retention rounds, {self.lost} recorded lost)"
                   if self.deleted else "")
                + f", {self.epochs} epochs committed, {self.counted} counted"
                + (f" (executors wrote the files in {self.executor_rounds} rounds)" if self.executor_rounds else "")
                + (f", {self.published} published" if self.published else "")
                + (f", {self.rebuilt} epochs rebuilt" if self.rebuilt else "")
                + (f", {self.answers_lost} commit answers lost" if self.answers_lost else "")
                + (f"; {self.maintenance}" if self.maintenance else "")
                + f"; duplicates {self.duplicates}, losses {self.losses}"
                + (f", final rows changed {self.final_changes}" if self.published else ""))


class _Processes:
    """The CLI commands chaos starts: each in a process group of its own, so a kill takes
    its Spark JVM with it; output to a log file per process."""

    def __init__(self, cfg: PipelineConfig, logs: Path) -> None:
        self.cfg, self.logs = cfg, logs
        # (Numbered on from an earlier sitting's logs, which stay.)
        self.count = max((int(f.name[:4]) for f in logs.glob("[0-9][0-9][0-9][0-9]-*.log")), default=0)
        self.sessions: set[int] = set()  # each started process leads a session of its own
        self.started: list[subprocess.Popen] = []
        self.log_of: dict[int, Path] = {}

    def start(self, *args: str) -> subprocess.Popen:
        """``ipcount ARGS``."""
        return self.spawn(args[0], [sys.executable, "-m", "ipcount.cli", *args],
                          {**os.environ, "PYTHONPATH": str(REPO_ROOT)})

    def spawn(self, label: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        self.count += 1
        self.last_log = self.logs / f"{self.count:04d}-{label}.log"
        with open(self.last_log, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.sessions.add(proc.pid)
        self.started.append(proc)
        self.log_of[proc.pid] = self.last_log
        return proc

    def phase(self, proc: subprocess.Popen) -> str:
        """Where ``proc``'s epoch has got to (:func:`phase_of` its log)."""
        return phase_of(self.log_of[proc.pid].read_text(errors="replace"))

    def kill_all(self) -> int:
        """SIGKILL every process started and everything left in their sessions (e.g. a child
        that outlived its killed parent); how many were still alive."""
        # (Not the groups of processes reaped long ago: their ids may belong to others by now.)
        alive = sum(self.kill(p) for p in self.started if p.returncode is None)
        for pid, sid in _sessions():
            if sid in self.sessions and pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                    alive += 1
                    log.warning("chaos: killed stray process %d of session %d", pid, sid)
                except ProcessLookupError:
                    pass
        self.started.clear()
        self.sessions.clear()
        return alive

    @staticmethod
    def kill(proc: subprocess.Popen) -> bool:
        """SIGKILL everything in the process's session at once (a process group is not enough:
        Airflow runs its task, and so the task's spark-submit, in a group of its own); whether
        the process was still running."""
        alive = proc.poll() is None
        # (Not the id of a leader reaped already: it may be another's by now. Linux gives no
        # new process the id of a session that still has members.)
        members = [pid for pid, sid in _sessions() if sid == proc.pid and pid != proc.pid]
        for pid in [proc.pid] * alive + members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        return alive


def _first_broker(bootstrap_servers: str) -> tuple[str, int]:
    host, _, port = bootstrap_servers.split(",")[0].strip().rpartition(":")
    return host, int(port)


def embedded_broker(state_dir: str | Path, bootstrap_servers: str) -> EmbeddedKafka:
    """The embedded broker under ``state_dir`` on the port ``bootstrap_servers`` names (as
    ``bin/lab kafka start --port`` makes it); it may not be running."""
    _, port = _first_broker(bootstrap_servers)
    return EmbeddedKafka(state_dir=Path(state_dir), port=port, controller_port=port + 1)


def restartable(kafka: EmbeddedKafka | None, bootstrap_servers: str) -> bool:
    """Whether ``kafka`` is a running embedded broker and the one ``bootstrap_servers`` names."""
    if kafka is None or kafka.pid() is None:
        return False
    host, port = _first_broker(bootstrap_servers)
    return host in ("127.0.0.1", "localhost") and port == kafka.port


def run_chaos(cfg: PipelineConfig, kills: int | None = None, records: int = 3000, seed: int = 1,
              workdir: str | Path | None = None, max_seconds: float = 3600.0,
              scenarios: tuple[str, ...] = SCENARIOS, kill_window: tuple[float, float] = (2.0, 30.0),
              max_records_per_epoch: int | None = None, broker_to_restart: EmbeddedKafka | None = None,
              write_window: float = 20.0, pause: bool = False, resume: str | Path | None = None) -> ChaosReport:
    """Kill runners ``kills`` times (default 20) and give each scenario a round (or stop at
    ``max_seconds``), finish, recount; the report.
    A kill comes either ``kill_window`` seconds (uniformly random) after its process started,
    or up to ``write_window`` seconds after the process logged a recorded plan.
    The ``broker`` scenario needs ``broker_to_restart``: the embedded broker serving ``cfg``.
    ``pause``: stop at ``kills`` or ``max_seconds`` without finishing, the run kept for a later
    sitting; ``resume``: a paused run's directory, to go on with (its own settings, ``kills``
    excepted, and the same broker)."""
    if resume is None:
        _check_scenarios(cfg, scenarios, broker_to_restart)
        run_dir, state = _new_run(cfg, kills or 20, records, seed, workdir, scenarios, kill_window, write_window,
                                  max_records_per_epoch)
    else:
        run_dir = Path(resume)
        state = RunState.load(run_dir / STATE_FILE)
        _check_scenarios(cfg, tuple(state.scenarios), broker_to_restart, resumed=run_dir)
        state.kills_wanted = kills or state.kills_wanted
    store = _LossyStore(run_dir) if state.object_store else _NoStore()
    with store, (_connect_server(run_dir) if "connect" in state.scenarios else nullcontext()) as connect:
        return _run(_chaos_config(cfg, state, run_dir), state, run_dir, store, connect, broker_to_restart, max_seconds,
                    pause, resumed=resume is not None)


@contextmanager
def _connect_server(run_dir: Path) -> Iterator[EmbeddedSparkConnect]:
    """The run's Spark Connect server: up while the sitting lasts if it has connect rounds, else
    for the finish only."""
    server = EmbeddedSparkConnect(state_dir=run_dir / "spark-connect", port=free_port(), master="local[2]", cores=2)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _run(chaos_cfg: PipelineConfig, state: RunState, run_dir: Path, store: _NoStore,
         connect: EmbeddedSparkConnect | None, broker_to_restart: EmbeddedKafka | None,
         max_seconds: float, pause: bool, resumed: bool) -> ChaosReport:
    """The rounds of one sitting, then (unless pausing) the finish and the recount."""
    if not resumed:
        source = _Source(chaos_cfg, state, partitions=PARTITIONS)
        source.produce(state.batch, round_rng(state.seed, 0))
    else:
        source = _Source(chaos_cfg, state, partitions=_partitions(chaos_cfg))
        # (The broker's word: a partition added by a sitting killed before it saved.)
        state.partitions_added = max(state.partitions_added, source.partitions - PARTITIONS)
    log.info("chaos: topic %s, warehouse %s, logs %s%s", state.name, chaos_cfg.warehouse, run_dir / "logs",
             f"; resumed at {state.kills} kills after {state.rounds} rounds" if resumed else "")
    procs = _Processes(chaos_cfg, run_dir / "logs")
    killer = _Killer(procs, tuple(state.kill_window), state.write_window)
    sitting = {"started": _now(), "stopped": None, "kills": 0}
    state.sittings.append(sitting)
    deadline = time.monotonic() + max_seconds
    maintenance = MaintenanceBeside(chaos_cfg)
    try:
        with maintenance:
            _rounds(chaos_cfg, state, run_dir, store, connect, broker_to_restart, pause, deadline, source, procs,
                    killer, sitting)
        if not pause:
            with (nullcontext(connect) if connect is not None else _connect_server(run_dir)) as finisher:
                _finish(chaos_cfg, procs, finisher, state.backfills, deleted=bool(state.deleted))
            if not state.deleted:
                _complete_rebuild(chaos_cfg, procs, state, run_dir)
    finally:  # an error or Ctrl-C leaves no JVM of the run behind (they are in sessions of their own)
        state.strays += procs.kill_all()
        sitting["stopped"] = _now()
        state.save(run_dir / STATE_FILE)
    report = _report(state, run_dir, chaos_cfg, paused=pause)
    report.maintenance = maintenance.line()
    if not pause:
        _recount(chaos_cfg, report, state.deleted_marks(), _kept_records(run_dir), state.rebuilt)
        if chaos_cfg.publish:
            _recount_sink(chaos_cfg, report)
    log.info("%s", report.line())
    return report


def _rounds(chaos_cfg: PipelineConfig, state: RunState, run_dir: Path, store: _NoStore,
            connect: EmbeddedSparkConnect | None, broker_to_restart: EmbeddedKafka | None, pause: bool,
            deadline: float, source: _Source, procs: _Processes, killer: _Killer, sitting: dict) -> None:
    """The rounds of one sitting, until enough kills are made or the time is up."""
    while not state.enough(pause) and time.monotonic() < deadline:
        rng = killer.rng = round_rng(state.seed, state.rounds + 1)
        if state.partitions_added == 0 and state.kills >= state.kills_wanted // 2:
            source.add_partition()
            state.partitions_added += 1
        source.produce(state.batch, rng)
        scenario = state.next_scenario()
        # (Under fail, a chain that met deleted offsets could do nothing but fail from then on.)
        round_cfg = chaos_cfg.replace(on_data_loss="skip") if state.deleted else chaos_cfg
        if state.rounds % 2:  # every other round, Spark's executors write the epochs' files
            round_cfg = round_cfg.replace(max_driver_tally_rows=0)
            state.executor_rounds += 1
        if scenario == "broker":
            phases = _broker_round(round_cfg, killer, broker_to_restart)
        elif scenario == "dag":
            phases = _dag_round(round_cfg, killer, state.backfills, run_dir / "airflow")
        elif scenario == RETENTION:
            if not state.deleted:  # the last moment a rebuild can replay everything
                _complete_rebuild(chaos_cfg, procs, state, run_dir)
            phases = _retention_round(chaos_cfg, killer, state, run_dir)
        elif scenario == REBUILD:
            phases = killer.kill_some([procs.start("epoch", *round_cfg.to_args(), "--epochs", "1000"),
                                       procs.start("rebuild", "--into", REPLAY_TARGET, *round_cfg.to_args())])
        elif scenario == "answers":
            phases = _answers_round(round_cfg, killer, state, store)
        elif scenario == "connect":
            phases = _connect_round(round_cfg, killer, connect, state.backfills)
        else:
            phases = _round(scenario, round_cfg, killer, state.backfills)
        state.rounds += 1
        state.by_scenario[scenario] = state.by_scenario.get(scenario, 0) + 1
        for phase in phases:
            state.by_phase[phase] = state.by_phase.get(phase, 0) + 1
        state.kills += len(phases)
        sitting["kills"] += len(phases)
        state.strays += procs.kill_all()
        sitting["stopped"] = _now()
        state.save(run_dir / STATE_FILE)
        log.info("chaos round %d (%s): %d kill(s) (%s), %d in all", state.rounds, scenario, len(phases),
                 ", ".join(phases) or "-", state.kills)


def _partitions(cfg: PipelineConfig) -> int:
    """How many partitions a paused run's topic has; a clear error if it is not there."""
    try:
        _, latest = broker.partition_offsets(cfg)
    except UnknownTopicError:
        raise ConfigError(f"the paused run's topic {cfg.topic} is not on {cfg.bootstrap_servers}: a run goes "
                          f"on on the broker it started on (an embedded one: `bin/lab kafka start` with the "
                          f"same --port and --state-dir)") from None
    return len(latest)


def _check_scenarios(cfg: PipelineConfig, scenarios: tuple[str, ...], kafka: EmbeddedKafka | None,
                     resumed: Path | None = None) -> None:
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown and resumed:  # a run paused by an older version, e.g. with `server` (the epoch server, removed)
        raise ConfigError(f"the paused run at {resumed} takes turns with {', '.join(unknown)}, a scenario this "
                          f"version no longer has: finish it with the commit that started it")
    if unknown or not scenarios:
        raise ConfigError(f"chaos scenarios: unknown {', '.join(unknown) or '(none given)'}; choose from "
                          f"{', '.join(SCENARIOS)}")
    if "broker" in scenarios and not restartable(kafka, cfg.bootstrap_servers):
        raise ConfigError(f"the broker scenario SIGKILLs and restarts the embedded broker, and none started by "
                          f"`bin/lab kafka start` serves {cfg.bootstrap_servers}; leave out broker")


def _new_run(cfg: PipelineConfig, kills: int, records: int, seed: int, workdir: str | Path | None,
             scenarios: tuple[str, ...], kill_window: tuple[float, float], write_window: float,
             max_records_per_epoch: int | None) -> tuple[Path, RunState]:
    """A run's directory, its topic (3 partitions) and its first state."""
    name = f"chaos_{seed}_{uuid.uuid4().hex[:6]}"
    # Beside the pipeline's warehouse when that is a directory; chaos's own tables stay local.
    default = STATE_DIR / "chaos" if location_scheme(cfg.warehouse) else Path(cfg.warehouse).parent / "chaos"
    run_dir = Path(workdir or default) / name
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    batch = max(10, records // (kills + 1))  # produced before the first round and before each
    order = list(scenarios)
    round_rng(seed, 0).shuffle(order)
    state = RunState(name=name, seed=seed, kills_wanted=kills, scenarios=list(scenarios), order=order, batch=batch,
                     clock_ms=BASE_MS, kill_window=list(kill_window), write_window=write_window,
                     # Two batches an epoch: a chain that lost rounds to kills catches up soon.
                     max_records_per_epoch=max_records_per_epoch or 2 * batch, publish=cfg.publish,
                     object_store="answers" in scenarios)
    broker.create_topic(_chaos_config(cfg, state, run_dir), PARTITIONS)
    state.save(run_dir / STATE_FILE)
    return run_dir, state


def _chaos_config(cfg: PipelineConfig, state: RunState, run_dir: Path) -> PipelineConfig:
    """The user's connection settings, with the run's own topic, tables and pipeline id."""
    name = state.name
    warehouse = EmbeddedS3().uri(name, "warehouse") if state.object_store else str(run_dir / "warehouse")
    return cfg.replace(topic=name, warehouse=warehouse, counts_table="", ledger_table="",
                       dead_letter_table="", late_table="", pipeline_id=name, group_id=name,
                       start_position="earliest", on_data_loss="fail", spark_connect_connection="",
                       max_records_per_epoch=state.max_records_per_epoch, publish=state.publish,
                       publish_topic=f"{name}_sink")


def _report(state: RunState, run_dir: Path, cfg: PipelineConfig, paused: bool) -> ChaosReport:
    return ChaosReport(cfg.topic, cfg.warehouse, run_dir=str(run_dir), paused=paused,
                       kills_wanted=state.kills_wanted, sittings=len(state.sittings), kills=state.kills,
                       rounds=state.rounds, by_scenario=Counter(state.by_scenario),
                       by_phase=Counter(state.by_phase), partitions_added=state.partitions_added,
                       strays=state.strays, answers_lost=state.answers_lost, executor_rounds=state.executor_rounds)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class _Source:
    """The run's topic and what is produced to it: batches whose event-time clock moves on
    from batch to batch, out of order within (5% late, 3% malformed). The clock lives in the
    run's state; each batch's randomness comes from its round."""

    def __init__(self, cfg: PipelineConfig, state: RunState, partitions: int) -> None:
        self.cfg, self.state, self.partitions = cfg, state, partitions
        self.gen = TrafficGenerator(seed=state.seed, events_per_second=20, late_share=0.05, malformed_share=0.03)

    def produce(self, n: int, rng: random.Random) -> None:
        """``n`` records: four fifths plain, the rest in two transactions, the second aborted."""
        from kafka import KafkaProducer

        self.gen.reseed(rng.randrange(1 << 30))
        records = list(self.gen.records(n, self.state.clock_ms))
        # (And a quarter of an hour between batches: hours of counts become final as the run
        # goes on, and the maintenance racing the rounds compacts them.)
        self.state.clock_ms += n * 50 + rng.randrange(0, 5_000) + BATCH_GAP_MS
        parts = self.partitions
        plain, in_tx = records[: n * 4 // 5], records[n * 4 // 5:]
        options = broker.client_options(self.cfg)
        produce(self.cfg.bootstrap_servers, self.cfg.topic, plain, partition_of=lambda i, r: i % parts,
                client_options=options)
        producer = KafkaProducer(bootstrap_servers=self.cfg.bootstrap_servers,
                                 transactional_id=f"{self.cfg.topic}-{uuid.uuid4().hex}", **options)
        producer.init_transactions()
        half = max(1, len(in_tx) // 2)
        for k, chunk in enumerate((in_tx[:half], in_tx[half:])):
            producer.begin_transaction()
            for i, r in enumerate(chunk):
                producer.send(self.cfg.topic, key=r.key, value=r.value, partition=i % parts)
            producer.flush()
            producer.abort_transaction() if k else producer.commit_transaction()
        producer.close()

    def add_partition(self) -> None:
        from kafka.admin import NewPartitions

        self.partitions += 1
        with broker.admin_client(self.cfg) as admin:
            admin.create_partitions({self.cfg.topic: NewPartitions(total_count=self.partitions)})
        log.info("chaos: %s now has %d partitions", self.cfg.topic, self.partitions)


@dataclass
class _Moment:
    """When to kill a process: ``delay`` seconds after it started or, ``aimed`` at the
    write-ahead window, after it first logged a recorded plan."""
    delay: float
    aimed: bool


class _Killer:
    """Picks each kill's moment and makes the kills of a round."""

    def __init__(self, procs: _Processes, kill_window: tuple[float, float], write_window: float) -> None:
        self.procs, self.kill_window, self.write_window = procs, kill_window, write_window
        self.rng = random.Random()  # each round sets its own (chaos_state.round_rng)

    def moment(self, start_delay: float = 0.0) -> _Moment:
        if self.rng.random() < 0.5:
            return _Moment(self.rng.uniform(0.0, self.write_window), aimed=True)
        return _Moment(start_delay + self.rng.uniform(*self.kill_window), aimed=False)

    def due(self, proc: subprocess.Popen, moment: _Moment, started: float) -> float | None:
        """The monotonic time ``proc`` is to die at, or None while an aimed moment waits for
        the plan (after GIVE_UP_SECONDS it waits no more)."""
        if not moment.aimed:
            return started + moment.delay
        if self.procs.phase(proc) in (WRITING, DONE) or time.monotonic() > started + GIVE_UP_SECONDS:
            return time.monotonic() + moment.delay
        return None

    def wait_for(self, proc: subprocess.Popen, moment: _Moment) -> None:
        """Until ``moment`` of ``proc`` (or its exit)."""
        started, due = time.monotonic(), None
        while proc.poll() is None and (due is None or time.monotonic() < due):
            due = due or self.due(proc, moment, started)
            time.sleep(0.2)

    def kill_some(self, running: list[subprocess.Popen], start_delay: float = 0.0) -> list[str]:
        """SIGKILL one of ``running`` at a moment of its own, each other one with probability
        1/2; wait for the rest. The phases of the kills made (one that ended first is no kill)."""
        victim = self.rng.choice(running)
        doomed = {i: self.moment(start_delay) for i, p in enumerate(running)
                  if p is victim or self.rng.random() < 0.5}
        spared = [p for i, p in enumerate(running) if i not in doomed]
        started, due, phases = time.monotonic(), {}, []
        while doomed:
            for i, moment in list(doomed.items()):
                proc = running[i]
                due[i] = due.get(i) or self.due(proc, moment, started)
                if proc.poll() is not None:
                    del doomed[i]
                elif due[i] is not None and time.monotonic() >= due[i]:
                    phase = self.procs.phase(proc)
                    if self.procs.kill(proc):
                        phases.append(phase)
                    del doomed[i]
            time.sleep(0.2)
        for proc in spared:
            _wait_or_kill(self.procs, proc, SPARED_SECONDS)
        return phases


def _round(scenario: str, cfg: PipelineConfig, killer: _Killer, backfills: list[str]) -> list[str]:
    """Start the scenario's processes and kill some (:meth:`_Killer.kill_some`)."""
    args, procs = cfg.to_args(), killer.procs
    running = [procs.start("epoch", *args, "--epochs", "1000")]
    if scenario == "race":
        running.append(procs.start("epoch", *args, "--epochs", "1"))
    elif scenario == "backfill":
        spec = _random_offsets(cfg, killer.rng)
        if spec:
            backfills.append(spec)
            running.append(procs.start("backfill", "--offsets", spec, *_backfill_args(cfg, killer.rng)))
    return killer.kill_some(running)


def _backfill_args(cfg: PipelineConfig, rng: random.Random) -> list[str]:
    """A backfill run's settings, with a cap of its own: a request run again (after a kill, or
    at the finish) goes on with another cap, and a settle cuts the rest by the settling run's."""
    cap = cfg.max_records_per_epoch
    return cfg.replace(max_records_per_epoch=rng.choice((max(1, cap // 8), max(1, cap // 2), cap, 2 * cap))).to_args()


class _NoStore:
    """The run's warehouse is a local directory: no store to start, no answers to lose."""

    def __enter__(self) -> _NoStore:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def losing(self, every: int) -> None:
        raise ConfigError("the answers scenario needs the run's warehouse on its own object store")

    @property
    def lost(self) -> int:
        return 0


class _LossyStore(_NoStore):
    """The run's warehouse on an S3 store of its own (s3proxy, objects under the run's
    directory), reached through :mod:`ipcount_lab.lossy_proxy`, which loses commit answers
    while told to (:meth:`losing`). While the run lasts, the AWS variables of this process - and
    so of every process it starts - point at the proxy."""

    def __init__(self, run_dir: Path) -> None:
        self.s3 = EmbeddedS3(state_dir=run_dir / "s3", port=free_port(), authorization=False)
        ctx = multiprocessing.get_context("spawn")
        self._every, self._lost = ctx.Value("i", 0), ctx.Value("i", 0)
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> _LossyStore:
        from ipcount_lab.lossy_proxy import start_proxy

        self.s3.start()
        try:
            self.proxy, port = start_proxy(self.s3.port, self._every, self._lost)
        except BaseException:
            self.s3.stop()
            raise
        env = {**self.s3.environment(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        self._saved = {k: os.environ.get(k) for k in (*env, "AWS_ENDPOINT_URL_S3")}
        os.environ.pop("AWS_ENDPOINT_URL_S3", None)  # (it would win over AWS_ENDPOINT_URL)
        os.environ.update(env)
        log.info("chaos: the run's tables are on %s, through a proxy on port %d", self.s3.endpoint, port)
        return self

    def __exit__(self, *exc) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.proxy.kill()
        self.s3.stop()

    def losing(self, every: int) -> None:
        """Lose the answer to every ``every``-th commit the store takes from now on (0: none)."""
        self._every.value = every

    @property
    def lost(self) -> int:
        """Commit answers lost so far in this sitting."""
        return self._lost.value


def _answers_round(cfg: PipelineConfig, killer: _Killer, state: RunState, store: _NoStore) -> list[str]:
    """The chain and a backfill racing, as in the backfill round, while the store loses the
    answer to every :data:`LOSE_EVERY`-th commit it takes: the writer tries again and is told
    the commit exists, or gives up, and must find its own commit there, not take it for
    another's or make it twice."""
    lost = store.lost
    store.losing(LOSE_EVERY)
    try:
        return _round("backfill", cfg, killer, state.backfills)
    finally:
        store.losing(0)
        state.answers_lost += store.lost - lost


def _complete_rebuild(cfg: PipelineConfig, procs: _Processes, state: RunState, run_dir: Path) -> None:
    """If rebuild rounds ran: the chain, then the rebuild into the replay target, run to their
    end, no kill, and the source's committed epochs - what the target must then hold - kept
    in the state. Once (before retention deletes anything: a rebuild needs every offset it
    replays). The chain first, so that the rebuild has every epoch counted so far to replay,
    however the kills fell before (they may have left none committed)."""
    if REBUILD not in state.by_scenario or state.rebuilt is not None:
        return
    _run_to_end(procs, "the chain, before completing the rebuild", "epoch", "--epochs", "1000", *cfg.to_args())
    epochs = sorted({r["epoch"] for r in read_rows(cfg.ledger_path, ["epoch", "topic", "status"])
                     if r["topic"] == cfg.topic and r["status"] == COMMITTED})
    log.info("chaos: completing the rebuild into %s (%d committed epochs)", REPLAY_TARGET, len(epochs))
    _run_to_end(procs, f"completing the rebuild into {REPLAY_TARGET}", "rebuild", "--into", REPLAY_TARGET,
                *cfg.to_args())
    state.rebuilt = epochs
    state.save(run_dir / STATE_FILE)


def _retention_round(cfg: PipelineConfig, killer: _Killer, state: RunState, run_dir: Path) -> list[str]:
    """The chain and a backfill of random ranges, both under ``skip`` or both under ``fail`` (the
    round's draw), the heads of partitions deleted under them up to ``write_window`` seconds
    after the chain logged a recorded plan (:func:`_delete_heads`), then kills as in
    :func:`_round`. An exit 3 (data loss) is expected here under either policy: ``fail`` stops
    at deleted offsets, and offsets deleted between an epoch's plan and its read fail it under
    ``skip`` too (the next run settles it)."""
    rng, procs = killer.rng, killer.procs
    cfg = cfg.replace(on_data_loss=rng.choice(("skip", "fail")))
    args = cfg.to_args()
    running = [procs.start("epoch", *args, "--epochs", "1000")]
    spec = _random_offsets(cfg, rng)
    if spec:
        state.backfills.append(spec)
        running.append(procs.start("backfill", "--offsets", spec, *_backfill_args(cfg, rng)))
    killer.wait_for(running[0], _Moment(rng.uniform(0.0, killer.write_window), aimed=True))
    _delete_heads(cfg, state, run_dir, rng)
    phases = killer.kill_some(running)
    for proc in running:
        if proc.returncode == EXIT_DATA_LOSS:
            log.info("chaos: %s exited %d, data loss (on_data_loss=%s): expected in a retention round",
                     procs.log_of[proc.pid].name, EXIT_DATA_LOSS, cfg.on_data_loss)
    return phases


def _delete_heads(cfg: PipelineConfig, state: RunState, run_dir: Path, rng: random.Random) -> None:
    """Delete the head of one partition and of each other with probability 1/2, up to a
    :func:`deletion_point`, as retention would: of partitions the chain has planned (before
    that, the pipeline's start there is the log start, whatever was deleted). The records are
    read back and kept (:data:`DELETED_FILE`) and the marks saved first: the recount needs them,
    and a chaos process killed in between must not leave deleted records it knows nothing of."""
    from kafka import TopicPartition

    earliest, latest = broker.partition_offsets(cfg)
    chain = _chain_ranges(cfg)
    first = rng.choice(sorted(latest))
    marks = {}
    for p in sorted(latest):
        picked, near, u = rng.random() < 0.5, rng.random() < 2 / 3, rng.random()
        if (picked or p == first) and p in chain and earliest[p] < latest[p]:
            marks[p] = deletion_point(earliest[p], latest[p], chain[p], near, u)
    with open(run_dir / DELETED_FILE, "a") as out:
        for p, until in marks.items():
            for rec in broker.read_range(cfg, p, earliest[p], until):
                value = None if rec.value is None else base64.b64encode(rec.value).decode()
                out.write(json.dumps({"partition": p, "offset": rec.offset, "timestamp": rec.timestamp,
                                      "value": value}) + "\n")
        out.flush()
        os.fsync(out.fileno())
    for p, until in marks.items():
        state.mark_deleted(p, until)
    state.save(run_dir / STATE_FILE)
    with broker.admin_client(cfg) as admin:
        admin.delete_records({TopicPartition(cfg.topic, p): until for p, until in marks.items()})
    chain_at = {p: f"[{a},{b})" for p, (a, b) in chain.items()}
    log.info("chaos: deleted %s (the chain's newest ranges: %s)",
             ", ".join(f"p{p}[{earliest[p]},{until})" for p, until in marks.items()) or "nothing",
             ", ".join(f"p{p}{r}" for p, r in sorted(chain_at.items())) or "none yet")


def deletion_point(start: int, end: int, chain: tuple[int, int], near: bool, u: float) -> int:
    """Where a retention round deletes a partition ``[start, end)`` up to (its new log start),
    in ``(start, end]``; ``u`` in [0, 1) picks. ``near``: inside the chain's newest range
    ``chain`` or a little past its end (a quarter of its size), so that an epoch planned there
    ages out before it is done; anywhere otherwise, or when that range is already gone."""
    lo, hi = start + 1, end
    if near:
        a, b = chain
        near_lo, near_hi = max(lo, a + 1), min(hi, b + max(1, (b - a) // 4))
        if near_lo <= near_hi:
            lo, hi = near_lo, near_hi
    return min(hi, lo + int(u * (hi - lo + 1)))


def _chain_ranges(cfg: PipelineConfig) -> dict[int, tuple[int, int]]:
    """Per partition, the range of the scheduled chain's newest ledger row, planned or not."""
    newest: dict[int, tuple[int, int, int]] = {}
    for r in read_rows(cfg.ledger_path, ["epoch", "topic", "partition", "from_offset", "until_offset", "kind"]):
        if r["topic"] == cfg.topic and is_scheduled(r):
            newest[r["partition"]] = max(newest.get(r["partition"], (-1, 0, 0)),
                                         (r["epoch"], r["until_offset"], r["from_offset"]))
    return {p: (a, b) for p, (_, b, a) in newest.items()}


def _connect_round(cfg: PipelineConfig, killer: _Killer, connect: EmbeddedSparkConnect,
                   backfills: list[str]) -> list[str]:
    """The chain and a backfill of random ranges on the run's Spark Connect server (each in its
    own process with a remote session); half the time the server is SIGKILLed under the chain
    at a moment of the chain's (and started again), else the processes are killed as in
    :func:`_round`. A chain whose server died fails or carries on; the next round or the
    finish picks it up."""
    remote = cfg.replace(**connect.settings())
    procs = killer.procs
    if killer.rng.random() < 0.5:
        return _round("backfill", remote, killer, backfills)
    chain = procs.start("epoch", *remote.to_args(), "--epochs", "1000")
    killer.wait_for(chain, killer.moment())
    phases = [procs.phase(chain)] if chain.poll() is None else []
    connect.kill()
    log.info("chaos: Spark Connect server SIGKILLed under the chain (%s); starting it again",
             phases[0] if phases else "gone already")
    connect.start()
    _wait_or_kill(procs, chain, SPARED_SECONDS)
    return phases


def _broker_round(cfg: PipelineConfig, killer: _Killer, kafka: EmbeddedKafka) -> list[str]:
    """The chain running, the broker SIGKILLed under it at a moment of the chain's, down for up
    to 5 s, then started again (same port, same log directories: an unclean shutdown to
    recover from). The chain may fail or carry on; either way the next round or the finish
    picks it up. The chain's phase at the kill, if it was running."""
    chain = killer.procs.start("epoch", *cfg.to_args(), "--epochs", "1000")
    killer.wait_for(chain, killer.moment())
    pid = kafka.pid()
    if pid is None:
        raise RuntimeError(f"chaos: the broker at {kafka.bootstrap_servers} is not running")
    # A broker killed under no running epoch tries nothing.
    phases = [killer.procs.phase(chain)] if chain.poll() is None else []
    try:
        kafka.kill()  # (it returns once every thread of the JVM is gone: its port closed)
        if kafka.pid() is not None or kafka.is_listening():
            raise RuntimeError(f"chaos: the broker (pid {pid}) still runs 30 s after SIGKILL")
        time.sleep(killer.rng.uniform(0.0, 5.0))
    finally:  # whatever happens, the broker (the user's, or the test suite's) comes back
        kafka.start()
    log.info("chaos: broker SIGKILLed and started again; the chain was %s", "running" if chain.poll() is None
             else f"gone (exit {chain.returncode})")
    _wait_or_kill(killer.procs, chain, SPARED_SECONDS)
    return phases


def _dag_round(cfg: PipelineConfig, killer: _Killer, backfills: list[str], home: Path) -> list[str]:
    """``airflow dags test ipcount_epoch`` (and, half the time, ``ipcount_backfill`` with a
    random request racing it): the real DAGs, operator and spark-submit, SIGKILLed mid-way."""
    env = _airflow_home(cfg, home)
    procs = killer.procs
    running = [procs.spawn("dag-epoch", [str(AIRFLOW), "dags", "test", "ipcount_epoch"], env)]
    spec = _random_offsets(cfg, killer.rng) if killer.rng.random() < 0.5 else ""
    if spec:
        backfills.append(spec)
        request = json.dumps({"offsets": spec, "max_records_per_epoch": cfg.max_records_per_epoch})
        running.append(procs.spawn("dag-backfill", [str(AIRFLOW), "dags", "test", "ipcount_backfill", "-c", request],
                                   env))
    return killer.kill_some(running, start_delay=AIRFLOW_START_SECONDS)


def _airflow_home(cfg: PipelineConfig, home: Path) -> dict[str, str]:
    """Airflow's environment for the chaos run's own home (SQLite), its database made once."""
    env = {**airflow_env(home, api_port=free_port(), spark_master=cfg.spark_master), **cfg.to_env(),
           "PYTHONPATH": str(REPO_ROOT),
           # Its own database even where the environment names the deployment's (docker-compose).
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}"}
    env.pop("AIRFLOW_CONFIG", None)
    if not (home / "airflow.db").exists():
        home.mkdir(parents=True, exist_ok=True)
        log.info("chaos: creating the Airflow database in %s", home)
        done = subprocess.run([str(AIRFLOW), "db", "migrate"], env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            (home / "airflow.db").unlink(missing_ok=True)
            raise RuntimeError(f"chaos: `airflow db migrate` failed: {(done.stdout + done.stderr)[-2000:]}")
    return env


def _sessions() -> list[tuple[int, int]]:
    """(pid, session id) of every live process (Linux /proc)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and (stat := proc_stat(proc.name)) is not None and stat[0] != "Z":
            out.append((int(proc.name), int(stat[3])))  # state ppid pgrp session ...
    return out


def _random_offsets(cfg: PipelineConfig, rng: random.Random) -> str:
    """A backfill request over random ranges of the log (from its start: a request for
    deleted offsets is refused): 'partition:from-until,...'."""
    earliest, latest = broker.partition_offsets(cfg)
    parts = []
    for p, end in sorted(latest.items()):
        if end - earliest[p] > 2 and rng.random() < 0.7:
            a = rng.randrange(earliest[p], end - 1)
            parts.append(f"{p}:{a}-{rng.randrange(a + 1, end + 1)}")
    return ",".join(parts)


def live_requests(specs: list[str], earliest: Mapping[int, int], latest: Mapping[int, int]) -> list[str]:
    """The backfill requests ``specs`` cut at the log start (one naming deleted offsets is
    refused), those left empty dropped. If none is left, one over a partition's live log: an
    unfinished backfill chunk is settled by the next backfill run, whatever its request."""
    out = []
    for spec in specs:
        live, _ = split_at_log_start(parse_offsets(spec, ""), earliest)
        if live:
            out.append(",".join(f"{r.partition}:{r.from_offset}-{r.until_offset}" for r in live))
    if specs and not out:
        out = [f"{p}:{earliest[p]}-{end}" for p, end in sorted(latest.items()) if earliest[p] < end][:1]
    return out


def _wait_or_kill(procs: _Processes, proc: subprocess.Popen, seconds: float) -> None:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        procs.kill(proc)


def _finish(cfg: PipelineConfig, procs: _Processes, connect: EmbeddedSparkConnect, backfills: list[str],
            deleted: bool) -> None:
    """No more kills: one chain epoch (its unfinished one, so that no backfill chunk waits for
    it: see :class:`ipcount.jobs.epoch.EpochRunner`), every backfill request again (each
    continues where it stopped), then the chain until nothing is left - each a process with a
    remote session on the ``connect`` server: one JVM for them all, not one each. ``deleted``:
    retention rounds deleted records; under ``skip``, so that epochs and chunks left unfinished
    over them settle, and with the requests cut at the log start."""
    if deleted:
        cfg = cfg.replace(on_data_loss="skip")
        backfills = live_requests(backfills, *broker.partition_offsets(cfg))
    args = cfg.replace(**connect.settings()).to_args()
    for command in ([["epoch", "--epochs", "1"]] + [["backfill", "--offsets", spec] for spec in backfills]
                    + [["epoch", "--epochs", "1000"]]):
        _run_to_end(procs, f"finishing `ipcount {' '.join(command)}`", *command, *args)


def _run_to_end(procs: _Processes, what: str, *args: str, timeout: float = 1800.0) -> None:
    """``ipcount ARGS`` without kills, to its end: an error naming its log unless it exits 0
    within ``timeout`` seconds (then it is killed)."""
    proc = procs.start(*args)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        procs.kill(proc)
        code = None
    if code != 0:
        outcome = f"not done after {timeout:.0f} s" if code is None else f"exit code {code}"
        raise RuntimeError(f"chaos: {what} failed ({outcome}; see {procs.log_of[proc.pid]})")


class _Kept(NamedTuple):
    """A record a retention round deleted, as read back before (what the recount reads of one)."""
    offset: int
    timestamp: int
    value: bytes | None


def _kept_records(run_dir: Path) -> dict[tuple[int, int], _Kept]:
    """(partition, offset) -> the records retention rounds deleted (:data:`DELETED_FILE`)."""
    path, out = run_dir / DELETED_FILE, {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
            except ValueError:  # torn by a kill of chaos itself, before its records were deleted
                continue
            value = None if d["value"] is None else base64.b64decode(d["value"])
            out[(d["partition"], d["offset"])] = _Kept(d["offset"], d["timestamp"], value)
    return out


@dataclass(frozen=True)
class LedgerCheck:
    """What became of each offset, by the ledger (:func:`check_ledger`)."""
    counted: Mapping[tuple[int, int], Row]  # records a committed row owns -> that row
    lost: frozenset[tuple[int, int]]      # records a lost row owns below the deletion mark: deleted uncounted
    owners: Mapping[tuple[int, int], int]  # offsets more than one row owns -> how many (duplicates)
    unowned: frozenset[tuple[int, int]]   # records no row owns (losses)
    lost_live: frozenset[tuple[int, int]]  # offsets a lost row owns at or above the mark: never deleted (losses)


def check_ledger(rows: Iterable[Row], records: Iterable[tuple[int, int]], deleted: Mapping[int, int]) -> LedgerCheck:
    """The ledger ``rows`` against the committed ``records`` (partition, offset) and
    ``deleted`` (partition -> every offset below it was deleted): every record is owned by a
    row (a planned row is an unfinished epoch, reported apart), no offset by two; a ``lost`` row
    owns only deleted offsets. So a record below the mark is counted (before it aged out) or
    lost, one at or above it is counted."""
    owners: Counter = Counter()
    owner: dict[tuple[int, int], Row] = {}
    lost_live = set()
    for r in rows:
        p = r["partition"]
        for o in range(r["from_offset"], r["until_offset"]):
            owners[(p, o)] += 1
            owner[(p, o)] = r
            if r["status"] == LOST and o >= deleted.get(p, 0):
                lost_live.add((p, o))
    records = set(records)
    return LedgerCheck(counted={k: owner[k] for k in records if k in owner and owner[k]["status"] == COMMITTED},
                       lost=frozenset(k for k in records
                                      if k in owner and owner[k]["status"] == LOST and k not in lost_live),
                       owners={k: n for k, n in owners.items() if n > 1},
                       unowned=frozenset(k for k in records if k not in owner), lost_live=frozenset(lost_live))


def _recount(cfg: PipelineConfig, report: ChaosReport, deleted: Mapping[int, int],
             kept: dict[tuple[int, int], _Kept], rebuilt: list[int] | None) -> None:
    """Compare the tables with a plain-Python recount over the ledger's epochs, of Kafka and of
    the ``kept`` copies of what retention rounds ``deleted``; and the replay target, if the
    run ``rebuilt`` it, with the source's epochs it must hold."""
    earliest, latest = broker.partition_offsets(cfg)
    in_kafka: dict[tuple[int, int], object] = dict(kept)
    for p, end in latest.items():
        for rec in broker.read_range(cfg, p, earliest[p], end):
            in_kafka[(p, rec.offset)] = rec
    report.records = len(in_kafka)
    report.deleted = sum(o < deleted.get(p, 0) for p, o in in_kafka)
    rows = [r for r in read_rows(cfg.ledger_path) if r["topic"] == cfg.topic]
    report.epochs = len({r["epoch"] for r in rows if r["status"] == COMMITTED})
    unfinished = sorted({r["epoch"] for r in rows if r["status"] not in (COMMITTED, LOST)})
    if unfinished:
        report.problems.append(f"unfinished epochs after the final run: {unfinished}")

    check = _check_owners(report, rows, in_kafka, deleted, "ledger")
    report.lost = len(check.lost)
    report.counted = _recount_tables(cfg, report, check.counted, in_kafka, "")
    if rebuilt is not None:
        _recount_rebuild(cfg, report, rows, rebuilt, in_kafka)


def _check_owners(report: ChaosReport, rows: list[Row], records: Iterable[tuple[int, int]],
                  deleted: Mapping[int, int], what: str) -> LedgerCheck:
    """:func:`check_ledger`, its duplicates and losses added to ``report``."""
    check = check_ledger(rows, records, deleted)
    overlapping = sum(n - 1 for n in check.owners.values())
    report.duplicates += overlapping
    report.losses += len(check.unowned) + len(check.lost_live)
    if overlapping or check.unowned:
        report.problems.append(f"{what}: {overlapping} offsets owned twice ({_spans(check.owners)}), "
                               f"{len(check.unowned)} records owned by none ({_spans(check.unowned)}; deletion "
                               f"marks {dict(sorted(deleted.items()))})")
    if check.lost_live:
        live = [f"epoch {r['epoch']} p{r['partition']}[{r['from_offset']},{r['until_offset']})" for r in rows
                if r["status"] == LOST and r["until_offset"] > deleted.get(r["partition"], 0)]
        report.problems.append(f"{what}: {len(check.lost_live)} offsets recorded lost that were never deleted "
                               f"(marks {dict(sorted(deleted.items()))}): {', '.join(live)}")
    return check


def _recount_tables(cfg: PipelineConfig, report: ChaosReport, counted: Mapping[tuple[int, int], Row],
                    in_kafka: Mapping[tuple[int, int], object], where: str) -> int:
    """The counts, dead-letter and late tables of ``cfg`` against a recount of the ``counted``
    records (each with the ledger row that owns it); differences added to ``report``. The
    total of the counts table."""
    expected_counts: Counter = Counter()
    expected_dead: Counter = Counter()
    expected_late: Counter = Counter()
    for (p, o), r in counted.items():  # (each once: an offset owned twice is a duplicate already)
        outcome, key = recount_record(cfg, r, in_kafka[(p, o)])
        if outcome == MALFORMED:
            expected_dead[(p, o, key)] += 1
        elif outcome == LATE:
            expected_late[(p, o)] += 1
        else:
            expected_counts[key] += 1
    actual_counts = table_counts(cfg.counts_path)
    actual_dead = Counter((r["partition"], r["offset"], r["reason"])
                          for r in read_rows(cfg.dead_letter_path, ["partition", "offset", "reason"]))
    actual_late = Counter((r["partition"], r["offset"]) for r in read_rows(cfg.late_path, ["partition", "offset"]))
    for what, want, got in (("counts", expected_counts, actual_counts), ("dead letters", expected_dead, actual_dead),
                            ("late records", expected_late, actual_late)):
        over = sum(max(0, got[k] - want[k]) for k in got)
        under = sum(max(0, want[k] - got[k]) for k in want)
        report.duplicates += over
        report.losses += under
        if over or under:
            report.problems.append(f"{where}{what}: {over} more than the recount, {under} fewer")
    return sum(actual_counts.values())


def _recount_rebuild(cfg: PipelineConfig, report: ChaosReport, source_rows: list[Row], rebuilt: list[int],
                     in_kafka: Mapping[tuple[int, int], object]) -> None:
    """The replay target holds exactly the source's epochs ``rebuilt`` (same ranges, all
    committed), and its tables equal a recount of them."""
    target = cfg.for_target(REPLAY_TARGET)
    rows = [r for r in read_rows(target.ledger_path) if r["topic"] == cfg.topic]
    report.rebuilt = len({r["epoch"] for r in rows})

    def ranges(of: Iterable[Row]) -> set[tuple]:
        return {(r["epoch"], r["partition"], r["from_offset"], r["until_offset"], r["status"]) for r in of}
    want, got = ranges(r for r in source_rows if r["epoch"] in set(rebuilt)), ranges(rows)
    if want != got:
        report.losses += len(want - got)
        report.duplicates += len(got - want)
        report.problems.append(f"replay target: {len(want - got)} of the source's ledger rows missing "
                               f"({sorted(want - got)[:5]}), {len(got - want)} the source has not "
                               f"({sorted(got - want)[:5]})")
    owned = {(r["partition"], o) for r in rows for o in range(r["from_offset"], r["until_offset"])} & in_kafka.keys()
    check = _check_owners(report, rows, owned, {}, "replay target ledger")
    _recount_tables(target, report, check.counted, in_kafka, "replay target ")


def _spans(offsets: Iterable[tuple[int, int]]) -> str:
    """(partition, offset) pairs as ``p0[3,5) p1[7,8)``: runs of offsets."""
    runs: list[list[int]] = []
    for p, o in sorted(offsets):
        if runs and runs[-1][0] == p and runs[-1][2] == o:
            runs[-1][2] = o + 1
        else:
            runs.append([p, o, o + 1])
    return " ".join(f"p{p}[{a},{b})" for p, a, b in runs) or "-"


def _iso_ms(text: str) -> int:
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def _recount_sink(cfg: PipelineConfig, report: ChaosReport) -> None:
    """With publishing on: publish what the finish committed, then check the sink topic as a
    read_committed consumer sees it: no (version, key) twice, its last value per key is the
    counts table's row, and no live epoch changed a row after it was published final
    (:func:`live_changes_to_final_rows`)."""
    from ipcount.jobs.publish import publish_pending
    from ipcount.storage.publisher import committed_records

    publish_pending(cfg)
    records = committed_records(cfg, cfg.publish_topic, timeout_seconds=300)
    report.published = len(records)
    sent = Counter((dict(r.headers).get("ipcount-version"), r.key) for r in records)
    twice = sum(n - 1 for n in sent.values() if n > 1)
    values = [json.loads(r.value) for r in records]
    last = {r.key: v for r, v in zip(records, values)}
    changed = live_changes_to_final_rows(values)
    report.final_changes = len(changed)
    if changed:
        report.problems.append(f"sink topic: {len(changed)} rows published final were changed by live epochs "
                               f"afterwards, e.g. {changed[:3]}")
    got = Counter({(_iso_ms(v["window_start"]), v["ip"]): v["count"] for v in last.values()})
    want = table_counts(cfg.counts_path)
    over = sum(max(0, got[k] - want[k]) for k in got) + twice
    under = sum(max(0, want[k] - got[k]) for k in want)
    report.duplicates += over
    report.losses += under
    if over or under:
        report.problems.append(f"sink topic: {twice} records sent twice, counts {over - twice} above the table, "
                               f"{under} below")


def live_changes_to_final_rows(values: Iterable[Mapping]) -> list[Mapping]:
    """Of the sink topic's values in the order published (per key, the order of its partition),
    those by which a live epoch changed the count of a row published final before. A backfill
    may correct a closed window (its new count is then the final one); a live epoch's records
    for a closed window go to the late table, never into the count."""
    final: dict[tuple[str, str], int] = {}
    out = []
    for v in values:
        key = (v["window_start"], v["ip"])
        if key in final and v["kind"] == LIVE and v["count"] != final[key]:
            out.append(v)
        if v["is_final"]:
            final[key] = v["count"]
    return out


def report_json(report: ChaosReport) -> str:
    return json.dumps({"ok": None if report.paused else report.ok, "paused": report.paused,
                       "sittings": report.sittings, "run_dir": report.run_dir, "kills": report.kills,
                       "kills_wanted": report.kills_wanted, "rounds": report.rounds,
                       "scenarios": dict(report.by_scenario), "phases": {p: report.by_phase[p] for p in PHASES},
                       "partitions_added": report.partitions_added,
                       "strays": report.strays,
                       "records": report.records, "deleted": report.deleted, "lost": report.lost,
                       "epochs": report.epochs, "counted": report.counted,
                       "published": report.published, "rebuilt": report.rebuilt,
                       "answers_lost": report.answers_lost, "executor_rounds": report.executor_rounds,
                       "final_changes": report.final_changes,
                       "maintenance": report.maintenance,
                       "duplicates": report.duplicates, "losses": report.losses, "problems": report.problems,
                       "topic": report.topic, "warehouse": report.warehouse})
