"""What a writing task of Spark's executors leaves in a table's location (run here, on Arrow batches)."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ipcount.storage import table_files


@pytest.mark.parametrize(("group_rows", "group_bytes", "groups"), [
    (12, 2**20, [12, 12, 11]),  # whole row groups, what is left of the rows at the end
    (12, 1, [5] * 7),           # rows buffered past the byte limit: each batch's five written at once
])
def test_a_file_holds_its_partitions_rows_in_row_groups_of_many_batches(tmp_path, monkeypatch, group_rows,
                                                                        group_bytes, groups):
    monkeypatch.setattr(table_files, "ROW_GROUP_ROWS", group_rows)
    monkeypatch.setattr(table_files, "ROW_GROUP_BYTES", group_bytes)
    schema = pa.schema([("n", pa.int64())])
    # Seven batches of ten rows, as Spark hands them over; each row's day alternates: five
    # rows of each file a batch.
    batches = [pa.RecordBatch.from_pydict({"n": list(range(b * 10, b * 10 + 10)),
                                           "day": ["d1" if n % 2 else "d0" for n in range(b * 10, b * 10 + 10)]})
               for b in range(7)]
    write = table_files._file_writer(str(tmp_path), schema.serialize().to_pybytes(), ("day",), "epoch-1")
    files = [row for batch in write(iter(batches)) for row in batch.to_pylist()]

    assert sorted(json.loads(f["partition_values"])["day"] for f in files) == ["d0", "d1"]
    for f in files:
        day = json.loads(f["partition_values"])["day"]
        parquet = pq.ParquetFile(tmp_path / f["path"])
        assert f["path"].startswith(f"day={day}/epoch-1-") and f["records"] == 35
        assert f["size"] == (tmp_path / f["path"]).stat().st_size
        assert [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)] == groups
        expected = [n for n in range(70) if (n % 2 == 1) == (day == "d1")]
        assert parquet.read().column("n").to_pylist() == expected
        assert json.loads(f["stats"])["numRecords"] == 35


def test_a_file_of_columns_a_newer_version_added_gets_stats_delta_reads(tmp_path):
    """A counts table may carry a newer version's columns of any type through the executors'
    merge: bounds are recorded for the types Delta spells as this writer does (integers,
    strings, timestamps, booleans) and only null counts for the rest (decimals and dates,
    which JSON cannot hold as they come; floats, whose NaN would make wrong bounds)."""
    from datetime import date, datetime, timezone
    from decimal import Decimal

    schema = pa.schema([("n", pa.int64()), ("s", pa.string()), ("t", pa.timestamp("us", tz="UTC")),
                        ("b", pa.bool_()), ("price", pa.decimal128(10, 2)), ("seen", pa.date32()),
                        ("x", pa.float64())])
    batch = pa.RecordBatch.from_pydict({
        "n": [2, 1], "s": ["b", "a"], "t": [datetime(2026, 11, 21, 10, tzinfo=timezone.utc)] * 2,
        "b": [True, False], "price": [Decimal("1.50"), None], "seen": [date(2026, 11, 21), None],
        "x": [1.0, float("nan")]}, schema=schema)
    write = table_files._file_writer(str(tmp_path), schema.serialize().to_pybytes(), (), "epoch-1")
    (row,) = [r for out in write(iter([batch])) for r in out.to_pylist()]
    stats = json.loads(row["stats"])
    assert stats["minValues"] == {"n": 1, "s": "a", "t": "2026-11-21T10:00:00.000000Z", "b": False}
    assert stats["maxValues"] == {"n": 2, "s": "b", "t": "2026-11-21T10:00:00.000000Z", "b": True}
    assert stats["nullCount"] == {"n": 0, "s": 0, "t": 0, "b": 0, "price": 1, "seen": 1, "x": 0}
