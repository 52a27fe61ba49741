"""``bin/benchmark``: this pipeline side by side with Spark Structured Streaming (the peer)
and with the read-only limits, on the same data and the same Spark settings.

Each measurement is a process of its own, started the way it would run for real (the
pipeline exactly as the DAG submits it: ``spark-submit spark_jobs/epoch_job.py epoch``),
watched for its Spark driver's peak memory (the JVM's resident set; in local mode the
driver is the whole of Spark). Two times per measurement:

* **wall**: the whole process, JVM start included - what a DAG run costs;
* **work**: from a ready Spark session to done - what the approach itself costs.

``pipeline_server`` runs the same epoch in the epoch server (``epoch_job.py serve``, started
once per benchmark and warmed up; its start is reported as ``server_start``), on tables of its
own. ``small_epochs`` adds the fixed overhead (an empty epoch through spark-submit, through the
epoch server, and the DAG's JVM-free idle check) and history growth (an epoch after a few
committed epochs against one after ``--history-epochs``, with every table grown by the epochs
between), both through spark-submit and through the server.

Ratios compare work times (and wall times beside them); the figures go to a table on stdout
and to a JSON file.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from ipcount.devtools.embedded_kafka import free_port
from ipcount.rules.config import REPO_ROOT, STATE_DIR, PipelineConfig
from ipcount.rules.ledger import EpochSummary, summaries_in
from ipcount.server import auth, client
from ipcount.server.vetting import Pipelines
from ipcount.storage.spark import DRIVER_ENV

MEASUREMENTS = ("pipeline", "pipeline_server", "peer", "spark_count", "kafka_python", "small_epochs")
BENCH_APPLICATION = str(REPO_ROOT / "spark_jobs" / "bench_job.py")


@dataclass
class Measurement:
    name: str
    what: str
    records: int
    wall_seconds: float
    work_seconds: float
    peak_driver_mb: float | None
    stages: dict[str, float] = field(default_factory=dict)
    counted: int | None = None  # requests counted into windows (pipeline and peer must agree)

    @property
    def records_per_second(self) -> float:
        return self.records / self.work_seconds if self.work_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "records_per_second": round(self.records_per_second, 1)}


class PeakMemory:
    """Samples the resident memory of the JVMs under a process, keeping the peak (MB)."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        self.pid, self.every, self.peak_mb = pid, every, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in procs if "java" in (p.name() or ""))
            except psutil.Error:
                rss = 0
            if rss:
                self.peak_mb = max(self.peak_mb or 0.0, rss / 2**20)
            self._stop.wait(self.every)

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join()
        return None if self.peak_mb is None else round(self.peak_mb, 1)


def run_process(command: Sequence[str], log_path: Path, env: dict | None = None) -> tuple[float, float | None, str]:
    """(wall seconds, peak JVM MB, output) of a command that must succeed."""
    started = time.monotonic()
    with open(log_path, "w") as log:  # a file, not a pipe: Spark's logs would fill a pipe and stall it
        proc = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})})
        memory = PeakMemory(proc.pid)
        proc.wait()
    wall = time.monotonic() - started
    peak = memory.stop()
    out = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed (exit {proc.returncode}); its output: {log_path}")
    return wall, peak, out


def spark_submit(cfg: PipelineConfig, application: str, args: Sequence[str], name: str) -> list[str]:
    """The spark-submit command line the DAG's SparkSubmitOperator builds (same master,
    jars and settings)."""
    from ipcount.storage.spark import spark_conf, spark_jars

    command = [str(Path(sys.executable).parent / "spark-submit"), "--master", cfg.spark_master,
               "--name", name, "--jars", ",".join(spark_jars())]
    for key, value in spark_conf(cfg).items():
        command += ["--conf", f"{key}={value}"]
    return [*command, application, *args]


def _last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON summary in the output: {stdout[-2000:]}")


