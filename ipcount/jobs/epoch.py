"""One checkpoint epoch: plan -> record plan -> read -> parse -> sink -> ledger commit.

The order is the exactly-once protocol (Flink's pre-commit/commit, Spark's offsets and commits logs):

1. The ranges are planned from the ledger, never from Kafka's consumer group, and recorded (``planned``) before anything
   is read; an unfinished epoch is re-run with exactly its recorded ranges and watermark.
2. The records are read with ``read_committed`` and classified deterministically.
3. The sink commits idempotently (a Delta transaction id per epoch).
4. The ledger marks the epoch ``committed``.

A crash between any two steps leaves a ``planned`` epoch that the next run finishes as if it never crashed. The group
offset commit comes after all this, for monitoring (:mod:`ipcount.jobs.group_commit`).
"""
from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

from ipcount.jobs import transform
from ipcount.jobs.crash import PLANNING, Crash, no_crash, step_line
from ipcount.jobs.tally import EpochTally, SparkTally
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import CommitContention, DataLossError, EpochFenced, PlanConflict, first_line
from ipcount.rules.kafka_security import read_group_id, sasl_password, spark_kafka_options
from ipcount.rules.ledger import SCHEDULED, EpochPlan, EpochSummary, LedgerState, PartitionMetrics
from ipcount.rules.offsets import (OffsetRange, check_still_there, describe, plan_ranges, read_tasks,
                                   reads_in_one_task, skip_deleted, split_at_log_start)
from ipcount.rules.records import dead_letter_prefix_bytes
from ipcount.rules.tableset import locations as table_locations
from ipcount.storage import broker
from ipcount.storage import tableset as tableset_io
from ipcount.storage.delta import check_writable, one_epoch_of_tables
from ipcount.storage.ledger import Ledger
from ipcount.storage.retry import retrying
from ipcount.storage.sink import Sink
from ipcount.storage.spark import read_group_key, task_slots

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


class Source(Protocol):
    """Where epochs read from: :class:`KafkaSource` in production; the ledger's model test gives a simulated log, so the
    protocol runs on the very code below over every sequence of operations and faults."""

    def partition_offsets(self) -> tuple[dict[int, int], dict[int, int]]:
        """(earliest, latest) per partition; latest is the last stable offset."""

    def start_offsets(self, earliest: Mapping[int, int], latest: Mapping[int, int]) -> dict[int, int]:
        """Where an empty ledger's chain starts (``start_position``)."""

    def offsets_for_time(self, timestamp_ms: int, latest: Mapping[int, int]) -> dict[int, int]:
        """Per partition, the first offset whose timestamp is >= ``timestamp_ms``."""

    def tally(self, plan: EpochPlan) -> EpochTally | SparkTally | None:
        """The plan's records read, parsed, classified and tallied (None: it reads nothing)."""


@dataclass(frozen=True)
class KafkaSource:
    """The topic on the broker, read with Spark's Kafka source."""

    cfg: PipelineConfig
    spark: SparkSession | None

    def partition_offsets(self) -> tuple[dict[int, int], dict[int, int]]:
        return broker.partition_offsets(self.cfg)

    def start_offsets(self, earliest: Mapping[int, int], latest: Mapping[int, int]) -> dict[int, int]:
        return broker.start_offsets(self.cfg, earliest, latest)

    def offsets_for_time(self, timestamp_ms: int, latest: Mapping[int, int]) -> dict[int, int]:
        return broker.offsets_for_time(self.cfg, timestamp_ms, latest)

    def tally(self, plan: EpochPlan) -> EpochTally | SparkTally | None:
        return _read_and_tally(self.spark, self.cfg, plan)


