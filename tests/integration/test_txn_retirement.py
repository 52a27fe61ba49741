"""Maintenance retires the sink tables' transactions of final epochs under a floor: a table
keeps a bounded number of them, and an epoch's write is skipped whether its transaction is
there or retired (delta-rs only: no broker, no JVM)."""
from __future__ import annotations

import time
from datetime import datetime, timezone

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import EpochFenced, TableSetMismatch
from ipcount.rules.ledger import BACKFILL, EpochPlan, PartitionMetrics
from ipcount.rules.offsets import OffsetRange
from ipcount.storage import tableset
from ipcount.storage.delta import arrow_schema
from ipcount.storage.ledger import Ledger
from ipcount.storage.maintenance import maintain
from ipcount.storage.sink import COUNTS_COLUMNS, DEAD_LETTER_COLUMNS, LATE_COLUMNS, Sink
from tests.tables import counts, dead_letters, late_records

T0 = datetime(2026, 11, 21, 10, tzinfo=timezone.utc)


@pytest.fixture
def tables(tmp_path):
    cfg = PipelineConfig(warehouse=str(tmp_path / "w"), pipeline_id="p", topic="t")
    Sink(cfg).ensure()
    Ledger(cfg.ledger_path).ensure()
    return cfg, Sink(cfg), Ledger(cfg.ledger_path)


def plan(k: int, kind: str = "scheduled") -> EpochPlan:
    return EpochPlan(k, (OffsetRange("t", 0, 10 * (k - 1), 10 * k),), kind=kind,
                     request_id="r" if kind == BACKFILL else None)