def measure_pipeline(cfg: PipelineConfig, records: int, logs: Path, server: EpochServerProcess | None = None
                     ) -> Measurement:
    """One epoch over the whole range: through spark-submit, or in the epoch server (on a
    warehouse of its own, so both start from empty tables)."""
    if server is None:
        name, what = "pipeline", "this pipeline: one epoch over the whole range (spark-submit, as the DAG)"
        wall, peak, summaries = submit_epoch(cfg, logs, name)
    else:
        name, what = "pipeline_server", "this pipeline: the same epoch in the warm epoch server (the DAG's fast path)"
        cfg = cfg.replace(warehouse=str(Path(cfg.warehouse).parent / name), pipeline_id=f"{cfg.pipeline_id}_{name}")
        wall, peak, summaries = server.epoch(cfg, name)
    summary = summaries[-1]
    if summary.records_read != records:
        raise RuntimeError(f"the epoch did not read all {records} records: {summary}")
    stages = {k: round(v, 3) for k, v in summary.stage_seconds.items()}
    return Measurement(name, what, records, round(wall, 3), round(sum(stages.values()), 3), peak, stages,
                       summary.records_counted)


class EpochServerProcess:
    """``spark-submit spark_jobs/epoch_job.py serve`` for the benchmark: started (and warmed
    up) once, then sent epochs the way the DAG's operator sends them."""

    def __init__(self, cfg: PipelineConfig, logs: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.pipelines = logs / "pipelines"  # the other measurements' table sets, served as pipelines of their own
        self.pipelines.mkdir(exist_ok=True)
        command = spark_submit(cfg, str(REPO_ROOT / "spark_jobs" / "epoch_job.py"),
                               ["serve", *cfg.to_args(), "--port", str(port), "--pipelines-dir", str(self.pipelines)],
                               "bench-epoch-server")
        started = time.monotonic()
        self.log_file = open(logs / "epoch-server.log", "w")
        # A process group of its own: spark-submit's JVM and the Python driver it starts go together.
        self.proc = subprocess.Popen(command, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, **DRIVER_ENV}, start_new_session=True)
        state = client.wait_until_ready(self.url, self.proc, logs / "epoch-server.log", timeout=600)
        self.token = auth.read_token(cfg.epoch_server_token_path)
        self.start = Measurement("server_start", "epoch server start: JVM, Spark session and the warm-up epoch "
                                 "(once, not per epoch)", 0, round(time.monotonic() - started, 3),
                                 round(state["warm_up_seconds"] or 0.0, 3), None)

    def epoch(self, cfg: PipelineConfig, name: str, *extra: str) -> tuple[float, float | None, list[EpochSummary]]:
        """An ``epoch`` request as the operator sends it: (wall seconds, peak JVM MB, summaries)."""
        memory = PeakMemory(self.proc.pid)
        started = time.monotonic()
        Pipelines.add(self.pipelines, cfg)
        with open(Path(self.log_file.name).with_name(f"{name}.log"), "w") as log:
            result = client.submit(self.url, ["epoch", *cfg.to_args(), "--run-id", f"benchmark-{name}",
                                              "--summary-json", *extra], self.token,
                                   on_log=lambda line: print(line, file=log))
        wall = time.monotonic() - started
        peak = memory.stop()
        if result["exit_code"] != 0:
            raise RuntimeError(f"epoch {name} failed in the epoch server (exit {result['exit_code']}); "
                               f"see {self.log_file.name}")
        summaries = summaries_in(result["stdout"])
        if not summaries:
            raise RuntimeError(f"no epoch summary from the epoch server for {name}: {result['stdout'][-2000:]}")
        return wall, peak, summaries

    def stop(self) -> None:
        import signal

        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=30)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.log_file.close()


def submit_epoch(cfg: PipelineConfig, logs: Path, name: str, *extra: str
                 ) -> tuple[float, float | None, list[EpochSummary]]:
    """``spark-submit spark_jobs/epoch_job.py epoch`` as the DAG runs it: (wall seconds, peak
    JVM MB, the summary JSON of each epoch attempted)."""
    command = spark_submit(cfg, str(REPO_ROOT / "spark_jobs" / "epoch_job.py"),
                           ["epoch", *cfg.to_args(), "--run-id", f"benchmark-{name}", "--summary-json", *extra],
                           f"bench-{name}")
    wall, peak, out = run_process(command, logs / f"{name}.log", DRIVER_ENV)
    summaries = summaries_in(out)
    if not summaries:
        raise RuntimeError(f"no epoch summary in {logs / (name + '.log')}")
    return wall, peak, summaries


