"""Delta table helpers shared by every reader and writer: a look for a table, reads with
delta-rs (no JVM: cheap enough for an Airflow task, a watcher or a page), and the Spark
side's table creation and conflict retries.

Spark writes the counts table; delta-rs writes the ledger and the dead-letter and
late-record tables (one engine per table: see :mod:`ipcount.storage.ledger`) and reads
them all. pyspark, delta-spark and deltalake are
imported inside the functions that need them, so the readers work where no JVM is wanted.
"""
from __future__ import annotations

import logging
import re
import shutil
import threading
import time
from collections import OrderedDict
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, TypeVar

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

log = logging.getLogger(__name__)
T = TypeVar("T")

_OPERATORS = ("=", "!=", "<", "<=", ">", ">=")


def has_table(path: str | Path) -> bool:
    """Whether a Delta table (its log) is at ``path``: a look at the directory, no read
    (a missing table is not an empty one)."""
    return (Path(path) / "_delta_log").is_dir()


# -- SQL text for delta-rs queries ---------------------------------------------------------

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


def sql_timestamp(ms: int) -> str:
    """A Spark SQL timestamp literal of an instant in epoch milliseconds (a literal, so Delta
    can skip files by their min/max statistics)."""
    instant = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return f"TIMESTAMP '{instant.isoformat(timespec='milliseconds')}'"


# -- reads with delta-rs -------------------------------------------------------------------

def _open(path: str):
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    if not has_table(path):
        return None
    try:
        return DeltaTable(path)
    except TableNotFoundError:
        return None


def query_table(table, sql: str) -> list[dict[str, Any]]:
    """Rows of ``sql`` over a loaded delta-rs ``table`` (named ``t``): a query of exactly
    that snapshot."""
    return _run(table, sql)


def _run(table, sql: str) -> list[dict[str, Any]]:
    """``sql`` over ``table`` (named ``t``), through delta-rs's own query engine rather
    than ``to_pyarrow_table``: the pyarrow dataset path aborts the interpreter at exit
    ("terminate called without an active exception", delta-rs issue 2184) in short-lived
    processes such as CLI commands."""
    import pyarrow as pa
    from deltalake import QueryBuilder

    return pa.table(QueryBuilder().register("t", table).execute(sql).read_all()).to_pylist()


def read_rows(path: str, columns: Iterable[str] | None = None,
              filters: Iterable[tuple[str, str, Any]] | None = None) -> list[dict[str, Any]]:
    """Rows of the Delta table at ``path`` ([] if there is none), optionally only some
    columns and only rows matching every ``(column, op, value)`` filter."""
    table = _open(path)
    if table is None:
        return []
    columns = list(columns or [])
    select = ", ".join(sql_identifier(c) for c in columns) if columns else "*"
    where = " AND ".join(f"{sql_identifier(c)} {sql_operator(op)} {sql_literal(v)}" for c, op, v in (filters or []))
    return _run(table, f"SELECT {select} FROM t" + (f" WHERE {where}" if where else ""))


