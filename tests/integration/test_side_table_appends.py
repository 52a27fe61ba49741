"""The sink's delta-rs writes: an epoch's rows land once, whoever races to write them and
however often it is replayed, and a table is created once, however many create it at once
(no broker, no JVM)."""
from __future__ import annotations

import multiprocessing

from deltalake import DeltaTable

from ipcount.storage.delta import arrow_schema, read_rows, rs_append_once, rs_create_table, version_with_metadata
from ipcount.storage.sink import LATE_COLUMNS

SCHEMA = arrow_schema([c for c in LATE_COLUMNS if c[0] in ("epoch", "partition", "offset")])


def rows(epoch: int, n: int = 3):
    import pyarrow as pa

    return pa.table({"epoch": [epoch] * n, "partition": [0] * n, "offset": list(range(n))}, schema=SCHEMA)


def at_once(n: int, target, *args) -> list:
    """``target(*args, start, results)`` in ``n`` processes at once (each waits at the barrier
    ``start``); what each put in ``results``, after all exited cleanly."""
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(n), ctx.Queue()
    workers = [ctx.Process(target=target, args=(*args, start, results)) for _ in range(n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert [w.exitcode for w in workers] == [0] * n
    return [results.get(timeout=5) for _ in workers]


def append(path: str, epoch: int, start, results) -> None:
    start.wait()
    results.put(rs_append_once(path, rows(epoch), f"p/epoch-{epoch}", epoch, f"epoch={epoch}"))


def test_four_processes_appending_one_epoch_at_once_land_it_once(tmp_path):
    race_appends(str(tmp_path / "late_records"))


def race_appends(path: str) -> None:
    """Four processes append epoch 7 to a new table at ``path`` at once: it lands once."""
    rs_create_table(path, SCHEMA)
    versions = at_once(4, append, path, 7)
    assert sorted(v is not None for v in versions) == [False, False, False, True]
    assert sorted(r["offset"] for r in read_rows(path)) == [0, 1, 2]
    assert version_with_metadata(path, "epoch=7") == 1 == next(v for v in versions if v is not None)


def test_a_replay_is_skipped_and_a_fence_keeps_a_late_writer_out(tmp_path):
    path = str(tmp_path / "late_records")
    rs_create_table(path, SCHEMA)
    assert rs_append_once(path, rows(1), "p/epoch-1", 1, "epoch=1")
    assert not rs_append_once(path, rows(1), "p/epoch-1", 1, "epoch=1")          # the replay
    assert rs_append_once(path, SCHEMA.empty_table(), "p/epoch-2", 2, "fenced epoch=2")
    assert not rs_append_once(path, rows(2), "p/epoch-2", 2, "epoch=2")          # after the fence
    assert rs_append_once(path, rows(3, n=1), "p/epoch-3", 3, "epoch=3")         # other epochs go on
    assert sorted((r["epoch"], r["offset"]) for r in read_rows(path)) == [(1, 0), (1, 1), (1, 2), (3, 0)]


def create(paths: list[str], start, results) -> None:
    for path in paths:
        start.wait()
        rs_create_table(path, SCHEMA)
    results.put(len(paths))


def test_processes_creating_one_table_at_once_make_one_table(tmp_path):
    """delta-rs retries a losing CREATE by default, committing it on top of the winner's as
    a new table (another id): unchecked, that happened in about half of such races."""
    paths = [str(tmp_path / f"t{i}") for i in range(12)]
    assert at_once(3, create, paths) == [12, 12, 12]
    for path in paths:
        history = DeltaTable(path).history()
        assert [(h["version"], h["operation"]) for h in history] == [(0, "CREATE TABLE")], path


def merge_counts(cfg, epoch: int, start, results) -> None:
    import pyarrow as pa

    from ipcount.rules.ledger import EpochPlan
    from ipcount.storage.sink import DEAD_LETTER_COLUMNS, LATE_COLUMNS, Sink

    counts = pa.table({"window_start": pa.array([1_795_255_200_000_000] * 2, pa.timestamp("us", tz="UTC")),
                       "window_end": pa.array([1_795_255_205_000_000] * 2, pa.timestamp("us", tz="UTC")),
                       "ip": ["10.0.0.1", "10.0.0.2"], "count": [3, 4]})
    start.wait()
    results.put(Sink(cfg).write(EpochPlan(epoch, ()), counts, arrow_schema(DEAD_LETTER_COLUMNS).empty_table(),
                                arrow_schema(LATE_COLUMNS).empty_table()))


def test_processes_merging_one_epoch_s_counts_at_once_commit_it_once(tmp_path):
    """The counts MERGE, raced by runners of the same epoch: one commit, counted once."""
    from ipcount.rules.config import PipelineConfig
    from ipcount.storage.sink import EpochCommit, Sink
    from tests.tables import counts

    cfg = PipelineConfig(warehouse=str(tmp_path / "warehouse"), pipeline_id="race")
    Sink(cfg).ensure()
    assert at_once(3, merge_counts, cfg, 5) == [1, 1, 1]              # all see the one commit: version 1
    assert Sink(cfg).epoch_commit(5) == EpochCommit(fenced=False, version=1)   # as the table's transactions say
    merges = [h for h in DeltaTable(cfg.counts_path).history() if h["operation"] == "MERGE"]
    assert [h.get("userMetadata") for h in merges] == ["epoch=5"]
    assert sorted(counts(cfg).values()) == [3, 4]


def test_a_row_without_its_hour_in_a_partitioned_counts_table_is_merged_into_not_doubled(tmp_path):
    """A writer of an older version puts rows without window_hour into a partitioned counts
    table; the next MERGE must still find them (one row per window and client)."""
    from datetime import datetime, timezone

    import pyarrow as pa
    from deltalake import write_deltalake

    from ipcount.rules.config import PipelineConfig
    from ipcount.storage.sink import COUNTS_COLUMNS, Sink

    cfg = PipelineConfig(warehouse=str(tmp_path), window_seconds=10)
    sink = Sink(cfg)
    sink.ensure()
    assert DeltaTable(cfg.counts_path).metadata().partition_columns == ["window_hour"]
    start = datetime(2026, 11, 24, 10, 0, 10, tzinfo=timezone.utc)
    end = datetime(2026, 11, 24, 10, 0, 20, tzinfo=timezone.utc)
    old = {"window_start": [start], "window_end": [end], "ip": ["1.2.3.4"], "count": [2], "first_epoch": [1],
           "last_epoch": [1], "is_final": [False], "window_hour": [None]}
    write_deltalake(cfg.counts_path, pa.table(old, schema=arrow_schema(COUNTS_COLUMNS)), mode="append")
    counts = pa.table({"window_start": [start, start], "window_end": [end, end], "ip": ["1.2.3.4", "5.6.7.8"],
                       "count": [3, 1]})
    sink._merge_counts(2, counts, None, finalize_untouched=False)  # noqa: SLF001
    got = sorted((r["ip"], r["count"], r["first_epoch"], r["last_epoch"])
                 for r in DeltaTable(cfg.counts_path).to_pyarrow_table().to_pylist())
    assert got == [("1.2.3.4", 5, 1, 2), ("5.6.7.8", 1, 2, 2)]


def test_in_one_epoch_s_scope_a_table_is_loaded_once_and_another_writer_s_commit_is_seen(tmp_path, table_loads):
    """Inside ``one_epoch_of_tables`` a table is loaded from its log once, and every later use
    is brought up to date: a commit another process made in between is seen (a stale
    snapshot would append that epoch a second time)."""
    from ipcount.storage.delta import latest, one_epoch_of_tables, table_metadata

    path = str(tmp_path / "late_records")
    with one_epoch_of_tables():
        rs_create_table(path, SCHEMA)
        assert rs_append_once(path, rows(1), "p/epoch-1", 1, "epoch=1") == 1
        assert at_once(1, append, path, 2) == [2]                          # another process's commit
        assert not rs_append_once(path, rows(2), "p/epoch-2", 2, "epoch=2")  # ... is seen: skipped
        with one_epoch_of_tables():                                          # a nested scope shares the tables
            assert latest(path).version() == 2
        assert table_metadata(path)[1]["delta.checkpointInterval"] == "10"
        assert version_with_metadata(path, "epoch=2") == 2
        assert sorted((r["epoch"], r["offset"]) for r in read_rows(path)) == [(1, 0), (1, 1), (1, 2),
                                                                              (2, 0), (2, 1), (2, 2)]
    assert table_loads == [path]
    read_rows(path)
    read_rows(path)
    assert table_loads == [path] * 3  # outside a scope each use loads the table


def test_in_one_epoch_s_scope_a_deleted_table_is_gone_and_threads_load_their_own(tmp_path):
    import shutil
    import threading

    from ipcount.storage.delta import latest, one_epoch_of_tables

    path = str(tmp_path / "late_records")
    with one_epoch_of_tables():
        rs_create_table(path, SCHEMA)
        rs_append_once(path, rows(1), "p/epoch-1", 1, "epoch=1")
        mine = latest(path)
        theirs: list = []
        worker = threading.Thread(target=lambda: theirs.append(latest(path)))
        worker.start()
        worker.join()
        assert theirs[0] is not mine and theirs[0].version() == mine.version() == 1
        shutil.rmtree(path)
        assert read_rows(path) == []
        rs_create_table(path, SCHEMA)             # a new table, not the scope's old object
        assert latest(path).version() == 0 and read_rows(path) == []
