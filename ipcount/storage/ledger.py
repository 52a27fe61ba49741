"""The offset ledger's I/O, all of it with delta-rs (no JVM; why: docs/data-model.md): the write-ahead of a plan,
the commit after the sink, and the reads (the DAG's tasks, the CLI's watcher and the idle check use them too). What
the rows mean - statuses, kinds, plans, chain positions, summaries - is :mod:`ipcount.rules.ledger`.

Whatever the kind, the rows of one ledger never overlap: :meth:`Ledger.record_plan` checks a plan against one snapshot
and commits it as exactly that snapshot's next version, put-if-absent: any commit after the snapshot, by any runner in
any process, makes it fail and plan again.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ipcount.rules.config import PipelineConfig
from ipcount.rules.coverage import intersect
from ipcount.rules.errors import CommitContention, PlanConflict
from ipcount.rules.finality import ChainCommit
from ipcount.rules.ledger import (COLUMNS, COMMITTED, LOST, METRICS, PLANNED, SCHEDULED, SUMMARY, VIEW_COLUMNS,
                                  EpochPlan, EpochSummary, LedgerState, PartitionMetrics, Row, committed_summaries,
                                  plan_from_rows, rows_by_epoch)
from ipcount.rules.maintenance import log_properties
from ipcount.rules.ledger_summary import (LedgerSummary, chain_commits_of, committed_chain, fold, fold_due,
                                          state as summary_state)
from ipcount.rules.offsets import OffsetRange
from ipcount.storage.delta import (arrow_schema, latest, open_table, query_table, read_rows, retry_on_conflict,
                                   rs_concurrent_errors, rs_create_table, sql_identifier, sql_literal)

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

# Past this many files under half LEDGER_FILE_BYTES a commit compacts the ledger into files of up to
# LEDGER_FILE_BYTES; a file near that size holds folded epochs only, which readers skip (docs/data-model.md).
COMPACT_AFTER_FILES = 16
LEDGER_FILE_BYTES = 1 << 20
# The Delta app transaction whose version names the newest summary row (its from_offset is -version).
SUMMARY_TXN = "ipcount/ledger-summary"


@dataclass(frozen=True)
class LedgerView:
    """One snapshot of the ledger: its newest summary (None: none yet) and the rows it does not hold (or every row)."""

    summary: LedgerSummary | None
    tail: list[Row]
    _states: dict[str, LedgerState] = field(default_factory=dict, init=False, repr=False, compare=False)

    def state(self, topic: str) -> LedgerState:
        """Folded once per topic: a view is one snapshot, and the watcher and the monitor keep theirs."""
        if topic not in self._states:
            self._states[topic] = summary_state(self.summary, topic, self.tail)
        return self._states[topic]


def ledger_schema() -> pa.Schema:
    """The ledger's Arrow schema (:data:`ipcount.rules.ledger.COLUMNS`)."""
    return arrow_schema(COLUMNS)


