"""Rebuilds: a ledger's committed epochs replayed as recorded into a fresh replay target, so the rebuilt tables equal
the source's row for row - the way to recover from a damaged counts table while Kafka still holds the offsets.

An epoch the target holds counts as replayed, so the target must hold nothing else: the rebuild records the source
ledger's table id in the target's manifest (``rebuild_of``) before it writes, and refuses a target of another table set.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ipcount.jobs.crash import PLANNING, Crash, no_crash
from ipcount.jobs.epoch import EpochRunner, KafkaSource, Source, check_locations
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import BadRequestError, DataLossError
from ipcount.rules.ledger import COMMITTED
from ipcount.rules.offsets import check_still_there
from ipcount.rules.requests import MAIN_TARGET, check_target
from ipcount.rules.tableset import recorded_settings
from ipcount.storage import tableset as tableset_io
from ipcount.storage.delta import has_table, table_metadata
from ipcount.storage.ledger import Ledger

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


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


def check_request(cfg: PipelineConfig, into: str, source: str = MAIN_TARGET) -> PipelineConfig:
    """``source``'s configuration, once the request is one a rebuild can run: ``into`` a fresh replay name, from a
    source whose ledger exists (before a JVM starts, or anything is written)."""
    if check_target(into) == MAIN_TARGET or into == check_target(source):
        raise BadRequestError(f"rebuild needs a fresh replay target to write into, not {into!r} (rebuild into a "
                              "new name, verify it, then swap it in; see the README)")
    src_cfg = cfg.for_target(source)
    if not has_table(src_cfg.ledger_path):
        raise BadRequestError(f"target {source!r} has no ledger at {src_cfg.ledger_path}; nothing to rebuild")
    check_locations(cfg.for_target(into))
    return src_cfg


def rebuild(cfg: PipelineConfig, spark: SparkSession | None, into: str, source: str = MAIN_TARGET,
            run_id: str | None = None, crash: Crash = no_crash, log_source: Source | None = None) -> RebuildReport:
    """Replay every committed epoch of ``source``'s ledger into the replay target ``into``: same ranges, watermarks,
    kinds and epoch ids, in the order their counts were committed, so the rebuilt tables equal the source's row for row.
    Resumable: epochs the target already committed are skipped, its unfinished one is finished. Refused unless ``into``
    is fresh or this source's earlier rebuild. ``log_source``: the log to read (default the topic on the broker, through
    ``spark``)."""
    src_cfg = check_request(cfg, into, source)
    # The rebuilt tables mean what the source's mean, whatever today's settings say.
    dst_cfg = cfg.for_target(into).replace(**recorded_settings(tableset_io.recorded(src_cfg)))
    src = Ledger(src_cfg.ledger_path)
    epochs = src.epochs(cfg.topic)
    if log_source is None:
        log_source = KafkaSource(dst_cfg, spark)
    earliest, latest = log_source.partition_offsets()
    for plan, _ in epochs:  # everything must still be in Kafka: fail before writing anything
        for r in plan.nonempty_ranges:
            try:
                check_still_there(cfg.topic, (r,), earliest, latest)
            except DataLossError as e:
                raise DataLossError(f"cannot rebuild epoch {plan.epoch}: {r} is no longer in Kafka ({e}); a "
                                    "rebuild needs all counted offsets within retention") from None
    report = RebuildReport(source, into, unfinished_in_source=src.state(cfg.topic).unfinished)
    runner = EpochRunner.open(dst_cfg, spark, run_id, crash, log_source,
                              rebuild_of=table_metadata(src_cfg.ledger_path)[0])
    done = {p.epoch for p, _ in runner.ledger.epochs(cfg.topic, (COMMITTED,))}
    runner.step(PLANNING)
    pending = set(runner.state().unfinished)
    for plan, _ in epochs:
        if plan.epoch in done:
            report.already.append(plan.epoch)
            continue
        if plan.epoch not in pending:
            runner.ledger.record_plan(plan, run_id)
        log.info("rebuild: replaying epoch %d: %s", plan.epoch, plan.describe())
        runner.execute(plan, earliest, latest, resumed=plan.epoch in pending)
        report.replayed.append(plan.epoch)
    log.info("%s", report.line())
    return report
