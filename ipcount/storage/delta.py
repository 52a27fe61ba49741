"""Delta table helpers for every reader and writer, all delta-rs (no JVM: cheap enough for an Airflow task, a watcher or
a page): a look for a table, reads, creation, and commits made at most once per transaction id (:func:`rs_commit_once`).
delta-rs commits to every table; Spark never does. deltalake is imported where needed.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, TypeVar

from ipcount.rules.config import location_scheme
from ipcount.rules.errors import CommitContention, ConfigError, StorageUnavailableError, first_line
from ipcount.storage.retry import retrying

if TYPE_CHECKING:
    import pyarrow as pa
    from deltalake import CommitProperties, DeltaTable

log = logging.getLogger(__name__)
T = TypeVar("T")

_OPERATORS = ("=", "!=", "<", "<=", ">", ">=")


def has_table(path: str | Path) -> bool:
    """Whether a Delta table (its log) is at ``path``. Every command's first look at its tables, so a location that
    cannot hold them is refused here: a path through a file (:class:`ConfigError`), a store that does not answer or
    refuses the login (:class:`StorageUnavailableError`)."""
    if location_scheme(str(path)):
        from deltalake import DeltaTable

        try:
            return DeltaTable.is_deltatable(str(path))
        except OSError as e:
            raise StorageUnavailableError(_object_storage_problem(str(path), e)) from None
    try:
        if (Path(path) / "_delta_log").is_dir():
            return True
        _nearest_directory(Path(path))
    except PermissionError as e:
        raise ConfigError(f"cannot look at {e.filename or path}: permission denied (check warehouse and the "
                          "*_table settings)") from None
    return False


def _nearest_directory(path: Path) -> Path:
    """The nearest existing one of ``path`` and its parents, which must be a directory (else :class:`ConfigError`)."""
    for above in (path, *path.parents):
        if above.exists():
            if not above.is_dir():
                raise ConfigError(f"{above} is a file, not a directory, so no table can be at {path}: check "
                                  "warehouse and the *_table settings")
            return above
    return Path("/")


def check_writable(path: str) -> None:
    """A table can be made at ``path``: locally, the nearest existing directory is writable by this user. Object storage
    is only asked whether the table is there (which fails without a login); whether it may be written, the first write
    says."""
    if has_table(path) or location_scheme(path):  # (object storage: it answered, with the credentials)
        return
    above = _nearest_directory(Path(path))
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot make a table at {path}: {above} is not writable by this user (a read-only file "
                          "system, or another user's directory): check warehouse and the *_table settings")


# Where the AWS SDK finds credentials besides an instance role (which needs none of these).
_CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                         "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")


def _credentials_given() -> bool:
    """Whether credentials are set where the AWS SDK looks besides the instance's role."""
    shared = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or str(Path.home() / ".aws" / "credentials")
    return any(os.environ.get(name) for name in _CREDENTIAL_VARIABLES) or Path(shared).is_file()


def _object_storage_problem(path: str, error: BaseException) -> str:
    # delta-rs chains its causes with colour codes and arrows: one plain line of them.
    said = re.sub(r"\s*\u21b3\s*", "; ", " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(error)).split()))[:200]
    if not _credentials_given():
        return (f"no credentials for the object storage of {path} (none in the AWS_* variables or ~/.aws, and no "
                "instance role answered): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
                f"AWS_REGION, and AWS_ENDPOINT_URL for a store other than AWS's (delta-rs: {said})")
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS's"
    return (f"the object storage of {path} (endpoint {endpoint}) did not answer or refused the request: check "
            f"AWS_ENDPOINT_URL, AWS_REGION and the credentials (delta-rs: {said})")


def subdirectory_names(location: str) -> list[str]:
    """The directories right under ``location`` (local, or on object storage), sorted; [] if it does not exist."""
    if not location_scheme(location):
        root = Path(location)
        return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    from pyarrow import fs

    store, prefix = arrow_filesystem(location)
    found = store.get_file_info(fs.FileSelector(prefix, allow_not_found=True))
    return sorted(info.base_name for info in found if info.type == fs.FileType.Directory)


def arrow_filesystem(location: str):
    """pyarrow's file system of ``location`` (local, or ``s3://`` with delta-rs's AWS_* settings) and its path there."""
    from pyarrow import fs

    if not location_scheme(location):
        return fs.LocalFileSystem(), str(Path(location).absolute())
    # pyarrow reads the credentials from the environment itself, but not an endpoint other than AWS's (below).
    options: dict[str, Any] = {"region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")}
    if endpoint := os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        scheme, _, host = endpoint.rpartition("://")
        options.update(endpoint_override=host.rstrip("/"), scheme=scheme or "https")
    return fs.S3FileSystem(**options), location.split("://", 1)[1].rstrip("/")


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
    """A SQL timestamp literal of epoch milliseconds in UTC (a literal, so Delta can skip files by their statistics)."""
    instant = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return f"TIMESTAMP '{instant.isoformat(timespec='milliseconds')}'"