class DeltaReader:
    """Delta tables by path for a long-lived reader (the monitoring pages): each table
    opened once and refreshed at most every ``refresh_seconds``, SQL answers cached per
    (path, version, query), so polling costs one small log read between commits."""

    def __init__(self, refresh_seconds: float = 1.0, cache_entries: int = 512) -> None:
        self.refresh_seconds, self.cache_entries = refresh_seconds, cache_entries
        self._tables: dict[str, tuple[Any, float]] = {}
        self._answers: OrderedDict[tuple[str, int, str], list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def _table(self, path: str):
        now = time.monotonic()
        held = self._tables.get(path)
        if held is not None:
            table, checked = held
            if now - checked >= self.refresh_seconds:
                table.update_incremental()
                self._tables[path] = (table, now)
            return table
        table = _open(path)
        if table is not None:
            self._tables[path] = (table, now)
        return table

    def query(self, path: str, sql: str) -> list[dict[str, Any]]:
        """Rows of ``sql`` over the table at ``path``, named ``t`` in the query ([] if there
        is no table yet)."""
        with self._lock:
            table = self._table(path)
            if table is None:
                return []
            key = (path, table.version(), sql)
            if key in self._answers:
                self._answers.move_to_end(key)
                return self._answers[key]
            rows = _run(table, sql)
            self._answers[key] = rows
            while len(self._answers) > self.cache_entries:
                self._answers.popitem(last=False)
            return rows


def table_metadata(path: str) -> tuple[str, dict[str, str]]:
    """(Delta table id, table properties) of the table at ``path``, from its log."""
    from deltalake import DeltaTable as LogReader

    metadata = LogReader(path).metadata()
    return metadata.id, dict(metadata.configuration)


def latest_version(path: str) -> int | None:
    """The version of the Delta table at ``path`` now (None if there is no table)."""
    table = _open(path)
    return None if table is None else table.version()


def version_with_metadata(path: str, user_metadata: str, search: int = 50) -> int | None:
    """The table version whose commit carries ``user_metadata`` (None if none of the last
    ``search`` commits does). From the log's commit infos, read with delta-rs: Spark's
    history() would be a query of its own."""
    from deltalake import DeltaTable as LogReader

    return next((h["version"] for h in LogReader(path).history(search)
                 if h.get("userMetadata") == user_metadata), None)


# -- the Spark side: creating tables, retrying conflicts -----------------------------------

# -- the tables delta-rs writes ------------------------------------------------------------

_ARROW_TYPES = ("bigint", "int", "string", "double", "timestamp", "boolean", "binary", "map<string,double>")


def arrow_schema(columns: Iterable[tuple[str, str, bool]]):
    """An Arrow schema from (name, Spark SQL type, nullable) columns: what delta-rs writes
    for the Delta types Spark would (timestamps in microseconds, UTC)."""
    import pyarrow as pa

    types = dict(zip(_ARROW_TYPES, (pa.int64(), pa.int32(), pa.string(), pa.float64(), pa.timestamp("us", tz="UTC"),
                                    pa.bool_(), pa.binary(), pa.map_(pa.string(), pa.float64()))))
    return pa.schema([pa.field(name, types[kind], nullable) for name, kind, nullable in columns])


def rs_concurrent_errors() -> tuple[type[BaseException], ...]:
    """delta-rs's refusal of a commit that lost to a concurrent one."""
    from deltalake.exceptions import CommitFailedError

    return (CommitFailedError,)


def rs_create_table(path: str, schema, properties: Mapping[str, str] | None = None) -> None:
    """Create an empty Delta table at ``path`` with delta-rs unless one is there; one made
    by an older version gets the (nullable) columns it lacks. Version 0 is put-if-absent
    like every commit: of concurrent creators one wins and the others find its table."""
    from deltalake import DeltaTable, Schema
    from deltalake.exceptions import DeltaError, TableNotFoundError

    table = _open(path)
    if table is None:
        try:
            DeltaTable.create(path, schema=schema, mode="error", configuration=dict(properties or {}) or None)
            return
        except (DeltaError, TableNotFoundError) as e:
            table = _open(path)
            if table is None:
                raise
            log.info("%s was created by a concurrent run (%s)", path, str(e).splitlines()[0][:200])
    have = {f.name for f in table.schema().fields}
    missing = [f for f in schema if f.name not in have]
    if missing:
        import pyarrow as pa

        log.info("adding columns %s to %s", ", ".join(f.name for f in missing), path)
        retry_on_conflict(lambda: DeltaTable(path).alter.add_columns(Schema.from_arrow(pa.schema(missing)).fields),
                          f"adding columns to {path}", rs_concurrent_errors())


def rs_append_once(path: str, data, app_id: str, version: int, user_metadata: str, attempts: int = 20) -> bool:
    """Append ``data`` (Arrow) to the table at ``path`` in one commit that records Delta's
    transaction (``app_id``, ``version``), unless the table holds that transaction at that
    version or later already (an earlier attempt's commit, or a fence): Delta's idempotent
    write, as Spark's ``txnAppId``/``txnVersion`` make it. True if this call committed.

    The check and the commit are one step: the commit is made as exactly the next version
    of the snapshot checked, with no retry, and the log store creates it only if absent; a
    concurrent commit - perhaps the same epoch's, from another runner - sends this one back
    to check again."""
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

    for attempt in range(1, attempts + 1):
        table = DeltaTable(path)
        done = table.transaction_version(app_id)
        if done is not None and done >= version:
            return False
        try:
            write_deltalake(table, data, mode="append", commit_properties=CommitProperties(
                custom_metadata={"userMetadata": user_metadata}, max_commit_retries=0,
                app_transactions=[Transaction(app_id, version)]))
            return True
        except rs_concurrent_errors() as e:
            log.info("%s: a concurrent commit came first (%s); checking again (%d/%d)", path,
                     str(e).splitlines()[0][:200], attempt, attempts)
            time.sleep(min(0.05 * attempt, 1.0))
    raise RuntimeError(f"could not append to {path} after {attempts} attempts: other writers kept committing first")


def spark_schema(columns: Iterable[tuple[str, str, bool]]) -> StructType:
    """A Spark schema from ``(name, Spark SQL type, nullable)`` columns (as
    :data:`ipcount.rules.ledger.COLUMNS` declares the ledger without Spark)."""
    from pyspark.sql import types as st

    simple = {"bigint": st.LongType(), "int": st.IntegerType(), "string": st.StringType(),
              "double": st.DoubleType(), "timestamp": st.TimestampType(), "boolean": st.BooleanType(),
              "binary": st.BinaryType(), "map<string,double>": st.MapType(st.StringType(), st.DoubleType())}
    return st.StructType([st.StructField(name, simple[kind], nullable) for name, kind, nullable in columns])


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
        _create(spark, path, schema, properties)
        return
    detail = DeltaTable.forPath(spark, path).detail().select("properties").first()
    have_props = dict(detail.properties or {})
    stale = {k: v for k, v in properties.items() if have_props.get(k) != v}
    if stale:
        retry_on_conflict(lambda: set_table_properties(spark, path, stale), f"setting table properties of {path}")
    have = set(spark.read.format("delta").load(path).schema.fieldNames())
    missing = [f for f in schema.fields if f.name not in have]
    if missing:
        columns = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in missing)
        retry_on_conflict(lambda: spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS ({columns})"),
                          f"adding columns to {path}")