@dataclass(frozen=True)
class EpochRunner:
    """Records plans in one target's ledger and runs them into its sink: what scheduled epochs, backfill chunks and
    rebuilds share. ``run_id`` is recorded in the ledger; ``crash`` is called at each step boundary.

    ``yields_to_chain`` (a backfill's chunks): before its sink writes, finish the chain's unfinished epoch, if any. A
    backfill committing chunk after chunk could otherwise make the chain's commit lose every race; waiting for the
    chain's runner would need a deadline, and a runner still on the epoch loses nothing (its writes and its ledger
    commit find the epoch done)."""

    cfg: PipelineConfig
    spark: SparkSession
    ledger: Ledger
    sink: Sink
    run_id: str | None = None
    crash: Crash = no_crash
    yields_to_chain: bool = False
    source: Source | None = None  # the log it reads (None: the topic, KafkaSource(cfg, spark))

    def __post_init__(self) -> None:
        if self.source is None:
            object.__setattr__(self, "source", KafkaSource(self.cfg, self.spark))

    @classmethod
    def open(cls, cfg: PipelineConfig, spark: SparkSession | None, run_id: str | None = None,
             crash: Crash = no_crash, source: Source | None = None, rebuild_of: str | None = None) -> EpochRunner:
        """The runner of ``cfg``'s tables, created if missing; refused unless ``cfg`` matches their manifest
        (``rebuild_of``: claimed as the rebuild of that ledger, :func:`ipcount.storage.tableset.claim`)."""
        ledger, sink = Ledger(cfg.ledger_path), Sink(cfg)
        ledger.ensure(cfg.log_retention_hours)
        sink.ensure()
        tableset_io.claim(cfg, rebuild_of=rebuild_of)
        return cls(cfg, spark, ledger, sink, run_id, crash, source=source)

    def state(self) -> LedgerState:
        return self.ledger.state(self.cfg.topic)

    def step(self, point: str, epoch: int | None = None) -> None:
        """A step boundary: its marker in the log (:func:`ipcount.jobs.crash.step_line`), then the crash hook's turn."""
        log.info("%s", step_line(point, epoch))
        self.crash(point)

    def record_new_plan(self, planner: Callable[[LedgerState], EpochPlan | None],
                        state: LedgerState | None = None, attempts: int = 8) -> EpochPlan | None:
        """Plan from the ledger and record the plan, again if a concurrent planner took some of its offsets (or its id)
        first. An epoch the ledger holds unfinished is returned as it is."""
        self.step(PLANNING)
        states = [state] if state is not None else []

        def plan_and_record() -> EpochPlan | None:
            st = states.pop() if states else self.state()  # (the ledger read again after a conflict)
            plan = planner(st)
            if plan is None or plan.epoch in st.unfinished:
                return plan
            if plan.planned_at_ms is None:
                plan = replace(plan, planned_at_ms=int(time.time() * 1000))
            self.ledger.record_plan(plan, self.run_id)
            log.info("planned epoch %d: %s", plan.epoch, plan.describe())
            return plan
        return retrying(plan_and_record, PlanConflict, "the plan was not recorded", attempts, again="planning again",
                        gave_up=lambda: CommitContention(
                            f"could not record a plan in {self.ledger.path} after {attempts} attempts: other planners "
                            "kept taking the same offsets. Nothing was planned; run the command again"))

    def execute(self, plan: EpochPlan, earliest: dict[int, int], latest: dict[int, int],
                resumed: bool = False, started: float | None = None) -> EpochSummary:
        """Steps 2-4 of a recorded plan: read, sink, ledger commit. A re-run of the same plan changes nothing."""
        with one_epoch_of_tables():
            return self._execute(plan, earliest, latest, resumed, started)

    def _execute(self, plan: EpochPlan, earliest: dict[int, int], latest: dict[int, int], resumed: bool,
                 started: float | None) -> EpochSummary:
        cfg = self.cfg
        started = time.monotonic() if started is None else started
        stages: dict[str, float] = {}
        self.step("after_plan", plan.epoch)
        # Data that aged out (or a partition that vanished) since planning fails loudly, too.
        check_still_there(cfg.topic, plan.ranges, earliest, latest)
        stages["plan"] = time.monotonic() - started

        t = time.monotonic()
        try:
            tally = self.source.tally(plan)
        except Exception as read_error:
            # Retention may pass the ranges between that check and Spark's read: the read then fails with a Java trace;
            # say what happened, as the check would have.
            try:
                offsets = self.source.partition_offsets()
            except Exception:  # noqa: BLE001 - the broker is away too: the read's own error says more
                raise read_error from None
            check_still_there(cfg.topic, plan.ranges, *offsets)
            raise
        metrics = tally.metrics() if tally is not None else {}
        epoch_max = tally.max_event_ms() if tally is not None else None
        stages["read"] = time.monotonic() - t  # Kafka read, parse, classify, tally (one Spark job), metrics

        watermark_after = max((w for w in (plan.watermark_ms, epoch_max) if w is not None), default=None)
        totals = PartitionMetrics(*(sum(getattr(m, f.name) for m in metrics.values())
                                    for f in fields(PartitionMetrics)))

        sink_version = None
        if tally is not None:
            sink_version = self._write(plan, tally, totals, watermark_after, stages)
        self.step("after_sink", plan.epoch)

        t = time.monotonic()
        seconds = time.monotonic() - started
        lag = {r.partition: max(0, latest.get(r.partition, r.until_offset) - r.until_offset) for r in plan.ranges}
        self.ledger.commit(plan, metrics, watermark_after, sink_version, round(seconds, 3), self.run_id,
                           lag_after=lag, stage_seconds={k: round(v, 3) for k, v in stages.items()})
        stages["ledger"] = time.monotonic() - t  # (its own time is in the summary, not the ledger row)
        self.step("after_ledger", plan.epoch)

        summary = EpochSummary(
            plan, **asdict(totals),
            watermark_ms=watermark_after, sink_version=sink_version, seconds=time.monotonic() - started,
            stage_seconds=stages, lag_after=lag, run_id=self.run_id, resumed=resumed)
        log.info("%s", summary.line())
        return summary

    def settle_aged_out(self, plan: EpochPlan, lost: tuple[OffsetRange, ...],
                        again: Callable[[LedgerState], tuple[EpochPlan, ...]] | None = None) -> bool:
        """Settle an unfinished epoch whose offsets ``lost`` aged out before it was resumed (``on_data_loss = "skip"``),
        from the sink's own commits: if its sink writes are in, commit it in the ledger (True); else delete its side
        table rows, record ``lost`` and give the rest of its ranges to the plans ``again`` makes of it in the same
        commit (:meth:`Ledger.release`; without ``again``, to the next plan) (False)."""
        where = describe(lost)
        # The fence first: a runner still busy with the epoch writes (and commits in the ledger) nothing more of it.
        self.sink.fence(plan.epoch)
        done = self.sink.epoch_commit(plan.epoch)
        if done is not None and not done.fenced:  # its counts commit came before the fence
            log.warning("epoch %d: offsets %s aged out before it was resumed, but its sink writes are in; "
                        "committing it in the ledger (record counts unknown)", plan.epoch, where)
            watermark = done.watermark_ms if done.known else plan.watermark_ms
            self.ledger.commit(plan, None, watermark, done.version, 0.0, self.run_id)
            return True
        log.warning("data loss on %s: epoch %d's offsets %s aged out before it was resumed; its counts were "
                    "never written, so it is given up (on_data_loss=skip): those offsets are recorded as lost "
                    "and the rest of its ranges is planned again", self.cfg.topic, plan.epoch, where)
        self.sink.remove_epoch_rows(plan.epoch)
        self.ledger.release(plan, lost, again, self.run_id)
        return False

    def _write(self, plan: EpochPlan, tally: EpochTally | SparkTally, totals: PartitionMetrics,
               watermark_after: int | None, stages: dict[str, float]) -> int | None:
        """Write the epoch's rows to the sink (``totals``: its metrics over all partitions); the counts version."""
        if self.yields_to_chain:
            self._finish_the_chains_epoch(plan)
        # What the chain's last counts commits left final, so the MERGE reads only what it must.
        chain = self.ledger.chain_commits(self.cfg.topic) if plan.kind == SCHEDULED else ()
        window_ms, t = self.cfg.window_ms, time.monotonic()
        if isinstance(tally, SparkTally):
            try:
                sink_version = self.sink.write_from_spark(
                    plan, tally.counts(window_ms), tally.dead_letters(plan.epoch),
                    tally.late_records(plan.epoch, window_ms, plan.watermark_ms), totals,
                    counted_windows_ms=tally.counted_windows_ms, watermark_after_ms=watermark_after, chain=chain,
                    stages=stages, before_commit=lambda: self.step("after_counts_files", plan.epoch))
            finally:
                tally.rows.unpersist()
        else:
            counts, dead_letters = tally.counts(window_ms), tally.dead_letters(plan.epoch)
            late = tally.late_records(plan.epoch, window_ms, plan.watermark_ms)
            stages["aggregate"] = time.monotonic() - t  # the tally split into the sink's rows (Arrow)
            t = time.monotonic()
            sink_version = self.sink.write(plan, counts, dead_letters, late, watermark_after_ms=watermark_after,
                                           chain=chain, stages=stages)
        # The counts commit with what it reads (in Spark: its read, merge and file writes); the appends are side_tables.
        stages["merge"] = time.monotonic() - t - stages.get("side_tables", 0.0)
        return sink_version

    def _finish_the_chains_epoch(self, plan: EpochPlan) -> None:
        """Finish the chain's unfinished epoch, if any, before ``plan``'s writes. Never settles it: giving up offsets
        that aged out is the chain's own runs' decision."""
        chain = self.state().pending
        if chain is None:
            return
        log.info("epoch %d: the chain's epoch %d is unfinished; finishing it first with its recorded ranges %s",
                 plan.epoch, chain.epoch, chain.describe())
        earliest, latest = self.source.partition_offsets()
        try:
            replace(self, yields_to_chain=False).execute(chain, earliest, latest, resumed=True)
        except (DataLossError, EpochFenced) as e:
            log.info("epoch %d: the chain's epoch %d is left to the chain's runs: %s", plan.epoch, chain.epoch,
                     first_line(e))