def rows_of(k: int) -> tuple[pa.Table, pa.Table, pa.Table]:
    """Epoch ``k``'s counts (two clients in its own window), a dead letter and a late record."""
    start = pa.scalar(T0.timestamp() * 1e6 + k * 5e6, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    end = pa.scalar(T0.timestamp() * 1e6 + (k + 1) * 5e6, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    window = {"window_start": [start] * 2, "window_end": [end] * 2}
    counted = pa.table({**window, "ip": ["10.0.0.1", "10.0.0.2"], "count": pa.array([k, 1], pa.int64())})
    record = {"epoch": [k], "topic": ["t"], "partition": [0], "offset": [10 * (k - 1)]}
    dead = pa.table({**record, "kafka_timestamp": [start], "key": [None], "value": [b"x"], "reason": ["not_json"],
                     "value_bytes": [1], "value_sha256": ["00"]}, schema=arrow_schema(DEAD_LETTER_COLUMNS))
    late = pa.table({**record, "ip": ["10.0.0.3"], "event_time": [start], "window_start": [start],
                     "window_end": [end], "watermark": [end]}, schema=arrow_schema(LATE_COLUMNS))
    return counted, dead, late


def run(sink: Sink, ledger: Ledger, k: int, kind: str = "scheduled", commit: bool = True) -> int | None:
    p = plan(k, kind)
    ledger.record_plan(p, "r")
    version = sink.write(p, *rows_of(k), watermark_after_ms=None)
    if commit:
        ledger.commit(p, {0: PartitionMetrics(10, 2)}, None, version, 0.1, "r")
    return version


def checkpoint_txns(path: str) -> list[str]:
    from pathlib import Path

    import pyarrow.parquet as pq

    log = Path(path) / "_delta_log"
    newest = max(log.glob("*.checkpoint.parquet"), key=lambda f: f.name)
    return sorted(t["appId"] for t in pq.read_table(newest, columns=["txn"]).column("txn").to_pylist() if t)


def test_retired_epochs_are_skipped_and_leave_the_checkpoints(tables):
    cfg, sink, ledger = tables
    for k in range(1, 31):
        run(sink, ledger, k)
    open_version = run(sink, ledger, 31, commit=False)  # died after its sink writes: open in the ledger
    run(sink, ledger, 32, kind=BACKFILL)
    before = (counts(cfg), dead_letters(cfg), late_records(cfg))

    report = {t.table: t for t in maintain(cfg).tables}
    assert sink.floors() == {path: 30 for path in sink.paths()}
    assert "transactions retired through epoch 30" in report["counts"].notes
    assert any("retirement waits for epoch 31" in n for n in report["late_records"].notes)
    # what the checkpoints keep: the floor, and the transactions of the epochs above it
    assert checkpoint_txns(cfg.counts_path) == [
        "p/epoch-31", "p/epoch-31/counts-version", "p/epoch-32", "p/epoch-32/counts-version", "p/retired-through"]
    assert checkpoint_txns(cfg.late_path) == ["p/epoch-31", "p/epoch-32", "p/retired-through"]
    assert report["counts"].transactions == 5 and report["ledger"].transactions == 1  # (the ledger's summary)

    # a stray runner of a retired epoch writes nothing, and says why
    with pytest.raises(EpochFenced, match="epoch 5 is final in the ledger and retired"):
        sink.write(plan(5), *rows_of(5), watermark_after_ms=None)
    # the open epoch's resume finds its own commit, above the floor
    assert sink.write(plan(31), *rows_of(31), watermark_after_ms=None) == open_version
    assert (counts(cfg), dead_letters(cfg), late_records(cfg)) == before
    ledger.commit(plan(31), None, None, open_version, 0.1, "r")

    maintain(cfg)
    assert sink.floors() == {path: 32 for path in sink.paths()}
    assert checkpoint_txns(cfg.counts_path) == ["p/retired-through"]
    assert sink.epoch_commit(31).retired and sink.epoch_commit(33) is None
    versions = {path: DeltaTable(path).version() for path in sink.paths()}
    sink.fence(32)  # a settling run's fence of a retired epoch: nothing to write
    with pytest.raises(EpochFenced):
        sink.write(plan(32, BACKFILL), *rows_of(32), watermark_after_ms=None)
    assert {path: DeltaTable(path).version() for path in sink.paths()} == versions
    assert (counts(cfg), dead_letters(cfg), late_records(cfg)) == before
    assert sum(counts(cfg).values()) == sum(k + 1 for k in range(1, 33))


def test_a_floor_never_goes_down(tables):
    cfg, sink, _ = tables
    assert sink.retire(20) == {path: 20 for path in sink.paths()}
    assert sink.retire(10) == {path: 20 for path in sink.paths()}  # a racing run's older view
    assert sink.floors() == {path: 20 for path in sink.paths()}


def test_a_retired_epoch_is_never_written_even_without_its_ledger(tables):
    cfg, sink, _ = tables
    sink.retire(20)
    with pytest.raises(EpochFenced):
        sink.write(plan(15), *rows_of(15), watermark_after_ms=None)
    assert counts(cfg) == {} and dead_letters(cfg) == set() and late_records(cfg) == set()
    assert sink.write(plan(21), *rows_of(21), watermark_after_ms=None) is not None  # above the floor: written


def test_a_retirement_of_a_long_history_takes_batches_that_each_raise_the_floor(tables, monkeypatch):
    from ipcount.storage import sink as sink_io

    cfg, sink, _ = tables
    monkeypatch.setattr(sink_io, "RETIRE_BATCH", 7)
    sink.retire(30)
    table = DeltaTable(cfg.late_path)
    retirements = [h for h in table.history() if (h.get("userMetadata") or "").startswith("retired epochs")]
    assert sorted(h["userMetadata"] for h in retirements) == sorted(
        f"retired epochs {a}..{min(a + 6, 30)}" for a in range(1, 31, 7))


def test_transactions_dated_by_delta_spark_do_not_expire(tables):
    cfg, sink, _ = tables
    long_ago = int(time.time() * 1000) - 400 * 86_400_000  # delta-spark dated the transactions it wrote
    write_deltalake(cfg.counts_path, arrow_schema(COUNTS_COLUMNS).empty_table(), mode="append",
                    commit_properties=CommitProperties(app_transactions=[Transaction("p/epoch-3", 3, long_ago)]))
    assert DeltaTable(cfg.counts_path).transaction_version("p/epoch-3") == 3
    assert DeltaTable(cfg.counts_path).metadata().configuration["delta.setTransactionRetentionDuration"] == \
        "interval 3650 days"


def test_a_bare_table_holding_only_a_floor_is_refused_beside_a_new_ledger(tmp_path):
    cfg = PipelineConfig(warehouse=str(tmp_path / "w"), pipeline_id="p", topic="t")
    Sink(cfg).ensure()
    Sink(cfg).retire(5)  # epochs 1..5 retired: a new ledger's epochs 1..5 would be skipped there
    Ledger(cfg.ledger_path).ensure()
    with pytest.raises(TableSetMismatch, match="the ledger .* is new"):
        tableset.claim(cfg)


def test_tables_a_newer_version_added_a_column_to_take_every_write(tables):
    """A newer version added a column to each table (as Sink.ensure adds its own) and filled
    it. This version's writes that append (side tables, an epoch that counted nothing, a
    fence, a retirement) carry the column as nulls; before, delta-rs refused them all, so the
    chain stopped at its first epoch that counted nothing."""
    from deltalake import Field, Schema

    cfg, sink, ledger = tables
    run(sink, ledger, 1)
    for path in sink.paths():
        DeltaTable(path).alter.add_columns(Schema([Field("source", "string", nullable=True)]).fields)
        DeltaTable(path).update(updates={"source": "'newer'"})
    run(sink, ledger, 2)                                         # counts merged, side rows appended
    p = plan(3)
    ledger.record_plan(p, "r")
    counted, dead, late = rows_of(3)
    assert sink.write(p, counted.slice(0, 0), dead, late, watermark_after_ms=None) is None  # nothing counted
    ledger.commit(p, {0: PartitionMetrics(10, 0)}, None, None, 0.1, "r")
    assert sink.epoch_commit(3) is not None
    sink.fence(4)
    assert sink.retire(3) == {path: 3 for path in sink.paths()}
    assert counts(cfg) == {(int((T0.timestamp() + k * 5) * 1000), ip): n for k in (1, 2)
                           for ip, n in (("10.0.0.1", k), ("10.0.0.2", 1))}
    assert dead_letters(cfg) == {(0, 10 * (k - 1), "not_json") for k in (1, 2, 3)}
    assert len(late_records(cfg)) == 3
    for path in sink.paths():  # epoch 1's rows keep the newer version's values; this version's rows have none
        sources = {r["source"] for r in DeltaTable(path).to_pyarrow_table(columns=["source"]).to_pylist()}
        assert sources == {"newer", None}, path


def test_a_column_a_newer_version_requires_is_refused_before_anything_is_written(tmp_path):
    """Tables a newer version created with a NOT NULL column of its own: this version cannot
    fill it, so each write with rows is refused with a ConfigError naming the column, before
    anything is written (before, the counts MERGE failed with delta-rs's "Invalid data", and
    the side tables' executor appends committed files the tables cannot be read with).
    Writes without rows (an epoch that counted nothing, a fence) still commit."""
    from ipcount.rules.errors import ConfigError
    from ipcount.storage.sink import COUNTS_PARTITION_BY

    cfg = PipelineConfig(warehouse=str(tmp_path / "w"), pipeline_id="p", topic="t")
    sink = Sink(cfg)
    for path, columns in sink.tables():
        partitions = list(COUNTS_PARTITION_BY) if path == cfg.counts_path else None
        DeltaTable.create(path, schema=arrow_schema(columns).append(pa.field("source", pa.string(), False)),
                          partition_by=partitions)
    sink.ensure()
    ledger = Ledger(cfg.ledger_path)
    ledger.ensure()
    versions = {path: DeltaTable(path).version() for path in sink.paths()}
    ledger.record_plan(plan(1), "r")
    counted, dead, late = rows_of(1)
    none = [r.slice(0, 0) for r in (counted, dead, late)]
    for rows in ((counted, *none[1:]), (none[0], dead, none[2]), (none[0], none[1], late)):  # each table refuses
        with pytest.raises(ConfigError, match=r"source.*newer version"):
            sink.write(plan(1), *rows, watermark_after_ms=None)
    assert {path: DeltaTable(path).version() for path in sink.paths()} == versions
    assert sink.write(plan(1), *none, watermark_after_ms=None) is None
    sink.fence(2)
    assert sink.epoch_commit(1) is not None and sink.epoch_commit(2).fenced