# -- one log read per use, within an epoch --------------------------------------------------

# The tables a `one_epoch_of_tables` scope has opened, by thread (a task run with the scope's context must not refresh
# an object another thread holds between its check and its commit) and path; None outside a scope.
_OPENED: ContextVar[dict[tuple[int, str], DeltaTable] | None] = ContextVar("ipcount_opened_tables",
                                                                            default=None)


@contextmanager
def one_epoch_of_tables() -> Iterator[None]:
    """A scope (one epoch's run) in which each table is loaded once and then refreshed for every later use
    (:func:`latest`): a load replays the log from its last checkpoint, a refresh reads only the commits since. Nested
    scopes share the outer one's tables; other threads load their own. A table deleted and created again at the same
    path within the scope is not told apart (replace tables only with the pipeline paused: docs/backfill.md)."""
    if _OPENED.get() is not None:
        yield
        return
    token = _OPENED.set({})
    try:
        yield
    finally:
        _OPENED.reset(token)


def latest(path: str) -> DeltaTable:
    """The Delta table at ``path`` at its latest version (``TableNotFoundError`` if none). Inside
    :func:`one_epoch_of_tables` the object is the scope's, which the next ``latest(path)`` refreshes."""
    from deltalake import DeltaTable

    opened, key = _OPENED.get(), (threading.get_ident(), path)
    table = opened.get(key) if opened is not None else None
    if table is not None:
        table.update_incremental()
        return table
    table = DeltaTable(path)
    if opened is not None:
        opened[key] = table
    return table


def _forget(path: str, table: DeltaTable | None = None) -> None:
    """Drop this thread's object of ``path`` from the scope, or make it ``table``."""
    if (opened := _OPENED.get()) is not None:
        opened.pop((threading.get_ident(), path), None)
        if table is not None:
            opened[(threading.get_ident(), path)] = table


# -- reads with delta-rs -------------------------------------------------------------------

def open_table(path: str):
    """The Delta table at ``path`` at its latest version (:func:`latest`), or None if there is none."""
    from deltalake.exceptions import TableNotFoundError

    if not has_table(path):  # (a look at a directory, or a listing on object storage)
        _forget(path)
        return None
    try:
        return latest(path)
    except TableNotFoundError:
        return None


def query_table(table, sql: str) -> list[dict[str, Any]]:
    """Rows of ``sql`` over a loaded delta-rs ``table`` (named ``t``): a query of exactly that snapshot."""
    return query_arrow(table, sql).to_pylist()


def query_arrow(table, sql: str) -> pa.Table:
    """``sql`` over a loaded delta-rs ``table`` (named ``t``), as Arrow, through delta-rs's query engine: the pyarrow
    dataset path (``to_pyarrow_table``) aborts short-lived processes at exit (delta-rs issue 2184)."""
    import pyarrow as pa
    from deltalake import QueryBuilder

    return pa.table(QueryBuilder().register("t", table).execute(sql).read_all())


def read_rows(path: str, columns: Iterable[str] | None = None,
              filters: Iterable[tuple[str, str, Any]] | None = None) -> list[dict[str, Any]]:
    """Rows of the Delta table at ``path`` ([] if none), optionally some columns of the rows matching every
    ``(column, op, value)`` filter."""
    table = open_table(path)
    if table is None:
        return []
    columns = list(columns or [])
    select = ", ".join(sql_identifier(c) for c in columns) if columns else "*"
    where = " AND ".join(f"{sql_identifier(c)} {sql_operator(op)} {sql_literal(v)}" for c, op, v in (filters or []))
    return query_table(table, f"SELECT {select} FROM t" + (f" WHERE {where}" if where else ""))


