"""bin/benchmark's Flink contender: the seeds' reference job in Flink SQL
(:mod:`ipcount_lab.flink_job`) on the range the pipeline reads, set up by ``bin/setup --flink``.

* **warm**: one process running the job ``jobs`` times, one after another (one JVM, its
  classes loaded and its code compiled by the first job); the first job is the cold one.
* **cold**: the job as a fresh process, ``repeats`` times.

Each job's net runtime as Flink reports it, its time from submission to done, the process's
wall time (the JVM's start included) and the peak resident memory of its JVM. Every job
writes to a topic of its own; the topic is read back with ``read_committed`` and folded
window by window, IP by IP, against a recount of the range by the record specification
(:mod:`ipcount.rules.records`), which is what the pipeline counts in one epoch.
"""
from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping

from ipcount.rules.config import REPO_ROOT, STATE_DIR, PipelineConfig
from ipcount_lab import bench_stats

FLINK_PYTHON = STATE_DIR / "flink-venv" / "bin" / "python"
FLINK_JARS = STATE_DIR / "jars" / "flink"
FLINK_JOB = REPO_ROOT / "ipcount_lab" / "flink_job.py"
# The JVM's heap, as the pipeline's local driver has by default (Spark's 1g), and an English
# locale: the access-log time's month names are parsed in it.
FLINK_JVM_ARGS = "-Xmx1g -Duser.language=en -Duser.country=US"


def not_set_up() -> str | None:
    """Why the Flink contender cannot run here, or None when it can."""
    if not FLINK_PYTHON.exists():
        return f"no PyFlink virtualenv at {FLINK_PYTHON.parent.parent} (run bin/setup --flink)"
    if not list(FLINK_JARS.glob("flink-sql-connector-kafka-*.jar")):
        return f"no flink-sql-connector-kafka jar in {FLINK_JARS} (run bin/setup --flink)"
    return None


def connector_jar() -> Path:
    return sorted(FLINK_JARS.glob("flink-sql-connector-kafka-*.jar"))[-1]


def recount(cfg: PipelineConfig, ending: Mapping[int, int]) -> Counter:
    """(window start ms, ip) -> requests over the range ``[0, ending)``, by the record
    specification, as one epoch over the range counts them (nothing is late within an epoch)."""
    from ipcount.rules.records import Event, parse_value, window_start
    from ipcount.storage import broker

    out: Counter = Counter()
    for partition, until in ending.items():
        for rec in broker.read_range(cfg, partition, 0, until):
            parsed = parse_value(rec.value, cfg.max_value_bytes, event_time=cfg.event_time,
                                 kafka_timestamp_ms=rec.timestamp, max_ahead_ms=cfg.max_event_time_ahead_ms)
            if isinstance(parsed, Event):
                out[(window_start(parsed.event_ms, cfg.window_ms), parsed.ip)] += 1
    return out


def fold(cfg: PipelineConfig, topic: str) -> Counter:
    """The committed counts a job wrote to ``topic``, summed per (window start ms, ip)."""
    from ipcount.storage.publisher import committed_records

    out: Counter = Counter()
    for rec in committed_records(cfg, topic):
        row = json.loads(rec.value)
        start = datetime.fromisoformat(row["window_start"]).replace(tzinfo=timezone.utc)
        out[(int(start.timestamp() * 1000), row["ip"])] += row["requests"]
    return out


def differences(truth: Counter, counted: Counter, limit: int = 5) -> list[str]:
    keys = sorted(k for k in set(truth) | set(counted) if truth[k] != counted[k])
    return [f"window {w} ip {ip}: recount {truth[(w, ip)]}, Flink {counted[(w, ip)]}" for w, ip in keys[:limit]]


