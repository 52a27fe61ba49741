"""Data files that Spark's executors write into a Delta table's location, and read from it.

An epoch too large for one process (:data:`ipcount.rules.config.PipelineConfig.max_driver_tally_rows`) has its rows
written where they are computed: each Spark task writes Parquet files straight into the table's (partition) directories,
as delta-rs lays them out, and hands back one row per file - its path, size, partition values and statistics. Only that
metadata reaches the process that commits the files with delta-rs (:func:`add_actions`,
:func:`ipcount.storage.delta.rs_commit_once`), and no row of the epoch passes through it.

A file no commit names is not part of the table: an attempt that dies (or loses its commit) leaves files no reader sees,
which vacuum removes once older than its retention. The writers use pyarrow's file systems, which read the same
``AWS_*`` variables as delta-rs: executors need no Hadoop connector, only access to the tables' location.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from ipcount.rules.config import location_scheme
from ipcount.rules.errors import ConfigError
from ipcount.rules.file_stats import FileStats, partition_path, partition_text
from ipcount.storage.delta import arrow_filesystem, conform

if TYPE_CHECKING:
    import pyarrow as pa
    from deltalake.transaction import AddAction, RemoveAction
    from pyspark.sql import DataFrame, SparkSession

# Rows per Parquet row group the writers make (fewer at a file's end, or where the rows buffered for one reach
# ROW_GROUP_BYTES first: dead letters keep values of up to 64 KiB).
ROW_GROUP_ROWS = 131_072
ROW_GROUP_BYTES = 64 * 2**20
# What a writing task returns per file.
WRITTEN_FILE_SCHEMA = "path string, size long, partition_values string, records long, stats string"


@dataclass(frozen=True)
class WrittenFile:
    """A data file written into a table's location, not yet committed."""

    path: str                                 # relative to the table's root
    size: int
    partition_values: Mapping[str, str | None]
    records: int
    stats: str                                # Delta's statistics JSON (:mod:`ipcount.rules.file_stats`)


@dataclass(frozen=True)
class TableFile:
    """A live file of a table snapshot: what a commit that replaces it must name."""

    path: str
    size: int
    partition_values: Mapping[str, str | None]
    bounds: tuple[Any, Any] | None = None  # a column's minimum and maximum, if asked for and recorded


def write_files(rows: DataFrame, location: str, schema: pa.Schema, partition_by: Sequence[str] = (),
                tag: str = "part") -> list[WrittenFile]:
    """Have Spark's tasks write ``rows`` as Parquet files (``<tag>-<uuid>``, one per task and partition value) into the
    table at ``location``: ``schema`` is the files' (the table's columns but ``partition_by``). Returns the files
    written, each checked to be there as this process sees the location (else :class:`ConfigError`)."""
    location = absolute_location(location)
    written = rows.mapInArrow(_file_writer(location, schema.serialize().to_pybytes(), tuple(partition_by), tag),
                              WRITTEN_FILE_SCHEMA).collect()
    files = [WrittenFile(r["path"], r["size"], json.loads(r["partition_values"]), r["records"], r["stats"])
             for r in written]
    _check_written(location, files)
    return files


def absolute_location(location: str) -> str:
    """``location`` as every process reads it (an executor's working directory is not this process's)."""
    return location if location_scheme(location) else str(Path(location).absolute())


def all_present(location: str, files: Sequence[WrittenFile]) -> bool:
    """Whether each of ``files`` is still at ``location`` with its size (a full vacuum deletes uncommitted files)."""
    try:
        _check_written(absolute_location(location), files)
        return True
    except ConfigError:
        return False


def _check_written(location: str, files: Sequence[WrittenFile]) -> None:
    """That each file is at ``location`` with its size, as this process reaches the location."""
    from pyarrow import fs as pafs

    if not files:
        return
    store, root = arrow_filesystem(location)
    found = store.get_file_info([f"{root}/{f.path}" for f in files])
    wrong = [f.path for f, info in zip(files, found) if info.type != pafs.FileType.File or info.size != f.size]
    if wrong:
        raise ConfigError(f"Spark's executors wrote {len(wrong)} file(s) that this process does not find at "
                          f"{location} as written (first: {wrong[0]}): the executors must reach the tables' "
                          "location as this process does (the same file system, or the same AWS_* settings for "
                          "object storage). Nothing was committed")