class DeltaReader:
    """Delta tables by path for a long-lived reader (the monitoring pages): each opened once and refreshed at most every
    ``refresh_seconds``, SQL answers cached per (path, version, query) up to ``cache_bytes`` (least recently used out
    first). Queries run outside any lock, on the snapshot their key names: a long scan holds up no other page."""

    CACHE_BYTES = 64 << 20

    def __init__(self, refresh_seconds: float = 1.0, cache_bytes: int = CACHE_BYTES) -> None:
        self.refresh_seconds, self.cache_bytes = refresh_seconds, cache_bytes
        self._tables: dict[str, tuple[Any, float]] = {}
        self._table_locks: dict[str, threading.Lock] = {}
        self._answers: OrderedDict[tuple[str, int, str], tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the answers and the table locks: held for no I/O

    def _path_lock(self, path: str) -> threading.Lock:
        with self._lock:
            return self._table_locks.setdefault(path, threading.Lock())

    def _refreshed(self, path: str):
        """The table at ``path``, refreshed if due (None if there is none); under its path lock."""
        now = time.monotonic()
        table, checked = self._tables.get(path, (None, now))
        if table is None:
            table = open_table(path)
            if table is None:
                return None
        elif now - checked >= self.refresh_seconds:
            table.update_incremental()
        else:
            return table
        self._tables[path] = (table, now)
        return table

    def _snapshot(self, path: str):
        """(version, a query builder over that version) of the table at ``path``, or None if there is no table yet. A
        path's open and refresh (a log read) hold only its own lock."""
        from deltalake import QueryBuilder

        with self._path_lock(path):
            table = self._refreshed(path)
            if table is None:
                return None
            # The builder copies this snapshot: a refresh while the query runs changes nothing it reads.
            return table.version(), QueryBuilder().register("t", table)

    def computed(self, path: str, name: str, compute: Callable[[Any], T], size: int = 64 << 10) -> T | None:
        """``compute(table)`` over the table at ``path`` (None if there is none), kept like a query's answer as ``size``
        bytes. It runs under the path's lock: no refresh moves the table meanwhile."""
        with self._path_lock(path):
            table = self._refreshed(path)
            if table is None:
                return None
            key = (path, table.version(), "#" + name)
            with self._lock:
                if key in self._answers:
                    self._answers.move_to_end(key)
                    return self._answers[key][0]
            value = compute(table)
        self._keep(key, value, size)
        return value

    def _keep(self, key: tuple[str, int, str], value: Any, size: int) -> None:
        with self._lock:
            if key not in self._answers:  # (unless an identical query came first)
                self._answers[key] = (value, size)
                self._bytes += size
            while self._bytes > self.cache_bytes:
                self._bytes -= self._answers.popitem(last=False)[1][1]

    def query(self, path: str, sql: str, cache: bool = True) -> list[dict[str, Any]]:
        """Rows of ``sql`` over the table at ``path`` (``t``; [] if there is none), kept unless ``cache`` is False."""
        import pyarrow as pa

        snapshot = self._snapshot(path)
        if snapshot is None:
            return []
        version, builder = snapshot
        key = (path, version, sql)
        with self._lock:
            if key in self._answers:
                self._answers.move_to_end(key)
                return self._answers[key][0]
        rows = pa.table(builder.execute(sql).read_all()).to_pylist()
        size = self._size(rows)
        if cache and size <= self.cache_bytes:
            self._keep(key, rows, size)
        return rows

    @staticmethod
    def _size(rows: list[dict[str, Any]]) -> int:
        """Bytes of ``rows`` in memory, roughly (a value shared by rows is counted for each)."""
        from sys import getsizeof

        def size(value: Any) -> int:
            if isinstance(value, dict):
                return getsizeof(value) + sum(map(size, value.values()))
            if isinstance(value, (list, tuple)):
                return getsizeof(value) + sum(map(size, value))
            return getsizeof(value)
        return size(rows)


def table_metadata(path: str) -> tuple[str, dict[str, str]]:
    """(Delta table id, table properties) of the table at ``path``, from its log."""
    metadata = latest(path).metadata()
    return metadata.id, dict(metadata.configuration)


def commit_infos(path: str, first: int, attempts: int = 5,
                 load: Callable[[], DeltaTable] | None = None) -> dict[int, dict[str, Any]] | None:
    """The commit infos of the table's versions from ``first`` to its latest, by version (those the log no longer holds
    missing); None if commits kept landing while it read. delta-rs's ``history(n)`` numbers what it lists down from the
    snapshot's version but lists the log with no upper bound, so a listing counts only if no commit came before it was
    checked. ``load`` gives the table (by default objects of its own, not the epoch scope's, which :func:`latest`
    moves). A commit without commit info would shift the older ones: callers take a missing version as unknown."""
    from deltalake import DeltaTable

    load = load or (lambda: DeltaTable(path))
    for _ in range(attempts):
        table = load()
        version = table.version()
        if first > version:
            return {}
        listed = table.history(version - first + 1)
        if load().version() == version:
            return {h["version"]: h for h in listed if h["version"] >= first}
    return None


def version_with_metadata(path: str, user_metadata: str, search: int = 50) -> int | None:
    """The version among the last ``search`` whose commit info carries ``user_metadata`` (None if none, or unknown)."""
    infos = commit_infos(path, max(0, latest(path).version() - search + 1), load=lambda: latest(path)) or {}
    return next((v for v, h in sorted(infos.items(), reverse=True) if h.get("userMetadata") == user_metadata), None)


# -- the tables delta-rs writes ------------------------------------------------------------

_ARROW_TYPES = ("bigint", "int", "string", "double", "timestamp", "boolean", "binary", "map<string,double>")


def arrow_schema(columns: Iterable[tuple[str, str, bool]]):
    """An Arrow schema from (name, Spark SQL type, nullable) columns, typed as Spark would (timestamps in us, UTC)."""
    import pyarrow as pa

    types = dict(zip(_ARROW_TYPES, (pa.int64(), pa.int32(), pa.string(), pa.float64(), pa.timestamp("us", tz="UTC"),
                                    pa.bool_(), pa.binary(), pa.map_(pa.string(), pa.float64()))))
    return pa.schema([pa.field(name, types[kind], nullable) for name, kind, nullable in columns])


def rs_concurrent_errors() -> tuple[type[BaseException], ...]:
    """delta-rs's refusal of a commit that lost to a concurrent one."""
    from deltalake.exceptions import CommitFailedError

    return (CommitFailedError,)


# A checkpoint every 10 commits, not delta-rs's default 100: every epoch loads each of its tables, replaying the commits
# since the last checkpoint (docs/performance.md).
CHECKPOINT_EVERY = {"delta.checkpointInterval": "10"}


def _cannot_make_directory(error: BaseException) -> bool:
    """Whether delta-rs failed to make a local table's directory (no parent, no permission, a read-only file system)."""
    import errno

    if isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT,
                                                      errno.ENOTDIR):
        return True
    return "Could not create local directory" in str(error)