def run_epoch(cfg: PipelineConfig, spark: SparkSession | None, run_id: str | None = None,
              crash: Crash = no_crash, source: Source | None = None) -> EpochSummary | None:
    """Run the scheduled chain's next epoch to its ledger commit (or finish its unfinished one). Returns None when there
    was nothing to read. ``source``: the log to read (default the topic on the broker, through ``spark``)."""
    started = time.monotonic()
    with one_epoch_of_tables():
        source = source if source is not None else KafkaSource(cfg, spark)
        earliest, latest = check_before_touch(cfg, source)
        runner = EpochRunner.open(cfg, spark, run_id, crash, source)
        plan, resumed = next_chain_epoch(runner, earliest, latest)
        lost = aged_out(plan, earliest, latest) if plan is not None and resumed and cfg.on_data_loss == "skip" else ()
        if lost:
            runner.settle_aged_out(plan, lost, functools.partial(_rest_of, plan, earliest))
            plan, resumed = next_chain_epoch(runner, earliest, latest)
        if plan is None:
            return None
        return runner.execute(plan, earliest, latest, resumed=resumed, started=started)


def check_before_touch(cfg: PipelineConfig, source: Source | None = None) -> tuple[dict[int, int], dict[int, int]]:
    """What an epoch needs, checked before a JVM starts or a table is made (a misspelt topic must not reach a new
    manifest): the tables are there or can be made, and the broker has the topic. The log's (earliest, latest)."""
    check_locations(cfg)
    return source.partition_offsets() if source is not None else broker.partition_offsets(cfg)