def read_files(spark: SparkSession, location: str, files: Sequence[TableFile], schema: pa.Schema,
               spark_schema: str, tasks: int, with_path: bool = False) -> DataFrame:
    """The rows of ``files`` of the table at ``location``, read by at most ``tasks`` Spark tasks, as a DataFrame of
    ``spark_schema`` (``schema``: the table's columns in Arrow; partition columns from the files' partition values).
    ``with_path``: each row also names its file (``_file``, the last column of ``spark_schema``)."""
    import pyspark.sql.types as T

    location = absolute_location(location)
    listing = spark.createDataFrame([(f.path, json.dumps(dict(f.partition_values))) for f in files],
                                    T.StructType([T.StructField("path", T.StringType(), False),
                                                  T.StructField("partition_values", T.StringType(), False)]))
    reader = _file_reader(location, schema.serialize().to_pybytes(), with_path)
    return listing.repartition(max(1, min(tasks, len(files)))).mapInArrow(reader, spark_schema)


def add_actions(files: Sequence[WrittenFile]) -> list[AddAction]:
    from deltalake.transaction import AddAction

    now = int(time.time() * 1000)
    return [AddAction(f.path, f.size, dict(f.partition_values), now, True, f.stats) for f in files]


def remove_actions(files: Sequence[TableFile]) -> list[RemoveAction]:
    from deltalake.transaction import RemoveAction

    now = int(time.time() * 1000)
    return [RemoveAction(f.path, True, now, f.size, dict(f.partition_values)) for f in files]


def live_files(table, bounds_of: str | None = None) -> list[TableFile]:
    """The live files of the delta-rs snapshot ``table`` (from its file list: no data is read), with the statistics'
    minimum and maximum of the column ``bounds_of``."""
    import pyarrow as pa

    actions = pa.table(table.get_add_actions(flatten=True))
    columns = [c for c in actions.column_names if c.startswith("partition.")]
    stats = [f"min.{bounds_of}", f"max.{bounds_of}"] if bounds_of else []
    stats = stats if all(s in actions.column_names for s in stats) else []
    out = []
    for row in actions.select(["path", "size_bytes", *columns, *stats]).to_pylist():
        values = {c.removeprefix("partition."): partition_text(row[c]) for c in columns}
        low, high = (row[s] for s in stats) if stats else (None, None)
        out.append(TableFile(row["path"], row["size_bytes"], values,
                             (low, high) if low is not None and high is not None else None))
    return out


# -- what runs in Spark's tasks (pickled by reference: the package is on the executors) -----

