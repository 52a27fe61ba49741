"""``bin/benchmark``: this pipeline side by side with Spark Structured Streaming (the peer)
and with the read-only limits, on the same data and the same Spark settings, warm against
warm and cold against cold.

* **warm** (:mod:`ipcount_lab.bench_rounds`): one ``spark-submit`` of
  ``ipcount_lab/bench_job.py rounds``, one JVM and Spark session for every contender, rounds
  of [read-only count, peer, pipeline (and both again in several epochs)] in a rotated
  order; round 1 is the cold session, the rounds after it are warm. Then series of small
  epochs through both, for the per-epoch cost and its growth with history.
* **cold**: each contender as a fresh process, the way a scheduler starts it (the pipeline
  exactly as the DAG submits it: ``spark-submit spark_jobs/epoch_job.py epoch``), repeated.
  Two times each: **wall** (the whole process, JVM start included) and **work** (from a
  ready Spark session to done), and the driver's peak resident memory.
* **flink** (:mod:`ipcount_lab.bench_flink`): the seeds' reference job in Flink SQL on the
  same range, warm (several jobs in one process) and cold (a process per job), its sink
  topic read back and checked against a recount; skipped, saying so, until
  ``bin/setup --flink`` has set it up.
* **paths**: the DAG's fixed costs on Spark Connect: the Connect server's start, a small
  epoch and an empty one each as a fresh ``ipcount epoch`` process, the same epochs warm in
  one process, and the DAG's JVM-free idle check.
* **kafka_python**: a plain consumer draining the range, the limit without Spark.
* **history**: a long scheduled chain of whole epochs (one spark-submit), each a minute of
  event time, for what the history an epoch's tables, ledger and logs build up costs it.
* **growth**: the counts MERGE alone over many more epochs (delta-rs, no Spark).
* **year** (:mod:`ipcount_lab.bench_year`): real epochs on table sets as old as a year of
  minute epochs (synthesized), maintained and not, stage by stage, in one spark-submit.

Every figure is a median with its min and max (:mod:`ipcount_lab.bench_stats`), every
ratio is taken run by run, and every total is read back from its Delta table and checked
against the others. The figures go to a table on stdout and to a JSON file, and with ``--log``
to the results log (:mod:`ipcount_lab.bench_log`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
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

from ipcount.rules.config import REPO_ROOT, STATE_DIR, PipelineConfig
from ipcount.rules.ledger import METRICS, SCHEDULED, EpochPlan, EpochSummary
from ipcount.rules.offsets import OffsetRange
from ipcount.storage.spark import DRIVER_ENV
from ipcount_lab import bench_log, bench_rounds, bench_stats
from ipcount_lab.service import free_port

MEASUREMENTS = ("warm", "cold", "flink", "paths", "kafka_python", "profile", "history", "growth", "year",
                "cardinality", "cluster")
# What runs unless --only says otherwise: ``cluster`` starts Spark clusters of its own and its
# default is the target's 5M records on each, so it runs when named.
DEFAULT_MEASUREMENTS = tuple(m for m in MEASUREMENTS if m != "cluster")
# The measurements that read the --records range (the others bring records of their own).
READ_THE_RANGE = ("warm", "cold", "flink", "kafka_python", "profile")
COLD = ("spark_count", "peer", "pipeline")
# Ratios, as (label, the pipeline's contender, the other): throughput ratios, > 1 when the pipeline is faster.
WARM_RATIOS = (("pipeline / peer", "pipeline", "peer"), ("pipeline / read limit", "pipeline", "spark_count"),
               ("pipeline / parse floor", "pipeline", "parse_floor"),
               # The most any pipeline sharing the peer's parse could gain on it: its time were the floor's.
               ("parse floor / peer (the ceiling)", "parse_floor", "peer"),
               ("pipeline_epochs / peer_epochs", "pipeline_epochs", "peer_epochs"),
               ("pipeline_epochs / read limit", "pipeline_epochs", "spark_count"))
BENCH_APPLICATION = str(Path(__file__).with_name("bench_job.py"))
# The line bench_job.py prints once a round's pipeline run is done (bench_rounds.warm_rounds):
# how far a session that failed got.
PIPELINE_ROUND_DONE = re.compile(r"^\[benchmark\]\s+round \d+ pipeline: ", re.MULTILINE)
# A JVM memory size, as --driver-memory, spark.executor.memory and a worker's --memory all take it.
JVM_MEMORY = re.compile(r"[1-9][0-9]*[kmgt]", re.IGNORECASE)


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


class ProcessFailed(RuntimeError):
    """A measured command exited with an error: its exit code and the log that holds its output
    (a measurement that counts failures records them, the others let this end the run)."""

    def __init__(self, command: Sequence[str], returncode: int, log_path: Path, timeout: float | None = None) -> None:
        why = f"was stopped after {timeout:g} s" if timeout is not None else f"failed (exit {returncode})"
        super().__init__(f"{Path(command[0]).name} {why}; its output: {log_path}")
        self.returncode, self.log_path = returncode, log_path



def summaries_in(output: str) -> list[EpochSummary]:
    """The summaries in the output of ``ipcount epoch --summary-json`` (one JSON line per epoch attempted, among the
    human-readable lines): what :meth:`EpochSummary.to_dict` made."""
    return [summary_from_dict(json.loads(line)) for line in output.splitlines() if line.startswith("{")]


def summary_from_dict(data: dict) -> EpochSummary:
    plan = None
    if data.get("epoch") is not None:
        ranges = tuple(OffsetRange("", int(p), r["from_offset"], r["until_offset"])
                       for p, r in sorted(data.get("ranges", {}).items(), key=lambda kv: int(kv[0])))
        plan = EpochPlan(data["epoch"], ranges, kind=data.get("kind") or SCHEDULED, request_id=data.get("request_id"))
    lag = data.get("lag_after")
    return EpochSummary(plan, **{m: data.get(m) or 0 for m in METRICS}, watermark_ms=data.get("watermark_after_ms"),
                        sink_version=data.get("sink_version"), seconds=data.get("seconds") or 0.0,
                        stage_seconds=dict(data.get("stage_seconds") or {}),
                        lag_after=None if lag is None else {int(p): n for p, n in lag.items()},
                        run_id=data.get("run_id"))

def run_process(command: Sequence[str], log_path: Path, env: dict | None = None,
                timeout: float | None = None) -> tuple[float, float | None, str]:
    """(wall seconds, peak JVM MB, output) of a command that must succeed: the peak is the sum of
    the resident memory of the ``java`` processes in its process tree (:class:`PeakMemory`).
    With ``timeout``, a command still running after that many seconds is killed with every
    process it started, and fails."""
    started = time.monotonic()
    with open(log_path, "w") as log:  # a file, not a pipe: Spark's logs would fill a pipe and stall it
        # A session of its own when it may be killed: its JVMs go with it.
        proc = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})}, start_new_session=timeout is not None)
        memory = PeakMemory(proc.pid)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            memory.stop()
            raise ProcessFailed(command, proc.returncode, log_path, timeout) from None
    wall = time.monotonic() - started
    peak = memory.stop()
    out = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        raise ProcessFailed(command, proc.returncode, log_path)
    return wall, peak, out


def spark_submit(cfg: PipelineConfig, application: str, args: Sequence[str], name: str,
                 driver_memory: str | None = None, conf: dict[str, str] | None = None, delta: bool = True) -> list[str]:
    """The spark-submit command line the DAG's SparkSubmitOperator builds (same master,
    jars and settings), with ``conf``'s settings added (a measurement's own), and with
    ``delta`` Delta's jars and settings for the peer (the pipeline's own sessions load none)."""
    from ipcount.storage.spark import spark_conf, spark_jars
    from ipcount_lab.peer import DELTA_CONF, delta_jars

    command = [str(Path(sys.executable).parent / "spark-submit"), "--master", cfg.spark_master,
               "--name", name, "--jars", ",".join([*spark_jars(), *(delta_jars() if delta else ())]),
               *(("--driver-memory", driver_memory) if driver_memory else ())]
    for key, value in {**spark_conf(cfg), **(DELTA_CONF if delta else {}), **(conf or {})}.items():
        command += ["--conf", f"{key}={value}"]
    return [*command, application, *args]


def _last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON summary in the output: {stdout[-2000:]}")


def submit_epoch(cfg: PipelineConfig, logs: Path, name: str, *extra: str
                 ) -> tuple[float, float | None, list[EpochSummary]]:
    """``spark-submit spark_jobs/epoch_job.py epoch`` as the DAG runs it: (wall seconds, peak
    JVM MB, the summary JSON of each epoch attempted)."""
    command = spark_submit(cfg, str(REPO_ROOT / "spark_jobs" / "epoch_job.py"),
                           ["epoch", *cfg.to_args(), "--run-id", f"benchmark-{name}", "--summary-json", *extra],
                           f"bench-{name}", delta=False)
    wall, peak, out = run_process(command, logs / f"{name}.log", DRIVER_ENV)
    summaries = summaries_in(out)
    if not summaries:
        raise RuntimeError(f"no epoch summary in {logs / (name + '.log')}")
    return wall, peak, summaries


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


def job_args(job: str, cfg: PipelineConfig, ending: dict[int, int], workdir: Path) -> list[str]:
    """The arguments every ``bench_job.py`` job takes (:func:`job_main`): the job, the range
    and the window settings."""
    return [job, "--bootstrap-servers", cfg.bootstrap_servers, "--topic", cfg.topic,
            "--ending", json.dumps({str(p): o for p, o in ending.items()}), "--workdir", str(workdir),
            "--window-seconds", str(cfg.window_seconds),
            "--allowed-lateness-seconds", str(cfg.allowed_lateness_seconds)]


def measure_job(cfg: PipelineConfig, job: str, records: int, logs: Path, where: Path, ending: dict[int, int],
                label: str) -> Measurement:
    """``bench_job.py JOB`` (the peer or a read-only limit) as a process of its own."""
    args = job_args(job, cfg, ending, where)
    if job == "kafka_python":
        command = [sys.executable, BENCH_APPLICATION, *args]
    else:
        command = spark_submit(cfg, BENCH_APPLICATION, args, f"bench-{label}")
    wall, peak, out = run_process(command, logs / f"{label}.log", DRIVER_ENV)
    result = _last_json(out)
    if result["records"] != records:
        raise RuntimeError(f"{label} read {result['records']} records, not {records}")
    counted = bench_rounds.sum_count(str(where / "counts")) if job == "peer" else None
    return Measurement(job, label, records, round(wall, 3), round(result["seconds"], 3),
                       peak if job != "kafka_python" else None, result.get("stages", {}), counted)


def measure_warm(cfg: PipelineConfig, ending: dict[int, int], small_cfg: PipelineConfig,
                 small_ending: dict[int, int], args: argparse.Namespace, logs: Path, workdir: Path) -> dict:
    """The warm rounds and small-epoch series in one spark-submit (:mod:`bench_rounds`)."""
    command = spark_submit(cfg, BENCH_APPLICATION, [
        *job_args("rounds", cfg, ending, workdir / "warm"),
        "--rounds", str(args.rounds), "--epochs", str(args.epochs), "--small-topic", small_cfg.topic,
        "--small-ending", json.dumps({str(p): o for p, o in small_ending.items()}),
        "--small-per-epoch", str(args.epoch_records)], "bench-warm")
    wall, peak, out = run_process(command, logs / "warm.log", DRIVER_ENV)
    result = _last_json(out)
    runs = result["runs"]
    contenders = [c for c in (*bench_rounds.CONTENDERS, *bench_rounds.EPOCH_CONTENDERS)
                  if any(r["contender"] == c for r in runs)]
    small = {name: {"seconds": series, "steady": bench_stats.steady(series), "growth": bench_stats.growth(series)}
             for name, series in result["small"].items()}
    if result["small"]:  # the small pipeline's tables after its series (bench_rounds.small_epochs)
        small["tables"] = table_sizes(cfg.replace(warehouse=str(workdir / "warm" / "small" / "pipeline")))
    return {"rounds": args.rounds, "epochs": args.epochs, "wall_seconds": round(wall, 3), "peak_rss_mb": peak,
            "memory": result["memory"], "runs": runs,
            "contenders": {c: bench_stats.contender_summary(runs, c) for c in contenders},
            "ratios": {label: bench_stats.paired_ratio(runs, mine, other, first_round=2)
                       for label, mine, other in WARM_RATIOS if mine in contenders and other in contenders},
            "small": {"records_per_epoch": args.epoch_records, **small}}


def measure_cardinality(cfg: PipelineConfig, sizes: Sequence[int], rounds: int, partitions: int, seed: int,
                        logs: Path, workdir: Path, driver_memory: str) -> dict:
    """Every record from a client of its own, so the tally has a row per record: per size,
    the pipeline (one epoch) and the peer (one batch) in warm rounds of one spark-submit whose
    driver heap is ``driver_memory`` (in local mode, all of Spark's)."""
    out: dict = {"driver_memory": driver_memory, "rounds": rounds,
                 "max_driver_tally_rows": cfg.max_driver_tally_rows, "sizes": {}}
    for size in sizes:
        sized = cfg.replace(topic=f"{cfg.topic}_distinct{size}", max_records_per_epoch=size)
        say(f"generating {size:,} records, each from a client of its own, on {sized.topic}")
        ending = generate(sized, size, partitions, seed + 3, distinct_clients=True)
        say(f"measuring cardinality at {size:,}: {rounds} rounds of the pipeline and the peer in one session "
            f"(driver heap {driver_memory}; log {logs / f'cardinality-{size}.log'})")
        command = spark_submit(sized, BENCH_APPLICATION, [
            *job_args("rounds", sized, ending, workdir / f"cardinality-{size}"), "--rounds", str(rounds),
            "--epochs", "1", "--contenders", "peer,pipeline",
            "--max-driver-tally-rows", str(cfg.max_driver_tally_rows)], f"bench-cardinality-{size}",
            driver_memory=driver_memory)
        wall, peak, result = run_process(command, logs / f"cardinality-{size}.log", DRIVER_ENV)
        runs = _last_json(result)["runs"]
        out["sizes"][str(size)] = {
            "wall_seconds": round(wall, 3), "peak_rss_mb": peak, "runs": runs,
            "contenders": {c: bench_stats.contender_summary(runs, c) for c in ("pipeline", "peer")},
            "ratio": bench_stats.paired_ratio(runs, "pipeline", "peer", first_round=2 if rounds > 1 else 1)}
    return out


def measure_cluster(cfg: PipelineConfig, records: int, workers: Sequence[int], rounds: int, partitions: int,
                    seed: int, logs: Path, workdir: Path, driver_memory: str, executor_memory: str) -> dict:
    """Every record from a client of its own (a tally row per record) on a Spark standalone
    cluster: for each count of workers (a core each) a cluster of its own, and on it one
    spark-submit of ``rounds`` rounds of the pipeline, an epoch over the whole range on a fresh
    table set each, in one long-lived session whose driver heap is ``driver_memory`` and each
    executor's ``executor_memory`` (each worker offers just that, so an executor always fits).
    The peer is left out: its state store holds an entry per window and client on the
    executors (at 5M in a 1 GB local-mode heap it died of OutOfMemoryError), and the target is
    the pipeline's. A failed spark-submit is recorded with its exit, its log and the rounds done
    before it, not raised: whether the session lasts every round is what is measured."""
    from ipcount_lab.embedded_spark import EmbeddedSparkCluster, cluster_env

    workdir = workdir.resolve()  # the executors run in the workers' directories, not this one
    sized = cfg.replace(topic=f"{cfg.topic}_cluster", max_records_per_epoch=records)
    say(f"generating {records:,} records, each from a client of its own, on {sized.topic}")
    ending = generate(sized, records, partitions, seed + 4, distinct_clients=True)
    out: dict = {"records": records, "rounds": rounds, "driver_memory": driver_memory,
                 "executor_memory": executor_memory, "max_driver_tally_rows": cfg.max_driver_tally_rows,
                 "workers": {}}
    for n in workers:
        name = f"cluster-{n}w"
        log = logs / f"{name}.log"
        cluster = EmbeddedSparkCluster(state_dir=workdir / f"{name}-spark", port=free_port(), webui_port=free_port(),
                                       workers=n, worker_cores=1, worker_memory=executor_memory)
        command = spark_submit(sized.replace(spark_master=cluster.master_url), BENCH_APPLICATION, [
            *job_args("rounds", sized, ending, workdir / name), "--rounds", str(rounds), "--epochs", "1",
            "--contenders", "pipeline", "--max-driver-tally-rows", str(cfg.max_driver_tally_rows)], f"bench-{name}",
            driver_memory=driver_memory, conf={"spark.executor.memory": executor_memory})
        say(f"measuring cluster with {n} worker(s): {rounds} rounds of the pipeline in one session (driver heap "
            f"{driver_memory}, executors {executor_memory}; log {log}, the cluster's under {cluster.state_dir})")
        try:
            cluster.start()
            wall, peak, output = run_process(command, log, {**DRIVER_ENV, **cluster_env()})
        except ProcessFailed as failed:
            done = len(PIPELINE_ROUND_DONE.findall(log.read_text(errors="replace")))
            say(f"  {n} worker(s): spark-submit failed (exit {failed.returncode}) after {done} of {rounds} rounds")
            out["workers"][str(n)] = {"ok": False, "exit": failed.returncode, "log": str(log), "rounds_done": done}
            continue
        finally:
            cluster.stop()
        summary = _last_json(output)
        runs = summary["runs"]
        out["workers"][str(n)] = {
            "ok": True, "exit": 0, "log": str(log), "rounds_done": len(runs), "wall_seconds": round(wall, 3),
            # The JVMs under spark-submit: the driver's alone (not the executors); its Python's
            # own peak (the task's part) is in "memory".
            "peak_rss_mb": peak, "memory": summary["memory"], "runs": runs,
            "pipeline": bench_stats.contender_summary(runs, "pipeline")}
    # What adding workers buys: the fewest workers' warm median over each larger count's.
    medians = {int(n): w["pipeline"]["warm"].get("median") for n, w in out["workers"].items() if w["ok"]}
    fewest = min(workers)
    out["speedup"] = {str(n): round(medians[fewest] / m, 3) for n, m in medians.items()
                      if n != fewest and m and medians.get(fewest)}
    return out


def measure_cold(cfg: PipelineConfig, ending: dict[int, int], records: int, repeats: int, logs: Path,
                 workdir: Path) -> dict:
    """Each contender as a fresh process, ``repeats`` times in a rotated order."""
    runs: list[dict] = []
    for rep in range(1, repeats + 1):
        shift = (rep - 1) % len(COLD)
        for name in COLD[shift:] + COLD[:shift]:
            where = workdir / "cold" / f"{name}_{rep}"
            label = f"cold-{name}-{rep}"
            say(f"  cold {name}, run {rep} of {repeats}")
            if name == "pipeline":
                run_cfg = cfg.replace(warehouse=str(where), pipeline_id=f"{cfg.pipeline_id}_cold_{rep}",
                                      group_id=f"{cfg.group_id}_cold_{rep}", max_records_per_epoch=records)
                wall, peak, summaries = submit_epoch(run_cfg, logs, label)
                summary = summaries[-1]
                if summary.records_read != records:
                    raise RuntimeError(f"the cold epoch read {summary.records_read} records, not {records}")
                m = Measurement(name, label, records, round(wall, 3), round(sum(summary.stage_seconds.values()), 3),
                                peak, dict(summary.stage_seconds), bench_rounds.sum_count(run_cfg.counts_path))
            else:
                m = measure_job(cfg, name, records, logs, where, ending, label)
            say(f"    wall {m.wall_seconds:.1f} s, work {m.work_seconds:.1f} s, driver peak {m.peak_driver_mb} MB")
            runs.append({"contender": name, "round": rep, "seconds": m.work_seconds, "wall_seconds": m.wall_seconds,
                         "peak_driver_mb": m.peak_driver_mb, "counted": m.counted, "stages": m.stages})
    wall_runs = [{**r, "seconds": r["wall_seconds"]} for r in runs]
    return {"repeats": repeats, "runs": runs,
            "contenders": {c: {"work": bench_stats.spread(r["seconds"] for r in runs if r["contender"] == c),
                               "wall": bench_stats.spread(r["wall_seconds"] for r in runs if r["contender"] == c),
                               "peak_driver_mb": max(r["peak_driver_mb"] or 0 for r in runs if r["contender"] == c),
                               "counted": next(r["counted"] for r in runs if r["contender"] == c)}
                           for c in COLD},
            "ratios": {f"{label} ({kind})": bench_stats.paired_ratio(rs, mine, other)
                       for label, mine, other in WARM_RATIOS if mine in COLD and other in COLD
                       for kind, rs in (("work", runs), ("wall", wall_runs))}}


def measure_paths(cfg: PipelineConfig, per_epoch: int, warm_epochs: int, partitions: int, seed: int, logs: Path,
                  workdir: Path, warmup: int = 0) -> dict:
    """The DAG's fixed costs on Spark Connect: the server's start; on a table set of their own,
    each a fresh ``ipcount epoch`` process as a DAG task on Connect runs it (Python's start, the
    imports, a remote session and the epoch: an upper bound of the task), a ``per_epoch``-record
    epoch after a first one, and an empty one; on another table set, the same in one process and
    remote session, ``warm_epochs`` epochs after its first and ``warmup`` more (the warm
    epoch's cost on a server whose JIT has compiled the query path, as a long-lived server's
    has: it goes on getting faster for some tens of epochs); the same epochs in an in-process
    session (the path without Connect), with the server stopped; the idle check."""
    from ipcount_lab.embedded_connect import EmbeddedSparkConnect

    topic = f"bench_{uuid.uuid4().hex[:8]}_paths"
    paths_cfg = cfg.replace(topic=topic, group_id=f"g_{topic}", pipeline_id=f"p_{topic}",
                            warehouse=str(workdir / "paths"), max_records_per_epoch=per_epoch)
    warm_cfg = paths_cfg.replace(topic=f"{topic}_warm", group_id=f"g_{topic}_warm", pipeline_id=f"p_{topic}_warm",
                                 warehouse=str(workdir / "paths_warm"))
    generate(paths_cfg, 2 * per_epoch, partitions, seed)
    warm_records = (warmup + warm_epochs + 1) * per_epoch
    generate(warm_cfg, warm_records, partitions, seed + 3)
    server = EmbeddedSparkConnect(state_dir=logs / "spark-connect", port=free_port(), master=cfg.spark_master)
    say(f"  starting the Spark Connect server (log {server.log_file})")
    try:
        started = time.monotonic()
        server.start(timeout=600)
        out: dict = {"connect_start": {"wall_seconds": round(time.monotonic() - started, 3)}}
        fresh = []
        for n, name in ((1, "first_epoch"), (2, "epoch"), (None, "empty_epoch")):
            wall, _, summaries = _epoch_process(paths_cfg.replace(**server.settings()), logs, f"paths-{name}", 1)
            summary = summaries[-1]
            if summary.epoch != n:
                raise RuntimeError(f"paths: expected epoch {n}, got {summary}")
            fresh.append(summary)
            out[name] = {"wall_seconds": round(wall, 3), "work_seconds": round(summary.seconds, 3),
                         "stages": {k: round(v, 3) for k, v in summary.stage_seconds.items()}}
        out["totals"] = read_back(paths_cfg, fresh, 2 * per_epoch)
        epochs = warmup + warm_epochs + 2
        say(f"  {epochs} epochs in one process (ipcount epoch --epochs {epochs}), the last {warm_epochs} timed")
        out["warm"] = _warm_series(warm_cfg.replace(**server.settings()), logs, "paths-warm", warmup, warm_epochs,
                                   warm_records)
    finally:
        server.stop()
    say(f"  the same {epochs} epochs in an in-process session")
    in_process = warm_cfg.replace(group_id=f"g_{topic}_in_process", pipeline_id=f"p_{topic}_in_process",
                                  warehouse=str(workdir / "paths_in_process"))
    out["warm_in_process"] = _warm_series(in_process, logs, "paths-in-process", warmup, warm_epochs, warm_records)
    out["connect_over_in_process"] = round(out["warm"]["epoch"]["median"]
                                           / out["warm_in_process"]["epoch"]["median"], 3)
    command = [sys.executable, BENCH_APPLICATION, "idle_check", "--bootstrap-servers", cfg.bootstrap_servers,
               "--topic", topic, "--ending", "{}", "--workdir", paths_cfg.warehouse]
    wall, _, text = run_process(command, logs / "idle_check.log")
    result = _last_json(text)
    if result["run"]:
        raise RuntimeError(f"the idle check wants to run an epoch although nothing is new: {result['why']}")
    out["idle_check"] = {"wall_seconds": round(wall, 3), "work_seconds": round(result["seconds"], 3)}
    out["records_per_epoch"] = per_epoch
    return out


def _warm_series(cfg: PipelineConfig, logs: Path, name: str, warmup: int, warm_epochs: int, records: int) -> dict:
    """``warmup + warm_epochs + 2`` epochs in one ``ipcount epoch`` process: the first, the
    untimed warm-up ones, the timed ones and an empty one; their figures, the table set's
    totals read back."""
    wall, _, summaries = _epoch_process(cfg, logs, name, warmup + warm_epochs + 2)
    if [s.epoch for s in summaries] != [*range(1, warmup + warm_epochs + 2), None]:
        raise RuntimeError(f"paths: {name} ran epochs {[s.epoch for s in summaries]}, not 1 to "
                           f"{warmup + warm_epochs + 1} and an empty one")
    warming, warm = summaries[1:1 + warmup], summaries[1 + warmup:-1]
    stages = dict.fromkeys(stage for s in warm for stage in s.stage_seconds)  # (in the epoch's order)
    return {"epochs": warm_epochs, "warmup_epochs": warmup, "wall_seconds": round(wall, 3),
            "first_epoch_seconds": round(summaries[0].seconds, 3),
            "warmup": bench_stats.spread(s.seconds for s in warming) if warming else None,
            "seconds": [round(s.seconds, 3) for s in warm],
            "epoch": bench_stats.spread(s.seconds for s in warm),
            "stages": {stage: bench_stats.spread(s.stage_seconds.get(stage, 0.0) for s in warm)["median"]
                       for stage in stages},
            "empty_epoch_seconds": round(summaries[-1].seconds, 3),
            "totals": read_back(cfg, summaries, records)}


def _epoch_process(cfg: PipelineConfig, logs: Path, name: str, epochs: int
                   ) -> tuple[float, float | None, list[EpochSummary]]:
    """``ipcount epoch --epochs EPOCHS`` as a process of its own: (wall seconds, peak JVM MB,
    the summary of each epoch attempted)."""
    wall, peak, out = run_process([sys.executable, "-m", "ipcount.cli", "epoch", *cfg.to_args(),
                                   "--run-id", f"benchmark-{name}", "--summary-json", "--epochs", str(epochs)],
                                  logs / f"{name}.log")
    summaries = summaries_in(out)
    if not summaries:
        raise RuntimeError(f"no epoch summary in {logs / (name + '.log')}")
    return wall, peak, summaries


def read_back(cfg: PipelineConfig, summaries: Sequence[EpochSummary], records: int) -> dict[str, int]:
    """A table set's totals, read back with delta-rs after ``summaries``' epochs: every one of
    the ``records`` produced read once, and counted, late or dead-lettered."""
    sizes = table_sizes(cfg)
    totals = {"records": sum(s.records_read for s in summaries), "counted": bench_rounds.sum_count(cfg.counts_path),
              "late": sizes["late"]["rows"], "malformed": sizes["dead_letter"]["rows"]}
    if (totals["records"] != records or totals["counted"] + totals["late"] + totals["malformed"] != records
            or totals["counted"] != sum(s.records_counted for s in summaries)):
        raise RuntimeError(f"{cfg.warehouse}: {records} records produced, but its epochs and tables say {totals} "
                           f"(the epochs counted {sum(s.records_counted for s in summaries)})")
    return totals


def check_totals(report: dict) -> None:
    """Warm and cold, the pipeline and the peer counted the same requests over one batch."""
    counted = {}
    for mode in ("warm", "cold"):
        for name in ("peer", "pipeline"):
            c = report.get(mode, {}).get("contenders", {}).get(name)
            if c:
                counted[f"{mode} {name}"] = c["counted"]
    if report.get("flink", {}).get("counted") is not None:
        counted["flink"] = report["flink"]["counted"]
    if len(set(counted.values())) > 1:
        raise RuntimeError(f"requests counted differ: {counted}; they do not compute the same thing")
    on_clusters = {n: w["pipeline"]["counted"] for n, w in report.get("cluster", {}).get("workers", {}).items()
                   if w["ok"]}
    if len(set(on_clusters.values())) > 1:
        raise RuntimeError(f"requests counted on clusters of each count of workers differ: {on_clusters}")


def measure_profile(cfg: PipelineConfig, ending: dict[int, int], records: int, repeats: int, logs: Path,
                    workdir: Path) -> dict:
    """The read stage's profile in one spark-submit (:mod:`bench_profile`)."""
    command = spark_submit(cfg, BENCH_APPLICATION, [*job_args("profile", cfg, ending, workdir / "profile"),
                                                     "--repeats", str(repeats)], "bench-profile")
    _, _, out = run_process(command, logs / "profile.log", DRIVER_ENV)
    result = _last_json(out)
    if result["records"] != records:
        raise RuntimeError(f"profile read {result['records']} records, not {records}")
    return result


def measure_history(cfg: PipelineConfig, ending: dict[int, int], per_epoch: int, logs: Path,
                    workdir: Path) -> dict:
    """A long scheduled chain of whole epochs in one spark-submit (:func:`bench_rounds.history`)."""
    where = workdir / "history"
    command = spark_submit(cfg, BENCH_APPLICATION, [*job_args("history", cfg, ending, where),
                                                     "--per-epoch", str(per_epoch)], "bench-history")
    _, _, out = run_process(command, logs / "history.log", DRIVER_ENV)
    result = _last_json(out)
    summary = bench_stats.history_summary(result["seconds"], result["stages"])
    return {"records_per_epoch": per_epoch, **summary, "run": result["run"], "seconds": result["seconds"],
            "tables": table_sizes(cfg.replace(warehouse=str(where)))}


def measure_year(cfg: PipelineConfig, args: argparse.Namespace, logs: Path, workdir: Path) -> dict:
    """Table sets of each age synthesized, maintained and not, then real epochs timed on all
    of them in one spark-submit (:mod:`bench_year`); totals checked."""
    from ipcount_lab import bench_year

    ages = [int(a) for a in args.year_ages.split(",")]
    end_ms = bench_year.history_end(int(time.time() * 1000))
    epochs = args.year_warmup + args.year_rounds * args.year_epochs
    sets, synthesis, produced = [], {}, {}
    for age in ages:
        topic_cfg = cfg.replace(topic=f"{cfg.topic}_year{age}")
        say(f"year: {age:,} epochs: a topic of {age:,} records per partition the history owns, then "
            f"{epochs * args.year_records:,} for {epochs} real epochs")
        bench_year.fill_topic(topic_cfg, age, args.partitions)
        ending = generate(topic_cfg, epochs * args.year_records, args.partitions, args.seed + 3,
                          after=age * args.partitions, events_per_second=args.year_records / 60, start_ms=end_ms)
        produced[age] = sum(ending.values()) - age * args.partitions
        for maintained in (True, False):
            if not maintained and age > args.year_unmaintained_max:
                continue
            ts = bench_year.TableSet(age, maintained, str(workdir / "year" / f"{age}-{'on' if maintained else 'off'}"),
                                     topic_cfg.topic, end_ms, args.year_log_retention_hours)
            synthesis[ts.name] = bench_year.synthesize(cfg, ts, args.partitions, say=say)
            sets.append(ts)
    say(f"year: timing {args.year_rounds} rounds of {args.year_epochs} epochs on {len(sets)} table sets "
        f"(spark-submit bench_job.py year; log {logs / 'year.log'})")
    command = spark_submit(cfg, BENCH_APPLICATION, [
        *job_args("year", cfg, {}, workdir / "year"), "--sets", json.dumps([ts.to_dict() for ts in sets]),
        "--rounds", str(args.year_rounds), "--epochs", str(args.year_epochs), "--warmup", str(args.year_warmup),
        "--per-epoch", str(args.year_records)], "bench-year")
    _, _, out = run_process(command, logs / "year.log", DRIVER_ENV)
    result = _last_json(out)
    summary = bench_year.summarize(result, sets)
    for ts in sets:
        read = result["records"][ts.name]
        if read != produced[ts.age]:
            raise RuntimeError(f"year: set {ts.name} read {read} records, not the {produced[ts.age]} produced")
    for age in ages:
        counted = {name: s["counted"] for name, s in summary.items() if s["age"] == age}
        if len(set(counted.values())) > 1:
            raise RuntimeError(f"year: the sets of age {age} counted differently: {counted}")
    tables = {}
    for ts in sets:
        set_cfg = ts.config(cfg)
        tables[ts.name] = {role: bench_year.table_state(path) for role, path in (
            ("counts", set_cfg.counts_path), ("ledger", set_cfg.ledger_path),
            ("dead_letter", set_cfg.dead_letter_path), ("late", set_cfg.late_path))}
    return {"ages": ages, "log_retention_hours": args.year_log_retention_hours, "rounds": args.year_rounds,
            "epochs_per_round": args.year_epochs,
            "warmup": args.year_warmup, "records_per_epoch": args.year_records, "sets": summary,
            "synthesis": synthesis, "tables": tables, "epochs": result["epochs"]}


def job_main(argv: Sequence[str] | None = None) -> int:
    """The peer, the limits and the warm rounds as jobs (``ipcount_lab/bench_job.py``);
    prints a JSON line."""
    p = argparse.ArgumentParser(prog="bench_job.py", description="one benchmark measurement (used by bin/benchmark)")
    p.add_argument("job", choices=("peer", "spark_count", "kafka_python", "idle_check", "rounds", "profile",
                                   "history", "year"))
    p.add_argument("--bootstrap-servers", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--ending", required=True, help="JSON: partition -> end offset")
    p.add_argument("--workdir", required=True)
    p.add_argument("--window-seconds", type=int, default=5)
    p.add_argument("--allowed-lateness-seconds", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4, help="rounds: how many")
    p.add_argument("--epochs", type=int, default=4, help="rounds: epochs of the multi-epoch contenders")
    p.add_argument("--small-topic", help="rounds: the topic of the small-epoch series")
    p.add_argument("--small-ending", default="{}", help="rounds: JSON, partition -> end offset of --small-topic")
    p.add_argument("--small-per-epoch", type=int, default=2000, help="rounds: records per small epoch")
    p.add_argument("--contenders", default="", help="rounds: comma-separated, only these (default all)")
    p.add_argument("--max-driver-tally-rows", type=int, default=PipelineConfig.max_driver_tally_rows,
                   help="the pipeline's max_driver_tally_rows")
    p.add_argument("--repeats", type=int, default=3, help="profile: runs per figure")
    p.add_argument("--per-epoch", type=int, default=10_000, help="history, year: records per epoch")
    p.add_argument("--sets", default="[]", help="year: JSON, the table sets (bench_year.TableSet)")
    p.add_argument("--warmup", type=int, default=2, help="year: untimed epochs on each set first")
    args = p.parse_args(argv)
    ending = {int(k): v for k, v in json.loads(args.ending).items()}
    cfg = PipelineConfig(bootstrap_servers=args.bootstrap_servers, topic=args.topic, window_seconds=args.window_seconds,
                         allowed_lateness_seconds=args.allowed_lateness_seconds, warehouse=args.workdir,
                         max_driver_tally_rows=args.max_driver_tally_rows)
    from ipcount_lab import peer

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
    if args.job == "rounds":
        return _rounds_job(spark, cfg, ending, args)
    if args.job == "history":
        say(f"history: {sum(ending.values()):,} records in epochs of {args.per_epoch:,}")
        print(json.dumps(bench_rounds.history(spark, cfg, ending, Path(args.workdir), args.per_epoch)), flush=True)
        return 0
    if args.job == "year":
        from ipcount_lab import bench_year

        sets = [bench_year.TableSet(**s) for s in json.loads(args.sets)]
        result = bench_year.run_rounds(spark, cfg.replace(max_records_per_epoch=args.per_epoch), sets, args.rounds,
                                       args.epochs, args.warmup, say=say)
        print(json.dumps(result), flush=True)
        return 0
    if args.job == "profile":
        from ipcount_lab import bench_profile

        print(json.dumps(bench_profile.profile(spark, cfg, ending, args.repeats, say=say)), flush=True)
        return 0
    started = time.monotonic()
    if args.job == "spark_count":
        n = peer.spark_count(cfg, spark, ending)
        print(json.dumps({"records": n, "seconds": time.monotonic() - started}), flush=True)
        return 0
    table = str(Path(args.workdir) / "counts")
    result = peer.run_peer(cfg, spark, table, str(Path(args.workdir) / "checkpoint"), ending)
    print(json.dumps({"records": sum(result.reached.values()), "batches": result.batches,
                      "seconds": time.monotonic() - started}), flush=True)
    return 0


def _rounds_job(spark, cfg: PipelineConfig, ending: dict[int, int], args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    say(f"warm rounds: {args.rounds} rounds over {sum(ending.values()):,} records")
    only = tuple(c for c in args.contenders.split(",") if c) or None
    runs = bench_rounds.warm_rounds(spark, cfg, ending, workdir, args.rounds, args.epochs, say=say, only=only)
    small: dict[str, list[float]] = {}
    if args.small_topic:
        small_ending = {int(k): v for k, v in json.loads(args.small_ending).items()}
        say(f"small epochs: {sum(small_ending.values()):,} records in epochs of {args.small_per_epoch:,}")
        small = bench_rounds.small_epochs(spark, cfg.replace(topic=args.small_topic), small_ending, workdir,
                                          args.small_per_epoch)
    print(json.dumps({"runs": bench_rounds.runs_json(runs), "small": small,
                      "memory": bench_rounds.jvm_memory(spark)}), flush=True)
    return 0


def generate(cfg: PipelineConfig, records: int, partitions: int, seed: int, after: int = 0,
             events_per_second: float = 2000, start_ms: int | None = None,
             distinct_clients: bool = False) -> dict[int, int]:
    """``records`` generator records (JSON and NGINX lines, a few late and malformed) spread
    over the partitions, after the ``after`` records already there, ``events_per_second`` of
    event time from ``start_ms`` (default: where ``after`` records of 2026-11-01 on end), each
    from a client of its own if ``distinct_clients``; the log end per partition."""
    from kafka import KafkaProducer

    from ipcount.storage.broker import client_options, create_topic, partition_offsets
    from ipcount_lab.generator import TrafficGenerator

    create_topic(cfg, partitions)
    producer = KafkaProducer(bootstrap_servers=cfg.bootstrap_servers, acks=1, linger_ms=50,
                             batch_size=512 * 1024, compression_type=None, **client_options(cfg))
    gen = TrafficGenerator(seed=seed + after, events_per_second=events_per_second, distinct_clients=distinct_clients)
    # Records that follow ``after`` others follow them in time, too.
    if start_ms is None:
        start_ms = (int(datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp() * 1000)
                    + int(after * 1000 / events_per_second))
    for i, rec in enumerate(gen.records(records, start_ms)):
        producer.send(cfg.topic, key=rec.key, value=rec.value, partition=(after + i) % partitions)
    producer.flush()
    producer.close()
    _, latest = partition_offsets(cfg)
    if sum(latest.values()) != after + records:
        raise RuntimeError(f"produced {records} records after {after} but the log holds {sum(latest.values())}")
    return latest


def _range(sp: dict, unit: str = "") -> str:
    """'median [min-max]' of a spread."""
    if not sp:
        return "-"
    return f"{sp['median']:.2f}{unit} [{sp['min']:.2f}-{sp['max']:.2f}]"


def _warmup(warm: dict) -> str:
    """How the timed epochs' server was warmed, for the report's line."""
    if not warm.get("warmup_epochs"):
        return "no warm-up epochs"
    return f"{warm['warmup_epochs']} warm-up epochs, {_range(warm['warmup'], ' s')}"


def render(report: dict) -> str:
    """The report as the table bin/benchmark prints."""
    lines = []
    warm = report.get("warm")
    if warm:
        lines += [f"warm: one Spark session, {report['records']:,} records over {report['partitions']} partitions; "
                  f"round 1 of {warm['rounds']} is the cold session, rounds 2-{warm['rounds']} warm "
                  f"(seconds: median [min-max])",
                  f"{'contender':<16} {'round 1':>8} {'warm':>22} {'records/s':>11} {'counted':>10} {'late':>7} "
                  f"{'malformed':>9} {'batches':>7} {'GC s':>5}  stages (warm medians, s)"]
        for name, c in warm["contenders"].items():
            stages = " ".join(f"{k} {v:.2f}" for k, v in c["stages"].items())
            cold = "-" if c["cold_seconds"] is None else f"{c['cold_seconds']:.2f}"
            late = c["late"] if name.startswith("pipeline") else "-"
            malformed = c["malformed"] if name.startswith("pipeline") else "-"
            lines.append(f"{name:<16} {cold:>8} {_range(c['warm']):>22} {c['records_per_second'] or 0:>11,} "
                         f"{c['counted']:>10,} {late:>7} {malformed:>9} {c['batches']:>7} "
                         f"{c.get('gc_seconds', 0.0):>5.2f}  {stages}")
        lines.append("ratios (throughput, > 1: the pipeline is faster), round by round over the warm rounds:")
        lines += [f"  {label:<34} {_range(sp)}" for label, sp in warm["ratios"].items()]
        memory = warm["memory"]
        lines.append(f"driver JVM: peak heap {memory['peak_heap_mb']} MB, GC {memory['gc_seconds']} s in all; "
                     f"largest spill of a warm run "
                     f"{max((c['spill_bytes_max'] for c in warm['contenders'].values()), default=0):,} bytes")
        small = warm["small"]
        for name in ("pipeline", "peer"):
            if name in small:
                sm = small[name]
                growth = "-" if sm["growth"] is None else f"{sm['growth']:.2f}"
                lines.append(f"small epochs of {small['records_per_epoch']:,} records, {name}: "
                             f"{len(sm['seconds'])} epochs, from the 4th on {_range(sm['steady'], ' s')}; "
                             f"the last 3 / epochs 4-6: {growth}")
        lines.append("")
    cold = report.get("cold")
    if cold:
        lines += [f"cold: each contender a fresh spark-submit process, {cold['repeats']} time(s) "
                  f"(seconds: median [min-max])",
                  f"{'contender':<16} {'work':>22} {'wall':>22} {'driver peak MB':>15} {'counted':>10}"]
        for name, c in cold["contenders"].items():
            lines.append(f"{name:<16} {_range(c['work']):>22} {_range(c['wall']):>22} {c['peak_driver_mb']:>15.0f} "
                         f"{'-' if c['counted'] is None else format(c['counted'], ','):>10}")
        lines += [f"  {label:<34} {_range(sp)}" for label, sp in cold["ratios"].items()]
        lines.append("")
    lines += _render_flink(report)
    paths = report.get("paths")
    if paths:
        warm = paths["warm"]
        stages = " ".join(f"{k} {v:.3f}" for k, v in warm["stages"].items())
        lines += [f"paths: Spark Connect server start {paths['connect_start']['wall_seconds']:.1f} s; on it, each a "
                  f"fresh process as the DAG's task runs it, a {paths['records_per_epoch']:,}-record epoch "
                  f"{paths['epoch']['wall_seconds']:.2f} s (after a first one, "
                  f"{paths['first_epoch']['wall_seconds']:.2f} s), an empty epoch "
                  f"{paths['empty_epoch']['wall_seconds']:.2f} s; the DAG's idle check (no JVM) "
                  f"{paths['idle_check']['wall_seconds']:.2f} s",
                  f"  warm, one process and remote session: a {paths['records_per_epoch']:,}-record epoch "
                  f"{_range(warm['epoch'], ' s')} ({warm['epochs']} epochs after its first, "
                  f"{warm['first_epoch_seconds']:.2f} s, and {_warmup(warm)}), an empty epoch "
                  f"{warm['empty_epoch_seconds']:.2f} s; stages (median s) {stages}"]
        if paths.get("warm_in_process"):
            alone = paths["warm_in_process"]
            lines.append(f"  the same epochs in an in-process session (no Connect): {_range(alone['epoch'], ' s')}; "
                         f"Connect / in-process {warm['epoch']['median'] / alone['epoch']['median']:.2f}")
    prof = report.get("profile")
    if prof:
        per = 1e6 / prof["records"]
        lines.append(f"profile: {prof['records']:,} records from a cache, median of {prof['repeats']} "
                     f"(seconds, and microseconds per record)")
        for part in ("path", "pieces"):
            lines.append(f"  {part:<7} " + ", ".join(f"{k} {v:.2f} ({v * per:.1f})" for k, v in prof[part].items()))
        lines.append(f"  codegen {prof['codegen']['compiles']} classes compiled in "
                     f"{prof['codegen']['compile_seconds']:.2f} s")
    grown = report.get("growth")
    if grown:
        lines.append(f"growth: {grown['epochs']} epochs' counts MERGEs of {grown['rows_per_epoch']:,} rows each: "
                     f"epochs 5-15 {grown['early_median']:.3f} s, the last 10 {grown['last10_median']:.3f} s "
                     f"(x{grown['ratio']:.2f}); the table: {grown['table_rows']:,} rows in {grown['files']} "
                     f"file(s), the largest {grown['largest_file_rows']:,} rows")
    history = report.get("history")
    if history:
        ratio = "-" if history["ratio"] is None else f"x{history['ratio']:.2f}"
        lines.append(f"history: {history['epochs']} epochs of {history['records_per_epoch']:,} records, a minute of "
                     f"event time each: epochs 6-15 {_range(history['early'], ' s')}, the last 10 "
                     f"{_range(history['last'], ' s')} ({ratio})")
        if history["stages"]:
            lines.append("  stages (median s, epochs 6-15 -> the last 10): " + ", ".join(
                f"{name} {s['early']:.3f} -> {s['last']:.3f}" for name, s in history["stages"].items()))
        lines.append("  median of each hour's 60 epochs (s): " + " ".join(f"{h:.3f}" for h in history["hours"]))
        lines.append("  tables after it: " + ", ".join(
            f"{name} {t['rows']:,} rows in {t['files']} files (version {t['version']})"
            for name, t in history["tables"].items()))
    lines += _render_year(report.get("year"))
    lines += _render_cardinality(report.get("cardinality"))
    lines += _render_cluster(report.get("cluster"))
    drain = report.get("kafka_python")
    if drain:
        lines.append(f"kafka_python: a plain consumer draining the range: {_range(drain['seconds'], ' s')}")
    return "\n".join(lines).rstrip("\n")


def _render_flink(report: dict) -> list[str]:
    flink = report.get("flink")
    if not flink:
        return []
    if "skipped" in flink:
        return [f"flink: skipped: {flink['skipped']}", ""]
    warm, cold = flink["warm"], flink["cold"]
    lines = [f"flink: the seeds' job in Flink SQL, {flink['counted']:,} requests counted by every job, as the "
             f"recount; job runtime as Flink reports it (seconds: median [min-max])",
             f"  warm, {flink['jobs']} jobs in one process: the first {warm['first_job_seconds']:.2f}, the rest "
             f"{_range(warm['job'])}; peak JVM {warm['peak_mb'] or 0:.0f} MB",
             f"  cold, a process per job: job {_range(cold['job'])}, process wall {_range(cold['wall'])}; peak JVM "
             f"{cold['peak_mb']:.0f} MB"]
    ratios = flink_ratios(report)
    if "warm" in ratios:
        lines.append(f"  pipeline / flink, warm (the pipeline's warm epoch against Flink's warm job): "
                     f"{ratios['warm']:.2f}")
    if "cold" in ratios:
        lines.append(f"  pipeline / flink, cold (process wall against process wall): {ratios['cold']:.2f}")
    return [*lines, ""]


def flink_ratios(report: dict) -> dict[str, float]:
    """Flink's medians over the pipeline's, warm (job against warm epoch) and cold (process
    wall against process wall), as far as the report holds both: ratios of medians, since
    the contenders run in processes of their own (not round by round)."""
    flink, out = report.get("flink") or {}, {}
    if "warm" not in flink:
        return out
    pipeline = report.get("warm", {}).get("contenders", {}).get("pipeline")
    if pipeline and flink["warm"]["job"]:
        out["warm"] = flink["warm"]["job"]["median"] / pipeline["warm"]["median"]
    cold_pipeline = report.get("cold", {}).get("contenders", {}).get("pipeline")
    if cold_pipeline:
        out["cold"] = flink["cold"]["wall"]["median"] / cold_pipeline["wall"]["median"]
    return out


def _render_cardinality(card: dict | None) -> list[str]:
    if not card:
        return []
    lines = [f"cardinality: every record from a client of its own (a tally row per record); one epoch (the "
             f"pipeline) and one batch (the peer) in one session, driver heap {card['driver_memory']}, "
             f"{card['rounds']} rounds, the first cold (seconds: median [min-max] of the rest)"]
    for size, sized in card["sizes"].items():
        c = sized["contenders"]
        stages = " ".join(f"{k} {v:.2f}" for k, v in c["pipeline"]["stages"].items())
        lines.append(f"  {int(size):>10,} records: pipeline {_range(c['pipeline']['warm'], ' s')}, peer "
                     f"{_range(c['peer']['warm'], ' s')}; pipeline / peer {_range(sized['ratio'])}; "
                     f"{c['pipeline']['counted']:,} counted; peak RSS {sized['peak_rss_mb'] or 0:.0f} MB; "
                     f"pipeline stages {stages}")
    return lines


def _render_cluster(cluster: dict | None) -> list[str]:
    if not cluster:
        return []
    lines = [f"cluster: {cluster['records']:,} records, each from a client of its own; one epoch (the pipeline) a "
             f"round on a Spark standalone cluster of workers of 1 core, executors {cluster['executor_memory']}, "
             f"driver heap {cluster['driver_memory']}; {cluster['rounds']} rounds in one session, the first cold "
             f"(seconds: median [min-max] of the rest)"]
    for n, w in cluster["workers"].items():
        head = f"  {int(n):>2} worker{'' if n == '1' else 's'}: {w['rounds_done']} of {cluster['rounds']} rounds"
        if not w["ok"]:
            lines.append(f"{head}, then the spark-submit failed (exit {w['exit']}; {w['log']})")
            continue
        p = w["pipeline"]
        cold = "-" if p["cold_seconds"] is None else f"{p['cold_seconds']:.2f} s"
        stages = " ".join(f"{k} {v:.2f}" for k, v in p["stages"].items())
        lines.append(f"{head}; round 1 {cold}, warm {_range(p['warm'], ' s')}; {p['counted']:,} counted; driver "
                     f"peak heap {w['memory']['peak_heap_mb'] or 0:.0f} MB, its JVM's peak RSS "
                     f"{w['peak_rss_mb'] or 0:.0f} MB, its Python's {w['memory']['python_peak_rss_mb'] or 0:.0f} "
                     f"MB; stages {stages}")
    if cluster["speedup"]:
        fewest = min(int(n) for n in cluster["workers"])
        lines.append(f"  adding workers (the {fewest}-worker warm median / this one's, > 1: faster): " + ", ".join(
            f"{n} workers x{ratio:.2f}" for n, ratio in cluster["speedup"].items()))
    return lines


def _render_year(year: dict | None) -> list[str]:
    if not year:
        return []
    from ipcount_lab.bench_year import STAGES

    lines = [f"year: real epochs of {year['records_per_epoch']:,} records on table sets of each age "
             f"({year['rounds']} rounds of {year['epochs_per_round']} after {year['warmup']} untimed, logs kept "
             f"{year['log_retention_hours']} h); median s "
             f"(x the youngest maintained set's, round by round)",
             f"{'set':<12} {'epoch':>14} " + " ".join(f"{s:>17}" for s in STAGES)]

    def cell(c: dict) -> str:
        return f"{c['median']:.3f}" + ("" if c["ratio"] is None else f" (x{c['ratio']:.2f})")
    for name, s in year["sets"].items():
        lines.append(f"{name:<12} {cell(s['stages']['epoch']):>14} "
                     + " ".join(f"{cell(s['stages'][st]):>17}" for st in STAGES))
    lines.append("  tables after (version; _delta_log entries and MB; checkpoint MB and transactions; data files, MB):")
    for name, tables in year["tables"].items():
        lines.append(f"  {name:<12} " + "; ".join(
            f"{role} v{t['version']:,} log {t['log_entries']:,}/{(t['log_bytes'] or 0) / 2**20:.1f} "
            f"cp {(t['checkpoint_bytes'] or 0) / 2**20:.2f}/{t['transactions'] or 0:,} "
            f"files {t['files']:,}/{t['bytes'] / 2**20:.1f}" for role, t in tables.items()))
    return lines


def _distinct_numbers(text: str, least: int) -> list[int] | None:
    """The comma-separated whole numbers of ``text``, or None unless there are some, all
    distinct and at least ``least``."""
    try:
        numbers = [int(n) for n in text.split(",")]
    except ValueError:
        return None
    return numbers if numbers and min(numbers) >= least and len(set(numbers)) == len(numbers) else None


def arguments() -> argparse.ArgumentParser:
    """bin/benchmark's options."""
    p = argparse.ArgumentParser(prog="bin/benchmark", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000, help="records to generate (default 1M; 5M and more work)")
    p.add_argument("--partitions", type=int, default=3, help="topic partitions (default 3)")
    p.add_argument("--bootstrap-servers", help="use this broker instead of starting an embedded one")
    p.add_argument("--only", default=",".join(DEFAULT_MEASUREMENTS),
                   help=f"comma-separated measurements to run, from {','.join(MEASUREMENTS)} (default all but "
                        "cluster, which starts clusters of its own)")
    p.add_argument("--rounds", type=int, default=4, help="warm: rounds in the one session; flink: jobs in its warm process "
                        "(default 4, at least 2)")
    p.add_argument("--epochs", type=int, default=4,
                   help="warm: epochs (micro-batches) of the multi-epoch contenders (default 4; 1: none)")
    p.add_argument("--small-epochs", type=int, default=100,
                   help="warm: small epochs in the series through each (default 100, at least 2; growth "
                        "from 9)")
    p.add_argument("--epoch-records", type=int, default=2000, help="records per small epoch (default 2000)")
    p.add_argument("--paths-epochs", type=int, default=10,
                   help="paths: warm epochs of --epoch-records in one process after its first (default 10, at least 5)")
    p.add_argument("--paths-warmup", type=int, default=40,
                   help="paths: epochs the Connect server runs before those, untimed, for its JIT (default 40)")
    p.add_argument("--cold-repeats", type=int, default=3,
                   help="cold: runs of each contender; flink: its cold processes; profile: runs per figure "
                        "(default 3)")
    p.add_argument("--history-epochs", type=int, default=1000,
                   help="history: whole epochs in the scheduled chain, a minute of event time each (default 1000)")
    p.add_argument("--history-records", type=int, default=10_000,
                   help="history: records per epoch (default 10000: about 170 requests a second)")
    p.add_argument("--growth-epochs", type=int, default=1000,
                   help="growth: scheduled epochs' counts merged one after another (default 1000)")
    p.add_argument("--growth-ips", type=int, default=1000,
                   help="growth: clients per window in each epoch (default 1000: 7,000 counts rows an epoch)")
    p.add_argument("--year-ages", default="10,10000,100000,525600",
                   help="year: ages of the table sets, in minute epochs (default 10,10000,100000,525600)")
    p.add_argument("--year-unmaintained-max", type=int, default=100_000,
                   help="year: the oldest age also synthesized unmaintained (default 100000: a file per epoch "
                        "in each side table)")
    p.add_argument("--year-log-retention-hours", type=int, default=PipelineConfig.log_retention_hours,
                   help="year: the sets' log_retention_hours (default the pipeline's, "
                        f"{PipelineConfig.log_retention_hours}; Delta's own default is 720)")
    p.add_argument("--year-rounds", type=int, default=4, help="year: rounds over every set (default 4)")
    p.add_argument("--year-epochs", type=int, default=5, help="year: timed epochs per set and round (default 5)")
    p.add_argument("--year-warmup", type=int, default=2, help="year: untimed epochs on each set first (default 2)")
    p.add_argument("--year-records", type=int, default=2000, help="year: records per real epoch (default 2000)")
    p.add_argument("--cardinality-records", default="1000000",
                   help="cardinality: comma-separated sizes of the ranges whose records each come from a client "
                        "of their own (default 1000000; 5000000 with --cardinality-driver-memory 3g: at 1g the peer's "
                        "state store runs out of memory)")
    p.add_argument("--cardinality-rounds", type=int, default=3,
                   help="cardinality: rounds of each size in one session, the first cold (default 3)")
    p.add_argument("--cardinality-driver-memory", default="1g",
                   help="cardinality: the spark-submit's --driver-memory (default 1g, Spark's; in local mode "
                        "it holds all of Spark)")
    p.add_argument("--cluster-records", type=int, default=5_000_000,
                   help="cluster: records in the range, each from a client of its own (default 5000000)")
    p.add_argument("--cluster-workers", default="1,2",
                   help="cluster: comma-separated counts of workers (1 core each), a cluster of each (default 1,2)")
    p.add_argument("--cluster-rounds", type=int, default=3,
                   help="cluster: rounds in one session on each cluster, an epoch over the range each, the first "
                        "cold (default 3; the target asks for 10)")
    p.add_argument("--cluster-driver-memory", default="512m",
                   help="cluster: the spark-submit's --driver-memory (default 512m)")
    p.add_argument("--cluster-executor-memory", default="1g",
                   help="cluster: spark.executor.memory, and what each worker offers (default 1g, Spark's)")
    p.add_argument("--max-driver-tally-rows", type=int, default=PipelineConfig.max_driver_tally_rows,
                   help="cardinality, cluster: the pipeline's max_driver_tally_rows (default the pipeline's, "
                        f"{PipelineConfig.max_driver_tally_rows:,}; larger tallies are written by the executors)")
    p.add_argument("--json", type=Path, help="where to write the figures (default .local/benchmark/<time>.json)")
    p.add_argument("--workdir", type=Path, help="tables, checkpoints and logs (default: a new temp dir)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--log", type=Path, nargs="?", const=bench_log.LOG,
                   help="also append the figures to the results log (default, with no path: "
                        "docs/performance/results.csv; see ipcount_lab/bench_log.py)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = arguments()
    args = p.parse_args(argv)
    for flag, value, least in (("--records", args.records, 1), ("--rounds", args.rounds, 2),
                               ("--epochs", args.epochs, 1), ("--small-epochs", args.small_epochs, 2),
                               ("--paths-epochs", args.paths_epochs, 5), ("--paths-warmup", args.paths_warmup, 0),
                               ("--cold-repeats", args.cold_repeats, 1),
                               ("--growth-epochs", args.growth_epochs, 2), ("--history-epochs", args.history_epochs, 2),
                               ("--growth-ips", args.growth_ips, 1), ("--year-rounds", args.year_rounds, 1),
                               ("--year-epochs", args.year_epochs, 1), ("--year-warmup", args.year_warmup, 1),
                               ("--year-log-retention-hours", args.year_log_retention_hours, 1),
                               ("--cardinality-rounds", args.cardinality_rounds, 1),
                               ("--cluster-rounds", args.cluster_rounds, 1)):
        if value < least:
            p.error(f"{flag} must be at least {least}")
    ages = _distinct_numbers(args.year_ages, 1)
    if ages is None:
        p.error(f"--year-ages takes distinct whole numbers of at least 1, comma-separated; got {args.year_ages!r}")
    sizes = _distinct_numbers(args.cardinality_records, args.partitions)
    if sizes is None:
        p.error("--cardinality-records takes distinct whole numbers of at least --partitions, comma-separated; "
                f"got {args.cardinality_records!r}")
    workers = _distinct_numbers(args.cluster_workers, 1)
    if workers is None:
        p.error("--cluster-workers takes distinct whole numbers of at least 1, comma-separated; "
                f"got {args.cluster_workers!r}")
    workers = sorted(workers)
    for flag, value in (("--cluster-driver-memory", args.cluster_driver_memory),
                        ("--cluster-executor-memory", args.cluster_executor_memory)):
        if not JVM_MEMORY.fullmatch(value):
            p.error(f"{flag} takes a JVM memory size such as 512m or 1g; got {value!r}")
    for flag, value in (("--epoch-records", args.epoch_records), ("--history-records", args.history_records),
                        ("--year-records", args.year_records), ("--cluster-records", args.cluster_records)):
        if value < args.partitions:
            p.error(f"{flag} must be at least --partitions")
    if not 1 <= args.partitions <= 64:
        p.error("--partitions must be between 1 and 64")
    only = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = [m for m in only if m not in MEASUREMENTS]
    if unknown or not only:
        p.error(f"--only takes names from {', '.join(MEASUREMENTS)}; got {args.only!r}")
    if args.workdir is not None and args.workdir.is_dir() and any(args.workdir.iterdir()):
        # Its tables and checkpoints would be resumed, not measured from scratch.
        p.error(f"--workdir {args.workdir} is not empty (an earlier run's tables and checkpoints?): "
                "give a new or empty directory")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ipcount-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    broker = None
    finished = False
    if args.bootstrap_servers:
        servers = args.bootstrap_servers
    else:
        from ipcount_lab.embedded_kafka import EmbeddedKafka

        broker = EmbeddedKafka(state_dir=workdir / "kafka", port=free_port(), controller_port=free_port())
        say(f"starting an embedded Kafka broker (log: {broker.log_file})")
        broker.start()
        servers = broker.bootstrap_servers
    try:
        topic = f"bench_{uuid.uuid4().hex[:8]}"
        cfg = PipelineConfig(bootstrap_servers=servers, topic=topic, group_id=f"g_{topic}", pipeline_id=f"p_{topic}",
                             warehouse=str(workdir / "pipeline"), spark_master="local[*]",
                             max_records_per_epoch=max(args.records, 1))
        ending: dict[int, int] = {}
        if any(m in only for m in READ_THE_RANGE):
            say(f"generating {args.records:,} records over {args.partitions} partitions of {topic}")
            started = time.monotonic()
            ending = generate(cfg, args.records, args.partitions, args.seed)
            say(f"generated in {time.monotonic() - started:.1f} s: log ends {ending}")
        report: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                        "commit": git_commit(), "argv": list(sys.argv[1:] if argv is None else argv),
                        "records": args.records, "partitions": args.partitions, "spark_master": cfg.spark_master}
        if "warm" in only:
            small_cfg = cfg.replace(topic=f"{topic}_small")
            small_records = args.small_epochs * args.epoch_records
            say(f"generating {small_records:,} records for the small epochs on {small_cfg.topic}")
            small_ending = generate(small_cfg, small_records, args.partitions, args.seed + 1)
            say(f"measuring warm: {args.rounds} rounds in one session (spark-submit bench_job.py rounds; "
                f"log {logs / 'warm.log'})")
            report["warm"] = measure_warm(cfg, ending, small_cfg, small_ending, args, logs, workdir)
        if "cold" in only:
            say(f"measuring cold: each contender a fresh process, {args.cold_repeats} time(s)")
            report["cold"] = measure_cold(cfg, ending, args.records, args.cold_repeats, logs, workdir)
        if "flink" in only:
            from ipcount_lab import bench_flink

            why = bench_flink.not_set_up()
            if why:
                say(f"skipping flink: {why}")
                report["flink"] = {"skipped": why}
            else:
                say(f"measuring flink: {args.rounds} jobs in one process, then {args.cold_repeats} process(es) of one")
                report["flink"] = bench_flink.measure(cfg, ending, args.rounds, args.cold_repeats, logs, run_process,
                                                      say)
        if "paths" in only:
            say("measuring paths: the Spark Connect server, epochs on it and the DAG's idle check")
            report["paths"] = measure_paths(cfg, args.epoch_records, args.paths_epochs, args.partitions, args.seed,
                                            logs, workdir, warmup=args.paths_warmup)
        if "kafka_python" in only:
            say(f"measuring kafka_python, {args.cold_repeats} time(s)")
            seconds = [measure_job(cfg, "kafka_python", args.records, logs, workdir / "kafka_python", ending,
                                   f"kafka_python-{n}").work_seconds for n in range(1, args.cold_repeats + 1)]
            report["kafka_python"] = {"seconds": bench_stats.spread(seconds)}
        if "profile" in only:
            say(f"measuring profile: where the read stage's time goes (log {logs / 'profile.log'})")
            report["profile"] = measure_profile(cfg, ending, args.records, args.cold_repeats, logs, workdir)
        if "history" in only:
            history_cfg = cfg.replace(topic=f"{topic}_history")
            history_records = args.history_epochs * args.history_records
            say(f"generating {history_records:,} records for the history on {history_cfg.topic}, "
                f"a minute of event time per {args.history_records:,}")
            history_ending = generate(history_cfg, history_records, args.partitions, args.seed + 2,
                                      events_per_second=args.history_records / 60)
            say(f"measuring history: {args.history_epochs} epochs in one session (spark-submit bench_job.py "
                f"history; log {logs / 'history.log'})")
            report["history"] = measure_history(history_cfg, history_ending, args.history_records, logs, workdir)
        if "growth" in only:
            from ipcount_lab import bench_growth

            say(f"measuring growth: {args.growth_epochs} epochs' counts MERGEs (delta-rs, no Spark)")
            report["growth"] = bench_growth.growth(workdir, args.growth_epochs, args.growth_ips, args.seed, say=say)
        if "year" in only:
            say(f"measuring year: table sets of {args.year_ages} minute epochs, maintained and not")
            report["year"] = measure_year(cfg, args, logs, workdir)
        if "cardinality" in only:
            say(f"measuring cardinality: ranges of {args.cardinality_records} records, a client per record")
            report["cardinality"] = measure_cardinality(
                cfg.replace(max_driver_tally_rows=args.max_driver_tally_rows), sizes, args.cardinality_rounds,
                args.partitions, args.seed, logs, workdir, args.cardinality_driver_memory)
        if "cluster" in only:
            say(f"measuring cluster: {args.cluster_records:,} records, a client per record, on clusters of "
                f"{args.cluster_workers} worker(s)")
            report["cluster"] = measure_cluster(
                cfg.replace(max_driver_tally_rows=args.max_driver_tally_rows), args.cluster_records, workers,
                args.cluster_rounds, args.partitions, args.seed, logs, workdir,
                driver_memory=args.cluster_driver_memory, executor_memory=args.cluster_executor_memory)
        if "warm" in report.get("flink", {}):
            report["flink"]["ratios"] = {k: round(v, 3) for k, v in flink_ratios(report).items()}
        check_totals(report)
        print(render(report), flush=True)
        out = args.json or STATE_DIR / "benchmark" / f"{datetime.now():%Y%m%d-%H%M%S}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        say(f"figures written to {out}")
        if args.log:
            say(f"{bench_log.append(report, args.log)} rows appended to {args.log}")
        finished = True
        return 0
    finally:
        if broker is not None:
            broker.stop()
        if args.workdir is None and finished:
            shutil.rmtree(workdir, ignore_errors=True)
        elif args.workdir is None:  # a failure names a log in it
            say(f"the run failed: its tables and logs are kept in {workdir}")


def machine() -> dict:
    import psutil

    java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()
    return {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "java": java[0] if java else None,
            "platform": platform.platform()}


def git_commit() -> str | None:
    """The checkout's commit (``git rev-parse --short HEAD``), with "+dirty" when files outside
    docs/ differ from it; None without git or a repository."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None
    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    return head + ("+dirty" if git("status", "--porcelain", "--", ".", ":(exclude)docs") else "")


def say(text: str) -> None:
    print(f"[benchmark] {text}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
