"""Warm against warm: the benchmark's contenders in one Spark session, round after round.

Each round runs every contender once on the same records, in an order rotated from round
to round:

* ``spark_count``: the read-only limit, Spark's batch Kafka read of the range, counted;
* ``parse_floor``: that read and the parse the peer and the pipeline share, its outputs
  computed and nothing else: the floor both stand on, so ``peer / parse_floor`` is about the
  most any pipeline with this parse could gain on the peer;
* ``peer``: Structured Streaming (:mod:`ipcount_lab.peer`) on a fresh table and checkpoint;
* ``pipeline``: ``run_epoch`` until caught up, each epoch followed by the consumer-group
  commit (what an ``ipcount epoch`` process runs), on a fresh table set;
* with ``epochs`` > 1, ``peer_epochs`` and ``pipeline_epochs``: the same range in ``epochs``
  micro-batches (``maxOffsetsPerTrigger``) and epochs (``max_records_per_epoch``), so the
  watermark moves and late records take the late path.

One definition of work for all: from a warm session, the target tables already created
(outside the timer), until the counts are durably committed (the pipeline: its ledger and
group commits; the peer: its query terminated). Round 1 is the cold one (the session's first
Kafka read, first MERGE, code not yet compiled by the JIT); rounds 2.. are warm. Before each
contender, cached data is dropped, finished streaming queries' state stores are unloaded
and the JVM collects garbage. Every total is read back
from the contender's Delta tables with delta-rs, never taken from its own metrics, and
checked: the pipeline's counted, late and dead-lettered records add up to the range, and a
single-epoch pipeline counts what the single-batch peer counts.

Then ``small_epochs``: epochs of ``small_per_epoch`` records through both, each timed (the
pipeline: an epoch with its group commit; the peer: each trigger's execution).

``history`` (a spark-submit of its own): a long scheduled chain of whole epochs, each timed
with its stages, for what history costs an epoch: its tables, ledger and logs grow.
"""
from __future__ import annotations

import gc
import json
import time
import urllib.request
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ipcount.rules.config import PipelineConfig
from ipcount.storage.delta import DeltaReader
from ipcount_lab import peer

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

CONTENDERS = ("spark_count", "parse_floor", "peer", "pipeline")
EPOCH_CONTENDERS = ("peer_epochs", "pipeline_epochs")


@dataclass
class Run:
    """One contender's run in one round."""

    contender: str
    round: int
    seconds: float
    records: int              # records in the range it read
    counted: int = 0          # sum(count) read back from its counts table
    late: int = 0             # rows in the pipeline's late table
    malformed: int = 0        # rows in the pipeline's dead-letter table
    batches: int = 1          # epochs, micro-batches
    stages: dict[str, float] = field(default_factory=dict)
    spill_bytes: int = 0      # memory and disk spill of its Spark stages
    gc_seconds: float = 0.0   # JVM garbage collection in its Spark tasks


@dataclass
class EpochTime:
    """One epoch of a pipeline run: its seconds (with the group commit) and its stages'."""

    seconds: float
    stages: dict[str, float]