def set_table_properties(spark: SparkSession, path: str, properties: Mapping[str, str]) -> None:
    """One commit that sets ``properties`` on the table at ``path`` (values quoted as SQL
    strings). Not retried here: a caller whose change depends on what is there re-reads."""
    def quoted(value: str) -> str:
        return value.replace("\\", "\\\\").replace("'", "\\'")
    assignments = ", ".join(f"'{k}' = '{quoted(v)}'" for k, v in sorted(properties.items()))
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({assignments})")


def _create(spark: SparkSession, path: str, schema: StructType, properties: Mapping[str, str],
            attempts: int = 5) -> None:
    """Create the table; a concurrent creator that wins the race (Delta refuses the loser's
    version 0 with DELTA_PROTOCOL_CHANGED or a concurrent-commit error) is success too, and
    what a creator killed mid-way left behind (a log directory with no commit, which Delta
    answers with DELTA_TABLE_NOT_FOUND or NON_EMPTY_LOCATION for good) is cleared."""
    from delta.tables import DeltaTable

    for attempt in range(1, attempts + 1):
        builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema)
        for key, value in properties.items():
            builder = builder.property(key, value)
        try:
            builder.execute()
            return
        except Exception as e:  # noqa: BLE001 - Delta's errors come back as JVM errors; sorted below
            if DeltaTable.isDeltaTable(spark, path):
                log.info("%s was created by a concurrent run (%s)", path, type(e).__name__)
                return
            if attempt == attempts:
                raise
            age = _unborn_table_age(path)
            if age is not None and age >= UNBORN_AFTER_SECONDS:
                log.warning("%s holds the log directory of a table whose creation never committed (its creator "
                            "was killed %.0f s ago or more); clearing it", path, age)
                shutil.rmtree(Path(path) / "_delta_log")
                continue
            wait = UNBORN_AFTER_SECONDS - age if age is not None else 0.2 * attempt  # a creation in flight?
            log.info("creating %s: %s; trying again in %.1f s (%d/%d)", path, str(e).splitlines()[0][:200], wait,
                     attempt, attempts)
            time.sleep(wait)


# A creation commits within seconds; a log directory without a commit that is older than
# this was left by a creator that was killed.
UNBORN_AFTER_SECONDS = 10.0
_COMMIT_FILE = re.compile(r"^\d{20}\.(json|checkpoint.*\.parquet)$")


def _unborn_table_age(path: str) -> float | None:
    """Seconds since the newest file of a table whose creation never committed, else None.
    Only a local directory whose every file is in ``_delta_log`` and none of them a commit or
    checkpoint: anything else is data, and is never cleared."""
    root = Path(path)
    log_dir = root / "_delta_log"
    if "://" in path or not log_dir.is_dir():
        return None
    files = [f for f in root.rglob("*") if f.is_file()]
    if any(log_dir not in f.parents or _COMMIT_FILE.match(f.name) for f in files):
        return None
    newest = max((f.stat().st_mtime for f in files), default=log_dir.stat().st_mtime)
    return max(0.0, time.time() - newest)


def _up_to_date(path: str, schema: StructType, properties: Mapping[str, str]) -> bool:
    """Whether the table at ``path`` exists with every column and property, looked up in its
    log with delta-rs: an epoch makes this check for four tables, and through Spark each
    would cost a Delta snapshot and a query (seconds in a fresh JVM). Any doubt: False."""
    from deltalake import DeltaTable as LogReader

    if not has_table(path):
        return False
    try:
        table = LogReader(path)
        have = {f.name for f in table.schema().fields}
        config = table.metadata().configuration
    except Exception:  # noqa: BLE001 - Spark's path below decides (and says what is wrong)
        return False
    return all(f.name in have for f in schema.fields) and all(config.get(k) == v for k, v in properties.items())


def concurrent_errors() -> tuple[type[BaseException], ...]:
    """Delta's optimistic-concurrency conflicts (a concurrent commit won)."""
    from delta.exceptions import base

    return (base.DeltaConcurrentModificationException, base.ConcurrentWriteException,
            base.MetadataChangedException, base.ProtocolChangedException, base.ConcurrentAppendException,
            base.ConcurrentDeleteReadException, base.ConcurrentDeleteDeleteException,
            base.ConcurrentTransactionException)


def retry_on_conflict(action: Callable[[], T], what: str, errors: tuple[type[BaseException], ...] | None = None,
                      attempts: int = 10) -> T:
    """Run a Delta write, again if a concurrent writer's commit conflicted with it
    (``errors``: delta-spark's :func:`concurrent_errors` unless given). Only for writes that
    are idempotent (txnAppId/txnVersion, or MERGEs matching planned rows)."""
    errors = errors or concurrent_errors()
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except errors as e:
            if attempt == attempts:
                raise
            log.info("%s: concurrent commit (%s); retrying (%d/%d)", what, type(e).__name__, attempt, attempts)
            time.sleep(0.2 * attempt)
    raise AssertionError("unreachable")