def check_locations(cfg: PipelineConfig) -> None:
    """Each of ``cfg``'s tables (the maintenance log too) is there or can be made where the settings say."""
    for path in (*table_locations(cfg).values(), cfg.maintenance_path):
        check_writable(path)


def _rest_of(plan: EpochPlan, earliest: dict[int, int], state: LedgerState) -> tuple[EpochPlan, ...]:
    """The chain's next epoch over what Kafka still holds of ``plan``, a given-up epoch of the chain (all of it: its
    planner kept to the cap), recorded in the commit that gives ``plan`` up, so the offsets the chain had passed are
    never owned by no row. Before the chain's first commit its empty ranges are kept too: the start positions it
    pinned."""
    rest, _ = split_at_log_start(plan.nonempty_ranges, earliest)
    if not state.committed:
        rest += tuple(r for r in plan.ranges if r.size == 0 and r.partition in earliest)
    if not rest:
        return ()
    return (EpochPlan(state.last_epoch + 1, tuple(sorted(rest, key=lambda r: r.partition)), state.watermark_ms,
                      chain_watermark_ms=state.watermark_ms),)


def aged_out(plan: EpochPlan, earliest: dict[int, int], latest: dict[int, int]) -> tuple[OffsetRange, ...]:
    """The parts of ``plan``'s ranges the broker no longer has (retention; a partition not in ``latest``, deleted): per
    partition at most one, from where its range starts."""
    return split_at_log_start(plan.nonempty_ranges, {p: earliest[p] for p in latest})[1]


def next_chain_epoch(runner: EpochRunner, earliest: dict[int, int], latest: dict[int, int],
                     state: LedgerState | None = None) -> tuple[EpochPlan | None, bool]:
    """The scheduled chain's next epoch, recorded, or its unfinished one (left by a crash, or just recorded by a
    concurrent runner), which is finished, never planned past: (plan, resumed). ``state``: the ledger as last read."""
    resumed: list[int] = []

    def planner(st: LedgerState) -> EpochPlan | None:
        if st.pending is not None:
            log.info("resuming unfinished epoch %d with its recorded ranges %s", st.pending.epoch,
                     st.pending.describe())
            resumed.append(st.pending.epoch)
            return st.pending
        return _plan_next(runner.cfg, st, earliest, latest, runner.source)
    plan = runner.record_new_plan(planner, state)
    return plan, bool(resumed)