def measure_small_epochs(servers: str, epochs: int, per_epoch: int, partitions: int, seed: int, logs: Path,
                         workdir: Path, server: EpochServerProcess) -> tuple[dict[str, Measurement], dict]:
    """Fixed overhead and history growth, on a pipeline of ``per_epoch``-record epochs.

    Epoch 1 runs in the epoch server, epoch 2 through spark-submit (after 1 committed epoch);
    epoch 3 in the server again (after 2), and epochs 4..N there in one request. Then an empty
    epoch in the server, one through spark-submit, and the DAG's idle check (no JVM). After
    ``per_epoch`` more records epoch N+1 is submitted (after N committed epochs, the tables
    grown accordingly), and after as many again epoch N+2 runs in the server.
    """
    topic = f"bench_{uuid.uuid4().hex[:8]}_small"
    cfg = PipelineConfig(bootstrap_servers=servers, topic=topic, group_id=f"g_{topic}", pipeline_id=f"p_{topic}",
                         warehouse=str(workdir / "small_epochs"), spark_master="local[*]",
                         max_records_per_epoch=per_epoch)
    say(f"  generating {epochs} epochs of {per_epoch:,} records on {topic}")
    generate(cfg, epochs * per_epoch, partitions, seed)
    out: dict[str, Measurement] = {}

    def epoch_measurement(name: str, what: str, run: tuple[float, float | None, list[EpochSummary]], epoch: int | None,
                          records: int) -> Measurement:
        wall, peak, summaries = run
        summary = summaries[-1]
        if summary.epoch != epoch or summary.records_read != records:
            raise RuntimeError(f"{name}: expected epoch {epoch} of {records} records, got {summary}")
        stages = {k: round(v, 3) for k, v in summary.stage_seconds.items()}
        return Measurement(name, what, records, round(wall, 3), round(summary.seconds, 3), peak, stages,
                           summary.records_counted if summary.plan is not None else None)

    say("  epoch 1 (epoch server), epoch 2 (spark-submit)")
    epoch_measurement("epoch 1", "", server.epoch(cfg, "small-epoch-1"), 1, per_epoch)
    out["epoch_after_1"] = epoch_measurement("epoch_after_1", "an epoch after 1 committed epoch (spark-submit)",
                                             submit_epoch(cfg, logs, "small-epoch-2"), 2, per_epoch)
    say("  epoch 3 (epoch server)")
    out["server_epoch_after_2"] = epoch_measurement(
        "server_epoch_after_2", "an epoch after 2 committed epochs (epoch server)",
        server.epoch(cfg, "small-epoch-3"), 3, per_epoch)
    if epochs > 3:
        say(f"  epochs 4..{epochs} (epoch server, one request)")
        started = time.monotonic()
        _, _, summaries = server.epoch(cfg, "small-epochs-grow", "--epochs", str(epochs - 3))
        if [s_.epoch for s_ in summaries] != list(range(4, epochs + 1)):
            raise RuntimeError(f"expected epochs 4..{epochs}: {summaries}")
        say(f"    done in {time.monotonic() - started:.1f} s")
    say("  an empty epoch (epoch server)")
    out["empty_server"] = epoch_measurement("empty_server", "an empty epoch in the epoch server (request round trip)",
                                            server.epoch(cfg, "small-epoch-empty-server"), None, 0)
    say("  an empty epoch (spark-submit)")
    out["empty_submit"] = epoch_measurement("empty_submit", "an empty epoch through spark-submit (the DAG without "
                                            "its idle check or server)", submit_epoch(cfg, logs, "small-epoch-empty"),
                                            None, 0)
    say("  the DAG's idle check (no JVM)")
    command = [sys.executable, BENCH_APPLICATION, "idle_check", "--bootstrap-servers", servers, "--topic", topic,
               "--ending", "{}", "--workdir", cfg.warehouse]
    wall, _, text = run_process(command, logs / "idle_check.log")
    result = _last_json(text)
    if result["run"]:
        raise RuntimeError(f"the idle check wants to run an epoch although nothing is new: {result['why']}")
    out["idle_check"] = Measurement("idle_check", "the DAG's idle check: ledger by delta-rs, log ends by kafka-python",
                                    0, round(wall, 3), round(result["seconds"], 3), None)
    generate(cfg, per_epoch, partitions, seed, after=epochs * per_epoch)
    say(f"  epoch {epochs + 1} (spark-submit)")
    out[f"epoch_after_{epochs}"] = epoch_measurement(
        f"epoch_after_{epochs}", f"an epoch after {epochs} committed epochs (spark-submit)",
        submit_epoch(cfg, logs, f"small-epoch-{epochs + 1}"), epochs + 1, per_epoch)
    generate(cfg, per_epoch, partitions, seed, after=(epochs + 1) * per_epoch)
    say(f"  epoch {epochs + 2} (epoch server)")
    out[f"server_epoch_after_{epochs + 1}"] = epoch_measurement(
        f"server_epoch_after_{epochs + 1}", f"an epoch after {epochs + 1} committed epochs (epoch server)",
        server.epoch(cfg, f"small-epoch-{epochs + 2}"), epochs + 2, per_epoch)
    return out, {"epochs": epochs + 2, "records_per_epoch": per_epoch, "tables": table_sizes(cfg)}


