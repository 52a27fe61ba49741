"""The offset ledger's schema and rules, without Spark or Delta: every reader and writer of the ledger goes through this
module.

The ledger is the pipeline's only recovery state (like a Flink checkpoint). One row per (epoch, partition): ``status``
is ``planned`` from the write-ahead until the sink commit is done, then ``committed``; offsets deleted before they were
counted (``on_data_loss = "skip"``) get a ``lost`` row, so that per partition the ranges still chain without a gap.
``kind`` is ``scheduled`` (the chain the DAG advances; also a row without kind) or ``backfill`` (``request_id`` names
the request). The rows of one ledger never overlap. Rows are plain mappings (column -> value), as delta-rs returns them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Iterable, Mapping

from ipcount.rules.coverage import Coverage
from ipcount.rules.offsets import OffsetRange, describe, offsets_json, span_text

Row = Mapping[str, Any]

PLANNED, COMMITTED, LOST = "planned", "committed", "lost"
SUMMARY = "summary"  # the status of a summary row (:mod:`ipcount.rules.ledger_summary`), no epoch's
SCHEDULED, BACKFILL = "scheduled", "backfill"
EPOCH_KINDS = (SCHEDULED, BACKFILL)

# (column, Spark SQL type, nullable), in table order. Columns after the first release are nullable, so that older
# ledgers gain them by ALTER TABLE ADD COLUMNS.
COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("epoch", "bigint", False),
    ("topic", "string", False),
    ("partition", "int", False),
    ("from_offset", "bigint", False),
    ("until_offset", "bigint", False),
    ("status", "string", False),                 # planned | committed | lost
    ("planned_at", "timestamp", False),
    ("committed_at", "timestamp", True),
    ("records_read", "bigint", True),
    ("records_counted", "bigint", True),
    ("records_late", "bigint", True),
    ("records_malformed", "bigint", True),
    ("watermark_before_ms", "bigint", True),
    ("watermark_after_ms", "bigint", True),
    ("sink_version", "bigint", True),
    ("duration_seconds", "double", True),
    ("run_id", "string", True),
    ("lag_after", "bigint", True),
    ("stage_seconds", "map<string,double>", True),
    ("kind", "string", True),                    # scheduled | backfill (null: scheduled)
    ("request_id", "string", True),              # the backfill request
    ("chain_watermark_ms", "bigint", True),      # scheduled chain's watermark at planning
    ("planned_by", "string", True),              # the run that planned the epoch (run_id: that committed it)
    ("summary", "string", True),                 # a summary row's JSON (status summary), else null
)
# What planning reads of each row.
STATE_COLUMNS = ("epoch", "topic", "partition", "from_offset", "until_offset", "status", "kind", "request_id",
                 "watermark_before_ms", "watermark_after_ms", "chain_watermark_ms", "planned_at")
# What planning and the chain's readers read of the rows a summary does not hold.
VIEW_COLUMNS = (*STATE_COLUMNS, "sink_version")
METRICS = ("records_read", "records_counted", "records_late", "records_malformed")


def kind_of(row: Row) -> str:
    return row.get("kind") or SCHEDULED


def is_scheduled(row: Row) -> bool:
    """A row of the scheduled chain."""
    return kind_of(row) == SCHEDULED


@dataclass(frozen=True)
class EpochPlan:
    """The ranges of one epoch and what was in force when it was planned, recorded so that a replay does the same.

    ``watermark_ms``: left by the previous committed epoch of the same lane (the chain, or one backfill request), which
    this epoch's records are classified late against. ``chain_watermark_ms``: the chain's, which a backfill epoch
    finalizes windows against. ``planned_at_ms``: every record of the ranges was in Kafka by then, so event times far
    past it are a bad clock's (:func:`ipcount.rules.records.is_ahead`).
    """

    epoch: int
    ranges: tuple[OffsetRange, ...]
    watermark_ms: int | None = None
    lost: tuple[OffsetRange, ...] = ()  # deleted before they were counted, skipped by policy
    kind: str = SCHEDULED
    request_id: str | None = None       # the backfill request (None for scheduled epochs)
    chain_watermark_ms: int | None = None
    planned_at_ms: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in EPOCH_KINDS:
            raise ValueError(f"epoch kind must be one of {EPOCH_KINDS}; found {self.kind!r}")

    @property
    def size(self) -> int:
        return sum(r.size for r in self.ranges)

    @property
    def nonempty_ranges(self) -> tuple[OffsetRange, ...]:
        return tuple(r for r in self.ranges if r.size > 0)

    def starting_offsets_json(self) -> str:
        return offsets_json(self.nonempty_ranges, "from_offset")

    def ending_offsets_json(self) -> str:
        return offsets_json(self.nonempty_ranges, "until_offset")

    def describe(self) -> str:
        spans = describe(self.ranges, empty="")
        return spans if self.kind == SCHEDULED else f"{spans} (backfill {self.request_id})"


def plan_from_rows(rows: Iterable[Row]) -> EpochPlan:
    """An epoch's plan as its ledger rows recorded it."""
    rows = sorted(rows, key=lambda r: (r["partition"], r["from_offset"]))
    first = rows[0]

    def ranges(keep) -> tuple[OffsetRange, ...]:
        return tuple(OffsetRange(r["topic"], r["partition"], r["from_offset"], r["until_offset"])
                     for r in rows if keep(r["status"]))
    return EpochPlan(epoch=first["epoch"], ranges=ranges(lambda s: s != LOST),
                     watermark_ms=first.get("watermark_before_ms"), lost=ranges(lambda s: s == LOST),
                     kind=kind_of(first), request_id=first.get("request_id"),
                     chain_watermark_ms=first.get("chain_watermark_ms"),
                     planned_at_ms=timestamp_ms(first.get("planned_at")))


