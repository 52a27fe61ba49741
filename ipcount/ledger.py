"""The offset ledger: a Delta table saying which offsets each epoch covers and whether it
committed. It is the pipeline's only recovery state (like a Flink checkpoint, or Spark's
offsets/commits logs), written ahead of the sink and marked committed after it.

One row per (epoch, partition). ``status`` is ``planned`` from the write-ahead until the
sink commit is done, then ``committed``. With ``on_data_loss = "skip"``, offsets deleted
before they were counted get a row of their own with status ``lost``, so that per
partition the committed and lost ranges still chain without a gap.

``kind`` is ``scheduled`` (the chain the DAG advances) or ``backfill`` (a request for a
given range, ``request_id`` naming it). Whatever the kind, the rows of one ledger never
overlap: every planner takes only offsets no row covers, and :meth:`Ledger.record_plan`
refuses - atomically, through Delta's optimistic concurrency - a plan that a concurrent
planner's rows overlap.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable, Mapping, TypeVar

from pyspark.sql import functions as F
from pyspark.sql.types import (DoubleType, IntegerType, LongType, MapType, StringType, StructField,
                               StructType, TimestampType)

from ipcount.coverage import Coverage
from ipcount.offsets import BACKFILL, SCHEDULED, EpochPlan, OffsetRange

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)
T = TypeVar("T")

PLANNED, COMMITTED, LOST = "planned", "committed", "lost"

LEDGER_SCHEMA = StructType([
    StructField("epoch", LongType(), False),
    StructField("topic", StringType(), False),
    StructField("partition", IntegerType(), False),
    StructField("from_offset", LongType(), False),
    StructField("until_offset", LongType(), False),
    StructField("status", StringType(), False),
    StructField("planned_at", TimestampType(), False),
    StructField("committed_at", TimestampType(), True),
    StructField("records_read", LongType(), True),
    StructField("records_counted", LongType(), True),
    StructField("records_late", LongType(), True),
    StructField("records_malformed", LongType(), True),
    StructField("watermark_before_ms", LongType(), True),
    StructField("watermark_after_ms", LongType(), True),
    StructField("sink_version", LongType(), True),
    StructField("duration_seconds", DoubleType(), True),
    StructField("run_id", StringType(), True),
    StructField("lag_after", LongType(), True),
    StructField("stage_seconds", MapType(StringType(), DoubleType()), True),
    StructField("kind", StringType(), True),               # scheduled | backfill (null: scheduled)
    StructField("request_id", StringType(), True),         # the backfill request
    StructField("chain_watermark_ms", LongType(), True),   # scheduled chain's watermark at planning
])


def ensure_table(spark: SparkSession, path: str, schema: StructType,
                 properties: Mapping[str, str] | None = None) -> None:
    """Create an empty Delta table at ``path`` unless one is there (checked first: creating
    is a commit, checking is a cheap look at the log). A table made by an older version
    gets the nullable columns and the table properties it lacks."""
    from delta.tables import DeltaTable

    properties = dict(properties or {})
    if _up_to_date(path, schema, properties):
        return
    if not DeltaTable.isDeltaTable(spark, path):
        builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema)
        for key, value in properties.items():
            builder = builder.property(key, value)
        builder.execute()
        return
    detail = DeltaTable.forPath(spark, path).detail().select("properties").first()
    have_props = dict(detail.properties or {})
    stale = {k: v for k, v in properties.items() if have_props.get(k) != v}
    if stale:
        assignments = ", ".join(f"'{k}' = '{v}'" for k, v in stale.items())
        retry_on_conflict(lambda: spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({assignments})"),
                          f"setting table properties of {path}")
    have = set(spark.read.format("delta").load(path).schema.fieldNames())
    missing = [f for f in schema.fields if f.name not in have]
    if missing:
        columns = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in missing)
        retry_on_conflict(lambda: spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS ({columns})"),
                          f"adding columns to {path}")


def _up_to_date(path: str, schema: StructType, properties: Mapping[str, str]) -> bool:
    """Whether the table at ``path`` exists with every column and property, looked up in its
    log with delta-rs: an epoch makes this check for four tables, and through Spark each
    would cost a Delta snapshot and a query (seconds in a fresh JVM). Any doubt: False."""
    from deltalake import DeltaTable as LogReader

    from ipcount.ledger_view import has_table

    if not has_table(path):
        return False
    try:
        table = LogReader(path)
        have = {f.name for f in table.schema().fields}
        config = table.metadata().configuration
    except Exception:  # noqa: BLE001 - Spark's path below decides (and says what is wrong)
        return False
    return all(f.name in have for f in schema.fields) and all(config.get(k) == v for k, v in properties.items())


# Each epoch adds a few tiny files to the ledger (the plan, then the commit's rewrite).
# Delta's auto compaction folds them together after a write once enough pile up, so a full
# read of the ledger - planning here, the monitoring pages there - stays a few files long
# however many epochs it holds.
LEDGER_PROPERTIES = {"delta.autoOptimize.autoCompact": "true"}


class PlanConflict(RuntimeError):
    """Another planner recorded offsets (or the epoch id) this plan wanted: plan again."""


def _concurrent_errors() -> tuple[type[BaseException], ...]:
    from delta.exceptions import base

    return (base.DeltaConcurrentModificationException, base.ConcurrentWriteException,
            base.MetadataChangedException, base.ProtocolChangedException, base.ConcurrentAppendException,
            base.ConcurrentDeleteReadException, base.ConcurrentDeleteDeleteException,
            base.ConcurrentTransactionException)


def retry_on_conflict(action: Callable[[], T], what: str, attempts: int = 10) -> T:
    """Run a Delta write, again if a concurrent writer's commit conflicted with it. Only for
    writes that are idempotent (txnAppId/txnVersion, or MERGEs matching planned rows)."""
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except _concurrent_errors() as e:
            if attempt == attempts:
                raise
            log.info("%s: concurrent commit (%s); retrying (%d/%d)", what, type(e).__name__, attempt, attempts)
            time.sleep(0.2 * attempt)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class LedgerState:
    """What planning needs from the ledger for one topic."""

    last_epoch: int = 0                       # highest epoch id of any kind, planned or committed
    committed: Mapping[int, int] = field(default_factory=dict)  # scheduled chain: partition -> next offset
    watermark_ms: int | None = None           # left by the chain's last committed epoch
    pending: EpochPlan | None = None          # scheduled epoch planned but not committed: re-run it
    pending_backfills: tuple[EpochPlan, ...] = ()  # backfill epochs planned but not committed
    coverage: Coverage = field(default_factory=lambda: Coverage(""))  # offsets any row owns
    request_watermarks: Mapping[str, int | None] = field(default_factory=dict)  # backfill lanes


@dataclass(frozen=True)
class PartitionMetrics:
    records_read: int = 0
    records_counted: int = 0
    records_late: int = 0
    records_malformed: int = 0


# Marker of the error the write-ahead MERGE raises when a concurrent plan got there first.
_CONFLICT = "ipcount-plan-conflict"


class Ledger:
    def __init__(self, spark: SparkSession, path: str) -> None:
        self.spark, self.path = spark, path

    def ensure(self) -> None:
        ensure_table(self.spark, self.path, LEDGER_SCHEMA, LEDGER_PROPERTIES)

    def _table(self):
        return self.spark.read.format("delta").load(self.path).withColumn(
            "kind", F.coalesce(F.col("kind"), F.lit(SCHEDULED)))

    def state(self, topic: str) -> LedgerState:
        """Read with delta-rs, not Spark: the ledger is a few rows per epoch in a few files
        (auto compaction), and three Spark queries over it cost seconds per epoch. A
        snapshot is enough: :meth:`record_plan` re-checks overlaps against the latest."""
        from ipcount.ledger_view import read_rows

        rows = read_rows(self.path, columns=list(_STATE_COLUMNS))
        return state_of(topic, [SimpleNamespace(**r) for r in rows], self.path)

    def epochs(self, topic: str, statuses: tuple[str, ...] = (COMMITTED, LOST)) -> list[tuple[EpochPlan, int | None]]:
        """Every epoch with rows of the given statuses, as (plan, counts sink version), in the
        order its sink commits happened: what a rebuild replays."""
        rows = self._table().where((F.col("topic") == topic) & F.col("status").isin(*statuses)).collect()
        by_epoch: dict[int, list] = {}
        for r in rows:
            by_epoch.setdefault(r.epoch, []).append(r)
        out = []
        for epoch, group in by_epoch.items():
            if not any(r.status == COMMITTED for r in group):
                continue  # lost rows of an epoch still in flight
            versions = [r.sink_version for r in group if r.sink_version is not None]
            out.append((plan_from_rows(group), versions[0] if versions else None))
        # Epochs that wrote no counts have no sink version; their place does not matter.
        return sorted(out, key=lambda pv: (pv[1] if pv[1] is not None else -1, pv[0].epoch))

    def record_plan(self, plan: EpochPlan, run_id: str | None) -> None:
        """The write-ahead: the epoch's ranges are durable before anything is read or written.

        A MERGE, not an append, so that it is also the guard against concurrent planners: a
        row already there that overlaps one of these ranges (or holds this epoch id) makes
        the MERGE raise, and a plan committed by another planner after this MERGE read the
        ledger makes Delta's conflict check refuse the commit. Either way :class:`PlanConflict`:
        nothing of this plan was written, and the caller plans again from the new state.
        """
        from delta.tables import DeltaTable

        now = datetime.now(timezone.utc)
        rows = [(plan.epoch, r.topic, r.partition, r.from_offset, r.until_offset, status, now,
                 None, None, None, None, None, plan.watermark_ms, None, None, None, run_id, None, None,
                 plan.kind, plan.request_id, plan.chain_watermark_ms)
                for status, ranges in ((LOST, plan.lost), (PLANNED, plan.ranges)) for r in ranges]
        # One source row answers for the epoch id, so the id check matches each target row once.
        anchor = plan.ranges[0].partition
        condition = (f"(t.epoch = s.epoch AND s.status = '{PLANNED}' AND s.partition = {int(anchor)}) OR "
                     "(t.topic = s.topic AND t.partition = s.partition "
                     " AND t.from_offset < s.until_offset AND s.from_offset < t.until_offset)")
        source = self.spark.createDataFrame(rows, LEDGER_SCHEMA)
        merge = (DeltaTable.forPath(self.spark, self.path).alias("t").merge(source.alias("s"), condition)
                 .whenMatchedUpdate(set={"status": F.raise_error(F.lit(_CONFLICT))})
                 .whenNotMatchedInsertAll())
        try:
            merge.execute()
        except _concurrent_errors() as e:
            raise PlanConflict(f"a concurrent commit to the ledger ({type(e).__name__})") from e
        except Exception as e:  # the MERGE's own refusal comes back as a JVM error
            text = str(e)
            if _CONFLICT in text or "MULTIPLE_SOURCE_ROW_MATCHING_TARGET_ROW" in text:
                raise PlanConflict("ledger rows that overlap the plan (or hold its epoch id) exist") from e
            raise

    def commit(self, plan: EpochPlan, metrics: Mapping[int, PartitionMetrics], watermark_after_ms: int | None,
               sink_version: int | None, duration_seconds: float, run_id: str | None,
               lag_after: Mapping[int, int] | None = None, stage_seconds: Mapping[str, float] | None = None) -> None:
        """Mark the epoch committed. Matches only ``planned`` rows, so a replay after a crash
        that happened after this commit changes nothing."""
        from delta.tables import DeltaTable

        now = datetime.now(timezone.utc)
        rows = []
        for r in plan.ranges:
            m = metrics.get(r.partition, PartitionMetrics())
            rows.append((plan.epoch, r.topic, r.partition, r.from_offset, r.until_offset, COMMITTED, now,
                         now, m.records_read, m.records_counted, m.records_late, m.records_malformed,
                         plan.watermark_ms, watermark_after_ms, sink_version, duration_seconds, run_id,
                         (lag_after or {}).get(r.partition), dict(stage_seconds or {}),
                         plan.kind, plan.request_id, plan.chain_watermark_ms))
        updates = self.spark.createDataFrame(rows, LEDGER_SCHEMA)
        set_cols = ["status", "committed_at", "records_read", "records_counted", "records_late",
                    "records_malformed", "watermark_after_ms", "sink_version", "duration_seconds", "run_id",
                    "lag_after", "stage_seconds"]

        def merge() -> None:
            (DeltaTable.forPath(self.spark, self.path).alias("t")
             .merge(updates.alias("s"), "t.epoch = s.epoch AND t.topic = s.topic AND t.partition = s.partition "
                                        f"AND t.status = '{PLANNED}'")
             .whenMatchedUpdate(set={c: f"s.{c}" for c in set_cols})
             .execute())
        retry_on_conflict(merge, f"committing epoch {plan.epoch} to the ledger")


_STATE_COLUMNS = ("epoch", "topic", "partition", "from_offset", "until_offset", "status", "kind", "request_id",
                  "watermark_before_ms", "watermark_after_ms", "chain_watermark_ms")


def state_of(topic: str, rows: list, path: str = "ledger") -> LedgerState:
    """:class:`LedgerState` of ``topic`` from the ledger's rows (of all topics: epoch ids
    are unique across them). Pure."""
    from ipcount.ledger_view import chain_positions

    mine = [r for r in rows if r.topic == topic]
    chain = [r for r in mine if (r.kind or SCHEDULED) == SCHEDULED and r.status == COMMITTED]
    committed = chain_positions(vars(r) for r in chain)
    latest = max(chain, key=lambda r: r.epoch, default=None)
    lanes: dict[str, list] = {}
    for r in mine:
        if r.kind == BACKFILL and r.status == COMMITTED:
            lanes.setdefault(r.request_id, []).append(r)
    request_watermarks = {rid: max(rs, key=lambda r: r.epoch).watermark_after_ms for rid, rs in lanes.items()}

    by_epoch: dict[int, list] = {}
    for r in mine:
        if r.status == PLANNED:
            by_epoch.setdefault(r.epoch, []).append(r)
    plans = [plan_from_rows(rs) for _, rs in sorted(by_epoch.items())]
    chain_plans = [p for p in plans if p.kind == SCHEDULED]
    if len(chain_plans) > 1:
        raise RuntimeError(f"ledger {path} has several unfinished scheduled epochs "
                           f"{[p.epoch for p in chain_plans]}; only one can be in flight")
    # Every row of the topic, planned, committed or lost and of any kind, owns its offsets.
    coverage = Coverage.of(topic, (OffsetRange(topic, r.partition, r.from_offset, r.until_offset) for r in mine))
    return LedgerState(last_epoch=max((r.epoch for r in rows), default=0), committed=committed,
                       watermark_ms=latest.watermark_after_ms if latest is not None else None,
                       pending=chain_plans[0] if chain_plans else None,
                       pending_backfills=tuple(p for p in plans if p.kind == BACKFILL),
                       coverage=coverage, request_watermarks=request_watermarks)


def plan_from_rows(rows) -> EpochPlan:
    """An epoch's plan as its ledger rows recorded it."""
    rows = sorted(rows, key=lambda r: (r.partition, r.from_offset))
    first = rows[0]
    kind = getattr(first, "kind", None) or SCHEDULED
    return EpochPlan(
        epoch=first.epoch,
        ranges=tuple(OffsetRange(r.topic, r.partition, r.from_offset, r.until_offset)
                     for r in rows if r.status != LOST),
        watermark_ms=first.watermark_before_ms,
        lost=tuple(OffsetRange(r.topic, r.partition, r.from_offset, r.until_offset) for r in rows if r.status == LOST),
        kind=kind, request_id=getattr(first, "request_id", None),
        chain_watermark_ms=getattr(first, "chain_watermark_ms", None))