class Ledger:
    def __init__(self, path: str) -> None:
        self.path = path

    def ensure(self, log_retention_hours: int = PipelineConfig.log_retention_hours) -> None:
        """Create the ledger unless it is there; one made by an older version gets the columns it lacks, and a log
        kept ``log_retention_hours`` (:func:`log_properties`)."""
        rs_create_table(self.path, ledger_schema(), log_properties(log_retention_hours))

    def view(self, table=None) -> LedgerView:
        """The ledger's summary and tail, both read from one snapshot (``table``, default the latest): from two, a plan
        folded between the reads would hide its epochs from both."""
        table = table if table is not None else open_table(self.path)
        if table is None:
            return LedgerView(None, [])
        summary = _summary_in(table)
        tail = "" if summary is None else f" AND {tail_sql(summary)}"
        columns = ", ".join(sql_identifier(c) for c in VIEW_COLUMNS)
        return LedgerView(summary, query_table(table, f"SELECT {columns} FROM t WHERE status <> '{SUMMARY}'{tail}"))

    def state(self, topic: str) -> LedgerState:
        """A snapshot is enough: :meth:`record_plan` re-checks overlaps against the latest."""
        return self.view().state(topic)

    def epochs(self, topic: str, statuses: tuple[str, ...] = (COMMITTED, LOST)) -> list[tuple[EpochPlan, int | None]]:
        """Every epoch with rows of the given statuses, as (plan, counts sink version), in the order its sink commits
        happened: what a rebuild replays."""
        rows = [{**r, "kind": r["kind"] or SCHEDULED}
                for r in read_rows(self.path, filters=[("topic", "=", topic)]) if r["status"] in statuses]
        out = []
        for group in rows_by_epoch(rows).values():
            if not any(r["status"] == COMMITTED for r in group):
                continue  # lost rows of an epoch still in flight
            versions = [r["sink_version"] for r in group if r["sink_version"] is not None]
            out.append((plan_from_rows(group), versions[0] if versions else None))
        # Epochs that wrote no counts have no sink version; their place does not matter.
        return sorted(out, key=lambda pv: (pv[1] if pv[1] is not None else -1, pv[0].epoch))

    def chain_commits(self, topic: str) -> list[ChainCommit]:
        """The scheduled chain's two newest counts commits, newest first (:mod:`ipcount.rules.finality`)."""
        view = self.view()
        return chain_commits_of(view.summary, topic, view.tail)

    def record_plan(self, plan: EpochPlan, run_id: str | None) -> None:
        """The write-ahead: the epoch's ranges are durable before anything is read or written.

        Also the guard against concurrent planners: a row in the snapshot that overlaps one of these ranges (or holds
        this epoch id) refuses the plan, and so does any commit made after the snapshot was read (the append is the
        snapshot's next version or nothing: a retry would commit it on top of rows it never checked). Either way
        :class:`PlanConflict`: nothing of this plan was written, and the caller plans again from the new state.

        A commit refused after it landed (an object store that stored the PUT but lost its answer, and answered the
        retry "already exists") is no conflict: a ledger holding exactly this plan, made at this plan's time, keeps it.
        """
        from deltalake import CommitProperties, Transaction, write_deltalake

        planned_at = (datetime.now(timezone.utc) if plan.planned_at_ms is None
                      else datetime.fromtimestamp(plan.planned_at_ms / 1000, timezone.utc))
        rows = (_uncommitted_rows(plan, LOST, plan.lost, planned_at, run_id)
                + _uncommitted_rows(plan, PLANNED, plan.ranges, planned_at, run_id))
        snapshot = latest(self.path)
        view = self.view(snapshot)
        ranges = (*plan.lost, *plan.ranges)
        if view.summary is not None and any(
                intersect((r.from_offset, r.until_offset), view.summary.folded(r.topic).owned.get(r.partition, ()))
                for r in ranges if r.size > 0):  # (an empty range owns nothing)
            raise PlanConflict("ledger rows that overlap the plan exist (epochs the summary holds)")
        overlaps = " OR ".join(
            f'(topic = {sql_literal(r.topic)} AND "partition" = {int(r.partition)} '
            f"AND from_offset < {int(r.until_offset)} AND {int(r.from_offset)} < until_offset "
            "AND from_offset < until_offset)"  # (an empty range owns nothing, folded or not)
            for r in ranges)
        tail = "" if view.summary is None else f"{tail_sql(view.summary)} AND "
        taken = query_table(snapshot, f"SELECT count(*) AS n FROM t WHERE epoch = {int(plan.epoch)} "
                                      f"OR ({tail}status <> '{SUMMARY}' AND ({overlaps}))")
        if taken[0]["n"]:
            raise PlanConflict("ledger rows that overlap the plan (or hold its epoch id) exist")
        version = snapshot.version() + 1  # the append is this version or nothing
        properties = {"max_commit_retries": 0}
        if fold_due(view.summary, plan.epoch, view.tail):
            summary = fold(view.summary, [*view.tail, *rows])
            # Its epoch is the plan's: with a negative one every file holding a summary row would span all older
            # epochs, and none could be skipped for a stale open epoch.
            rows.append({"epoch": plan.epoch, "topic": "", "partition": -1, "from_offset": -version,
                         "until_offset": -version, "status": SUMMARY, "planned_at": planned_at,
                         "summary": summary.to_json()})
            properties["app_transactions"] = [Transaction(SUMMARY_TXN, version)]
        try:
            write_deltalake(snapshot, arrow_rows(rows), mode="append", commit_properties=CommitProperties(**properties))
        except rs_concurrent_errors() as e:
            if self._holds(plan):
                log.warning("epoch %d: the ledger refused its plan (%s) but holds it as recorded: the commit "
                            "landed and only its answer was lost", plan.epoch, str(e).splitlines()[0][:200])
            else:
                raise PlanConflict(f"a concurrent commit to the ledger ({type(e).__name__})") from e
        self._compact_if_due()

    def _holds(self, plan: EpochPlan) -> bool:
        """Whether the ledger's rows of ``plan.epoch`` are exactly ``plan``, not yet committed."""
        rows = read_rows(self.path, filters=[("epoch", "=", int(plan.epoch)), ("status", "!=", SUMMARY)])
        def ordered(p: EpochPlan) -> EpochPlan:
            return replace(p, ranges=tuple(sorted(p.ranges)), lost=tuple(sorted(p.lost)))
        return (bool(rows) and all(r["status"] in (PLANNED, LOST) for r in rows)
                and ordered(plan_from_rows(rows)) == ordered(plan))

    def release(self, plan: EpochPlan, lost: tuple[OffsetRange, ...],
                again: Callable[[LedgerState], tuple[EpochPlan, ...]] | None = None,
                run_id: str | None = None) -> bool:
        """Give up an unfinished epoch whose offsets aged out before it was run, in one commit: each of its partitions'
        lost head (``lost``, one range per partition at most, starting where its planned range does) becomes a
        ``lost`` row of the epoch, and its other planned rows go. The lost rows keep the epoch id taken: its
        transaction id may be in the sink tables' logs already.

        ``again``: the plans that take over the rest of its ranges, made from the ledger's state (new epoch ids),
        recorded in the same commit - a backfill's rest, which no later plan would take if it were left to a second
        commit that a death can skip, or the chain's, which offsets the chain had passed must never leave. Without it
        the rest is free for a new plan. ``run_id``: the run that plans them.

        Committed against the snapshot it was planned from or not at all; after a concurrent commit it reads again.
        False if another run released the epoch first.
        """
        from deltalake import CommitProperties

        mine = f"t.epoch = {int(plan.epoch)} AND t.status = '{PLANNED}'"

        def merge() -> bool:
            snapshot = latest(self.path)
            state = self.view(snapshot).state(next(r.topic for r in (*plan.ranges, *plan.lost, *lost)))
            if plan.epoch not in state.unfinished:
                return False
            now = datetime.now(timezone.utc)
            rows = _uncommitted_rows(plan, LOST, lost, now, None)
            for new in (again(state) if again is not None else ()):
                rows += _uncommitted_rows(new, PLANNED, new.ranges, now, run_id)
            (snapshot.merge(arrow_rows(rows), f'{mine} AND s.epoch = {int(plan.epoch)} AND t.topic = s.topic '
                                              f'AND t."partition" = s."partition"', source_alias="s",
                            target_alias="t", commit_properties=CommitProperties(max_commit_retries=0))
             .when_matched_update({"status": f"'{LOST}'", "from_offset": "s.from_offset",
                                   "until_offset": "s.until_offset"})
             .when_not_matched_insert_all(f"s.epoch <> {int(plan.epoch)}")
             .when_not_matched_by_source_delete(mine)
             .execute())
            return True
        try:
            return retry_on_conflict(merge, f"releasing epoch {plan.epoch} in the ledger")
        except rs_concurrent_errors() as e:
            raise CommitContention(f"could not release epoch {plan.epoch} in {self.path}: other commits kept "
                                   "landing; run again") from e

    def commit(self, plan: EpochPlan, metrics: Mapping[int, PartitionMetrics] | None,
               watermark_after_ms: int | None,
               sink_version: int | None, duration_seconds: float, run_id: str | None,
               lag_after: Mapping[int, int] | None = None, stage_seconds: Mapping[str, float] | None = None) -> None:
        """Mark the epoch committed. Matches only ``planned`` rows, so a replay after a crash that happened after this
        commit changes nothing. ``metrics`` None: not known (the record counts stay empty)."""
        now = datetime.now(timezone.utc)
        rows = []
        for r in plan.ranges:
            m = metrics.get(r.partition, PartitionMetrics()) if metrics is not None else None
            # (The range and planned_at only because they may not be null: the MERGE sets set_cols.)
            rows.append({"epoch": plan.epoch, "topic": r.topic, "partition": r.partition,
                         "from_offset": r.from_offset, "until_offset": r.until_offset, "planned_at": now,
                         "status": COMMITTED, "committed_at": now, **({} if m is None else asdict(m)),
                         "watermark_after_ms": watermark_after_ms, "sink_version": sink_version,
                         "duration_seconds": duration_seconds, "run_id": run_id,
                         "lag_after": (lag_after or {}).get(r.partition), "stage_seconds": dict(stage_seconds or {})})
        updates = arrow_rows(rows)
        set_cols = ["status", "committed_at", *METRICS, "watermark_after_ms", "sink_version", "duration_seconds",
                    "run_id", "lag_after", "stage_seconds"]

        # The epoch as a literal: delta-rs then skips every file of other epochs by its statistics (the filter it
        # derives from the source's values alone skips fewer).
        match = (f"t.epoch = {int(plan.epoch)} AND t.epoch = s.epoch AND t.topic = s.topic "
                 f"AND t.\"partition\" = s.\"partition\" AND t.status = '{PLANNED}'")

        def merge() -> None:
            (latest(self.path)
             .merge(updates, match, source_alias="s", target_alias="t")
             .when_matched_update({c: f"s.{c}" for c in set_cols})
             .execute())
        retry_on_conflict(merge, f"committing epoch {plan.epoch} to the ledger")
        self._compact_if_due()

    def _compact_if_due(self) -> None:
        """Fold the ledger's small files into files of up to :data:`LEDGER_FILE_BYTES` once enough pile up. Best
        effort: a concurrent commit that wins leaves it for the next time (compaction changes no row)."""
        import pyarrow as pa

        table = latest(self.path)
        sizes = pa.table(table.get_add_actions(flatten=True)).column("size_bytes").to_pylist()
        if sum(1 for size in sizes if size < LEDGER_FILE_BYTES // 2) <= COMPACT_AFTER_FILES:
            return
        try:
            table.optimize.compact(target_size=LEDGER_FILE_BYTES)
        except rs_concurrent_errors() as e:
            log.info("compacting the ledger: a concurrent commit (%s); next time", type(e).__name__)


def _summary_in(table) -> LedgerSummary | None:
    """The newest summary in a snapshot of the ledger, found through its app transaction."""
    version = table.transaction_version(SUMMARY_TXN)
    if version is None:
        return None
    found = query_table(table, f"SELECT summary FROM t WHERE from_offset = {-int(version)} "
                               f"AND \"partition\" = -1 AND status = '{SUMMARY}'")
    if not found:
        log.warning("the ledger's summary of version %d is missing: reading every row", version)
        return None
    if (summary := LedgerSummary.from_json(found[0]["summary"])) is None:
        log.warning("the ledger's summary of version %d is unreadable: reading every row", version)
    return summary


def tail_sql(summary: LedgerSummary) -> str:
    """SQL for the rows a summary does not hold (:meth:`LedgerSummary.in_tail`), in parentheses."""
    open_epochs = ", ".join(str(int(e)) for e in summary.open)
    return f"(epoch > {int(summary.through)}" + (f" OR epoch IN ({open_epochs})" if open_epochs else "") + ")"


def arrow_rows(rows: list[Mapping[str, Any]]) -> pa.Table:
    """Ledger rows (column name -> value; a column left out is null) as an Arrow table of the ledger's schema. A name
    that is no column is refused: it would be dropped silently."""
    import pyarrow as pa

    schema = ledger_schema()
    unknown = {name for row in rows for name in row} - set(schema.names)
    if unknown:
        raise ValueError(f"not ledger columns: {sorted(unknown)}")
    return pa.Table.from_pylist(list(rows), schema=schema)


def _uncommitted_rows(plan: EpochPlan, status: str, ranges: tuple[OffsetRange, ...], planned_at: datetime,
                      run_id: str | None) -> list[dict[str, Any]]:
    """Ledger rows of ``plan``'s ``ranges`` with a status before the commit (planned or lost)."""
    return [{"epoch": plan.epoch, "topic": r.topic, "partition": r.partition, "from_offset": r.from_offset,
             "until_offset": r.until_offset, "status": status, "planned_at": planned_at,
             "watermark_before_ms": plan.watermark_ms, "run_id": run_id, "kind": plan.kind,
             "request_id": plan.request_id, "chain_watermark_ms": plan.chain_watermark_ms, "planned_by": run_id}
            for r in ranges]


# -- reads without a JVM ------------------------------------------------------------------

def committed_epochs(ledger_path: str, after_epoch: int = 0, run_id: str | None = None) -> list[EpochSummary]:
    """Committed epochs with id > ``after_epoch`` (optionally only those a run committed), oldest first."""
    filters = [("status", "=", COMMITTED), ("epoch", ">", after_epoch)]
    if run_id is not None:
        filters.append(("run_id", "=", run_id))
    return committed_summaries(read_rows(ledger_path, filters=filters))


def committed_positions(ledger_path: str, topic: str) -> tuple[int, dict[int, int]]:
    """(last committed epoch, partition -> next offset) of the chain for ``topic`` ((0, {}) if none)."""
    view = Ledger(ledger_path).view()
    epoch, positions, _ = committed_chain(view.summary, topic, view.tail)
    return epoch, positions