def timestamp_ms(value: datetime | None) -> int | None:
    """Epoch ms of a timestamp as delta-rs (aware) or Spark (naive, local time) returns it."""
    return None if value is None else round(value.timestamp() * 1_000_000) // 1000


def rows_by_epoch(rows: Iterable[Row]) -> dict[int, list[Row]]:
    """Per-partition ledger rows grouped by epoch id, in the order met."""
    out: dict[int, list[Row]] = {}
    for r in rows:
        out.setdefault(r["epoch"], []).append(r)
    return out


def metric_totals(rows: Iterable[Row]) -> dict[str, int]:
    """An epoch's record counts: its partitions' rows summed (missing counts are 0)."""
    rows = list(rows)
    return {m: sum(r.get(m) or 0 for r in rows) for m in METRICS}


def chain_positions(rows: Iterable[Row], statuses: tuple[str, ...] = (COMMITTED,)) -> dict[int, int]:
    """partition -> next offset of the scheduled chain, from one topic's ledger rows (only its rows of ``statuses``
    count; backfills may lie behind or ahead of the chain)."""
    positions: dict[int, int] = {}
    for r in rows:
        if r["status"] in statuses and is_scheduled(r):
            positions[r["partition"]] = max(positions.get(r["partition"], 0), r["until_offset"])
    return positions


def unfinished_chain_epochs(rows: Iterable[Row]) -> list[int]:
    """The scheduled chain's planned (not yet committed) epochs."""
    return sorted({r["epoch"] for r in rows if r["status"] == PLANNED and is_scheduled(r)})


@dataclass(frozen=True)
class PartitionMetrics:
    records_read: int = 0
    records_counted: int = 0
    records_late: int = 0
    records_malformed: int = 0