def warm_rounds(spark: SparkSession, cfg: PipelineConfig, ending: dict[int, int], workdir: Path, rounds: int,
                epochs: int, say: Callable[[str], None] = print, only: tuple[str, ...] | None = None) -> list[Run]:
    """``rounds`` rounds of every contender (or those ``only`` names) over ``cfg.topic`` up to
    ``ending`` (offset 0 on), checked (:func:`check`); their runs."""
    total = sum(ending.values())
    contenders = list(CONTENDERS) + (list(EPOCH_CONTENDERS) if epochs > 1 else [])
    contenders = [c for c in contenders if only is None or c in only]
    per_epoch = -(-total // epochs)
    runs = []
    for r in range(1, rounds + 1):
        shift = (r - 1) % len(contenders)
        for name in contenders[shift:] + contenders[:shift]:
            _settle(spark)
            where = workdir / f"round{r}" / name
            group = f"bench-{name}-round{r}"
            spark.sparkContext.setJobGroup(group, f"benchmark {name}, round {r}")
            if name == "spark_count":
                run = _spark_count(spark, cfg, ending, r)
            elif name == "parse_floor":
                run = _parse_floor(spark, cfg, ending, r)
            elif name.startswith("peer"):
                run = _peer(spark, cfg, ending, where, r, name, per_epoch if name == "peer_epochs" else None)
            else:
                run, _ = _pipeline(spark, cfg, where, r, name, per_epoch if name == "pipeline_epochs" else total)
            spark.sparkContext.setJobGroup("", "")
            if not name.startswith("peer"):  # (the peer's jobs run in its query's group: _peer)
                run.spill_bytes, run.gc_seconds = _stage_totals(spark, group)
            runs.append(run)
            say(f"  round {r} {name}: {run.seconds:.2f} s, {run.records:,} records, counted {run.counted:,}"
                + (f", late {run.late:,}, malformed {run.malformed:,}" if name.startswith("pipeline") else "")
                + (f", {run.batches} batches" if run.batches != 1 else ""))
    check(runs, total)
    return runs


def check(runs: list[Run], total: int) -> None:
    """Every contender read the whole range; the pipeline's records add up; the single
    epoch and the single batch count the same, round after round."""
    for run in runs:
        if run.records != total:
            raise RuntimeError(f"{run.contender} in round {run.round} read {run.records} records, not {total}")
        if run.contender.startswith("pipeline") and run.counted + run.late + run.malformed != total:
            raise RuntimeError(f"{run.contender} in round {run.round}: counted {run.counted} + late {run.late} + "
                               f"malformed {run.malformed} != {total} records read")
    single = {run.counted for run in runs if run.contender in ("parse_floor", "peer", "pipeline")}
    if len(single) > 1:
        raise RuntimeError(f"the parse floor, the peer and the pipeline counted differently over one batch: "
                           f"{sorted(single)}")
    for name in EPOCH_CONTENDERS:
        if len({run.counted for run in runs if run.contender == name}) > 1:
            raise RuntimeError(f"{name} counted differently from round to round")


def small_epochs(spark: SparkSession, cfg: PipelineConfig, ending: dict[int, int], workdir: Path,
                 per_epoch: int) -> dict[str, list[float]]:
    """Seconds of each epoch of ``per_epoch`` records, the pipeline's and the peer's."""
    _settle(spark)
    _, pipeline_epochs = _pipeline(spark, cfg, workdir / "small" / "pipeline", 0, "pipeline_small", per_epoch)
    pipeline_seconds = [e.seconds for e in pipeline_epochs]
    _settle(spark)
    table, checkpoint = str(workdir / "small" / "peer" / "counts"), str(workdir / "small" / "peer" / "checkpoint")
    peer.create_table(spark, table)
    # Every trigger's progress kept, not the last 100 only.
    spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", str(len(pipeline_seconds) + 100))
    result = peer.run_peer(cfg, spark, table, checkpoint, ending, max_offsets_per_trigger=per_epoch)
    return {"pipeline": pipeline_seconds, "peer": result.batch_seconds}


def history(spark: SparkSession, cfg: PipelineConfig, ending: dict[int, int], where: Path,
            per_epoch: int) -> dict:
    """Epochs of ``per_epoch`` records through the pipeline into fresh tables at ``where``
    until ``ending``, each timed with its stages; the run (totals read back and checked)."""
    _settle(spark)
    run, epochs = _pipeline(spark, cfg, where, 0, "pipeline_history", per_epoch)
    check([run], sum(ending.values()))
    return {"run": asdict(run), "seconds": [round(e.seconds, 4) for e in epochs],
            "stages": [{k: round(v, 4) for k, v in e.stages.items()} for e in epochs]}


def _spark_count(spark: SparkSession, cfg: PipelineConfig, ending: dict[int, int], r: int) -> Run:
    started = time.monotonic()
    n = peer.spark_count(cfg, spark, ending)
    return Run("spark_count", r, time.monotonic() - started, records=n, counted=n)


def _parse_floor(spark: SparkSession, cfg: PipelineConfig, ending: dict[int, int], r: int) -> Run:
    started = time.monotonic()
    records, requests = peer.parse_floor(cfg, spark, ending)
    return Run("parse_floor", r, time.monotonic() - started, records=records, counted=requests)


def _peer(spark: SparkSession, cfg: PipelineConfig, ending: dict[int, int], where: Path, r: int, name: str,
          per_trigger: int | None) -> Run:
    table = str(where / "counts")
    peer.create_table(spark, table)
    started = time.monotonic()
    result = peer.run_peer(cfg, spark, table, str(where / "checkpoint"), ending, max_offsets_per_trigger=per_trigger)
    seconds = time.monotonic() - started
    spill, gc_seconds = _stage_totals(spark, result.job_group)
    return Run(name, r, seconds, records=sum(result.reached.values()), counted=sum_count(table),
               batches=result.batches, spill_bytes=spill, gc_seconds=gc_seconds)


def _pipeline(spark: SparkSession, cfg: PipelineConfig, where: Path, r: int, name: str,
              per_epoch: int) -> tuple[Run, list[EpochTime]]:
    """The run, and each epoch's time."""
    from ipcount.jobs.epoch import EpochRunner, run_epoch
    from ipcount.jobs.group_commit import commit_group_offsets_from_ledger

    run_cfg = cfg.replace(warehouse=str(where), pipeline_id=f"{cfg.pipeline_id}_{name}_{r}",
                          group_id=f"{cfg.group_id}_{name}_{r}", max_records_per_epoch=per_epoch)
    EpochRunner.open(run_cfg, spark)  # the tables, created before the timer starts
    epochs: list[EpochTime] = []
    records = 0
    started = time.monotonic()
    while True:
        epoch_started = time.monotonic()
        summary = run_epoch(run_cfg, spark, run_id=f"benchmark-{name}-{r}")
        if summary is None:
            break
        commit_started = time.monotonic()
        commit_group_offsets_from_ledger(run_cfg)
        summary = summary.with_stages(kafka_commit=time.monotonic() - commit_started)
        epochs.append(EpochTime(time.monotonic() - epoch_started, dict(summary.stage_seconds)))
        records += summary.records_read
    seconds = time.monotonic() - started
    stages: dict[str, float] = defaultdict(float)
    for epoch in epochs:
        for stage, stage_seconds in epoch.stages.items():
            stages[stage] += stage_seconds
    reader = DeltaReader()
    late = reader.query(run_cfg.late_path, "SELECT count(*) AS n FROM t")
    malformed = reader.query(run_cfg.dead_letter_path, "SELECT count(*) AS n FROM t")
    run = Run(name, r, seconds, records=records, counted=sum_count(run_cfg.counts_path, reader),
              late=late[0]["n"] if late else 0, malformed=malformed[0]["n"] if malformed else 0,
              batches=len(epochs), stages=dict(stages))
    return run, epochs


def sum_count(table: str, reader: DeltaReader | None = None) -> int:
    """sum(count) of a counts table, read back with delta-rs."""
    rows = (reader or DeltaReader()).query(table, "SELECT coalesce(sum(count), 0) AS n FROM t")
    return int(rows[0]["n"]) if rows else 0


def _settle(spark: SparkSession) -> None:
    """Nothing cached or loaded, garbage collected: each contender starts from the same heap."""
    spark.catalog.clearCache()
    gc.collect()
    jvm = spark.sparkContext._jvm  # noqa: SLF001 - py4j has no public handle on these
    # A finished streaming query's state stores (the peer's: an entry per window and client)
    # stay loaded until a maintenance pass unloads them, up to a minute later: in the heap of
    # whichever contender runs next. No query runs here, so all of them are unloaded.
    jvm.org.apache.spark.sql.execution.streaming.state.StateStore.stop()
    jvm.java.lang.System.gc()


def _rest(spark: SparkSession, path: str) -> list[dict]:
    """Spark's monitoring REST API of this application (the UI's), or [] without a UI."""
    url = spark.sparkContext.uiWebUrl
    if not url:
        return []
    with urllib.request.urlopen(f"{url}/api/v1/applications/{spark.sparkContext.applicationId}/{path}",
                                timeout=30) as response:
        return json.load(response)


def _stage_totals(spark: SparkSession, group: str) -> tuple[int, float]:
    """Memory and disk spill (bytes) and JVM GC time (s) of the stages of a job group's jobs."""
    stage_ids = {s for job in _rest(spark, "jobs") if job.get("jobGroup") == group for s in job.get("stageIds", [])}
    stages = [s for s in _rest(spark, "stages") if s.get("stageId") in stage_ids] if stage_ids else []
    return (sum(s.get("memoryBytesSpilled", 0) + s.get("diskBytesSpilled", 0) for s in stages),
            round(sum(s.get("jvmGcTime", 0) for s in stages) / 1000, 3))


def _heap_pools_peak(spark: SparkSession) -> int:
    """The driver JVM's heap pools' peak usage since it started (bytes), from JMX."""
    jvm = spark.sparkContext._jvm  # noqa: SLF001 - py4j has no public handle on these
    pools = jvm.java.lang.management.ManagementFactory.getMemoryPoolMXBeans()
    return sum(pool.getPeakUsage().getUsed() for pool in pools if pool.getType().name() == "HEAP")


def jvm_memory(spark: SparkSession) -> dict[str, float | None]:
    """The driver's peak JVM heap (MB) and its GC time (s) so far (local mode: the driver
    is all of Spark), and the peak resident memory of this Python process, the task's part
    (:func:`python_peak_rss_mb`). The heap is Spark's executor metrics' peak; a run shorter
    than their first heartbeat (10 s) has none yet, and then the heap pools' peaks from JMX
    stand in (each pool's own peak: their sum is at least the heap's)."""
    driver = next((e for e in _rest(spark, "executors") if e.get("id") == "driver"), {})
    heap = (driver.get("peakMemoryMetrics") or {}).get("JVMHeapMemory") or _heap_pools_peak(spark)
    return {"peak_heap_mb": None if heap is None else round(heap / 2**20, 1),
            "gc_seconds": round(driver.get("totalGCTime", 0) / 1000, 2),
            "python_peak_rss_mb": python_peak_rss_mb()}


def python_peak_rss_mb() -> float | None:
    """This process's peak resident memory (MB), from ``VmHWM``: the peak of its own address
    space. ``getrusage``'s ``ru_maxrss`` will not do for a process started by another: Linux
    carries the peak over ``execve``, so a child of a large parent reports the parent's size.
    None where ``/proc`` has no such line (not Linux)."""
    try:
        with open("/proc/self/status") as status:
            line = next((line for line in status if line.startswith("VmHWM:")), None)
    except OSError:
        return None
    return None if line is None else round(int(line.split()[1]) / 1024, 1)


def runs_json(runs: list[Run]) -> list[dict]:
    return [asdict(run) for run in runs]