def run_jobs(cfg: PipelineConfig, ending: Mapping[int, int], jobs: int, log: Path,
             run_process: Callable) -> tuple[float, float | None, list[dict]]:
    """``jobs`` runs of the job in one fresh process: (wall seconds, peak JVM MB, each job's
    JSON line with its sink topic)."""
    from ipcount.storage.broker import create_topic

    sinks = [f"{cfg.topic}_flink_{uuid.uuid4().hex[:8]}" for _ in range(jobs)]
    for sink in sinks:  # the sink's topics exist before the job: as a deployment has them
        create_topic(cfg.replace(topic=sink), 1)
    command = [str(FLINK_PYTHON), str(FLINK_JOB), "--bootstrap-servers", cfg.bootstrap_servers,
               "--topic", cfg.topic, "--ending", json.dumps({str(p): o for p, o in ending.items()}),
               "--connector-jar", str(connector_jar()), "--window-seconds", str(cfg.window_seconds),
               # As many parallel tasks as Spark's local[*] runs.
               "--parallelism", str(os.cpu_count() or 1),
               "--checkpoint-dir", str(log.parent / f"{log.stem}-checkpoints"),
               *(arg for sink in sinks for arg in ("--sink-topic", sink))]
    # A few times what a job took here (under 20 s a million records, JVM start included): a
    # job that hangs (a sink it cannot write, say) ends the run instead of stalling it.
    timeout = 120 + jobs * (60 + sum(ending.values()) / 20_000)
    wall, peak, out = run_process(command, log, {"JVM_ARGS": FLINK_JVM_ARGS}, timeout)
    results = [json.loads(line) for line in out.splitlines() if line.startswith('{"job"')]
    if [r["sink_topic"] for r in results] != sinks:
        raise RuntimeError(f"the Flink process ran {len(results)} of {jobs} jobs; its output: {log}")
    return wall, peak, results


def check(cfg: PipelineConfig, truth: Counter, result: dict) -> None:
    """A job's sink topic, folded, holds the recount's counts, window by window, IP by IP."""
    wrong = differences(truth, fold(cfg, result["sink_topic"]))
    if wrong:
        raise RuntimeError(f"Flink's counts in {result['sink_topic']} differ from the recount: {wrong}")


def measure(cfg: PipelineConfig, ending: Mapping[int, int], jobs: int, repeats: int, logs: Path,
            run_process: Callable, say: Callable[[str], None]) -> dict:
    """The warm process (``jobs`` jobs) and ``repeats`` cold ones, every job's counts checked."""
    say("  recounting the range with the record specification (the ground truth of Flink's counts)")
    truth = recount(cfg, ending)
    say(f"  warm: {jobs} jobs in one process (log {logs / 'flink-warm.log'})")
    wall, peak, results = run_jobs(cfg, ending, jobs, logs / "flink-warm.log", run_process)
    for result in results:
        check(cfg, truth, result)
    warm_runs = [{"contender": "flink", "round": r["job"], "seconds": r["runtime_ms"] / 1000,
                  "submitted_seconds": r["seconds"]} for r in results]
    cold_runs = []
    for n in range(1, repeats + 1):
        say(f"  cold: a fresh process, run {n} of {repeats}")
        cold_wall, cold_peak, (result,) = run_jobs(cfg, ending, 1, logs / f"flink-cold-{n}.log", run_process)
        check(cfg, truth, result)
        cold_runs.append({"contender": "flink", "round": n, "seconds": result["runtime_ms"] / 1000,
                          "submitted_seconds": result["seconds"], "wall_seconds": round(cold_wall, 3),
                          "peak_mb": cold_peak})
        say(f"    job {result['runtime_ms'] / 1000:.1f} s, process wall {cold_wall:.1f} s, peak {cold_peak} MB")
    return {"jobs": jobs, "repeats": repeats, "counted": sum(truth.values()), "jvm_args": FLINK_JVM_ARGS,
            "warm": {"wall_seconds": round(wall, 3), "peak_mb": peak, "runs": warm_runs,
                     "first_job_seconds": warm_runs[0]["seconds"],
                     "job": bench_stats.spread(r["seconds"] for r in warm_runs[1:]) if jobs > 1 else None},
            "cold": {"runs": cold_runs, "job": bench_stats.spread(r["seconds"] for r in cold_runs),
                     "wall": bench_stats.spread(r["wall_seconds"] for r in cold_runs),
                     "peak_mb": max(r["peak_mb"] or 0 for r in cold_runs)}}
