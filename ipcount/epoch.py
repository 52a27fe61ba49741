"""One checkpoint epoch: plan -> record plan -> read -> parse -> sink -> ledger commit.

The order is the exactly-once protocol (Flink's pre-commit/commit, Spark's offsets and
commits logs):

1. The ranges are planned from the ledger, never from Kafka's consumer group, and
   recorded (``planned``) before anything is read. If the ledger already holds an
   unfinished epoch, that epoch is re-run with exactly its recorded ranges and watermark.
2. The records are read with ``read_committed`` and classified deterministically.
3. The sink commits idempotently (Delta txnAppId/txnVersion = epoch).
4. The ledger marks the epoch ``committed``.

A crash between any two steps leaves a ``planned`` epoch that the next run finishes, and
the result equals a run that never crashed. Committing offsets to the Kafka consumer
group happens after all this (:func:`commit_group_offsets_from_ledger`), for monitoring.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Callable

from ipcount import kafka_io, transform
from ipcount.config import PipelineConfig
from ipcount.ledger import Ledger, LedgerState, PartitionMetrics, PlanConflict
from ipcount.ledger_view import epoch_line
from ipcount.offsets import EpochPlan, check_partitions_exist, check_readable, plan_ranges, skip_deleted
from ipcount.sink import Sink

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

# Step boundaries where a crash can be injected (tests SIGKILL the process there).
CRASH_POINTS = ("after_plan", "after_sink", "after_ledger", "before_kafka_commit")


def crash_hook(crash_at: str | None) -> Callable[[str], None]:
    """A hook that kills this process with SIGKILL at the named step boundary."""
    if crash_at is not None and crash_at not in CRASH_POINTS:
        raise ValueError(f"crash point must be one of {', '.join(CRASH_POINTS)}; found {crash_at!r}")

    def hook(point: str) -> None:
        if point == crash_at:
            log.warning("crash injected at %s: SIGKILL", point)
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


@dataclass
class EpochSummary:
    epoch: int
    plan: EpochPlan
    records_read: int = 0
    records_counted: int = 0
    records_late: int = 0
    records_malformed: int = 0
    watermark_ms: int | None = None
    sink_version: int | None = None
    seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    lag_after: dict[int, int] = field(default_factory=dict)
    resumed: bool = False

    def line(self) -> str:
        return epoch_line(self.epoch, {r.partition: (r.from_offset, r.until_offset) for r in self.plan.ranges},
                          self.records_read, self.records_counted, self.records_late, self.records_malformed,
                          sum(self.lag_after.values()), self.seconds) + (" (resumed)" if self.resumed else "")


def run_epoch(cfg: PipelineConfig, spark: SparkSession, run_id: str | None = None,
              crash: Callable[[str], None] = lambda point: None) -> EpochSummary | None:
    """Run the scheduled chain's next epoch to its ledger commit (or finish its unfinished
    one). Returns None when there was nothing to read."""
    started = time.monotonic()
    ledger, sink = prepare_tables(cfg, spark)
    earliest, latest = kafka_io.partition_offsets(cfg)
    state = ledger.state(cfg.topic)
    if state.pending is not None:
        plan = state.pending
        log.info("resuming unfinished epoch %d with its recorded ranges %s", plan.epoch, plan.describe())
    else:
        plan = record_new_plan(ledger, cfg.topic, run_id, lambda st: _plan_next(cfg, st, earliest, latest),
                               state)
        if plan is None:
            return None
    return execute(cfg, spark, plan, earliest, latest, run_id=run_id, crash=crash,
                   resumed=state.pending is not None, started=started, ledger=ledger, sink=sink)


def prepare_tables(cfg: PipelineConfig, spark: SparkSession) -> tuple[Ledger, Sink]:
    ledger, sink = Ledger(spark, cfg.ledger_path), Sink(spark, cfg)
    ledger.ensure()
    sink.ensure()
    return ledger, sink


def record_new_plan(ledger: Ledger, topic: str, run_id: str | None,
                    planner: Callable[[LedgerState], EpochPlan | None], state: LedgerState | None = None,
                    attempts: int = 8) -> EpochPlan | None:
    """Plan from the ledger and record the plan; if a concurrent planner took some of the
    offsets (or the epoch id) first, plan again from the new state."""
    for attempt in range(1, attempts + 1):
        state = state if state is not None else ledger.state(topic)
        plan = planner(state)
        if plan is None:
            return None
        try:
            ledger.record_plan(plan, run_id)
        except PlanConflict as e:
            log.info("epoch %d not recorded: %s; planning again (%d/%d)", plan.epoch, e, attempt, attempts)
            state = None
            time.sleep(0.2 * attempt)
            continue
        log.info("planned epoch %d: %s", plan.epoch, plan.describe())
        return plan
    raise RuntimeError(f"could not record a plan in {ledger.path} after {attempts} attempts: other "
                       "planners kept taking the same offsets")


def execute(cfg: PipelineConfig, spark: SparkSession, plan: EpochPlan, earliest: dict[int, int],
            latest: dict[int, int], *, ledger: Ledger, sink: Sink, run_id: str | None = None,
            crash: Callable[[str], None] = lambda p: None, resumed: bool = False,
            started: float | None = None) -> EpochSummary:
    """Steps 2-4 of a recorded plan: read, sink, ledger commit. The same for scheduled
    epochs, backfill chunks and rebuilds; a re-run of the same plan changes nothing."""
    started = time.monotonic() if started is None else started
    stages: dict[str, float] = {}
    crash("after_plan")
    # Data that aged out (or a partition that vanished) since planning fails loudly, too.
    check_partitions_exist(cfg.topic, {r.partition: r.from_offset for r in plan.nonempty_ranges}, latest)
    for r in plan.nonempty_ranges:
        check_readable(cfg.topic, r.partition, r.from_offset, earliest[r.partition], latest[r.partition])
    stages["plan"] = time.monotonic() - started

    t = time.monotonic()
    classified = _read_and_classify(spark, cfg, plan)
    metrics_rows = transform.partition_metrics(classified).collect() if classified is not None else []
    stages["read"] = time.monotonic() - t  # Kafka read, parse, classify, per-partition metrics

    metrics = {r.partition: PartitionMetrics(r.records_read, r.records_counted, r.records_late,
                                             r.records_malformed) for r in metrics_rows}
    epoch_max = max((r.max_event_ms for r in metrics_rows if r.max_event_ms is not None), default=None)
    watermark_after = max((w for w in (plan.watermark_ms, epoch_max) if w is not None), default=None)

    totals = PartitionMetrics(*(sum(getattr(m, f.name) for m in metrics.values()) for f in fields(PartitionMetrics)))
    sink_version = None
    if classified is not None:
        t = time.monotonic()
        counts = transform.window_counts(classified, cfg.window_ms).persist()
        counts.count()  # materialized here, so the stages below time the writes alone
        stages["aggregate"] = time.monotonic() - t

        t = time.monotonic()
        sink_version = sink.write(plan, classified, counts, malformed=totals.records_malformed,
                                  late=totals.records_late, counted=totals.records_counted,
                                  watermark_after_ms=watermark_after)
        stages["merge"] = time.monotonic() - t  # dead letters, late records, MERGE into counts
        counts.unpersist()
        classified.unpersist()
    crash("after_sink")

    t = time.monotonic()
    seconds = time.monotonic() - started
    lag = {r.partition: max(0, latest.get(r.partition, r.until_offset) - r.until_offset) for r in plan.ranges}
    ledger.commit(plan, metrics, watermark_after, sink_version, round(seconds, 3), run_id, lag_after=lag,
                  stage_seconds={k: round(v, 3) for k, v in stages.items()})
    stages["ledger"] = time.monotonic() - t  # (its own time is in the summary, not the ledger row)
    crash("after_ledger")

    summary = EpochSummary(
        epoch=plan.epoch, plan=plan, watermark_ms=watermark_after, sink_version=sink_version,
        records_read=totals.records_read, records_counted=totals.records_counted,
        records_late=totals.records_late, records_malformed=totals.records_malformed,
        seconds=time.monotonic() - started, stage_seconds=stages, lag_after=lag, resumed=resumed)
    log.info("%s", summary.line())
    return summary


def _plan_next(cfg: PipelineConfig, state: LedgerState, earliest: dict[int, int],
               latest: dict[int, int]) -> EpochPlan | None:
    """The chain's next plan, or None when a pipeline with history has nothing new.

    Per partition the epoch continues where the chain ended, past any offsets a backfill
    already owns, up to the next owned offset or the end of the log; the cap is split
    across partitions by what is left.
    """
    if state.committed:
        log.info("ledger has entries: starting from its positions (start_position %r not used)", cfg.start_position)
        initial: dict[int, int] = {}
    else:
        initial = kafka_io.start_offsets(cfg, earliest, latest)
        log.info("empty ledger: start_position %s resolves to %s", cfg.start_position,
                 " ".join(f"p{p}={o}" for p, o in sorted(initial.items())))
    committed, lost = state.committed, ()
    if cfg.on_data_loss == "skip":
        committed, lost = skip_deleted(cfg.topic, committed, earliest)
        for r in lost:
            log.warning("data loss on %s-%d: offsets [%d, %d) were deleted before they were counted; skipping "
                        "them (on_data_loss=skip), recorded in the ledger as lost",
                        r.topic, r.partition, r.from_offset, r.until_offset)
    ranges = plan_ranges(cfg.topic, committed, earliest, latest, initial, cfg.max_records_per_epoch,
                         coverage=state.coverage)
    plan = EpochPlan(state.last_epoch + 1, ranges, state.watermark_ms, lost,
                     chain_watermark_ms=state.watermark_ms)
    # A pipeline with history skips empty epochs; the very first epoch is recorded even when
    # empty, so that a "latest" start position is pinned in the ledger.
    if plan.size == 0 and state.committed and not lost:
        log.info("nothing new to read on %s: %s", cfg.topic, plan.describe())
        return None
    return plan


def _read_and_classify(spark: SparkSession, cfg: PipelineConfig, plan: EpochPlan) -> DataFrame | None:
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    if not plan.nonempty_ranges:
        return None
    raw = (spark.read.format("kafka")
           .option("kafka.bootstrap.servers", cfg.bootstrap_servers)
           .option("assign", _assign_json(plan))
           .option("startingOffsets", plan.starting_offsets_json())
           .option("endingOffsets", plan.ending_offsets_json())
           .option("kafka.isolation.level", "read_committed")
           .option("failOnDataLoss", "true")
           .load())
    parsed = transform.parse(raw, cfg.max_value_bytes, cfg.event_time)
    classified = transform.classify(parsed, cfg.window_ms, cfg.allowed_lateness_ms, plan.watermark_ms)
    # Only dead letters keep the raw key and value; dropping them from the rest keeps the
    # cached rows small.
    bad = F.col("reason").isNotNull()
    classified = classified.withColumns({"key": F.when(bad, F.col("key")), "value": F.when(bad, F.col("value"))})
    # Read Kafka once: the sink's three writes and the metrics all use these rows.
    return classified.persist(StorageLevel.MEMORY_AND_DISK)


def _assign_json(plan: EpochPlan) -> str:
    import json

    by_topic: dict[str, list[int]] = {}
    for r in plan.nonempty_ranges:
        by_topic.setdefault(r.topic, []).append(r.partition)
    return json.dumps(by_topic, sort_keys=True)


def commit_group_offsets_from_ledger(cfg: PipelineConfig) -> bool:
    """Commit the ledger's committed positions to the consumer group (step 7, optional).

    Always the ledger's latest positions, so a commit that failed last time is caught up
    now. A failure only warns: recovery never reads these offsets.
    """
    from ipcount.ledger_view import committed_positions

    if not cfg.commit_offsets:
        log.info("offset commits to Kafka are off (commit_offsets=false); group %s untouched", cfg.group_id)
        return False
    epoch, positions = committed_positions(cfg.ledger_path, cfg.topic)
    if not positions:
        log.info("ledger has no committed epoch yet; nothing to commit to group %s", cfg.group_id)
        return False
    try:
        kafka_io.commit_group_offsets(cfg, positions, epoch)
    except Exception as e:  # noqa: BLE001 - monitoring only; must never fail the epoch
        log.warning("could not commit offsets to consumer group %s (monitoring only; retried after "
                    "the next epoch): %s", cfg.group_id, e)
        return False
    log.info("committed epoch %d positions to consumer group %s: %s", epoch, cfg.group_id,
             " ".join(f"p{p}={o}" for p, o in sorted(positions.items())))
    return True