@dataclass(frozen=True)
class LedgerState:
    """What planning needs from the ledger for one topic."""

    last_epoch: int = 0                       # highest epoch id of any kind, planned or committed
    committed: Mapping[int, int] = field(default_factory=dict)  # scheduled chain: partition -> next offset
    watermark_ms: int | None = None           # left by the chain's last committed epoch
    # Every scheduled epoch planned but not committed, lowest first: one at most, except in a rebuild's target, which
    # replays in the source's commit order and may be stopped after each plan.
    pending_chain: tuple[EpochPlan, ...] = ()
    pending_backfills: tuple[EpochPlan, ...] = ()  # backfill epochs planned but not committed
    coverage: Coverage = field(default_factory=lambda: Coverage(""))  # offsets any row owns
    request_watermarks: Mapping[str, int | None] = field(default_factory=dict)  # backfill lanes

    @property
    def pending(self) -> EpochPlan | None:
        """The scheduled epoch planned but not committed that a runner re-runs first."""
        return self.pending_chain[0] if self.pending_chain else None

    @property
    def unfinished(self) -> list[int]:
        """Every planned epoch, scheduled or backfill."""
        return sorted(p.epoch for p in (*self.pending_backfills, *self.pending_chain))


@dataclass(frozen=True)
class Folded:
    """What one topic's final epochs up to some id left behind, kept in the ledger's summary
    (:mod:`ipcount.rules.ledger_summary`) so that readers need not read their rows."""

    owned: Mapping[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)  # merged intervals
    chain_until: Mapping[int, int] = field(default_factory=dict)      # chain's committed and lost rows
    committed_until: Mapping[int, int] = field(default_factory=dict)  # chain's committed rows only
    chain_last: tuple[int, int | None] | None = None  # the chain's newest committed epoch, its watermark after
    chain_commits: tuple[tuple[int, int | None], ...] = ()  # (sink version, watermark), newest two
    lanes: Mapping[str, int | None] = field(default_factory=dict)  # backfill request -> its watermark


def newest_chain_epoch(rows: Iterable[Row], folded: Folded = Folded()) -> tuple[int, int | None] | None:
    """(epoch, watermark after) of the scheduled chain's newest committed epoch."""
    newest = folded.chain_last
    for r in rows:
        if is_scheduled(r) and r["status"] == COMMITTED and (newest is None or r["epoch"] > newest[0]):
            newest = (r["epoch"], r.get("watermark_after_ms"))
    return newest


def lane_watermarks(rows: Iterable[Row], folded: Folded = Folded()) -> dict[str, int | None]:
    """Backfill request -> its lane's watermark, from its committed rows (it only moves forward, even when two runs of
    one request overlapped)."""
    lanes = dict(folded.lanes)
    for r in rows:
        if kind_of(r) == BACKFILL and r["status"] == COMMITTED:
            rid, w = r["request_id"], r["watermark_after_ms"]
            lanes[rid] = max((v for v in (lanes.get(rid), w) if v is not None), default=None)
    return lanes


def furthest(*positions: Mapping[int, int]) -> dict[int, int]:
    """Per partition, the highest of the given positions."""
    out: dict[int, int] = {}
    for p in positions:
        for partition, offset in p.items():
            out[partition] = max(out.get(partition, offset), offset)
    return out


def chain_passed(rows: Iterable[Row], folded: Folded = Folded()) -> dict[int, int]:
    """partition -> the scheduled chain's next offset, past its committed and its lost rows: a chain that gave up its
    first epochs has no committed row, and resolving its start position again would leave offsets owned by no row."""
    return furthest(folded.chain_until, chain_positions(rows, statuses=(COMMITTED, LOST)))


def state_of(topic: str, rows: Iterable[Row], folded: Folded = Folded(), last_epoch: int = 0) -> LedgerState:
    """:class:`LedgerState` of ``topic`` from the ledger's rows (of all topics: epoch ids are unique across them), with
    a summary's ``folded`` facts and ``last_epoch`` for the rows it folded."""
    rows = list(rows)
    mine = [r for r in rows if r["topic"] == topic]
    chain_last = newest_chain_epoch(mine, folded)
    planned = rows_by_epoch(r for r in mine if r["status"] == PLANNED)
    plans = [plan_from_rows(rs) for _, rs in sorted(planned.items())]
    # Runners finish the chain's unfinished epochs (a rebuild's target may hold several) lowest first.
    chain_plans = [p for p in plans if p.kind == SCHEDULED]
    # Every row of the topic, planned, committed or lost and of any kind, owns its offsets.
    coverage = Coverage.of(topic, [*(OffsetRange(topic, p, a, b) for p, spans in folded.owned.items()
                                     for a, b in spans),
                                   *(OffsetRange(topic, r["partition"], r["from_offset"], r["until_offset"])
                                     for r in mine)])
    return LedgerState(last_epoch=max([last_epoch, *(r["epoch"] for r in rows)]),
                       committed=chain_passed(mine, folded),
                       watermark_ms=chain_last[1] if chain_last is not None else None,
                       pending_chain=tuple(chain_plans),
                       pending_backfills=tuple(p for p in plans if p.kind == BACKFILL),
                       coverage=coverage, request_watermarks=lane_watermarks(mine, folded))