def rs_create_table(path: str, schema, properties: Mapping[str, str] | None = None,
                    partition_by: list[str] | None = None) -> None:
    """Create an empty Delta table at ``path`` with delta-rs (with :data:`CHECKPOINT_EVERY`) unless one is there; one
    made by an older version (delta-spark's included) gets the (nullable) columns and the table properties it lacks, and
    keeps its partitioning. Of concurrent creators one wins version 0 (put-if-absent, like :func:`rs_commit_once`'s
    commits) and the others find its table; what a creator killed before its commit left behind is no table, and is
    created over."""
    from deltalake import CommitProperties, DeltaTable, Schema
    from deltalake.exceptions import DeltaError, TableNotFoundError

    properties = {**CHECKPOINT_EVERY, **(properties or {})}
    table = open_table(path)
    if table is None:
        try:
            # No retry: a retried creation would commit a new table on top of the winner's.
            created = DeltaTable.create(path, schema=schema, mode="error", configuration=properties or None,
                                        partition_by=partition_by,
                                        commit_properties=CommitProperties(max_commit_retries=0))
            _forget(path, created)
            return
        except (DeltaError, TableNotFoundError, OSError) as e:
            table = open_table(path)
            if table is None:
                if location_scheme(path) and isinstance(e, OSError):
                    raise StorageUnavailableError(_object_storage_problem(path, e)) from e
                if not location_scheme(path) and _cannot_make_directory(e):
                    raise ConfigError(f"cannot make a table at {path}: {' '.join(str(e).split())[:200]} (check "
                                      "warehouse and the *_table settings)") from e
                raise
            log.info("%s was created by a concurrent run (%s)", path, first_line(e))
    have = {f.name for f in table.schema().fields}
    missing = [f for f in schema if f.name not in have]
    if missing:
        import pyarrow as pa

        log.info("adding columns %s to %s", ", ".join(f.name for f in missing), path)
        retry_on_conflict(lambda: latest(path).alter.add_columns(Schema.from_arrow(pa.schema(missing)).fields),
                          f"adding columns to {path}")
    config = table.metadata().configuration
    stale = {k: v for k, v in properties.items() if config.get(k) != v}
    if stale:
        log.info("setting %s on %s", ", ".join(f"{k}={v}" for k, v in sorted(stale.items())), path)
        retry_on_conflict(lambda: latest(path).alter.set_table_properties(stale, raise_if_not_exists=False),
                          f"setting table properties of {path}")


