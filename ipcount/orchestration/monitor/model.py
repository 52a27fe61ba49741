"""Pure logic behind the monitoring pages: no I/O, unit-tested on its own."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Mapping

from ipcount.rules.config import ON_DATA, cron_expression
from ipcount.rules.ledger import BACKFILL, COMMITTED, EPOCH_KINDS, LOST, PLANNED, kind_of, metric_totals, rows_by_epoch
from ipcount.rules.maintenance import TableMaintenance

# An epoch's status on the pages. The ledger knows "planned" and "committed"; whether a planned epoch is still running
# or was left behind by a failed run, only Airflow knows.
RUNNING, FAILED = "running", "failed"
STATUSES = (COMMITTED, RUNNING, FAILED)
ACTIVE_RUN_STATES = ("queued", "running")
KINDS = EPOCH_KINDS


def epoch_status(planned: bool, run_state: str | None) -> str:
    """``committed`` once the ledger says so; a planned epoch is ``running`` while its DAG run is, and ``failed``
    otherwise (its run failed, or ended without committing it, or is unknown, e.g. a CLI run that died)."""
    if not planned:
        return COMMITTED
    return RUNNING if run_state in ACTIVE_RUN_STATES else FAILED


class BadQueryError(ValueError):
    """A page parameter cannot be used; the message says which and why."""


class ForbiddenError(PermissionError):
    """The user may not read this: the message names the DAG whose read access it needs."""


@dataclass(frozen=True)
class Access:
    """What the user may see besides the epoch DAG's pipeline (which every route needs): backfills - their epochs,
    runs and replay targets - need read access to the backfill DAG."""
    backfills: bool
    backfill_dag_id: str

    def visible(self, refs: Iterable[Any]) -> list[Any]:
        """The epochs (anything with a ``kind``) this user may see."""
        return [r for r in refs if self.backfills or r.kind != BACKFILL]

    def kinds(self, kinds: Iterable[str]) -> tuple[str, ...]:
        """Those of the epoch ``kinds`` this user may see."""
        return tuple(k for k in kinds if self.backfills or k != BACKFILL)

    def check_target(self, target: str, main: str) -> None:
        if target != main and not self.backfills:
            raise ForbiddenError(f"replay target {target!r} is made by backfills: reading it needs read access to "
                                 f"the DAG {self.backfill_dag_id}")

    def check_dag(self, dag_id: str) -> None:
        if dag_id == self.backfill_dag_id and not self.backfills:
            raise ForbiddenError(f"reading runs of {dag_id} needs read access to that DAG")


@dataclass(frozen=True)
class Page:
    number: int
    size: int
    total: int

    @property
    def pages(self) -> int:
        return max(1, math.ceil(self.total / self.size))

    @property
    def start(self) -> int:
        return (self.number - 1) * self.size

    @property
    def has_next(self) -> bool:
        return self.number < self.pages

    @property
    def has_prev(self) -> bool:
        return self.number > 1


def page_of(total: int, number: int, size: int, max_size: int = 500) -> Page:
    if size < 1 or size > max_size:
        raise BadQueryError(f"page_size must be between 1 and {max_size}, got {size}")
    if number < 1:
        raise BadQueryError(f"page must be 1 or more, got {number}")
    return Page(number, size, total)


def check_choice(name: str, value: str | None, choices: Iterable[str]) -> str | None:
    """``value`` if it is one of ``choices`` (empty or "all" mean no filter)."""
    if value in (None, "", "all"):
        return None
    choices = tuple(choices)
    if value not in choices:
        raise BadQueryError(f"{name} must be one of {', '.join(choices)} (or empty for all), got {value!r}")
    return value


@dataclass(frozen=True)
class EpochRow:
    """One epoch as the epochs page shows it, assembled from its per-partition ledger rows."""

    epoch: int
    status: str
    kind: str
    request_id: str | None
    run_id: str | None
    ranges: Mapping[int, tuple[int, int]]
    lost: Mapping[int, tuple[int, int]]
    records_read: int
    records_counted: int
    records_late: int
    records_malformed: int
    stage_seconds: Mapping[str, float]
    seconds: float | None
    sink_version: int | None
    planned_at: datetime | None
    committed_at: datetime | None
    dag_id: str | None = None
    run_state: str | None = None
    published: bool | None = None   # its counts version is in the sink topic (None: not published, or no version)

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "status": self.status, "kind": self.kind, "request_id": self.request_id,
                "run_id": self.run_id, "dag_id": self.dag_id, "run_state": self.run_state,
                "ranges": {str(p): [f, u] for p, (f, u) in sorted(self.ranges.items())},
                "lost": {str(p): [f, u] for p, (f, u) in sorted(self.lost.items())},
                "records_read": self.records_read, "records_counted": self.records_counted,
                "records_late": self.records_late, "records_malformed": self.records_malformed,
                "stage_seconds": dict(self.stage_seconds), "seconds": self.seconds,
                "sink_version": self.sink_version, "published": self.published, "planned_at": _iso(self.planned_at),
                "committed_at": _iso(self.committed_at)}


def epoch_rows(rows: Iterable[Mapping[str, Any]], run_states: Mapping[str, tuple[str, str]]) -> list[EpochRow]:
    """Per-partition ledger rows -> one :class:`EpochRow` per epoch, newest first. ``run_states``: run_id ->
    (dag_id, state) of the DAG runs Airflow knows."""
    by_epoch = rows_by_epoch(rows)
    out = []
    for epoch in sorted(by_epoch, reverse=True):
        group = by_epoch[epoch]
        live = [r for r in group if r["status"] != LOST]
        first = (live or group)[0]
        dag_id, run_state = run_states.get(first.get("run_id") or "", (None, None))
        planned = any(r["status"] == PLANNED for r in group)
        out.append(EpochRow(
            epoch=epoch, status=epoch_status(planned, run_state), kind=kind_of(first),
            request_id=first.get("request_id"), run_id=first.get("run_id"),
            ranges={r["partition"]: (r["from_offset"], r["until_offset"]) for r in live},
            lost={r["partition"]: (r["from_offset"], r["until_offset"]) for r in group if r["status"] == LOST},
            **metric_totals(live),
            stage_seconds=_in_stage_order(first.get("stage_seconds") or {}), seconds=first.get("duration_seconds"),
            sink_version=first.get("sink_version"), planned_at=first.get("planned_at"),
            committed_at=first.get("committed_at"), dag_id=dag_id, run_state=run_state))
    return out


def with_published(epochs: Iterable[EpochRow], published_until: int | None) -> list[EpochRow]:
    """Marks each committed epoch that made a counts version published or not, given the first version the publisher
    has not sent (None: publishing off or its cursor unknown)."""
    if published_until is None:
        return list(epochs)
    return [replace(e, published=e.sink_version < published_until)
            if e.status == COMMITTED and e.sink_version is not None else e for e in epochs]


STAGE_ORDER = ("plan", "read", "parse", "aggregate", "side_tables", "merge", "ledger", "kafka_commit")


def _in_stage_order(stages: Mapping[str, float] | Iterable[tuple[str, float]]) -> dict[str, float]:
    stages = dict(stages)  # Arrow gives a map column as (key, value) pairs
    rank = {name: i for i, name in enumerate(STAGE_ORDER)}
    return {k: stages[k] for k in sorted(stages, key=lambda k: (rank.get(k, len(rank)), k))}


def schedule_interval(cron: str, now: datetime, poll_seconds: int = 0) -> timedelta | None:
    """The time between the schedule's fire times around ``now`` (None if it is not a periodic cron expression or
    preset); for ``on-data``, how often its watcher looks (``poll_seconds``): a run follows new records that soon."""
    from croniter import croniter

    if cron.strip() == ON_DATA:
        return timedelta(seconds=poll_seconds)
    try:
        it = croniter(cron_expression(cron), now)
        first = it.get_next(datetime)
        second = it.get_next(datetime)
    except (ValueError, KeyError):
        return None
    return second - first


# Clocks differ a little; a watermark further ahead than this is a problem.
WATERMARK_TOLERANCE = timedelta(minutes=1)


@dataclass(frozen=True)
class Health:
    """The health line: is the chain keeping up with the schedule and the log?"""

    state: str                          # ok | late | idle (nothing committed yet) | failing
    last_epoch: int | None
    last_committed_at: datetime | None
    age_seconds: float | None
    interval_seconds: float | None
    total_lag: int | None
    unfinished: tuple[int, ...] = ()    # epochs planned and not committed
    failed_runs: tuple[str, ...] = ()   # DAG runs failed since the last successful one
    problems: tuple[str, ...] = field(default_factory=tuple)
    maintained_at: datetime | None = None    # when the newest maintenance run finished (None: never)
    maintenance: tuple[str, ...] = ()        # what it did, a line per table

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "last_epoch": self.last_epoch,
                "last_committed_at": _iso(self.last_committed_at), "age_seconds": self.age_seconds,
                "interval_seconds": self.interval_seconds, "total_lag": self.total_lag,
                "unfinished_epochs": list(self.unfinished), "failed_runs": list(self.failed_runs),
                "problems": list(self.problems), "maintained_at": _iso(self.maintained_at),
                "maintenance": list(self.maintenance)}


def with_maintenance(health: Health, now: datetime, rows: Iterable[Mapping[str, Any]],
                     interval: timedelta | None) -> Health:
    """``health`` with the newest maintenance run (``rows``: its log rows; none: it never ran), and a problem when a
    scheduled one (every ``interval``; None: by hand only) that ran once has not run for two intervals since."""
    rows = sorted(rows, key=lambda r: r["table"])
    at = max((r["finished_at"] for r in rows), default=None)
    problems = list(health.problems)
    if interval is not None and at is not None and now - at > 2 * interval:
        problems.append(f"maintenance last ran {(now - at).total_seconds() / 3600:.0f} h ago (schedule: every "
                        f"{interval.total_seconds() / 3600:.0f} h): small files and log entries pile up; see the "
                        "DAG ipcount_maintenance")
    return replace(health, maintained_at=at, problems=tuple(problems),
                   maintenance=tuple(TableMaintenance.from_row(r).line() for r in rows))


def assess_health(now: datetime, last_epoch: int | None, last_committed_at: datetime | None,
                  interval: timedelta | None, total_lag: int | None, unfinished: Iterable[EpochRow],
                  failed_runs: Iterable[str], broker_error: str | None = None,
                  watermark_ms: int | None = None) -> Health:
    """The health line's state and problems (docs/monitoring.md). Age alone is no problem: an epoch with nothing to
    read commits nothing. A chain's watermark ahead of the wall clock (by more than :data:`WATERMARK_TOLERANCE`) is
    failing: every record of the windows it has passed is then late."""
    unfinished = list(unfinished)
    failed_runs = tuple(failed_runs)
    age = (now - last_committed_at).total_seconds() if last_committed_at else None
    problems = []
    stuck = [e for e in unfinished if e.status == FAILED]
    for e in stuck:
        problems.append(f"epoch {e.epoch} ({e.kind}) is unfinished: run {e.run_id or '?'} did not commit it; "
                        "the next run on its lane resumes it")
    if failed_runs:
        problems.append(f"{len(failed_runs)} failed run(s) since the last successful one: {', '.join(failed_runs[:3])}")
    if broker_error:
        problems.append(f"broker: {broker_error}")
    lead = (None if watermark_ms is None
            else datetime.fromtimestamp(watermark_ms / 1000, timezone.utc) - now)  # how far ahead of now
    ahead = lead is not None and lead > WATERMARK_TOLERANCE
    if ahead:
        problems.append(f"watermark {_iso(now + lead)} is {lead.total_seconds() / 60:.0f} min ahead of the wall "
                        "clock: records of the windows it passed are counted late (a producer's clock ahead? see the "
                        "dead letters with reason event_time_ahead and the max_event_time_ahead_seconds setting)")
    late = (age is not None and interval is not None and total_lag
            and age > 2 * interval.total_seconds() + 60)
    if late:
        problems.append(f"last commit {age:.0f} s ago with {total_lag} records waiting "
                        f"(schedule: every {interval.total_seconds():.0f} s)")
    if stuck or failed_runs or broker_error or ahead:
        state = "failing"
    elif late:
        state = "late"
    elif last_epoch is None:
        state = "idle"
    else:
        state = "ok"
    return Health(state=state, last_epoch=last_epoch, last_committed_at=last_committed_at, age_seconds=age,
                  interval_seconds=interval.total_seconds() if interval else None, total_lag=total_lag,
                  unfinished=tuple(e.epoch for e in unfinished), failed_runs=failed_runs,
                  problems=tuple(problems))


# Event times the pipeline counts (rules.records) lie in 2000..2100; a little room either way, and no arithmetic near
# datetime's own limits.
EARLIEST_INSTANT = datetime(1970, 1, 1, tzinfo=timezone.utc)
LATEST_INSTANT = datetime(2200, 1, 1, tzinfo=timezone.utc)
MAX_COUNTS_WINDOWS = 10_000  # the counts page lists one row per window: bounded work and size


def parse_instant(name: str, value: str | None) -> datetime | None:
    """An ISO-8601 instant from a page parameter (naive means UTC, as the form's datetime-local inputs send it)."""
    if value in (None, ""):
        return None
    try:
        t = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise BadQueryError(f"{name} must be an ISO-8601 time such as 2026-11-21T10:00, got {value!r}") from None
    t = t if t.tzinfo else t.replace(tzinfo=timezone.utc)
    if not EARLIEST_INSTANT <= t <= LATEST_INSTANT:
        raise BadQueryError(f"{name} must lie between {EARLIEST_INSTANT:%Y-%m-%d} and {LATEST_INSTANT:%Y-%m-%d}, "
                            f"got {value!r}")
    return t


def counts_range(start: datetime | None, until: datetime | None, latest_end: datetime | None,
                 window_seconds: int, default_span: timedelta = timedelta(hours=1)) -> tuple[datetime, datetime]:
    """The counts page's range: as given, or the last hour of counted windows; at most :data:`MAX_COUNTS_WINDOWS`."""
    end = until or latest_end or datetime.now(timezone.utc)
    begin = start or max(EARLIEST_INSTANT, end - default_span)
    if begin >= end:
        raise BadQueryError(f"from ({_iso(begin)}) must be before until ({_iso(end)})")
    windows = (end - begin).total_seconds() / window_seconds
    if windows > MAX_COUNTS_WINDOWS:
        raise BadQueryError(f"from ({_iso(begin)}) to until ({_iso(end)}) spans {windows:,.0f} windows of "
                            f"{window_seconds} s; at most {MAX_COUNTS_WINDOWS:,} at a time "
                            f"({timedelta(seconds=MAX_COUNTS_WINDOWS * window_seconds)}): narrow the range")
    return begin, end


# Ranges from a page's parameters are read (and cached) in whole blocks, so that however many distinct ranges are
# asked for, they share a few cache keys; the page keeps what it asked for.
EPOCH_BLOCK = 100
TIME_BLOCK = timedelta(hours=1)


def epoch_blocks(low: int, high: int, block: int = EPOCH_BLOCK) -> tuple[int, int]:
    """The epochs [low, high] widened to whole blocks: (first, last) epoch to read."""
    return low - low % block, high - high % block + block - 1


def time_blocks(start: datetime, until: datetime, block: timedelta = TIME_BLOCK) -> tuple[datetime, datetime]:
    """The instants [start, until) widened to whole blocks (hours by default), in UTC."""
    start, until = start.astimezone(timezone.utc), until.astimezone(timezone.utc)
    return start - (start - EARLIEST_INSTANT) % block, until + (EARLIEST_INSTANT - until) % block


def _iso(t: datetime | None) -> str | None:
    return t.astimezone(timezone.utc).isoformat() if t is not None else None
