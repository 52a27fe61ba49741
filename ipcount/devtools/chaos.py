"""``ipcount chaos``: the exactly-once claim, tried against your own broker.

It makes a topic and a warehouse of its own (never the pipeline's), produces a known data
set - out of order, late, malformed, committed and aborted transactions - and then runs
the real commands as separate processes, the way a scheduler, an operator and a crash
would: the chain (``ipcount epoch``), a hand-run epoch racing it, backfills over random
offset ranges racing both, the epoch server (``ipcount serve``) with epochs sent to it, and
the DAGs (``airflow dags test`` of ``ipcount_epoch``, with ``ipcount_backfill`` racing it
half the time, in an Airflow home of its own). Each round produces a batch of new records
first, so every round has work to interrupt, then SIGKILLs one of its processes (the whole
process group, the Spark JVM with it) at a random moment, and each other one with
probability 1/2 at a moment of its own - or, in the ``broker`` scenario, SIGKILLs the
embedded Kafka broker under a running chain and starts it again. It adds a partition half
way. Then it lets the chain and every backfill finish without kills, and recounts
everything in plain Python from Kafka (:mod:`ipcount.rules.records`, not Spark):

* **duplicates**: counts above the recount, dead-letter or late rows of an offset more
  than once or of an offset that should have none, ledger ranges that overlap;
* **losses**: counts below the recount, missing dead-letter or late rows, records in
  Kafka that no ledger row covers.

Both must be 0. Scenarios take turns (in a shuffled order), each at least once, so a run
of ``n`` kills tries each of ``k`` scenarios at least once and about ``n / k`` times.
"""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ipcount.devtools.embedded_airflow import airflow_env
from ipcount.devtools.embedded_kafka import EmbeddedKafka, free_port, proc_stat
from ipcount.devtools.generator import TrafficGenerator, produce
from ipcount.rules.config import REPO_ROOT, PipelineConfig
from ipcount.rules.errors import ConfigError
from ipcount.jobs.verify import LATE, MALFORMED, recount_record, table_counts
from ipcount.rules.ledger import COMMITTED, LOST
from ipcount.storage import broker
from ipcount.storage.delta import read_rows

log = logging.getLogger(__name__)

SCENARIOS = ("chain", "race", "backfill", "server", "dag", "broker")
AIRFLOW = Path(sys.executable).parent / "airflow"
AIRFLOW_START_SECONDS = 10.0  # `airflow dags test` imports and parses before spark-submit starts
BASE_MS = 1_795_255_200_000  # 2026-11-21T10:00:00Z: event times, well behind any Kafka timestamp


@dataclass
class ChaosReport:
    topic: str
    warehouse: str
    kills: int = 0
    rounds: int = 0
    by_scenario: Counter = field(default_factory=Counter)
    partitions_added: int = 0
    strays: int = 0              # processes of the run still alive after their round, killed
    records: int = 0             # committed records in Kafka
    epochs: int = 0              # committed epochs in the ledger
    counted: int = 0
    duplicates: int = 0
    losses: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.duplicates == 0 and self.losses == 0

    def line(self) -> str:
        scenarios = ", ".join(f"{k} {v}" for k, v in sorted(self.by_scenario.items()))
        verdict = "OK" if self.ok else "FAILED"
        return (f"chaos {verdict}: {self.kills} kills survived in {self.rounds} rounds ({scenarios}); "
                f"{self.partitions_added} partition(s) added; {self.strays} stray process(es) killed; "
                f"{self.records} records in Kafka, {self.epochs} epochs committed, {self.counted} counted; duplicates {self.duplicates}, losses {self.losses}")


class _Processes:
    """The CLI commands chaos starts: each in a process group of its own, so a kill takes
    its Spark JVM with it; output to a log file per process."""

    def __init__(self, cfg: PipelineConfig, logs: Path) -> None:
        self.cfg, self.logs = cfg, logs
        self.count = 0
        self.sessions: set[int] = set()  # each started process leads a session of its own
        self.started: list[subprocess.Popen] = []

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
        return proc

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
        """SIGKILL the process group; whether it was still running."""
        alive = proc.poll() is None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        return alive