def _file_writer(location: str, schema_bytes: bytes, partition_by: tuple[str, ...], tag: str):
    def write(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
        fs, root = arrow_filesystem(location)
        open_files: dict[tuple, tuple[Any, Any, str, FileStats]] = {}
        pending: dict[tuple, list[Any]] = {}  # rows not yet written, per file

        def flush(key: tuple, whole_groups: bool = False) -> None:
            """Write the file's pending rows (only whole row groups of them if ``whole_groups``)."""
            data = pa.concat_tables(pending.pop(key))
            rows = data.num_rows - data.num_rows % ROW_GROUP_ROWS if whole_groups else data.num_rows
            if rows < data.num_rows:
                pending[key] = [data.slice(rows)]
            data = data.slice(0, rows)
            writer, _, _, stats = open_files[key]
            writer.write_table(data, row_group_size=ROW_GROUP_ROWS)
            stats.add(data.num_rows, _column_stats(data, pc))

        for batch in batches:
            if not batch.num_rows:
                continue
            table = pa.Table.from_batches([batch])
            for key, part in _split(table, partition_by):
                if key not in open_files:
                    values = {c: partition_text(v) for c, v in zip(partition_by, key)}
                    directory = partition_path(values)
                    relative = "/".join(filter(None, (directory, f"{tag}-{uuid.uuid4().hex}.parquet")))
                    if fs.type_name == "local":  # (on object storage a directory is only a marker object)
                        fs.create_dir(f"{root}/{directory}" if directory else root, recursive=True)
                    stream = fs.open_output_stream(f"{root}/{relative}")
                    open_files[key] = (pq.ParquetWriter(stream, schema, compression="snappy"), stream, relative,
                                       FileStats())
                # Spark's Arrow batches are small: a row group of each would make files slow to read.
                rows = pending.setdefault(key, [])
                rows.append(conform(part, schema))
                if sum(t.nbytes for t in rows) >= ROW_GROUP_BYTES:
                    flush(key)
                elif sum(t.num_rows for t in rows) >= ROW_GROUP_ROWS:
                    flush(key, whole_groups=True)
        for key, (writer, stream, relative, stats) in open_files.items():
            if key in pending:
                flush(key)
            writer.close()
            stream.close()
            size = fs.get_file_info(f"{root}/{relative}").size
            values = {c: partition_text(v) for c, v in zip(partition_by, key)}
            yield pa.RecordBatch.from_pylist([{"path": relative, "size": size, "partition_values": json.dumps(values),
                                               "records": stats.records, "stats": stats.json()}])
    return write


def _split(table, partition_by: tuple[str, ...]):
    """(partition key, rows) of each partition value in ``table``."""
    if not partition_by:
        yield (), table
        return
    import pyarrow.compute as pc

    keys = table.select(list(partition_by)).group_by(list(partition_by)).aggregate([]).to_pylist()
    for key in keys:
        mask = None
        for column in partition_by:
            value = key[column]
            match = pc.is_null(table[column]) if value is None else pc.equal(table[column], value)
            mask = match if mask is None else pc.and_(mask, match)
        yield tuple(key[c] for c in partition_by), table.filter(mask)


def _column_stats(data, pc) -> Iterator[tuple[str, Any, Any, int]]:
    import pyarrow as pa

    for name in data.column_names:
        column = data[name]
        if pa.types.is_binary(column.type) or pa.types.is_nested(column.type):
            continue
        kind = column.type
        # Bounds only where they come out as Delta spells them (not a decimal, date or float, say); the others keep
        # their null count, and are never skipped by.
        if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_timestamp(kind) or pa.types.is_boolean(kind)):
            yield name, None, None, column.null_count
            continue
        bounds = pc.min_max(column)
        yield name, bounds["min"].as_py(), bounds["max"].as_py(), column.null_count


def _file_reader(location: str, schema_bytes: bytes, with_path: bool):
    def read(listings: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
        out_schema = schema.append(pa.field("_file", pa.string(), False)) if with_path else schema
        fs, root = arrow_filesystem(location)
        for listing in listings:
            for path, values in zip(listing["path"].to_pylist(), listing["partition_values"].to_pylist()):
                values = json.loads(values)
                with fs.open_input_file(f"{root}/{path}") as source:
                    for batch in pq.ParquetFile(source).iter_batches(batch_size=65536):
                        columns = []
                        for f in schema:
                            if f.name in values:
                                columns.append(_constant(values[f.name], f.type, batch.num_rows))
                            elif f.name in batch.schema.names:
                                columns.append(batch.column(f.name).cast(f.type))
                            else:  # a column the file predates
                                columns.append(pa.nulls(batch.num_rows, f.type))
                        if with_path:
                            columns.append(pa.array([path] * batch.num_rows, pa.string()))
                        yield pa.RecordBatch.from_arrays(columns, schema=out_schema)
    return read


def _constant(text: str | None, arrow_type, rows: int):
    import pyarrow as pa

    if text is None:
        return pa.nulls(rows, arrow_type)
    value: Any = text == "true" if pa.types.is_boolean(arrow_type) else text
    return pa.array([value] * rows, arrow_type) if rows else pa.array([], arrow_type)
