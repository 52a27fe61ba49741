"""Read-only views of the ledger without a JVM (delta-rs), for Airflow tasks and watchers.

Spark writes the tables; these readers only look. They are cheap enough to call from a
DAG task or a terminal loop every few seconds.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping


_OPERATORS = ("=", "!=", "<", "<=", ">", ">=")


def read_rows(path: str, columns: list[str] | None = None, filters: list | None = None) -> list[dict[str, Any]]:
    """Rows of the Delta table at ``path`` ([] if there is none), optionally only some
    columns and only rows matching every ``(column, op, value)`` filter.

    Through delta-rs's own query engine rather than ``to_pyarrow_table``: the pyarrow
    dataset path aborts the interpreter at exit ("terminate called without an active
    exception", delta-rs issue 2184) in short-lived processes such as CLI commands.
    """
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder
    from deltalake.exceptions import TableNotFoundError

    if not has_table(path):
        return []
    try:
        table = DeltaTable(path)
    except TableNotFoundError:
        return []
    select = ", ".join(sql_identifier(c) for c in columns) if columns else "*"
    where = " AND ".join(f"{sql_identifier(c)} {sql_operator(op)} {sql_literal(v)}" for c, op, v in (filters or []))
    sql = f"SELECT {select} FROM ledger_view_table" + (f" WHERE {where}" if where else "")
    reader = QueryBuilder().register("ledger_view_table", table).execute(sql)
    return pa.table(reader.read_all()).to_pylist()


def has_table(path: str) -> bool:
    """Whether a Delta table (its log) is at ``path``: a look at the directory, no read."""
    return (Path(path) / "_delta_log").is_dir()


def is_scheduled(row: Mapping[str, Any]) -> bool:
    """A row of the scheduled chain (rows written before backfills existed have no kind)."""
    return (row.get("kind") or "scheduled") == "scheduled"


def chain_positions(rows: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """partition -> next offset of the scheduled chain, from one topic's ledger rows (only
    its committed rows count; backfills may lie behind or ahead of the chain). Pure."""
    positions: dict[int, int] = {}
    for r in rows:
        if r["status"] == "committed" and is_scheduled(r):
            positions[r["partition"]] = max(positions.get(r["partition"], 0), r["until_offset"])
    return positions


METRICS = ("records_read", "records_counted", "records_late", "records_malformed")


def rows_by_epoch(rows: Iterable[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    """Per-partition ledger rows grouped by epoch id, in the order met."""
    out: dict[int, list[Mapping[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["epoch"], []).append(r)
    return out


def metric_totals(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """An epoch's record counts: its partitions' rows summed (missing counts are 0)."""
    rows = list(rows)
    return {m: sum(r.get(m) or 0 for r in rows) for m in METRICS}


def sql_identifier(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"not a column name: {name!r}")
    return f'"{name}"'


def sql_operator(op: str) -> str:
    if op not in _OPERATORS:
        raise ValueError(f"unsupported filter operator {op!r}")
    return op


def sql_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return "'" + str(value).replace("'", "''") + "'"


def committed_positions(ledger_path: str, topic: str) -> tuple[int, dict[int, int]]:
    """(last committed epoch, partition -> next offset) of the scheduled chain for ``topic``;
    (0, {}) if none. The consumer group follows the chain."""
    rows = [r for r in read_rows(ledger_path, filters=[("topic", "=", topic), ("status", "=", "committed")])
            if is_scheduled(r)]
    return max((r["epoch"] for r in rows), default=0), chain_positions(rows)


def epoch_line(epoch: int, ranges: dict[int, tuple[int, int]], read: int, counted: int, late: int,
               malformed: int, lag: int | None, seconds: float) -> str:
    """The one-line epoch summary printed by the CLI, the watcher and the DAG."""
    spans = " ".join(f"p{p}[{f},{u})" for p, (f, u) in sorted(ranges.items()))
    lag_text = "" if lag is None else f" lag {lag}"
    return (f"epoch {epoch} committed: {spans} | read {read} counted {counted} late {late} "
            f"malformed {malformed}{lag_text} | {seconds:.1f}s")


@dataclass(frozen=True)
class CommittedEpoch:
    """One committed epoch, assembled from its per-partition ledger rows."""

    epoch: int
    ranges: dict[int, tuple[int, int]]
    records_read: int
    records_counted: int
    records_late: int
    records_malformed: int
    seconds: float
    sink_version: int | None
    watermark_after_ms: int | None
    run_id: str | None
    lag_after: dict[int, int] | None = None
    stage_seconds: dict[str, float] | None = None
    kind: str = "scheduled"
    request_id: str | None = None

    def line(self) -> str:
        lag = None if self.lag_after is None else sum(self.lag_after.values())
        return epoch_line(self.epoch, self.ranges, self.records_read, self.records_counted, self.records_late,
                          self.records_malformed, lag, self.seconds)

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch,
                "ranges": {str(p): {"from_offset": f, "until_offset": u} for p, (f, u) in sorted(self.ranges.items())},
                "records_read": self.records_read, "records_counted": self.records_counted,
                "records_late": self.records_late, "records_malformed": self.records_malformed,
                "seconds": self.seconds, "sink_version": self.sink_version,
                "watermark_after_ms": self.watermark_after_ms, "run_id": self.run_id,
                "lag_after": None if self.lag_after is None else {str(p): n for p, n in sorted(self.lag_after.items())},
                "stage_seconds": self.stage_seconds, "kind": self.kind, "request_id": self.request_id}


def committed_epochs(ledger_path: str, after_epoch: int = 0, run_id: str | None = None) -> list[CommittedEpoch]:
    """Committed epochs with id > ``after_epoch`` (optionally only those a run committed),
    oldest first."""
    filters = [("status", "=", "committed"), ("epoch", ">", after_epoch)]
    if run_id is not None:
        filters.append(("run_id", "=", run_id))
    out = []
    for epoch, rows in sorted(rows_by_epoch(read_rows(ledger_path, filters=filters)).items()):
        first = rows[0]
        out.append(CommittedEpoch(
            epoch=epoch,
            ranges={r["partition"]: (r["from_offset"], r["until_offset"]) for r in rows},
            **metric_totals(rows),
            seconds=first["duration_seconds"] or 0.0, sink_version=first["sink_version"],
            watermark_after_ms=first["watermark_after_ms"], run_id=first["run_id"],
            lag_after=({r["partition"]: r["lag_after"] for r in rows}
                       if all(r.get("lag_after") is not None for r in rows) else None),
            stage_seconds=dict(first["stage_seconds"]) if first.get("stage_seconds") else None,
            kind=first.get("kind") or "scheduled", request_id=first.get("request_id")))
    return out