def rs_commit_once(path: str, app_id: str, version: int, user_metadata: str,
                   commit: Callable[[DeltaTable, CommitProperties], bool | None], attempts: int = 20,
                   markers: Callable[[int], Mapping[str, int]] | None = None,
                   floor: str | None = None) -> int | None:
    """Make one commit to the table at ``path`` recording Delta's transaction (``app_id``, ``version``), unless the
    table holds it at that version or later (an earlier attempt's commit, a fence) or the transaction ``floor`` at
    ``version`` or later (:meth:`ipcount.storage.sink.Sink.retire`): Delta's idempotent write.
    ``commit(table, properties)`` writes to the snapshot ``table`` (False: nothing to commit). Returns the version
    committed, or None.

    The check and the commit are one step: the commit is exactly the next version of the snapshot checked, with no
    retry, and the log store creates it only if absent - put-if-absent across processes, locally and on object storage
    (delta-spark's log store makes it so only within one JVM, which is why delta-rs makes every commit of the pipeline).
    A concurrent commit, perhaps the same epoch's from another runner, sends this one back to check again.
    ``markers(version)`` may name more transactions (app id -> version) for the same commit: facts the table keeps
    through checkpoints, where commit infos are not kept."""
    from deltalake import CommitProperties, Transaction

    def attempt() -> int | None:
        table = latest(path)
        done = max((v for v in (table.transaction_version(app_id), floor and table.transaction_version(floor))
                    if v is not None), default=None)
        if done is not None and done >= version:
            return None
        at = table.version() + 1
        extra = [Transaction(a, v) for a, v in (markers(at) if markers else {}).items()]
        committed = commit(table, CommitProperties(custom_metadata={"userMetadata": user_metadata},
                                                   max_commit_retries=0,
                                                   app_transactions=[Transaction(app_id, version), *extra]))
        return None if committed is False else at
    return retrying(attempt, rs_concurrent_errors(), f"{path}: a concurrent commit came first", attempts,
                    pause=commit_race_pause, again="checking again",
                    gave_up=lambda: CommitContention(f"could not commit to {path} after {attempts} attempts: other "
                                                     "writers kept committing first. Nothing of this commit was "
                                                     "written; run the command again"))


def rs_append_once(path: str, data, app_id: str, version: int, user_metadata: str,
                   markers: Callable[[int], Mapping[str, int]] | None = None, floor: str | None = None) -> int | None:
    """Append ``data`` (Arrow) once per transaction (:func:`rs_commit_once`), with the columns of the snapshot it
    follows (:func:`with_table_columns`)."""
    from deltalake import write_deltalake

    return rs_commit_once(path, app_id, version, user_metadata, lambda table, properties: write_deltalake(
        table, with_table_columns(data, table), mode="append", commit_properties=properties), markers=markers,
        floor=floor)


def with_table_columns(data, table):
    """``data`` (Arrow) with the columns of the snapshot ``table`` it lacks (a newer version's), all nulls, in the
    table's order: delta-rs refuses an append with fewer columns than the table, even an empty one."""
    import pyarrow as pa

    if data.num_rows:
        check_fillable(table, data.column_names)
    schema = pa.schema(table.schema().to_arrow())
    missing = [f for f in schema if f.name not in data.column_names]
    for f in missing:
        data = data.append_column(f.name, pa.nulls(data.num_rows, f.type))
    return data.select(schema.names) if missing else data


def check_fillable(table, known: Iterable[str]) -> None:
    """Refuse to write rows to ``table`` if it has a NOT NULL column besides ``known`` (a newer version's), which this
    version cannot fill."""
    names = set(known)
    required = [f.name for f in table.schema().fields if f.name not in names and not f.nullable]
    if required:
        raise ConfigError(f"{table.table_uri} has column(s) {', '.join(required)} that a newer version of the "
                          "pipeline added as NOT NULL, which this version cannot fill, so it wrote nothing there: "
                          "run the newer version")


def commit_race_pause(attempt: int) -> float:
    """Seconds to wait after a concurrent writer won the ``attempt``-th commit race: short, growing, at most one."""
    return min(0.05 * attempt, 1.0)


def retry_on_conflict(action: Callable[[], T], what: str, attempts: int = 10) -> T:
    """Run a delta-rs write, again if a concurrent writer's commit came first (:func:`rs_concurrent_errors`). Only for
    writes that are idempotent (a Delta transaction id, or MERGEs matching planned rows)."""
    return retrying(action, rs_concurrent_errors(), f"{what}: concurrent commit", attempts)


def conform(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """``rows`` with exactly the columns, order and Arrow types of ``schema``: Spark's and DataFusion's answers differ
    from the tables' in details (nullability, time zones)."""
    import pyarrow as pa

    return pa.table([rows.column(f.name).cast(f.type) for f in schema], schema=schema)