def _first_broker(bootstrap_servers: str) -> tuple[str, int]:
    host, _, port = bootstrap_servers.split(",")[0].strip().rpartition(":")
    return host, int(port)


def embedded_broker(state_dir: str | Path, bootstrap_servers: str) -> EmbeddedKafka:
    """The embedded broker under ``state_dir`` on the port ``bootstrap_servers`` names (as
    ``ipcount kafka start --port`` makes it); it may not be running."""
    _, port = _first_broker(bootstrap_servers)
    return EmbeddedKafka(state_dir=Path(state_dir), port=port, controller_port=port + 1)


def restartable(kafka: EmbeddedKafka | None, bootstrap_servers: str) -> bool:
    """Whether ``kafka`` is a running embedded broker and the one ``bootstrap_servers`` names."""
    if kafka is None or kafka.pid() is None:
        return False
    host, port = _first_broker(bootstrap_servers)
    return host in ("127.0.0.1", "localhost") and port == kafka.port


def run_chaos(cfg: PipelineConfig, kills: int = 20, records: int = 3000, seed: int = 1,
              workdir: str | Path | None = None, max_seconds: float = 3600.0,
              scenarios: tuple[str, ...] = SCENARIOS, kill_window: tuple[float, float] = (2.0, 30.0),
              max_records_per_epoch: int | None = None, broker_to_restart: EmbeddedKafka | None = None
              ) -> ChaosReport:
    """Kill runners ``kills`` times and give each scenario a round (or stop at ``max_seconds``),
    finish, recount; the report.
    Each kill comes ``kill_window`` seconds (uniformly random) after its round started.
    The ``broker`` scenario needs ``broker_to_restart``: the embedded broker serving ``cfg``."""
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown or not scenarios:
        raise ConfigError(f"chaos scenarios: unknown {', '.join(unknown) or '(none given)'}; choose from "
                          f"{', '.join(SCENARIOS)}")
    if "broker" in scenarios and not restartable(broker_to_restart, cfg.bootstrap_servers):
        raise ConfigError(f"the broker scenario SIGKILLs and restarts the embedded broker, and none started by "
                          f"`ipcount kafka start` serves {cfg.bootstrap_servers}; leave out broker")
    rng = random.Random(seed)
    name = f"chaos_{seed}_{uuid.uuid4().hex[:6]}"
    workdir = Path(workdir or Path(cfg.warehouse).parent / "chaos") / name
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    batch = max(10, records // (kills + 1))  # produced before the first round and before each
    chaos_cfg = cfg.replace(topic=name, warehouse=str(workdir / "warehouse"), counts_table="", ledger_table="",
                            dead_letter_table="", late_table="", pipeline_id=name, group_id=name,
                            start_position="earliest", on_data_loss="fail", epoch_server="",
                            max_records_per_epoch=max_records_per_epoch or max(10, batch // 3))
    report = ChaosReport(chaos_cfg.topic, chaos_cfg.warehouse)
    broker.create_topic(chaos_cfg, 3)
    log.info("chaos: topic %s, warehouse %s, logs %s", name, chaos_cfg.warehouse, workdir / "logs")
    source = _Source(chaos_cfg, rng, partitions=3)
    source.produce(batch)
    procs = _Processes(chaos_cfg, workdir / "logs")
    backfills: list[str] = []
    order = list(scenarios)
    rng.shuffle(order)
    deadline = time.monotonic() + max_seconds
    try:
        # Until enough kills, and every scenario has had its round (a round may kill more than one).
        while (report.kills < kills or report.rounds < len(order)) and time.monotonic() < deadline:
            if report.partitions_added == 0 and report.kills >= kills // 2:
                source.add_partition()
                report.partitions_added += 1
            source.produce(batch)
            scenario = order[report.rounds % len(order)]
            report.rounds += 1
            report.by_scenario[scenario] += 1
            if scenario == "broker":
                killed = _broker_round(chaos_cfg, procs, rng, kill_window, broker_to_restart)
            elif scenario == "dag":
                killed = _dag_round(chaos_cfg, procs, rng, backfills, kill_window, workdir / "airflow")
            else:
                killed = _round(scenario, chaos_cfg, procs, rng, backfills, kill_window)
            report.kills += killed
            report.strays += procs.kill_all()
            log.info("chaos round %d (%s): %d kill(s), %d in all", report.rounds, scenario, killed, report.kills)
        _finish(chaos_cfg, procs, backfills)
    finally:  # an error or Ctrl-C leaves no JVM of the run behind (they are in sessions of their own)
        procs.kill_all()
    _recount(chaos_cfg, report)
    log.info("%s", report.line())
    return report


class _Source:
    """The run's topic and what is produced to it: batches whose event-time clock moves on
    from batch to batch, out of order within (5% late, 3% malformed)."""

    def __init__(self, cfg: PipelineConfig, rng: random.Random, partitions: int) -> None:
        self.cfg, self.rng, self.partitions = cfg, rng, partitions
        self.gen = TrafficGenerator(seed=rng.randrange(1 << 30), events_per_second=20, late_share=0.05,
                                    malformed_share=0.03)
        self.clock_ms = BASE_MS

    def produce(self, n: int) -> None:
        """``n`` records: four fifths plain, the rest in two transactions, the second aborted."""
        from kafka import KafkaProducer

        records = list(self.gen.records(n, self.clock_ms))
        self.clock_ms += n * 50 + self.rng.randrange(0, 5_000)
        parts = self.partitions
        plain, in_tx = records[: n * 4 // 5], records[n * 4 // 5:]
        produce(self.cfg.bootstrap_servers, self.cfg.topic, plain, partition_of=lambda i, r: i % parts)
        producer = KafkaProducer(bootstrap_servers=self.cfg.bootstrap_servers,
                                 transactional_id=f"{self.cfg.topic}-{uuid.uuid4().hex}")
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


def _round(scenario: str, cfg: PipelineConfig, procs: _Processes, rng: random.Random, backfills: list[str],
           kill_window: tuple[float, float]) -> int:
    """Start the scenario's processes, SIGKILL one of them at a random moment; kills made."""
    args = cfg.to_args()
    if scenario == "server":
        return _server_round(cfg, procs, rng, kill_window)
    running = [procs.start("epoch", *args, "--epochs", "1000")]
    if scenario == "race":
        running.append(procs.start("epoch", *args, "--epochs", "1"))
    elif scenario == "backfill":
        spec = _random_offsets(cfg, rng)
        if spec:
            backfills.append(spec)
            running.append(procs.start("backfill", "--offsets", spec, *args))
    return _kill_some(procs, rng, running, kill_window)


def _kill_some(procs: _Processes, rng: random.Random, running: list[subprocess.Popen],
               kill_window: tuple[float, float], delay: float = 0.0) -> int:
    """SIGKILL one of ``running`` at a random moment of the kill window (counted from JVM
    start-up to the ledger commit of a later epoch), each other one with probability 1/2 at
    a moment of its own; wait for the rest. Kills made (a process already gone is no kill)."""
    victim = rng.choice(running)
    doomed = sorted((delay + rng.uniform(*kill_window), i) for i, p in enumerate(running)
                    if p is victim or rng.random() < 0.5)
    started, killed = time.monotonic(), 0
    for at, i in doomed:
        time.sleep(max(0.0, started + at - time.monotonic()))
        killed += int(procs.kill(running[i]))
    spared = set(range(len(running))) - {i for _, i in doomed}
    for i in sorted(spared):
        _wait_or_kill(procs, running[i], 180)
    return killed


def _broker_round(cfg: PipelineConfig, procs: _Processes, rng: random.Random, kill_window: tuple[float, float],
                  kafka: EmbeddedKafka) -> int:
    """The chain running, the broker SIGKILLed under it at a random moment, down for up to 5 s,
    then started again (same port, same log directories: an unclean shutdown to recover from).
    The chain may fail or carry on; either way the next round or the finish picks it up."""
    chain = procs.start("epoch", *cfg.to_args(), "--epochs", "1000")
    time.sleep(rng.uniform(*kill_window))
    pid = kafka.pid()
    if pid is None:
        raise RuntimeError(f"chaos: the broker at {kafka.bootstrap_servers} is not running")
    chain_alive = chain.poll() is None  # a broker killed under no running epoch tries nothing
    try:
        os.kill(pid, signal.SIGKILL)
        gone = time.monotonic() + 30
        while kafka.pid() is not None and time.monotonic() < gone:
            time.sleep(0.1)
        if kafka.pid() is not None:
            raise RuntimeError(f"chaos: the broker (pid {pid}) still runs 30 s after SIGKILL")
        time.sleep(rng.uniform(0.0, 5.0))
    finally:  # whatever happens, the broker (the user's, or the test suite's) comes back
        kafka.start()
    log.info("chaos: broker SIGKILLed and started again; the chain was %s", "running" if chain.poll() is None
             else f"gone (exit {chain.returncode})")
    _wait_or_kill(procs, chain, 180)
    return int(chain_alive)


def _dag_round(cfg: PipelineConfig, procs: _Processes, rng: random.Random, backfills: list[str],
               kill_window: tuple[float, float], home: Path) -> int:
    """``airflow dags test ipcount_epoch`` (and, half the time, ``ipcount_backfill`` with a
    random request racing it): the real DAGs, operator and spark-submit, SIGKILLed mid-way."""
    env = _airflow_home(cfg, home)
    running = [procs.spawn("dag-epoch", [str(AIRFLOW), "dags", "test", "ipcount_epoch"], env)]
    spec = _random_offsets(cfg, rng) if rng.random() < 0.5 else ""
    if spec:
        backfills.append(spec)
        request = json.dumps({"offsets": spec, "max_records_per_epoch": cfg.max_records_per_epoch})
        running.append(procs.spawn("dag-backfill", [str(AIRFLOW), "dags", "test", "ipcount_backfill", "-c", request],
                                   env))
    return _kill_some(procs, rng, running, kill_window, delay=AIRFLOW_START_SECONDS)


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


def _server_round(cfg: PipelineConfig, procs: _Processes, rng: random.Random,
                  kill_window: tuple[float, float]) -> int:
    """An epoch server with epochs sent to it, SIGKILLed mid-way."""
    from ipcount.server import client

    try:
        server, url = _start_server(cfg, procs)
    except Exception as e:  # noqa: BLE001 - a server that never came up is killed like the rest
        log.warning("chaos: the epoch server did not come up (%s)", str(e).splitlines()[0])
        return 0

    def send() -> None:
        try:
            client.submit(url, ["epoch", *cfg.to_args(), "--epochs", "1000"], on_log=lambda line: None)
        except Exception:  # noqa: BLE001 - the kill breaks the connection
            pass
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    time.sleep(rng.uniform(*kill_window) / 2)  # the server is up: no JVM start to wait for
    killed = int(procs.kill(server))
    sender.join(timeout=30)
    return killed


def _start_server(cfg: PipelineConfig, procs: _Processes) -> tuple[subprocess.Popen, str]:
    """``ipcount serve`` on a free port, ready; the process and its URL."""
    from ipcount.server import client

    port = free_port()
    server = procs.start("serve", "--port", str(port), "--no-warm-up", *cfg.to_args())
    url = f"http://127.0.0.1:{port}"
    try:
        client.wait_until_ready(url, server, procs.last_log, timeout=300)
    except BaseException:
        procs.kill(server)
        raise
    return server, url


def _random_offsets(cfg: PipelineConfig, rng: random.Random) -> str:
    """A backfill request over random ranges of the log: 'partition:from-until,...'."""
    _, latest = broker.partition_offsets(cfg)
    parts = []
    for p, end in sorted(latest.items()):
        if end > 2 and rng.random() < 0.7:
            a = rng.randrange(0, end - 1)
            parts.append(f"{p}:{a}-{rng.randrange(a + 1, end + 1)}")
    return ",".join(parts)


def _wait_or_kill(procs: _Processes, proc: subprocess.Popen, seconds: float) -> None:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        procs.kill(proc)


def _finish(cfg: PipelineConfig, procs: _Processes, backfills: list[str]) -> None:
    """No more kills: every backfill request again (each continues where it stopped), then
    the chain until nothing is left - in one epoch server, to start one JVM, not one each."""
    from ipcount.server import client

    args = cfg.to_args()
    commands = [["backfill", "--offsets", spec, *args] for spec in backfills] + [["epoch", *args, "--epochs", "1000"]]
    server, url = _start_server(cfg, procs)
    finish_log, server_log = procs.logs / "finish.log", procs.last_log
    try:
        with open(finish_log, "w") as out:
            for command in commands:
                try:
                    result = client.submit(url, command, on_log=lambda line: out.write(line + "\n"),
                                           limit_seconds=1800)
                except Exception as e:
                    raise RuntimeError(f"chaos: finishing `{' '.join(command[:3])}`: {e} (see {server_log})") from e
                out.write(result.get("stdout") or "")
                if result["exit_code"] != 0:
                    raise RuntimeError(f"chaos: finishing `{' '.join(command[:3])}` failed with exit code "
                                       f"{result['exit_code']}: {result.get('error') or ''} (see {finish_log} "
                                       f"and {server_log})")
    finally:
        procs.kill(server)


def _recount(cfg: PipelineConfig, report: ChaosReport) -> None:
    """Compare the tables with a plain-Python recount of Kafka over the ledger's epochs."""
    _, latest = broker.partition_offsets(cfg)
    in_kafka: dict[tuple[int, int], object] = {}
    for p, end in latest.items():
        for rec in broker.read_range(cfg, p, 0, end):
            in_kafka[(p, rec.offset)] = rec
    report.records = len(in_kafka)
    rows = [r for r in read_rows(cfg.ledger_path) if r["topic"] == cfg.topic]
    report.epochs = len({r["epoch"] for r in rows if r["status"] == COMMITTED})
    unfinished = sorted({r["epoch"] for r in rows if r["status"] not in (COMMITTED, LOST)})
    if unfinished:
        report.problems.append(f"unfinished epochs after the final run: {unfinished}")

    owner: Counter = Counter()
    for r in rows:
        for o in range(r["from_offset"], r["until_offset"]):
            owner[(r["partition"], o)] += 1
    overlapping = sum(n - 1 for n in owner.values() if n > 1)
    uncovered = [k for k in in_kafka if owner[k] == 0]
    report.duplicates += overlapping
    report.losses += len(uncovered)
    if overlapping or uncovered:
        report.problems.append(f"ledger: {overlapping} offsets owned twice, {len(uncovered)} records owned by none")

    expected_counts: Counter = Counter()
    expected_dead: Counter = Counter()
    expected_late: Counter = Counter()
    for r in rows:
        if r["status"] != COMMITTED:
            continue
        for o in range(r["from_offset"], r["until_offset"]):
            rec = in_kafka.get((r["partition"], o))
            if rec is None:
                continue  # a transaction marker or an aborted record
            outcome, key = recount_record(cfg, r, rec)
            if outcome == MALFORMED:
                expected_dead[(r["partition"], o, key)] += 1
            elif outcome == LATE:
                expected_late[(r["partition"], o)] += 1
            else:
                expected_counts[key] += 1
    actual_counts = table_counts(cfg.counts_path)
    actual_dead = Counter((r["partition"], r["offset"], r["reason"])
                          for r in read_rows(cfg.dead_letter_path, ["partition", "offset", "reason"]))
    actual_late = Counter((r["partition"], r["offset"]) for r in read_rows(cfg.late_path, ["partition", "offset"]))
    report.counted = sum(actual_counts.values())
    for what, want, got in (("counts", expected_counts, actual_counts), ("dead letters", expected_dead, actual_dead),
                            ("late records", expected_late, actual_late)):
        over = sum(max(0, got[k] - want[k]) for k in got)
        under = sum(max(0, want[k] - got[k]) for k in want)
        report.duplicates += over
        report.losses += under
        if over or under:
            report.problems.append(f"{what}: {over} more than the recount, {under} fewer")


def report_json(report: ChaosReport) -> str:
    return json.dumps({"ok": report.ok, "kills": report.kills, "rounds": report.rounds,
                       "scenarios": dict(report.by_scenario), "partitions_added": report.partitions_added,
                       "strays": report.strays,
                       "records": report.records, "epochs": report.epochs, "counted": report.counted,
                       "duplicates": report.duplicates, "losses": report.losses, "problems": report.problems,
                       "topic": report.topic, "warehouse": report.warehouse})