@dataclass(frozen=True)
class EpochSummary:
    """What one epoch did, in the one shape every reporter uses (the CLI, the DAG, the benchmark). ``plan`` is None for
    a run that found nothing new to read."""

    plan: EpochPlan | None
    records_read: int = 0
    records_counted: int = 0
    records_late: int = 0
    records_malformed: int = 0
    watermark_ms: int | None = None         # after the epoch
    sink_version: int | None = None         # the counts table version holding the epoch
    seconds: float = 0.0
    stage_seconds: Mapping[str, float] = field(default_factory=dict)
    lag_after: Mapping[int, int] | None = None
    run_id: str | None = None
    resumed: bool = False

    @property
    def epoch(self) -> int | None:
        return self.plan.epoch if self.plan is not None else None

    @property
    def ranges(self) -> dict[int, tuple[int, int]]:
        return {r.partition: (r.from_offset, r.until_offset) for r in self.plan.ranges} if self.plan else {}

    def with_stages(self, **extra: float) -> EpochSummary:
        return replace(self, stage_seconds={**self.stage_seconds, **extra})

    def line(self) -> str:
        """The one-line summary printed by the CLI, the watcher and the DAG."""
        if self.plan is None:
            return "no new records: no epoch committed"
        spans = " ".join(span_text(p, f, u) for p, (f, u) in sorted(self.ranges.items()))
        lag = "" if self.lag_after is None else f" lag {sum(self.lag_after.values())}"
        return (f"epoch {self.epoch} committed: {spans} | read {self.records_read} counted {self.records_counted} "
                f"late {self.records_late} malformed {self.records_malformed}{lag} | {self.seconds:.1f}s"
                + (" (resumed)" if self.resumed else ""))

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan
        return {"epoch": self.epoch,
                "ranges": {str(p): {"from_offset": f, "until_offset": u} for p, (f, u) in sorted(self.ranges.items())},
                "records_read": self.records_read, "records_counted": self.records_counted,
                "records_late": self.records_late, "records_malformed": self.records_malformed,
                "seconds": self.seconds, "sink_version": self.sink_version,
                "watermark_after_ms": self.watermark_ms, "run_id": self.run_id,
                "lag_after": None if self.lag_after is None else {str(p): n for p, n in sorted(self.lag_after.items())},
                "stage_seconds": dict(self.stage_seconds),
                "kind": plan.kind if plan else None, "request_id": plan.request_id if plan else None}

    @classmethod
    def from_rows(cls, rows: Iterable[Row]) -> EpochSummary:
        """A committed epoch, assembled from its per-partition ledger rows."""
        rows = list(rows)
        first = rows[0]
        live = [r for r in rows if r["status"] != LOST]
        return cls(plan_from_rows(rows), **metric_totals(live), watermark_ms=first.get("watermark_after_ms"),
                   sink_version=first.get("sink_version"), seconds=first.get("duration_seconds") or 0.0,
                   stage_seconds=dict(first.get("stage_seconds") or {}),
                   lag_after=({r["partition"]: r["lag_after"] for r in live}
                              if all(r.get("lag_after") is not None for r in live) else None),
                   run_id=first.get("run_id"))


def committed_summaries(rows: Iterable[Row]) -> list[EpochSummary]:
    """One summary per committed epoch among ``rows``, oldest first."""
    committed = rows_by_epoch(r for r in rows if r["status"] == COMMITTED)
    return [EpochSummary.from_rows(rs) for _, rs in sorted(committed.items())]
