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
