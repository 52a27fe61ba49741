"""Backfills: epochs over ranges the scheduled chain did not count.

A backfill counts only the part of its request no ledger row owns yet, in bounded chunks, each its own epoch (kind
``backfill``). It shares the ledger's no-overlap rule with the scheduled chain, so running beside it cannot double
count.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ipcount.jobs.crash import PLANNING, Crash, no_crash
from ipcount.jobs.epoch import EpochRunner, KafkaSource, Source
from ipcount.rules.config import PipelineConfig
from ipcount.rules.coverage import chunks, next_chunk
from ipcount.rules.errors import DataLossError
from ipcount.rules.ledger import BACKFILL, EpochPlan, EpochSummary, LedgerState
from ipcount.rules.offsets import OffsetRange, describe, split_at_log_start
from ipcount.rules.requests import BackfillRequest, check_against_log
from ipcount.storage.delta import one_epoch_of_tables

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


@dataclass
class BackfillReport:
    request: BackfillRequest
    requested: tuple[OffsetRange, ...]
    skipped: tuple[OffsetRange, ...]            # already owned by the ledger when the request ran
    epochs: list[EpochSummary] = field(default_factory=list)
    resumed: list[EpochSummary] = field(default_factory=list)  # unfinished backfill epochs finished first

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def records_counted(self) -> int:
        return sum(e.records_counted for e in self.epochs)

    def line(self) -> str:
        return (f"backfill {self.request_id} ({self.request.describe()}): requested {describe(self.requested)}; "
                f"skipped (already counted) {describe(self.skipped)}; {len(self.epochs)} epoch(s) "
                f"{', '.join(str(e.epoch) for e in self.epochs) or '-'} counted {self.records_counted} records")

    def to_dict(self) -> dict[str, Any]:
        def spans(ranges: tuple[OffsetRange, ...]) -> list[dict[str, int]]:
            return [{"partition": r.partition, "from_offset": r.from_offset, "until_offset": r.until_offset}
                    for r in ranges]
        return {"request_id": self.request_id, "target": self.request.target, "requested": spans(self.requested),
                "skipped": spans(self.skipped), "epochs": [e.epoch for e in self.epochs],
                "resumed_epochs": [e.epoch for e in self.resumed], "records_counted": self.records_counted,
                "records_read": sum(e.records_read for e in self.epochs)}


@dataclass(frozen=True)
class Resolved:
    """A request as offset ranges, and the log bounds it was checked against."""

    ranges: tuple[OffsetRange, ...]
    earliest: dict[int, int]
    latest: dict[int, int]


def resolve(cfg: PipelineConfig, request: BackfillRequest, source: Source | None = None) -> Resolved:
    """The request as (non-empty) offset ranges of ``cfg.topic``, checked against the log (``source``; default the topic
    on the broker)."""
    source = source or KafkaSource(cfg, None)
    earliest, latest = source.partition_offsets()
    if request.by_time:
        request.check_time(int(time.time() * 1000))
        starts = source.offsets_for_time(request.from_ms, latest)
        ends = source.offsets_for_time(request.until_ms, latest)
        ranges = tuple(OffsetRange(cfg.topic, p, starts[p], max(starts[p], ends[p])) for p in sorted(latest))
    else:
        ranges = tuple(OffsetRange(cfg.topic, r.partition, r.from_offset, r.until_offset) for r in request.offsets)
    check_against_log(cfg.topic, ranges, earliest, latest)
    return Resolved(tuple(r for r in ranges if r.size > 0), earliest, latest)


def run_backfill(cfg: PipelineConfig, spark: SparkSession | None, request: BackfillRequest,
                 run_id: str | None = None, crash: Crash = no_crash, resolved: Resolved | None = None,
                 source: Source | None = None) -> BackfillReport:
    """Count what the request names and the target's ledger does not own yet, chunk by chunk. Re-running the same
    request after a crash finishes its unfinished chunk and continues its watermark chain, as one clean run would.
    ``resolved``: the request already resolved (and checked before Spark started). ``source``: the log to read.

    The log start is read again before each chunk: what retention deleted before it was counted fails the backfill
    (``on_data_loss = "fail"``) or is recorded ``lost`` with the chunk (``"skip"``); an unfinished chunk whose offsets
    aged out is settled as the chain's is (:meth:`EpochRunner.settle_aged_out`).
    """
    target_cfg = cfg.for_target(request.target)
    source = source or KafkaSource(target_cfg, spark)  # (what it reads is parsed by the target's rules)
    resolved = resolved or resolve(cfg, request, source)  # every check before any write
    with one_epoch_of_tables():  # (each table loaded once for all the chunks)
        return _run_chunks(cfg, target_cfg, spark, request, resolved, run_id, crash, source)


def _run_chunks(cfg: PipelineConfig, target_cfg: PipelineConfig, spark: SparkSession | None,
                request: BackfillRequest, resolved: Resolved, run_id: str | None, crash: Crash,
                source: Source) -> BackfillReport:
    requested = resolved.ranges
    log.info("backfill %s: %s -> %s", request.request_id, request.describe(), describe(requested))
    runner = replace(EpochRunner.open(target_cfg, spark, run_id, crash, source), yields_to_chain=True)

    runner.step(PLANNING)
    state = runner.state()
    resumed = []
    # A crashed backfill's chunks, whichever request they were, and the chunks that take over the rest of one settled
    # here: each settle leaves fewer offsets, so this ends.
    while state.pending_backfills:
        for plan in state.pending_backfills:
            resumed.extend(_finish(runner, plan))
        state = runner.state()
    skipped = tuple(o for r in requested for o in state.coverage.overlaps(r))
    if skipped:
        log.info("backfill %s: skipping what the ledger already owns: %s", request.request_id, describe(skipped))

    report = BackfillReport(request, requested, skipped, resumed=resumed)
    while True:
        earliest, latest = source.partition_offsets()
        plan = runner.record_new_plan(lambda st: _next_chunk(cfg, st, request.request_id, requested, earliest))
        if plan is None:
            break
        report.epochs.append(runner.execute(plan, earliest, latest))
    log.info("%s", report.line())
    return report


def _next_chunk(cfg: PipelineConfig, st: LedgerState, request_id: str, wanted: tuple[OffsetRange, ...],
                earliest: dict[int, int]) -> EpochPlan | None:
    """The request's next chunk: what no ledger row owns of ``wanted``, bounded; under ``skip`` with what retention
    deleted of it (all of it, so the chunk's cap counts only what is read) as its lost ranges."""
    gaps, deleted = split_at_log_start([g for r in wanted for g in st.coverage.gaps(r)], earliest)
    if deleted and cfg.on_data_loss != "skip":
        raise _deleted(deleted[0], f"backfill {request_id}")
    for r in deleted:
        log.warning("data loss on %s-%d: offsets [%d, %d) of backfill %s were deleted before they were counted; "
                    "skipping them (on_data_loss=skip), recorded in the ledger as lost",
                    r.topic, r.partition, r.from_offset, r.until_offset, request_id)
    chunk = next_chunk(gaps, cfg.max_records_per_epoch)
    if not chunk and not deleted:
        return None
    return EpochPlan(st.last_epoch + 1, chunk, st.request_watermarks.get(request_id), lost=deleted,
                     kind=BACKFILL, request_id=request_id, chain_watermark_ms=st.watermark_ms)


def _finish(runner: EpochRunner, plan: EpochPlan) -> list[EpochSummary]:
    """Finish an unfinished backfill chunk: run it with its recorded ranges, or, if Kafka no longer holds all of them
    and the policy is ``skip``, settle it: the rest of it becomes new chunks of the request in the very commit that
    gives it up (so no offsets are left owned by no row), which the caller runs as every unfinished chunk."""
    cfg = runner.cfg
    log.info("finishing unfinished backfill epoch %d (%s) with its recorded ranges", plan.epoch, plan.describe())
    earliest, latest = runner.source.partition_offsets()
    rest, lost = split_at_log_start(plan.nonempty_ranges, earliest)
    if not lost:
        return [runner.execute(plan, earliest, latest, resumed=True)]
    if cfg.on_data_loss != "skip":
        raise _deleted(lost[0], f"unfinished backfill epoch {plan.epoch} (request {plan.request_id})")

    def again(st: LedgerState) -> tuple[EpochPlan, ...]:
        return tuple(EpochPlan(st.last_epoch + i, chunk, st.request_watermarks.get(plan.request_id), kind=BACKFILL,
                               request_id=plan.request_id, chain_watermark_ms=st.watermark_ms,
                               planned_at_ms=int(time.time() * 1000))
                     for i, chunk in enumerate(chunks(rest, cfg.max_records_per_epoch), start=1))
    runner.settle_aged_out(plan, lost, again)
    return []


def _deleted(r: OffsetRange, of: str) -> DataLossError:
    return DataLossError(f"data loss on {r.topic}-{r.partition}: offsets [{r.from_offset}, {r.until_offset}) of {of} "
                         "were deleted before they were counted. Run again with on_data_loss=skip (--on-data-loss "
                         "skip) to record them as lost and count the rest")
