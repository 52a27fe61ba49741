"""What the monitoring pages read: the Delta tables through delta-rs (no JVM), answers cached per table version and
ranges read in whole blocks (:func:`model.epoch_blocks`, :func:`model.time_blocks`) so that they share cache keys;
and the broker's offsets, asked at most every few seconds (docs/monitoring.md says how little a page reads).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Mapping

from ipcount.orchestration.kafka_connection import resolved
from ipcount.orchestration.monitor.model import epoch_blocks, time_blocks
from ipcount.rules.config import PipelineConfig
from ipcount.rules.ledger import COMMITTED, PLANNED, SCHEDULED, newest_chain_epoch
from ipcount.rules.ledger_summary import chain_lag, committed_chain, of_topic
from ipcount.storage import broker
from ipcount.storage.delta import DeltaReader, has_table, query_table, sql_identifier, sql_literal, table_metadata
from ipcount.storage.ledger import SUMMARY_TXN, Ledger, LedgerView, tail_sql
from ipcount.storage.sink import partition_values
from ipcount.storage.publisher import committed_cursor, publisher_id

log = logging.getLogger(__name__)


# The ledger's values as SQL over delta-rs (rows before backfills existed have no kind).
KIND_SQL = f"coalesce(kind, {sql_literal(SCHEDULED)})"
PLANNED_SQL = sql_literal(PLANNED)
CHAIN_COMMITTED_SQL = f"status = {sql_literal(COMMITTED)} AND {KIND_SQL} = {sql_literal(SCHEDULED)}"
# The epochs page reads the newest NEWEST_WINDOW ids (or twice a page) and widens from there; a page past the newest
# DEEP_PAGE epochs reads every row.
NEWEST_WINDOW, DEEP_PAGE = 256, 5_000
# What is counted of the epochs a ledger summary holds, by (ledger, table id, summary version, what): never changes.
_FOLDED_COUNTS: dict[tuple, Any] = {}
_FOLDED_LOCK = threading.Lock()


@dataclass(frozen=True)
class EpochRef:
    epoch: int
    planned: bool
    kind: str
    run_id: str | None

    def matches(self, kinds: tuple[str, ...], run_id: str | None) -> bool:
        """Of one of ``kinds`` and (if given) of the run ``run_id``."""
        return self.kind in kinds and (run_id is None or self.run_id == run_id)


class PipelineTables:
    """The ledger and counts of one target (``main`` or a replay table set)."""

    def __init__(self, cfg: PipelineConfig, reader: DeltaReader) -> None:
        self.cfg, self.reader = cfg, reader

    def view(self) -> LedgerView:
        """The ledger's summary and the rows it does not hold, from one snapshot, kept per version."""
        return self._view()[0]

    def _view(self) -> tuple[LedgerView, tuple]:
        """The view, and a key naming its summary (the ledger's table id and the summary's version), by which what is
        counted of the epochs it holds is kept (a rebuild's out-of-order epoch comes with a new summary)."""
        def compute(table) -> tuple[LedgerView, tuple]:
            return (Ledger(self.cfg.ledger_path).view(table),
                    (self.cfg.ledger_path, table.metadata().id, table.transaction_version(SUMMARY_TXN)))
        return self.reader.computed(self.cfg.ledger_path, "ledger-view", compute) or (LedgerView(None, []), ())

    def _index(self, where: str) -> list[EpochRef]:
        """The topic's epochs matching ``where`` (SQL), newest first: id, unfinished or not, kind, run."""
        rows = self.reader.query(self.cfg.ledger_path, (
            f"SELECT epoch, bool_or(status = {PLANNED_SQL}) AS planned, min({KIND_SQL}) AS kind, "
            f"min(run_id) AS run_id FROM t WHERE topic = {sql_literal(self.cfg.topic)}{where} "
            "GROUP BY epoch ORDER BY epoch DESC"))
        return [EpochRef(r["epoch"], bool(r["planned"]), r["kind"], r["run_id"]) for r in rows]

    def unfinished(self) -> list[EpochRef]:
        """The topic's epochs still planned, newest first (their ids from the ledger's view)."""
        epochs = self.view().state(self.cfg.topic).unfinished
        return self._index(f" AND epoch IN ({', '.join(str(int(e)) for e in epochs)})") if epochs else []

    def newest_epochs(self, count: int, keep: Callable[[EpochRef], bool] = lambda ref: True) -> list[EpochRef]:
        """The ``count`` newest epochs ``keep`` keeps, newest first: read from a window of ids below the newest
        (Delta's statistics skip the files of older ones), widened until it holds them or reaches the first epoch."""
        newest = self.view().state(self.cfg.topic).last_epoch
        width = max(NEWEST_WINDOW, 2 * count)
        while True:
            low = newest - width
            refs = [ref for ref in self._index(f" AND epoch > {low}") if keep(ref)]
            if len(refs) >= count or low <= 0:
                return refs[:count]
            width *= 4

    def epoch_count(self, kinds: tuple[str, ...], run_id: str | None = None) -> int:
        """How many of the topic's epochs are of ``kinds`` (and, if given, ran in ``run_id``)."""
        if not kinds:   # (a user who may see none of the kinds asked for)
            return 0
        where = f" AND {KIND_SQL} IN ({', '.join(sql_literal(k) for k in kinds)})"
        if run_id is not None:   # an epoch belongs to the least run id of its rows, as on the page
            rows = self.reader.query(self.cfg.ledger_path, (
                f"SELECT count(*) AS n FROM (SELECT epoch FROM t WHERE topic = {sql_literal(self.cfg.topic)}{where} "
                f"GROUP BY epoch HAVING min(run_id) = {sql_literal(run_id)})"))
            return int(rows[0]["n"]) if rows else 0
        return sum(self._by_summary(where, lambda tail: self._count(where + tail)))

    def record_totals(self) -> dict[str, dict[str, int]]:
        """kind -> committed epochs and their records read, counted, late and malformed."""
        totals: dict[str, dict[str, int]] = {}
        for part in self._by_summary("record totals", self._totals):
            for kind, values in part.items():
                mine = totals.setdefault(kind, dict.fromkeys(values, 0))
                for name, n in values.items():
                    mine[name] += n
        return totals

    def _by_summary(self, what: str, query: Callable[[str], Any]) -> list[Any]:
        """``query`` (of an SQL condition to add) over the epochs the ledger's summary holds, computed once per
        summary (:func:`_folded`), and over the others, per version: the parts to add up."""
        view, summary_key = self._view()
        if view.summary is None:
            return [query("")]
        in_tail = tail_sql(view.summary)
        return [_folded(summary_key, what, lambda: query(f" AND NOT {in_tail}")), query(f" AND {in_tail}")]

    def _totals(self, where: str) -> dict[str, dict[str, int]]:
        sums = ", ".join(f"sum({m}) AS {m}" for m in TOTALS[1:])
        rows = self.reader.query(self.cfg.ledger_path, (
            f"SELECT {KIND_SQL} AS kind, count(DISTINCT epoch) AS epochs, {sums} FROM t "
            f"WHERE topic = {sql_literal(self.cfg.topic)} AND status = {sql_literal(COMMITTED)}{where} GROUP BY 1"))
        return {r["kind"]: {m: int(r[m] or 0) for m in TOTALS} for r in rows}

    def _count(self, where: str) -> int:
        rows = self.reader.query(self.cfg.ledger_path, (
            f"SELECT count(DISTINCT epoch) AS n FROM t WHERE topic = {sql_literal(self.cfg.topic)}{where}"))
        return int(rows[0]["n"]) if rows else 0

    def epoch_page(self, kinds: tuple[str, ...], run_id: str | None, start: int, size: int,
                   committed_only: bool = False) -> list[EpochRef]:
        """Epochs ``start``..``start + size`` (newest first) of ``kinds`` and ``run_id`` (and no longer planned): from
        a window of the newest ids, or (a page far back) from every row."""
        if not kinds:
            return []

        def keep(ref: EpochRef) -> bool:
            return ref.matches(kinds, run_id) and not (committed_only and ref.planned)
        if start + size <= DEEP_PAGE:
            return self.newest_epochs(start + size, keep)[start:]
        return [ref for ref in self._index("") if keep(ref)][start:start + size]

    def epoch_rows(self, epochs: list[int]) -> list[dict[str, Any]]:
        """The ledger rows of ``epochs``: one query of whole blocks (Delta's statistics skip the files outside it)."""
        if not epochs:
            return []
        wanted = set(epochs)
        first, last = epoch_blocks(min(wanted), max(wanted))
        rows = self.reader.query(self.cfg.ledger_path, (
            f"SELECT * FROM t WHERE topic = {sql_literal(self.cfg.topic)} AND epoch >= {first} AND epoch <= {last}"))
        return [r for r in rows if r["epoch"] in wanted]

    def chain_positions(self) -> dict[int, int]:
        """partition -> next offset of the scheduled chain (what the consumer group follows)."""
        view = self.view()
        return committed_chain(view.summary, self.cfg.topic, view.tail)[1]

    def chain_lag(self, log_start: Mapping[int, int], log_end: Mapping[int, int]) -> dict[int, int]:
        """partition -> offsets not counted yet (:func:`ipcount.rules.ledger_summary.chain_lag`)."""
        view = self.view()
        return chain_lag(view.summary, self.cfg.topic, view.tail, log_start, log_end)

    def last_committed(self) -> tuple[int, datetime, int | None] | None:
        """(epoch, committed at, watermark after it) of the chain's last committed epoch."""
        view = self.view()
        newest = newest_chain_epoch(*of_topic(view.summary, self.cfg.topic, view.tail))
        if newest is None:
            return None
        rows = self.reader.query(self.cfg.ledger_path, (
            f"SELECT committed_at FROM t WHERE topic = {sql_literal(self.cfg.topic)} AND epoch = {int(newest[0])} "
            f"AND {CHAIN_COMMITTED_SQL} LIMIT 1"))
        return (newest[0], rows[0]["committed_at"], newest[1]) if rows else None

    def last_maintenance(self) -> list[dict[str, Any]]:
        """The maintenance log's rows of its newest run ([] if maintenance never ran)."""
        path = self.cfg.maintenance_path
        newest = self.reader.query(path, "SELECT run_id FROM t ORDER BY finished_at DESC LIMIT 1")
        if not newest:
            return []
        return self.reader.query(path, f"SELECT * FROM t WHERE run_id = {sql_literal(newest[0]['run_id'])}")

    def lag_history(self, last: int) -> list[tuple[int, datetime | None, dict[int, int]]]:
        """(epoch, committed at, partition -> lag after) of the chain's last ``last`` committed epochs, oldest first."""
        chain = [e.epoch for e in self.newest_epochs(last, lambda e: e.kind == SCHEDULED and not e.planned)]
        by_epoch: dict[int, dict[int, int]] = {}
        committed: dict[int, datetime] = {}
        for r in self.epoch_rows(chain):
            if r["status"] == COMMITTED and r.get("lag_after") is not None:
                by_epoch.setdefault(r["epoch"], {})[r["partition"]] = r["lag_after"]
                committed[r["epoch"]] = max(committed.get(r["epoch"], r["committed_at"]), r["committed_at"])
        return [(e, committed.get(e), lags) for e, lags in sorted(by_epoch.items())]

    def latest_window_end(self) -> datetime | None:
        """The newest window's end: read from the newest partition when every file has its partition value (the
        snapshot's file list says so), else from the whole table."""
        def compute(table) -> datetime | None:
            import pyarrow.compute as pc

            found, where = partition_values(table), ""
            if found is not None:
                column, values = found
                newest = pc.max(values).as_py()
                where = "" if newest is None else f" WHERE {column} = {sql_literal(newest)}"
            rows = query_table(table, f"SELECT max(window_end) AS m FROM t{where}")
            return rows[0]["m"] if rows else None
        return self.reader.computed(self.cfg.counts_path, "latest-window-end", compute)

    def top_ips(self, start: datetime, until: datetime, limit: int, cache: bool = True) -> list[dict[str, Any]]:
        """IPs by requests counted in the windows inside [start, until). (A top list cannot be cut from a wider
        range's: ``cache`` False for a range from a page's parameters.)"""
        return self.reader.query(self.cfg.counts_path, (
            "SELECT ip, sum(count) AS requests, count(*) AS windows FROM t "
            f"WHERE {_window_filter(start, until)} GROUP BY ip ORDER BY requests DESC, ip LIMIT {int(limit)}"),
            cache=cache)

    def requests_per_window(self, start: datetime, until: datetime) -> list[dict[str, Any]]:
        """Per window inside [start, until): requests, IPs, and whether it is final (read for whole hours)."""
        rows = self.reader.query(self.cfg.counts_path, (
            "SELECT window_start, window_end, sum(count) AS requests, count(*) AS ips, "
            f"bool_and(coalesce(is_final, false)) AS final FROM t WHERE {_window_filter(*time_blocks(start, until))} "
            "GROUP BY window_start, window_end ORDER BY window_start"))
        return [r for r in rows if r["window_start"] >= start and r["window_end"] <= until]


