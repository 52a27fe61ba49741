"""``ipcount chaos``: the exactly-once claim, tried against your own broker.

It makes a topic and a warehouse of its own (never the pipeline's), produces a known data
set - out of order, late, malformed, committed and aborted transactions - and then runs
the real commands as separate processes, the way a scheduler, an operator and a crash
would: the chain (``ipcount epoch``), a hand-run epoch racing it, backfills over random
offset ranges racing both, and the epoch server (``ipcount serve``) with epochs sent to
it. It SIGKILLs one of them (its whole process group, the Spark JVM with it) at a random
moment, round after round, and adds a partition (with more data) half way. Then it lets
the chain and every backfill finish without kills, and recounts everything in plain
Python from Kafka (:mod:`ipcount.rules.records`, not Spark):

* **duplicates**: counts above the recount, dead-letter or late rows of an offset more
  than once or of an offset that should have none, ledger ranges that overlap;
* **losses**: counts below the recount, missing dead-letter or late rows, records in
  Kafka that no ledger row covers.

Both must be 0. Broker restarts and the DAG path are not part of it yet.
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

from ipcount.devtools.generator import TrafficGenerator, produce
from ipcount.rules.config import REPO_ROOT, PipelineConfig
from ipcount.jobs.verify import LATE, MALFORMED, recount_record, table_counts
from ipcount.rules.ledger import COMMITTED, LOST
from ipcount.storage import broker
from ipcount.storage.delta import read_rows

log = logging.getLogger(__name__)

SCENARIOS = ("chain", "race", "backfill", "server")
BASE_MS = 1_795_255_200_000  # 2026-11-21T10:00:00Z: event times, well behind any Kafka timestamp


@dataclass
class ChaosReport:
    topic: str
    warehouse: str
    kills: int = 0
    rounds: int = 0
    by_scenario: Counter = field(default_factory=Counter)
    partitions_added: int = 0
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
                f"{self.partitions_added} partition(s) added; {self.records} records in Kafka, {self.epochs} "
                f"epochs committed, {self.counted} counted; duplicates {self.duplicates}, losses {self.losses}")


class _Processes:
    """The CLI commands chaos starts: each in a process group of its own, so a kill takes
    its Spark JVM with it; output to a log file per process."""

    def __init__(self, cfg: PipelineConfig, logs: Path) -> None:
        self.cfg, self.logs = cfg, logs
        self.count = 0

    def start(self, *args: str) -> subprocess.Popen:
        self.count += 1
        path = self.logs / f"{self.count:04d}-{args[0]}.log"
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        with open(path, "w") as out:
            return subprocess.Popen([sys.executable, "-m", "ipcount.cli", *args], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)

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


def run_chaos(cfg: PipelineConfig, kills: int = 20, records: int = 3000, seed: int = 1,
              workdir: str | Path | None = None, max_seconds: float = 3600.0,
              scenarios: tuple[str, ...] = SCENARIOS, kill_window: tuple[float, float] = (2.0, 30.0),
              max_records_per_epoch: int | None = None) -> ChaosReport:
    """Kill runners ``kills`` times (or until ``max_seconds``), finish, recount; the report.
    Each kill comes ``kill_window`` seconds (uniformly random) after its round started."""
    rng = random.Random(seed)
    name = f"chaos_{seed}_{uuid.uuid4().hex[:6]}"
    workdir = Path(workdir or Path(cfg.warehouse).parent / "chaos") / name
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    chaos_cfg = cfg.replace(topic=name, warehouse=str(workdir / "warehouse"), counts_table="", ledger_table="",
                            dead_letter_table="", late_table="", pipeline_id=name, group_id=name,
                            start_position="earliest", on_data_loss="fail", epoch_server="",
                            max_records_per_epoch=max_records_per_epoch or max(20, records // 10))
    report = ChaosReport(chaos_cfg.topic, chaos_cfg.warehouse)
    broker.create_topic(chaos_cfg, 3)
    log.info("chaos: topic %s, warehouse %s, logs %s", name, chaos_cfg.warehouse, workdir / "logs")
    _produce(chaos_cfg, rng, records // 2, partitions=3)
    procs = _Processes(chaos_cfg, workdir / "logs")
    backfills: list[str] = []
    deadline = time.monotonic() + max_seconds
    while report.kills < kills and time.monotonic() < deadline:
        if report.partitions_added == 0 and report.kills >= kills // 2:
            _add_partition(chaos_cfg, 4)
            report.partitions_added += 1
            _produce(chaos_cfg, rng, records - records // 2, partitions=4)
        scenario = rng.choice(scenarios)
        report.rounds += 1
        report.by_scenario[scenario] += 1
        killed = _round(scenario, chaos_cfg, procs, rng, backfills, kill_window)
        report.kills += killed
        log.info("chaos round %d (%s): %d kill(s), %d in all", report.rounds, scenario, killed, report.kills)
    _finish(chaos_cfg, procs, backfills)
    _recount(chaos_cfg, report)
    log.info("%s", report.line())
    return report


def _produce(cfg: PipelineConfig, rng: random.Random, n: int, partitions: int) -> None:
    """``n`` records: most plain, a fifth in transactions of which every other one aborts."""
    from kafka import KafkaProducer

    gen = TrafficGenerator(seed=rng.randrange(1 << 30), events_per_second=20, late_share=0.05,
                           malformed_share=0.03)
    start = BASE_MS + rng.randrange(0, 3_600_000)
    batch = list(gen.records(n, start))
    plain, in_tx = batch[: n * 4 // 5], batch[n * 4 // 5:]
    produce(cfg.bootstrap_servers, cfg.topic, plain, partition_of=lambda i, r: i % partitions)
    producer = KafkaProducer(bootstrap_servers=cfg.bootstrap_servers,
                             transactional_id=f"{cfg.topic}-{uuid.uuid4().hex}")
    producer.init_transactions()
    for k in range(0, len(in_tx), 25):
        producer.begin_transaction()
        for i, r in enumerate(in_tx[k:k + 25]):
            producer.send(cfg.topic, key=r.key, value=r.value, partition=i % partitions)
        producer.flush()
        producer.abort_transaction() if (k // 25) % 2 else producer.commit_transaction()
    producer.close()


def _add_partition(cfg: PipelineConfig, total: int) -> None:
    from kafka.admin import NewPartitions

    with broker.admin_client(cfg) as admin:
        admin.create_partitions({cfg.topic: NewPartitions(total_count=total)})
    log.info("chaos: %s now has %d partitions", cfg.topic, total)


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
    time.sleep(rng.uniform(*kill_window))  # from JVM start-up to the ledger commit of a later epoch
    victim = rng.choice(running)
    killed = int(procs.kill(victim))
    for other in running:
        if other is not victim:
            _wait_or_kill(procs, other, 120)
    return killed


def _server_round(cfg: PipelineConfig, procs: _Processes, rng: random.Random,
                  kill_window: tuple[float, float]) -> int:
    """An epoch server with epochs sent to it, SIGKILLed mid-way."""
    from ipcount.devtools.embedded_kafka import free_port
    from ipcount.server import client

    port = free_port()
    server = procs.start("serve", "--port", str(port), "--no-warm-up", *cfg.to_args())
    url = f"http://127.0.0.1:{port}"
    try:
        client.wait_until_ready(url, server, procs.logs / f"{procs.count:04d}-serve.log", timeout=180)
    except Exception as e:  # noqa: BLE001 - a server that never came up is killed like the rest
        log.warning("chaos: the epoch server did not come up (%s)", str(e).splitlines()[0])
        procs.kill(server)
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
    the chain until nothing is left."""
    args = cfg.to_args()
    for spec in backfills:
        _must_succeed(procs.start("backfill", "--offsets", spec, *args), f"backfill {spec}")
    _must_succeed(procs.start("epoch", *args, "--epochs", "1000"), "the chain")


def _must_succeed(proc: subprocess.Popen, what: str) -> None:
    code = proc.wait(timeout=1800)
    if code != 0:
        raise RuntimeError(f"chaos: finishing {what} failed with exit code {code} (see {proc.args})")


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
                       "records": report.records, "epochs": report.epochs, "counted": report.counted,
                       "duplicates": report.duplicates, "losses": report.losses, "problems": report.problems,
                       "topic": report.topic, "warehouse": report.warehouse})
