"""The sink's delta-rs writes: an epoch's rows land once, whoever races to write them and
however often it is replayed, and a table is created once, however many create it at once
(no broker, no JVM)."""
from __future__ import annotations

import multiprocessing
from collections import Counter
from datetime import datetime, timedelta, timezone

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


def test_a_row_without_its_partition_value_in_a_partitioned_counts_table_is_merged_into_not_doubled(tmp_path):
    """A writer of an older version puts rows without their partition value into a partitioned
    counts table; the next MERGE must still find them (one row per window and client)."""
    from datetime import datetime, timezone

    import pyarrow as pa
    from deltalake import write_deltalake

    from ipcount.rules.config import PipelineConfig
    from ipcount.storage.sink import COUNTS_COLUMNS, Sink

    cfg = PipelineConfig(warehouse=str(tmp_path), window_seconds=10)
    sink = Sink(cfg)
    sink.ensure()
    assert DeltaTable(cfg.counts_path).metadata().partition_columns == ["window_day", "is_final"]
    start = datetime(2026, 11, 24, 10, 0, 10, tzinfo=timezone.utc)
    end = datetime(2026, 11, 24, 10, 0, 20, tzinfo=timezone.utc)
    old = {"window_start": [start], "window_end": [end], "ip": ["1.2.3.4"], "count": [2], "first_epoch": [1],
           "last_epoch": [1], "is_final": [False], "window_hour": [None], "window_day": [None]}
    write_deltalake(cfg.counts_path, pa.table(old, schema=arrow_schema(COUNTS_COLUMNS)), mode="append")
    counts = pa.table({"window_start": [start, start], "window_end": [end, end], "ip": ["1.2.3.4", "5.6.7.8"],
                       "count": [3, 1]})
    sink._merge_counts(2, counts, None, finalize_untouched=False)  # noqa: SLF001
    got = sorted((r["ip"], r["count"], r["first_epoch"], r["last_epoch"])
                 for r in DeltaTable(cfg.counts_path).to_pyarrow_table().to_pylist())
    assert got == [("1.2.3.4", 5, 1, 2), ("5.6.7.8", 1, 2, 2)]


BASE = datetime(2026, 11, 24, 10, tzinfo=timezone.utc)


def chain_epoch(sink, chain: list, epoch: int, want: Counter, ips: int = 50) -> None:
    """A scheduled epoch's counts commit, counting the end of window ``epoch - 1`` (10 clients)
    and the start of window ``epoch`` (``ips`` clients), its watermark at the next window's end."""
    import pyarrow as pa

    from ipcount.rules.finality import ChainCommit

    windows = [BASE + timedelta(seconds=10 * (epoch - 1))] * 10 + [BASE + timedelta(seconds=10 * epoch)] * ips
    clients = [f"10.0.0.{i}" for i in range(10)] + [f"10.0.0.{i}" for i in range(ips)]
    want.update(zip(windows, clients))
    watermark_ms = int((BASE + timedelta(seconds=10 * epoch + 10)).timestamp() * 1000)
    counts = pa.table({"window_start": windows, "window_end": [w + timedelta(seconds=10) for w in windows],
                       "ip": clients, "count": [1] * len(windows)})
    version = sink._merge_counts(epoch, counts, watermark_ms, finalize_untouched=True, chain=chain[:2])  # noqa: SLF001
    chain.insert(0, ChainCommit(version, watermark_ms))


def check_counts(cfg, want: Counter, last_epoch: int) -> list[dict]:
    """The counts table holds ``want``, one row each, final where the last watermark says."""
    rows = DeltaTable(cfg.counts_path).to_pyarrow_table().to_pylist()
    assert Counter({(r["window_start"], r["ip"]): r["count"] for r in rows}) == want
    watermark = BASE + timedelta(seconds=10 * last_epoch + 10)
    for r in rows:
        assert r["is_final"] == (r["window_end"] + timedelta(seconds=10) <= watermark), r
    return rows


def test_a_merge_rewrites_only_rows_not_yet_final_and_moves_rows_once_final(tmp_path):
    """Scheduled epochs, each counting the end of one window and the start of the next: a
    row moves to its day's final partition with the MERGE that makes it final, so a MERGE
    rewrites only rows within the lateness (an hour partition rewrote the hour so far)."""
    import pyarrow as pa

    from ipcount.rules.config import PipelineConfig
    from ipcount.storage.sink import Sink

    cfg = PipelineConfig(warehouse=str(tmp_path), window_seconds=10, allowed_lateness_seconds=10)
    sink, chain, want = Sink(cfg), [], Counter()
    sink.ensure()
    for epoch in range(1, 31):
        chain_epoch(sink, chain, epoch, want)
    check_counts(cfg, want, 30)
    table = DeltaTable(cfg.counts_path)
    files = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    assert {f["partition.is_final"] for f in files} == {True, False}
    merges = [h["operationMetrics"] for h in table.history(10) if h["operation"] == "MERGE"]
    # each of the last MERGEs read one window's rows at most (an hour partition: every row so far)
    assert merges and all(m["num_target_rows_copied"] + m["num_target_rows_updated"] <= 50 for m in merges)


