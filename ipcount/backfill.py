"""Backfills and rebuilds: epochs over ranges the scheduled chain did not (or must again) count.

A backfill counts only the part of its request that no ledger row owns yet, in bounded
chunks, each its own committed epoch (kind ``backfill``). It shares the ledger - and so
the no-overlap rule and its concurrency guard - with the scheduled chain, so running it
while scheduled epochs continue cannot double count. A rebuild replays a ledger's
committed epochs, as recorded, into a fresh replay target.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ipcount import kafka_io
from ipcount.backfill_request import MAIN_TARGET, BackfillRequest, BadRequestError, check_against_log, check_target
from ipcount.config import PipelineConfig
from ipcount.coverage import describe, next_chunk
from ipcount.epoch import EpochSummary, execute, prepare_tables, record_new_plan
from ipcount.ledger import COMMITTED, Ledger, LedgerState
from ipcount.offsets import (BACKFILL, DataLossError, EpochPlan, OffsetRange, check_partitions_exist,
                             check_readable)

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
        def spans(ranges):
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


def resolve(cfg: PipelineConfig, request: BackfillRequest) -> Resolved:
    """The request as (non-empty) offset ranges of ``cfg.topic``, checked against the log."""
    earliest, latest = kafka_io.partition_offsets(cfg)
    if request.by_time:
        request.check_time(int(time.time() * 1000))
        starts = kafka_io.offsets_for_time(cfg, request.from_ms, latest)
        ends = kafka_io.offsets_for_time(cfg, request.until_ms, latest)
        ranges = tuple(OffsetRange(cfg.topic, p, starts[p], max(starts[p], ends[p])) for p in sorted(latest))
    else:
        ranges = tuple(OffsetRange(cfg.topic, r.partition, r.from_offset, r.until_offset) for r in request.offsets)
    check_against_log(cfg.topic, ranges, earliest, latest)
    return Resolved(tuple(r for r in ranges if r.size > 0), earliest, latest)


def run_backfill(cfg: PipelineConfig, spark: SparkSession, request: BackfillRequest, run_id: str | None = None,
                 crash: Callable[[str], None] = lambda point: None, resolved: Resolved | None = None) -> BackfillReport:
    """Count what the request names and the target's ledger does not own yet, chunk by chunk.

    Re-running the same request (same id) after a crash finishes its unfinished chunk from
    its recorded plan and continues its watermark chain, so the result equals one clean run.
    ``resolved``: the request already resolved (by a caller that checked it before starting
    Spark); resolved here otherwise.
    """
    target_cfg = cfg.for_target(request.target)
    resolved = resolved or resolve(cfg, request)  # every check before any write
    requested, earliest, latest = resolved.ranges, resolved.earliest, resolved.latest
    log.info("backfill %s: %s -> %s", request.request_id, request.describe(), describe(requested))
    ledger, sink = prepare_tables(target_cfg, spark)

    state = ledger.state(cfg.topic)
    resumed = []
    for plan in state.pending_backfills:  # a crashed backfill's chunk, whichever request it was
        log.info("finishing unfinished backfill epoch %d (%s) with its recorded ranges", plan.epoch, plan.describe())
        resumed.append(execute(target_cfg, spark, plan, earliest, latest, run_id=run_id, crash=crash,
                               resumed=True, ledger=ledger, sink=sink))
    if resumed:
        state = ledger.state(cfg.topic)
    skipped = tuple(o for r in requested for o in state.coverage.overlaps(r))
    if skipped:
        log.info("backfill %s: skipping what the ledger already owns: %s", request.request_id, describe(skipped))

    def planner(st: LedgerState) -> EpochPlan | None:
        gaps = [g for r in requested for g in st.coverage.gaps(r)]
        chunk = next_chunk(gaps, cfg.max_records_per_epoch)
        if not chunk:
            return None
        return EpochPlan(st.last_epoch + 1, chunk, st.request_watermarks.get(request.request_id),
                         kind=BACKFILL, request_id=request.request_id, chain_watermark_ms=st.watermark_ms)

    report = BackfillReport(request, requested, skipped, resumed=resumed)
    while True:
        plan = record_new_plan(ledger, cfg.topic, run_id, planner)
        if plan is None:
            break
        report.epochs.append(execute(target_cfg, spark, plan, earliest, latest, run_id=run_id, crash=crash,
                                     ledger=ledger, sink=sink))
    log.info("%s", report.line())
    return report


@dataclass
class RebuildReport:
    source: str
    into: str
    replayed: list[int] = field(default_factory=list)
    already: list[int] = field(default_factory=list)  # committed in the target by an earlier attempt
    unfinished_in_source: list[int] = field(default_factory=list)

    def line(self) -> str:
        text = (f"rebuild of {self.source} into {self.into}: replayed {len(self.replayed)} epoch(s), "
                f"{len(self.already)} already there")
        if self.unfinished_in_source:
            text += f"; not replayed (unfinished in the source): {self.unfinished_in_source}"
        return text


def rebuild(cfg: PipelineConfig, spark: SparkSession, into: str, source: str = MAIN_TARGET,
            run_id: str | None = None, crash: Callable[[str], None] = lambda point: None) -> RebuildReport:
    """Replay every committed epoch of ``source``'s ledger into the replay target ``into``:
    same ranges, watermarks, kinds and epoch ids, in the order their counts were committed,
    so the rebuilt tables equal the source's row for row. Resumable: epochs the target
    already committed are skipped, its unfinished one is finished."""
    if check_target(into) == MAIN_TARGET or into == check_target(source):
        raise BadRequestError(f"rebuild needs a fresh replay target to write into, not {into!r} (rebuild into a "
                              "new name, verify it, then swap it in; see the README)")
    src_cfg, dst_cfg = cfg.for_target(source), cfg.for_target(into)
    if not (Path(src_cfg.ledger_path) / "_delta_log").is_dir():  # (a missing table is not an empty one)
        raise BadRequestError(f"target {source!r} has no ledger at {src_cfg.ledger_path}; nothing to rebuild")
    src = Ledger(spark, src_cfg.ledger_path)
    epochs = src.epochs(cfg.topic)
    earliest, latest = kafka_io.partition_offsets(cfg)
    for plan, _ in epochs:  # everything must still be in Kafka: fail before writing anything
        for r in plan.nonempty_ranges:
            try:
                check_partitions_exist(cfg.topic, {r.partition: r.from_offset}, latest)
                check_readable(cfg.topic, r.partition, r.from_offset, earliest[r.partition], latest[r.partition])
            except DataLossError as e:
                raise DataLossError(f"cannot rebuild epoch {plan.epoch}: {r} is no longer in Kafka ({e}); a "
                                    "rebuild needs all counted offsets within retention") from None
    src_state = src.state(cfg.topic)
    unfinished = [p.epoch for p in src_state.pending_backfills] + ([src_state.pending.epoch] if src_state.pending else [])
    report = RebuildReport(source, into, unfinished_in_source=sorted(unfinished))
    ledger, sink = prepare_tables(dst_cfg, spark)
    done = {p.epoch for p, _ in ledger.epochs(cfg.topic, (COMMITTED,))}
    state = ledger.state(cfg.topic)
    pending = {p.epoch for p in state.pending_backfills} | ({state.pending.epoch} if state.pending else set())
    for plan, _ in epochs:
        if plan.epoch in done:
            report.already.append(plan.epoch)
            continue
        if plan.epoch not in pending:
            ledger.record_plan(plan, run_id)
        execute(dst_cfg, spark, plan, earliest, latest, run_id=run_id, crash=crash, ledger=ledger, sink=sink,
                resumed=plan.epoch in pending)
        report.replayed.append(plan.epoch)
    log.info("%s", report.line())
    return report