def table_sizes(cfg: PipelineConfig) -> dict[str, dict[str, int]]:
    """Rows, data files and log versions of the pipeline's tables (read with delta-rs)."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    sizes = {}
    for name, path in (("counts", cfg.counts_path), ("ledger", cfg.ledger_path),
                       ("dead_letter", cfg.dead_letter_path), ("late", cfg.late_path)):
        table = DeltaTable(path)
        rows = pa.table(QueryBuilder().register("t", table).execute("SELECT count(*) AS n FROM t").read_all())
        sizes[name] = {"rows": rows.column("n")[0].as_py(), "files": len(table.file_uris()),
                       "version": table.version()}
    return sizes


def measure_job(cfg: PipelineConfig, job: str, what: str, records: int, logs: Path, workdir: Path,
                ending: dict[int, int]) -> Measurement:
    args = [job, "--bootstrap-servers", cfg.bootstrap_servers, "--topic", cfg.topic,
            "--ending", json.dumps({str(p): o for p, o in ending.items()}), "--workdir", str(workdir / job),
            "--window-seconds", str(cfg.window_seconds), "--allowed-lateness-seconds",
            str(cfg.allowed_lateness_seconds)]
    if job == "kafka_python":
        command = [sys.executable, BENCH_APPLICATION, *args]
    else:
        command = spark_submit(cfg, BENCH_APPLICATION, args, f"bench-{job}")
    wall, peak, out = run_process(command, logs / f"{job}.log", DRIVER_ENV)
    result = _last_json(out)
    if job != "peer" and result["records"] != records:
        raise RuntimeError(f"{job} read {result['records']} records, not {records}")
    return Measurement(job, what, records, round(wall, 3), round(result["seconds"], 3),
                       peak if job != "kafka_python" else None, result.get("stages", {}), result.get("counted"))


def job_main(argv: Sequence[str] | None = None) -> int:
    """The peer and the limits as jobs (``spark_jobs/bench_job.py``); prints a JSON line."""
    p = argparse.ArgumentParser(prog="bench_job.py", description="one benchmark measurement (used by bin/benchmark)")
    p.add_argument("job", choices=("peer", "spark_count", "kafka_python", "idle_check"))
    p.add_argument("--bootstrap-servers", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--ending", required=True, help="JSON: partition -> end offset")
    p.add_argument("--workdir", required=True)
    p.add_argument("--window-seconds", type=int, default=5)
    p.add_argument("--allowed-lateness-seconds", type=int, default=5)
    args = p.parse_args(argv)
    ending = {int(k): v for k, v in json.loads(args.ending).items()}
    cfg = PipelineConfig(bootstrap_servers=args.bootstrap_servers, topic=args.topic, window_seconds=args.window_seconds,
                         allowed_lateness_seconds=args.allowed_lateness_seconds, warehouse=args.workdir)
    from ipcount.devtools import peer

    if args.job == "idle_check":  # workdir is the pipeline's warehouse
        from ipcount.jobs import idle

        started = time.monotonic()
        verdict = idle.check(cfg)
        print(json.dumps({"run": verdict.run, "why": verdict.why, "seconds": time.monotonic() - started}), flush=True)
        return 0
    if args.job == "kafka_python":
        started = time.monotonic()
        n = peer.drain(cfg, ending)
        print(json.dumps({"records": n, "seconds": time.monotonic() - started}), flush=True)
        return 0
    from ipcount.storage.spark import get_spark

    spark = get_spark(cfg, app_name=f"bench-{args.job}")
    started = time.monotonic()
    if args.job == "spark_count":
        n = peer.spark_count(cfg, spark, ending)
        print(json.dumps({"records": n, "seconds": time.monotonic() - started}), flush=True)
        return 0
    table = str(Path(args.workdir) / "counts")
    batches = peer.run_peer(cfg, spark, table, str(Path(args.workdir) / "checkpoint"), ending)
    seconds = time.monotonic() - started
    rows = spark.read.format("delta").load(table).selectExpr("coalesce(sum(count), 0) AS n").first().n
    print(json.dumps({"records": sum(ending.values()), "counted": rows, "batches": batches, "seconds": seconds}),
          flush=True)
    return 0


def generate(cfg: PipelineConfig, records: int, partitions: int, seed: int, after: int = 0) -> dict[int, int]:
    """``records`` generator records (JSON and NGINX lines, a few late and malformed) spread
    over the partitions, after the ``after`` records already there; the log end per partition."""
    from kafka import KafkaProducer

    from ipcount.devtools.generator import TrafficGenerator
    from ipcount.storage.broker import client_options, create_topic, partition_offsets

    create_topic(cfg, partitions)
    producer = KafkaProducer(bootstrap_servers=cfg.bootstrap_servers, acks=1, linger_ms=50,
                             batch_size=512 * 1024, compression_type=None, **client_options(cfg))
    gen = TrafficGenerator(seed=seed + after, events_per_second=2000)
    # 2000 events per second: records that follow ``after`` others follow them in time, too.
    start_ms = int(datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp() * 1000) + after // 2
    for i, rec in enumerate(gen.records(records, start_ms)):
        producer.send(cfg.topic, key=rec.key, value=rec.value, partition=(after + i) % partitions)
    producer.flush()
    producer.close()
    _, latest = partition_offsets(cfg)
    if sum(latest.values()) != after + records:
        raise RuntimeError(f"produced {records} records after {after} but the log holds {sum(latest.values())}")
    return latest


def ratios(results: dict[str, Measurement]) -> dict[str, float]:
    out = {}

    def ratio(name: str, a: Measurement, b: Measurement) -> None:
        # Throughput ratios: > 1 means the first is faster.
        out[f"{name} (work)"] = round(b.work_seconds / a.work_seconds, 3)
        out[f"{name} (wall)"] = round(b.wall_seconds / a.wall_seconds, 3)

    for pipe in ("pipeline", "pipeline_server"):
        for other, label in (("peer", "peer"), ("spark_count", "spark read limit"),
                             ("kafka_python", "kafka-python drain")):
            if pipe in results and other in results:
                ratio(f"{pipe} / {label}", results[pipe], results[other])

    def growth(label: str, prefix: str) -> None:
        # Time ratios: 1.0 means the later epoch costs what the early one did.
        early, *later = sorted((m for name, m in results.items() if name.startswith(prefix)),
                               key=lambda m: int(m.name.rsplit("_", 1)[1]))
        if later:
            n, k = later[-1].name.rsplit("_", 1)[1], early.name.rsplit("_", 1)[1]
            out[f"{label}epoch after {n} / after {k} (work)"] = round(later[-1].work_seconds / early.work_seconds, 3)
            out[f"{label}epoch after {n} / after {k} (wall)"] = round(later[-1].wall_seconds / early.wall_seconds, 3)

    if any(name.startswith("epoch_after_") for name in results):
        growth("", "epoch_after_")
    if any(name.startswith("server_epoch_after_") for name in results):
        growth("epoch server: ", "server_epoch_after_")
    for fast in ("idle_check", "empty_server"):
        if "empty_submit" in results and fast in results:
            out[f"empty epoch: spark-submit / {fast.replace('_', ' ')} (wall)"] = round(
                results["empty_submit"].wall_seconds / results[fast].wall_seconds, 1)
    return out


def overhead_lines(results: dict[str, Measurement]) -> list[str]:
    """What an empty epoch costs, and what dominates it."""
    if not {"empty_submit", "empty_server", "idle_check"} <= set(results):
        return []
    submit, warm, idle = results["empty_submit"], results["empty_server"], results["idle_check"]
    return [f"empty epoch through spark-submit: {submit.wall_seconds:.1f} s wall, of which the epoch's own checks "
            f"{submit.work_seconds:.1f} s (in a fresh JVM) and JVM + Spark start the rest "
            f"({submit.wall_seconds - submit.work_seconds:.1f} s)",
            f"the same in the epoch server: {warm.wall_seconds:.2f} s wall ({warm.work_seconds:.2f} s checking); "
            f"the DAG's idle check, which skips the Spark job when nothing is new: {idle.wall_seconds:.2f} s wall "
            f"({idle.work_seconds:.2f} s checking)"]


def table(results: dict[str, Measurement], rs: dict[str, float]) -> str:
    lines = [f"{'measurement':<24} {'records':>9} {'wall s':>8} {'work s':>8} {'records/s (work)':>17} "
             f"{'driver peak MB':>15}  stages (s)"]
    for m in results.values():
        stages = " ".join(f"{k} {v:.2f}" for k, v in m.stages.items())
        peak = "-" if m.peak_driver_mb is None else f"{m.peak_driver_mb:.0f}"
        lines.append(f"{m.name:<24} {m.records:>9} {m.wall_seconds:>8.1f} {m.work_seconds:>8.1f} "
                     f"{m.records_per_second:>17,.0f} {peak:>15}  {stages}")
    lines.append("")
    lines += [f"{k:<56} {v:>6.2f}" for k, v in rs.items()]
    overhead = overhead_lines(results)
    if overhead:
        lines += ["", *overhead]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bin/benchmark", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000, help="records to generate (default 1M; 5M and more work)")
    p.add_argument("--partitions", type=int, default=3, help="topic partitions (default 3)")
    p.add_argument("--bootstrap-servers", help="use this broker instead of starting an embedded one")
    p.add_argument("--only", default=",".join(MEASUREMENTS),
                   help=f"comma-separated measurements to run (default all: {','.join(MEASUREMENTS)})")
    p.add_argument("--json", type=Path, help="where to write the figures (default .local/benchmark/<time>.json)")
    p.add_argument("--workdir", type=Path, help="tables, checkpoints and logs (default: a new temp dir)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--history-epochs", type=int, default=100,
                   help="small_epochs: committed epochs before the last spark-submit one is timed (default 100, "
                        "at least 3)")
    p.add_argument("--epoch-records", type=int, default=2000,
                   help="small_epochs: records per epoch (default 2000)")
    args = p.parse_args(argv)
    if args.history_epochs < 3:
        p.error("--history-epochs must be at least 3")
    if args.epoch_records < args.partitions:
        p.error("--epoch-records must be at least --partitions")
    if args.records < 1:
        p.error("--records must be at least 1")
    if not 1 <= args.partitions <= 64:
        p.error("--partitions must be between 1 and 64")
    only = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = [m for m in only if m not in MEASUREMENTS]
    if unknown or not only:
        p.error(f"--only takes names from {', '.join(MEASUREMENTS)}; got {args.only!r}")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ipcount-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    broker = server = None
    if args.bootstrap_servers:
        servers = args.bootstrap_servers
    else:
        from ipcount.devtools.embedded_kafka import EmbeddedKafka

        broker = EmbeddedKafka(state_dir=workdir / "kafka", port=free_port(), controller_port=free_port())
        say(f"starting an embedded Kafka broker (log: {broker.log_file})")
        broker.start()
        servers = broker.bootstrap_servers
    try:
        topic = f"bench_{uuid.uuid4().hex[:8]}"
        cfg = PipelineConfig(bootstrap_servers=servers, topic=topic, group_id=f"g_{topic}", pipeline_id=f"p_{topic}",
                             warehouse=str(workdir / "pipeline"), spark_master="local[*]",
                             max_records_per_epoch=max(args.records, 1))
        say(f"generating {args.records:,} records over {args.partitions} partitions of {topic}")
        started = time.monotonic()
        ending = generate(cfg, args.records, args.partitions, args.seed)
        say(f"generated in {time.monotonic() - started:.1f} s: log ends {ending}")
        results: dict[str, Measurement] = {}
        what = {"peer": "Structured Streaming, AvailableNow, foreachBatch MERGE with txnAppId/txnVersion",
                "spark_count": "limit: Spark batch Kafka read of the range, count only",
                "kafka_python": "limit: a plain kafka-python consumer draining the range"}
        history = None
        if {"pipeline_server", "small_epochs"} & set(only):
            say("starting the epoch server (spark-submit epoch_job.py serve; warm-up epoch on scratch tables)")
            server = EpochServerProcess(cfg, logs)
            results["server_start"] = server.start
            say(f"  ready at {server.url} after {server.start.wall_seconds:.1f} s "
                f"(warm-up {server.start.work_seconds:.1f} s)")
        for name in only:
            say(f"measuring {name} ...")
            if name in ("pipeline", "pipeline_server"):
                measured = {name: measure_pipeline(cfg, args.records, logs,
                                                   server if name == "pipeline_server" else None)}
            elif name == "small_epochs":
                measured, history = measure_small_epochs(servers, args.history_epochs, args.epoch_records,
                                                         args.partitions, args.seed, logs, workdir, server)
            else:
                measured = {name: measure_job(cfg, name, what[name], args.records, logs, workdir, ending)}
            results.update(measured)
            for m in measured.values():
                say(f"  {m.name}: wall {m.wall_seconds:.1f} s, work {m.work_seconds:.1f} s, "
                    f"{m.records_per_second:,.0f} records/s, driver peak {m.peak_driver_mb} MB")
        counted = {name: results[name].counted for name in ("pipeline", "pipeline_server", "peer") if name in results}
        if len(set(counted.values())) > 1:
            raise RuntimeError(f"requests counted differ: {counted}; they do not compute the same thing")
        rs = ratios(results)
        print(table(results, rs), flush=True)
        report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                  "records": args.records, "partitions": args.partitions, "spark_master": cfg.spark_master,
                  "measurements": {k: m.to_dict() for k, m in results.items()}, "ratios": rs,
                  "small_epochs": history}
        if history is not None:
            say("tables after the small epochs: " + ", ".join(
                f"{t} {v['rows']:,} rows in {v['files']} files (version {v['version']})"
                for t, v in history["tables"].items()))
        out = args.json or STATE_DIR / "benchmark" / f"{datetime.now():%Y%m%d-%H%M%S}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        say(f"figures written to {out}")
        return 0
    finally:
        if server is not None:
            server.stop()
        if broker is not None:
            broker.stop()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def machine() -> dict:
    import psutil

    java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()
    return {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "java": java[0] if java else None,
            "platform": platform.platform()}


def say(text: str) -> None:
    print(f"[benchmark] {text}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