def test_maintenance_s_commits_leave_the_finalizing_read_bounded_and_another_writer_s_rows_do_not(tmp_path):
    """The chain's bounded finalizing read is kept across commits that change no row (a
    compaction, an empty append, a vacuum); after a commit that adds rows, the next epochs
    take a full pass (the rule: ipcount.rules.finality)."""
    import pyarrow as pa

    from ipcount.rules.config import PipelineConfig
    from ipcount.storage.sink import Sink
    from tests.tables import counts_merges

    cfg = PipelineConfig(warehouse=str(tmp_path), window_seconds=10, allowed_lateness_seconds=10)
    sink, chain, want = Sink(cfg), [], Counter()
    sink.ensure()
    for epoch in range(1, 6):
        chain_epoch(sink, chain, epoch, want)
    DeltaTable(cfg.counts_path).optimize.compact(partition_filters=[("is_final", "=", "true")])
    sink.fence(1000)   # an empty append
    DeltaTable(cfg.counts_path).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    chain_epoch(sink, chain, 6, want)
    chain_epoch(sink, chain, 7, want)
    assert [m["full_pass"] for m in counts_merges(cfg)] == [True, True, False, False, False, False, False]
    # another writer's rows (a backfill's, below the watermark), then the chain again
    late_window = BASE + timedelta(seconds=10)
    backfilled = pa.table({"window_start": [late_window], "window_end": [late_window + timedelta(seconds=10)],
                           "ip": ["10.9.9.9"], "count": [1]})
    sink._merge_counts(2000, backfilled, None, finalize_untouched=False)  # noqa: SLF001
    want[(late_window, "10.9.9.9")] += 1
    for epoch in (8, 9, 10):
        chain_epoch(sink, chain, epoch, want)
    assert [m["full_pass"] for m in counts_merges(cfg)][-3:] == [True, True, False]
    check_counts(cfg, want, 10)   # the backfilled row too is final


def test_a_counts_table_partitioned_by_hour_keeps_its_layout_and_a_merge_reads_its_hours_only(tmp_path):
    """A counts table made by a version that partitioned by window_hour keeps that layout: it
    gains window_day, which every new row carries, and a MERGE reads only the hours it names."""
    from datetime import datetime, timedelta, timezone

    import pyarrow as pa

    from ipcount.rules.config import PipelineConfig
    from ipcount.storage.sink import COUNTS_COLUMNS, Sink, partition_of

    cfg = PipelineConfig(warehouse=str(tmp_path), window_seconds=10)
    older = tuple(c for c in COUNTS_COLUMNS if c[0] != "window_day")
    rs_create_table(cfg.counts_path, arrow_schema(older), partition_by=["window_hour"])
    sink = Sink(cfg)
    sink.ensure()
    table = DeltaTable(cfg.counts_path)
    assert table.metadata().partition_columns == ["window_hour"] and "window_day" in table.schema().to_arrow().names
    for epoch, (hour, n) in enumerate([(10, 1), (11, 2), (10, 3)], start=1):
        start = datetime(2026, 11, 24, hour, 0, 10, tzinfo=timezone.utc)
        counts = pa.table({"window_start": [start], "window_end": [start + timedelta(seconds=10)],
                           "ip": ["1.2.3.4"], "count": [n]})
        sink._merge_counts(epoch, counts, None, finalize_untouched=False)  # noqa: SLF001
    table = DeltaTable(cfg.counts_path)
    rows = sorted((r["window_hour"], r["window_day"], r["count"], r["first_epoch"], r["last_epoch"])
                  for r in table.to_pyarrow_table().to_pylist())
    assert rows == [("2026-11-24T10", "2026-11-24", 4, 1, 3), ("2026-11-24T11", "2026-11-24", 2, 2, 2)]
    assert partition_of(table) == "window_hour"
    metrics = table.history(1)[0]["operationMetrics"]   # epoch 3's MERGE: hour 10's file, not hour 11's
    assert (metrics["num_target_files_scanned"], metrics["num_target_files_skipped_during_scan"]) == (1, 1)


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


def test_commit_infos_are_numbered_as_the_log_numbers_them(tmp_path):
    """delta-rs's history(n) on a loaded snapshot numbers the commits it lists down from that
    snapshot's version, and lists the ones made since too: read so, the publisher took a
    later epoch's commit info for a version (and maintenance another commit's time).
    commit_infos numbers them as the log does."""
    from ipcount.storage.delta import commit_infos

    path = str(tmp_path / "late_records")
    rs_create_table(path, SCHEMA)
    for epoch in (1, 2, 3):
        rs_append_once(path, rows(epoch), f"p/epoch-{epoch}", epoch, f"epoch={epoch}")   # versions 1-3
    loaded = DeltaTable(path)
    for epoch in (4, 5):
        rs_append_once(path, rows(epoch), f"p/epoch-{epoch}", epoch, f"epoch={epoch}")   # since it was loaded
    assert {h["version"]: h.get("userMetadata") for h in loaded.history(3)}[1] == "epoch=3"   # (why)
    infos = commit_infos(path, 1)
    assert {v: h.get("userMetadata") for v, h in infos.items()} == {v: f"epoch={v}" for v in range(1, 6)}
    assert commit_infos(path, 6) == {} and set(commit_infos(path, 4)) == {4, 5}