# What record_totals sums per kind of epoch.
TOTALS = ("epochs", "records_read", "records_counted", "records_late", "records_malformed")


def _folded(summary_key: tuple, what: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` over the epochs a summary holds, kept by the summary's key: those never change."""
    key = (*summary_key, what)
    with _FOLDED_LOCK:
        folded = _FOLDED_COUNTS.get(key)
    if folded is None:
        folded = compute()
        with _FOLDED_LOCK:
            _FOLDED_COUNTS[key] = folded
            while len(_FOLDED_COUNTS) > 256:
                _FOLDED_COUNTS.pop(next(iter(_FOLDED_COUNTS)))
    return folded


def _window_filter(start: datetime, until: datetime) -> str:
    def ts(t: datetime) -> str:
        return f"arrow_cast({sql_literal(t.isoformat())}, 'Timestamp(Microsecond, Some(\"UTC\"))')"
    return f"{sql_identifier('window_start')} >= {ts(start)} AND {sql_identifier('window_end')} <= {ts(until)}"


@dataclass(frozen=True)
class BrokerPositions:
    """Per partition: the log's start and end, and the consumer group's committed offset."""

    log_start: dict[int, int]
    log_end: dict[int, int]
    group: dict[int, int]
    error: str | None = None


def publish_groups(cfg: PipelineConfig) -> tuple[str, ...]:
    """The consumer groups the monitor shows on the sink topic: the pipeline's own (its configured group and the
    publisher's). Other groups' offsets are not for every reader of the epoch DAG, and a few groups keep the broker's
    cached answers few."""
    return cfg.group_id, publisher_id(cfg)


def publish_status(cfg: PipelineConfig, group: str | None = None) -> dict[str, Any]:
    """How far publishing got: the publisher's cursor against the counts table's versions, and (for ``group``) how far
    a consumer of the sink topic is behind its end."""
    from deltalake import DeltaTable

    if not cfg.publish:
        return {"publish": False}
    out: dict[str, Any] = {"publish": True, "topic": cfg.publish_topic, "error": None}
    try:
        with resolved(cfg.replace(kafka_timeout_seconds=3)) as quick:
            cursor = committed_cursor(quick, cfg.publish_topic)
            latest = DeltaTable(cfg.counts_path).version() if has_table(cfg.counts_path) else None
            out.update(counts_version=latest, next_version=cursor.next_version if cursor else None,
                       last_epoch=cursor.last_epoch if cursor else None,
                       versions_behind=None if latest is None else latest + 1 - (cursor.next_version if cursor else 0))
            if group:
                sink = quick.replace(topic=cfg.publish_topic, group_id=group, publish=False)
                _, ends = broker.partition_offsets(sink)
                consumed = broker.group_offsets(sink)
                out["group"] = {"group_id": group, "partitions": [
                    {"partition": p, "log_end": end, "group_offset": consumed.get(p),
                     "lag": None if p not in consumed else end - consumed[p]} for p, end in sorted(ends.items())]}
    except Exception as e:  # shown as it is; the rest of the monitor still works
        out["error"] = f"{type(e).__name__}: {e}"
    return out


class BrokerProbe:
    """What the pages ask the broker, asked at most every ``ttl_seconds`` (pages poll; the broker should not feel it).
    An unreachable broker is an answer, not an exception."""

    def __init__(self, ttl_seconds: float = 5.0) -> None:
        self.ttl_seconds = ttl_seconds
        self._last: dict[str, tuple[float, str, Any]] = {}   # question -> (when, who asked, answer)
        self._lock = threading.Lock()

    def positions(self, cfg: PipelineConfig) -> BrokerPositions:
        def ask() -> BrokerPositions:
            try:
                with resolved(cfg.replace(kafka_timeout_seconds=3)) as quick:
                    start, end = broker.partition_offsets(quick)
                    group = broker.group_offsets(quick)
                return BrokerPositions(start, end, group)
            except Exception as e:  # shown on the page; the tables are still worth seeing
                log.warning("broker offsets unavailable: %s", e)
                return BrokerPositions({}, {}, {}, error=f"{type(e).__name__}: {e}")
        return self._cached("positions", cfg, ask)

    def published_until(self, cfg: PipelineConfig) -> int | None:
        """The first counts version not published yet (None: publishing off, or unknown)."""
        def ask() -> int | None:
            if not cfg.publish or not has_table(cfg.counts_path):
                return None
            try:
                with resolved(cfg.replace(kafka_timeout_seconds=3)) as quick:
                    cursor = committed_cursor(quick, cfg.publish_topic)
                table_id = table_metadata(cfg.counts_path)[0]
            except Exception as e:  # the epochs page shows no Published column then
                log.warning("publisher cursor unavailable: %s", e)
                return None
            return cursor.next_version if cursor and cursor.table_id == table_id else 0
        return self._cached("published_until", cfg, ask)

    def publish(self, cfg: PipelineConfig, group: str | None) -> dict[str, Any]:
        """:func:`publish_status` (``group``: one of :func:`publish_groups`)."""
        return self._cached(f"publish {group or ''}", cfg, lambda: publish_status(cfg, group))

    def _cached(self, question: str, cfg: PipelineConfig, ask: Callable[[], Any]) -> Any:
        # Who asks is part of the answer: another login may see other topics.
        who = "/".join((cfg.bootstrap_servers, cfg.kafka_connection, cfg.kafka_security_protocol,
                        cfg.kafka_sasl_username, cfg.topic, cfg.group_id, cfg.publish_topic, cfg.counts_path))
        with self._lock:
            last = self._last.get(question)
            if last and last[1] == who and time.monotonic() - last[0] < self.ttl_seconds:
                return last[2]
            answer = ask()
            self._last[question] = (time.monotonic(), who, answer)
            return answer