def _plan_next(cfg: PipelineConfig, state: LedgerState, earliest: dict[int, int],
               latest: dict[int, int], source: Source) -> EpochPlan | None:
    """The chain's next plan (per partition from where the chain ended, past offsets a backfill owns, up to the next
    owned offset or the log's end), or None when a pipeline with history has nothing new."""
    if state.committed:
        log.info("ledger has entries: starting from its positions (start_position %r not used)", cfg.start_position)
        initial: dict[int, int] = {}
    else:
        initial = source.start_offsets(earliest, latest)
        log.info("empty ledger: start_position %s resolves to %s", cfg.start_position,
                 " ".join(f"p{p}={o}" for p, o in sorted(initial.items())))
    committed, lost = state.committed, ()
    if cfg.on_data_loss == "skip":
        committed, lost = skip_deleted(cfg.topic, committed, earliest, state.coverage)
        for r in lost:
            log.warning("data loss on %s-%d: offsets [%d, %d) were deleted before they were counted; skipping "
                        "them (on_data_loss=skip), recorded in the ledger as lost",
                        r.topic, r.partition, r.from_offset, r.until_offset)
    ranges = plan_ranges(cfg.topic, committed, earliest, latest, initial, cfg.max_records_per_epoch,
                         coverage=state.coverage)
    plan = EpochPlan(state.last_epoch + 1, ranges, state.watermark_ms, lost,
                     chain_watermark_ms=state.watermark_ms)
    # A pipeline with history skips empty epochs; the very first epoch is recorded even when empty, so that a "latest"
    # start position is pinned in the ledger.
    if plan.size == 0 and state.committed and not lost:
        log.info("nothing new to read on %s: %s", cfg.topic, plan.describe())
        return None
    return plan


def _read_and_tally(spark: SparkSession, cfg: PipelineConfig, plan: EpochPlan) -> EpochTally | None:
    """Read the plan's ranges, parse, classify and tally them in one Spark job (None when the plan reads nothing)."""
    if not plan.nonempty_ranges:
        return None
    kafka = {"kafka.bootstrap.servers": cfg.bootstrap_servers, "kafka.isolation.level": "read_committed",
             **spark_kafka_options(cfg, sasl_password(cfg))}
    raw = (spark.read.format("kafka").options(**read_options(spark, plan.size, len(plan.nonempty_ranges)))
           .options(**kafka)
           .option("kafka.group.id", read_group_id(read_group_key(spark), kafka))
           .option("assign", _assign_json(plan))
           .option("startingOffsets", plan.starting_offsets_json())
           .option("endingOffsets", plan.ending_offsets_json())
           .option("failOnDataLoss", "true")
           .load())
    if reads_in_one_task(plan.size):
        raw = raw.coalesce(1)
    parsed = transform.parse(raw, cfg.max_value_bytes, cfg.event_time, cfg.max_event_time_ahead_ms, plan.planned_at_ms,
                             plan.watermark_ms)
    classified = transform.classify(parsed, cfg.window_ms, cfg.allowed_lateness_ms, plan.watermark_ms)
    tally = transform.tally(classified, dead_letter_prefix_bytes(cfg.max_value_bytes))
    # (a tally has at most a row per record, besides a few rows of totals per partition)
    if plan.size <= cfg.max_driver_tally_rows:
        return EpochTally(tally.toArrow())
    # Possibly too large for this process: kept in Spark, measured, and collected only if small.
    from pyspark import StorageLevel

    tally = tally.persist(StorageLevel.MEMORY_AND_DISK)
    measured = SparkTally.measure(tally)
    if measured.size <= cfg.max_driver_tally_rows:
        rows = tally.toArrow()
        tally.unpersist()
        return EpochTally(rows)
    log.info("epoch %d: its tally has %d rows (max_driver_tally_rows %d): Spark's executors write them", plan.epoch,
             measured.size, cfg.max_driver_tally_rows)
    return measured


def read_options(spark: SparkSession, records: int, partitions: int) -> dict[str, str]:
    """The Kafka source's task count for a read of ``records`` from ``partitions`` partitions
    (:func:`ipcount.rules.offsets.read_tasks`): ``minPartitions``, or nothing."""
    slots = task_slots(spark)
    tasks = read_tasks(records, partitions, slots) if slots else None
    return {} if tasks is None else {"minPartitions": str(tasks)}


def _assign_json(plan: EpochPlan) -> str:
    by_topic: dict[str, list[int]] = {}
    for r in plan.nonempty_ranges:
        by_topic.setdefault(r.topic, []).append(r.partition)
    return json.dumps(by_topic, sort_keys=True)
