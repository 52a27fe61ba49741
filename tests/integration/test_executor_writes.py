"""Epochs whose rows Spark's executors write into the tables, delta-rs committing only the
files' metadata (``max_driver_tally_rows``), against the same ground truth as the epochs
whose tally the process collects - and the two paths mixed on one table set."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from deltalake import DeltaTable

from ipcount.jobs.backfill import run_backfill
from ipcount.jobs.epoch import run_epoch
from ipcount.rules.requests import BackfillRequest, parse_offsets
from ipcount_lab.generator import TrafficGenerator, produce
from tests.conftest import run_until_idle
from tests.ground_truth import expected_tables
from tests.integration.test_backfill import lane_truth
from tests.tables import counts, dead_letters, epoch_ranges, finality, late_records, snapshot
from tests.tables import ledger as ledger_rows

BASE_MS = 1_795_255_200_000  # 2026-11-21T10:00:00Z


def produce_dataset(cfg, n=1500, seed=11, base_ms=BASE_MS):
    gen = TrafficGenerator(seed=seed, events_per_second=50, late_share=0.04, malformed_share=0.03)
    return produce(cfg.bootstrap_servers, cfg.topic, gen.records(n, base_ms), partition_of=lambda i, r: i % 3)


def executor_files(path: str) -> list[str]:
    """The live files of a table that Spark's executors wrote (named by epoch)."""
    return [p for p in DeltaTable(path).file_uris() if Path(p).name.startswith("epoch-")]


def assert_ground_truth(cfg, produced):
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts
    assert dead_letters(cfg) == expected.dead
    assert late_records(cfg) == expected.late
    assert expected.late and expected.dead and len(expected.counts) > 100
    want_final = {key: key[0] + 5_000 + 5_000 <= expected.watermark_ms for key in expected.counts}
    assert finality(cfg) == want_final
    assert 0 < sum(want_final.values()) < len(want_final)
    # each row carries its day and hour, and lies in its day's partition of its finality
    table = DeltaTable(cfg.counts_path)
    rows = table.to_pyarrow_table(columns=["window_start", "window_day", "window_hour", "is_final"]).to_pylist()
    assert rows and all((r["window_start"].strftime("%Y-%m-%d"), r["window_start"].strftime("%Y-%m-%dT%H"))
                        == (r["window_day"], r["window_hour"]) for r in rows)
    return expected


def test_executors_write_every_table_and_the_tables_equal_the_ground_truth(cfg, spark):
    cfg = cfg.replace(max_records_per_epoch=400, max_driver_tally_rows=0)
    produced = produce_dataset(cfg)
    summaries = run_until_idle(cfg, spark)
    assert len(summaries) >= 4
    assert_ground_truth(cfg, produced)
    # every row the epochs wrote is in files Spark's tasks wrote; none came through a delta-rs MERGE
    for path in (cfg.counts_path, cfg.dead_letter_path, cfg.late_path):
        assert executor_files(path) == DeltaTable(path).file_uris()
    assert not [h for h in DeltaTable(cfg.counts_path).history() if h.get("operation") == "MERGE"]
    # data skipping works on the files' statistics: a window's rows are found, and only there
    some = sorted(counts(cfg))[len(counts(cfg)) // 2]
    table = DeltaTable(cfg.counts_path)
    found = table.to_pyarrow_table(filters=[("ip", "=", some[1])]).to_pylist()
    assert any(int(r["window_start"].timestamp() * 1000) == some[0] for r in found)
    # a replay of a committed epoch changes nothing (its transaction is in every table)
    before = snapshot(cfg)
    assert run_until_idle(cfg, spark) == []
    assert snapshot(cfg) == before


def test_the_paths_mixed_on_one_table_set_give_the_same_tables(cfg, spark):
    produced = produce_dataset(cfg, n=1200, seed=12)
    # epochs alternate: collected and merged here, written by the executors
    for i in range(12):
        if run_epoch(cfg.replace(max_records_per_epoch=150, max_driver_tally_rows=0 if i % 2 else 10**6),
                     spark) is None:
            break
    assert len(epoch_ranges(cfg)) >= 8
    assert_ground_truth(cfg, produced)
    merges = [h for h in DeltaTable(cfg.counts_path).history() if h.get("operation") == "MERGE"]
    assert merges and executor_files(cfg.counts_path)


def test_a_backfill_written_by_the_executors_corrects_closed_windows(cfg, spark):
    """Backfills count into windows the chain has closed: the first adds final rows, the
    second counts into some of them, so the final files holding those are rewritten (found
    by their statistics and a look at their keys) and no other final file is."""
    cfg = cfg.replace(start_position="latest", max_records_per_epoch=250, max_driver_tally_rows=0)
    history = produce_dataset(cfg, n=600, seed=21)
    run_epoch(cfg, spark)  # pins "latest" in the ledger
    live = produce_dataset(cfg, n=300, seed=22, base_ms=BASE_MS + 60_000)
    run_until_idle(cfg, spark)
    pinned = dict(Counter(p.partition for p in history))
    first = run_backfill(cfg, spark, BackfillRequest(offsets=parse_offsets(
        ",".join(f"{p}:0-{u}" for p, u in sorted(pinned.items()) if p != 2), cfg.topic)))
    assert first.epochs
    final_before = {f for f in DeltaTable(cfg.counts_path).file_uris() if "is_final=true" in f}
    second = run_backfill(cfg, spark, BackfillRequest(offsets=parse_offsets(f"2:0-{pinned[2]}", cfg.topic)))
    assert second.epochs
    want = lane_truth(history + live, cfg)
    assert counts(cfg) == want.counts
    assert dead_letters(cfg) == want.dead and late_records(cfg) == want.late
    # the second backfill's windows were closed: its rows are corrections or new final rows
    final_after = {f for f in DeltaTable(cfg.counts_path).file_uris() if "is_final=true" in f}
    assert final_before - final_after  # some final files were replaced ...
    assert all(final for (w, _), final in finality(cfg).items() if w < BASE_MS + 60_000)


def test_killed_between_the_file_writes_and_the_commit_the_files_stay_invisible(cfg, spark):
    """SIGKILL after Spark wrote an epoch's counts files, before delta-rs committed them: the
    files are on disk but in no table version; the re-run writes and commits its own, and
    the tables equal the ground truth (each side table holds the epoch's rows once)."""
    cfg = cfg.replace(max_records_per_epoch=400, max_driver_tally_rows=0)
    produced = produce_dataset(cfg, n=800, seed=14)
    proc = subprocess.run([sys.executable, "-m", "ipcount.cli", "epoch", *cfg.to_args()],
                          env={**os.environ, "IPCOUNT_CRASH_AT": "after_counts_files"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]
    on_disk = {str(p.relative_to(cfg.counts_path)) for p in Path(cfg.counts_path).rglob("epoch-1-*.parquet")}
    assert on_disk and not {Path(p).name for p in DeltaTable(cfg.counts_path).file_uris()} & {
        Path(p).name for p in on_disk}
    assert {(r["epoch"], r["status"]) for r in ledger_rows(cfg)} == {(1, "planned")}
    # the dead letters' commit came before the kill (epoch 1 has no watermark: nothing is late)
    assert DeltaTable(cfg.dead_letter_path).to_pyarrow_table().num_rows > 0

    run_until_idle(cfg, spark)
    assert_ground_truth(cfg, produced)
    live = {Path(p).name for p in DeltaTable(cfg.counts_path).file_uris()}
    assert not live & {Path(p).name for p in on_disk}  # the killed attempt's files never became part of it

    # Maintenance's vacuum deletes such files once older than a day (whatever its retention:
    # younger ones may be an attempt's about to be committed), and nothing else of the table.
    from ipcount.storage.maintenance import maintain

    maintain(cfg, "young", None, retention_hours=0)
    assert all((Path(cfg.counts_path) / p).exists() for p in on_disk)
    day_old = time.time() - 25 * 3600
    for p in on_disk:
        os.utime(Path(cfg.counts_path) / p, (day_old, day_old))
    maintain(cfg, "old", None, retention_hours=0)
    assert not any((Path(cfg.counts_path) / p).exists() for p in on_disk)
    assert_ground_truth(cfg, produced)


def rows_at(cfg, version: int) -> dict[tuple[str, str], tuple[int, bool]]:
    rows = DeltaTable(cfg.counts_path, version=version).to_pyarrow_table().to_pylist()
    return {(r["window_start"].isoformat(timespec="milliseconds").replace("+00:00", "Z"), r["ip"]):
            (r["count"], r["is_final"]) for r in rows}


def test_publishing_sends_exactly_the_rows_each_version_changed(cfg, spark):
    """An executor merge replaces whole files, so its change feed reads as every row of them
    deleted and inserted again: the publisher sends only the rows whose count or finality
    changed, as a version of the table compared with the one before says."""
    from ipcount.jobs.publish import publish_pending
    from tests.integration.test_publish import folded, sink, table_now

    cfg = cfg.replace(publish=True, publish_topic=f"sink_{cfg.topic}", max_records_per_epoch=150)
    produce_dataset(cfg, n=900, seed=15)
    for i in range(10):
        if run_epoch(cfg.replace(max_driver_tally_rows=10**6 if i % 3 == 1 else 0), spark) is None:
            break
    report = publish_pending(cfg)
    records = sink(cfg)
    assert folded(records) == table_now(cfg)
    by_version: dict[int, set] = {}
    for r in records:
        key = json.loads(r.key)
        by_version.setdefault(int(dict(r.headers)["ipcount-version"]), set()).add((key["window_start"], key["ip"]))
    epochs = [(v, e) for v, e, _ in report.published if e is not None]
    assert len(epochs) >= 5
    for version, _ in epochs:
        before, after = rows_at(cfg, version - 1), rows_at(cfg, version)
        changed = {k for k, row in after.items() if before.get(k) != row}
        assert changed and by_version.get(version, set()) == changed, version
    # the executors' merges inserted again rows they did not change (the old publisher sent those too)
    import pyarrow as pa

    unchanged = 0
    for version, _ in epochs:
        feed = pa.table(DeltaTable(cfg.counts_path).load_cdf(starting_version=version, ending_version=version)
                        .read_all()).to_pylist()
        inserted = {(r["window_start"].isoformat(timespec="milliseconds").replace("+00:00", "Z"), r["ip"])
                    for r in feed if r["_change_type"] == "insert"}
        unchanged += len(inserted - by_version.get(version, set()))
    assert unchanged > 0


def test_a_counts_table_of_an_older_layout_has_its_counts_merged_in_the_task(cfg, spark):
    """A counts table partitioned by window_hour (made by an older version) has no open
    partitions to merge apart: its counts are collected and merged by delta-rs as before,
    while the executors still write the dead-letter and late files."""
    from ipcount.storage.delta import arrow_schema, rs_create_table
    from ipcount.storage.sink import COUNTS_COLUMNS

    cfg = cfg.replace(max_records_per_epoch=500, max_driver_tally_rows=0)
    older = tuple(c for c in COUNTS_COLUMNS if c[0] != "window_day")
    rs_create_table(cfg.counts_path, arrow_schema(older), partition_by=["window_hour"])
    produced = produce_dataset(cfg, n=1000, seed=16)
    run_until_idle(cfg, spark)
    assert DeltaTable(cfg.counts_path).metadata().partition_columns == ["window_hour"]
    assert [h for h in DeltaTable(cfg.counts_path).history() if h.get("operation") == "MERGE"]
    assert not executor_files(cfg.counts_path) and executor_files(cfg.dead_letter_path)
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead
    assert late_records(cfg) == expected.late


def test_files_the_committing_process_cannot_find_are_never_committed(tmp_path, monkeypatch):
    """An executor that reaches the location differently (a relative path read from another
    working directory, another store's settings) writes files this process does not see: the
    check before the commit says so, where a commit would make the table unreadable."""
    import pytest

    from ipcount.rules.errors import ConfigError
    from ipcount.storage.table_files import WrittenFile, _check_written, absolute_location

    monkeypatch.chdir(tmp_path)
    assert absolute_location("warehouse/counts") == str(tmp_path / "warehouse" / "counts")
    assert absolute_location("s3://bucket/counts") == "s3://bucket/counts"
    (tmp_path / "counts").mkdir()
    (tmp_path / "counts" / "epoch-1-a.parquet").write_bytes(b"1234")
    there = WrittenFile("epoch-1-a.parquet", 4, {}, 1, "{}")
    _check_written(str(tmp_path / "counts"), [there])  # as written: fine
    for wrong in (WrittenFile("epoch-1-b.parquet", 4, {}, 1, "{}"), WrittenFile("epoch-1-a.parquet", 5, {}, 1, "{}")):
        with pytest.raises(ConfigError, match="executors must reach the tables' location"):
            _check_written(str(tmp_path / "counts"), [there, wrong])


def test_a_column_this_version_does_not_know_keeps_its_values(cfg, spark):
    """A newer version added a column to the counts table and filled it. An epoch of this
    version that the executors write rewrites the open files: the rewritten rows keep the
    column's values (before 877b4d3 a merge that knew only its own columns wrote NULL there),
    and the rows it adds have none."""
    cfg = cfg.replace(max_records_per_epoch=300, max_driver_tally_rows=0)
    produced = produce_dataset(cfg, n=900, seed=17)
    assert run_epoch(cfg, spark) is not None
    assert executor_files(cfg.counts_path)
    table = DeltaTable(cfg.counts_path)
    from deltalake import Field, Schema  # a newer version's column, as Sink.ensure adds its own

    table.alter.add_columns(Schema([Field("source", "string", nullable=True)]).fields)
    DeltaTable(cfg.counts_path).update(updates={"source": "'newer'"})
    noted = {(r["window_start"], r["ip"]) for r in DeltaTable(cfg.counts_path).to_pyarrow_table().to_pylist()}
    files_before = set(executor_files(cfg.counts_path))
    run_until_idle(cfg, spark)
    assert len(epoch_ranges(cfg)) >= 3
    rows = DeltaTable(cfg.counts_path).to_pyarrow_table().to_pylist()
    kept = {(r["window_start"], r["ip"]) for r in rows if r["source"] == "newer"}
    assert kept == noted and len(noted) > 50                  # every row rewritten kept its value
    assert {(r["window_start"], r["ip"]) for r in rows if r["source"] is None} == \
        {(r["window_start"], r["ip"]) for r in rows} - noted  # new rows have none
    assert set(executor_files(cfg.counts_path)) - files_before  # the executors wrote the epochs' counts
    assert not [h for h in DeltaTable(cfg.counts_path).history() if h.get("operation") == "MERGE"]
    assert executor_files(cfg.dead_letter_path)
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead


def newer_counts_table(cfg, column, *constraints):
    """The counts table as a newer version would make it: with ``column`` (an Arrow field) of
    its own, and ``constraints`` (name, SQL) on it."""
    from ipcount.storage.delta import arrow_schema
    from ipcount.storage.sink import COUNTS_COLUMNS, COUNTS_PARTITION_BY

    DeltaTable.create(cfg.counts_path, schema=arrow_schema(COUNTS_COLUMNS).append(column),
                      partition_by=list(COUNTS_PARTITION_BY))
    for name, sql in constraints:
        DeltaTable(cfg.counts_path).alter.add_constraint({name: sql})


def test_a_column_a_newer_version_requires_stops_the_epoch_before_any_counts_file_is_written(cfg, spark):
    """A counts table a newer version made with a NOT NULL column of its own: the executors'
    counts merge is refused before it writes a file, naming the column (before, delta-rs's
    MERGE failed after the work; an executors' append left files no reader of the table
    could read). The side tables, without it, take the epoch's rows."""
    import pyarrow as pa
    import pytest

    from ipcount.rules.errors import ConfigError

    cfg = cfg.replace(max_records_per_epoch=300, max_driver_tally_rows=0)
    produce_dataset(cfg, n=300, seed=19)
    newer_counts_table(cfg, pa.field("source", pa.string(), False))
    with pytest.raises(ConfigError, match="source.*NOT NULL"):
        run_epoch(cfg, spark)
    assert DeltaTable(cfg.counts_path).transaction_version(f"{cfg.pipeline_id}/epoch-1") is None
    assert not list(Path(cfg.counts_path).rglob("epoch-*.parquet"))
    assert executor_files(cfg.dead_letter_path)


def test_a_table_asking_what_only_delta_rs_s_writes_check_is_merged_by_delta_rs(cfg, spark):
    """A counts table whose newer version's column has a CHECK constraint (here: never NULL,
    which this version cannot honour). Files the executors wrote would be committed unchecked
    (delta-rs checks only its own writes): the counts are merged by delta-rs, which refuses
    the rows, so the epoch fails with nothing of it in the table."""
    import pyarrow as pa
    import pytest

    cfg = cfg.replace(max_records_per_epoch=300, max_driver_tally_rows=0)
    produce_dataset(cfg, n=300, seed=23)
    newer_counts_table(cfg, pa.field("source", pa.string(), True), ("source_set", "source IS NOT NULL"))
    with pytest.raises(Exception, match="failed validation"):
        run_epoch(cfg, spark)
    assert DeltaTable(cfg.counts_path).transaction_version(f"{cfg.pipeline_id}/epoch-1") is None
    assert not DeltaTable(cfg.counts_path).to_pyarrow_table().num_rows


def test_side_tables_asking_what_only_delta_rs_checks_take_the_task_s_append(cfg, spark):
    """CHECK constraints on the dead-letter and late tables (which every row of theirs meets):
    files the executors wrote would be committed unchecked, so those rows are appended by
    delta-rs, which checks them; the counts stay the executors'. Against the ground truth."""
    from ipcount.storage.sink import Sink

    cfg = cfg.replace(max_records_per_epoch=400, max_driver_tally_rows=0)
    produced = produce_dataset(cfg, seed=29)
    Sink(cfg).ensure()
    DeltaTable(cfg.dead_letter_path).alter.add_constraint({"placed": "`offset` >= 0"})
    DeltaTable(cfg.late_path).alter.add_constraint({"ordered": "window_end > window_start"})
    assert len(run_until_idle(cfg, spark)) >= 3
    assert_ground_truth(cfg, produced)
    assert not executor_files(cfg.dead_letter_path) and not executor_files(cfg.late_path)
    assert DeltaTable(cfg.late_path).file_uris() and executor_files(cfg.counts_path)


def test_a_commit_that_came_first_redoes_the_merge_only_if_it_changed_what_the_merge_read(cfg, spark):
    """Between an executors' merge and its commit another commit lands. One that touched no
    file the merge read (a fence of another epoch; a backfill of another day, for a backfill)
    leaves the merge's files good: they are committed at the next version, nothing written
    twice (before, the whole merge was done again, and its first files left behind). One
    that removed a file it read, or added one it would read, makes it start over from the
    new snapshot. Against the counts summed by hand, with no (window, client) twice."""
    from collections import Counter
    from datetime import datetime, timedelta, timezone

    from deltalake import write_deltalake

    from ipcount.storage.delta import arrow_schema
    from ipcount.storage.sink import COUNTS_COLUMNS, Sink

    sink = Sink(cfg)
    sink.ensure()
    day = {d: datetime(2026, 11, 20 + d, 10, tzinfo=timezone.utc) for d in range(4)}
    expected: Counter = Counter()

    def merge(epoch: int, on: datetime, scheduled: bool = True, before_commit=lambda: None) -> None:
        windows = [on + timedelta(seconds=5 * k) for k in range(4)]
        rows = {(w, f"10.0.{epoch}.{i}" if i % 2 else "10.0.0.1"): epoch + i for i, w in enumerate(windows)}
        df = spark.createDataFrame([(w, w + timedelta(seconds=5), ip, n) for (w, ip), n in rows.items()],
                                   "window_start timestamp, window_end timestamp, ip string, count long")
        ms = [int(w.timestamp() * 1000) for w in windows]
        assert sink._merge_counts_in_spark(epoch, df, (min(ms), max(ms)), None, finalize_untouched=scheduled,
                                           before_commit=before_commit) is not None
        expected.update(rows)

    def on_first_call(action):
        calls = []

        def hook():
            calls.append(1)
            if len(calls) == 1:
                action()
        return hook

    def epoch_files(epoch: int) -> tuple[set[str], set[str]]:  # (written, live)
        written = {p.name for p in Path(cfg.counts_path).rglob(f"epoch-{epoch}-*.parquet")}
        return written, {Path(p).name for p in DeltaTable(cfg.counts_path).file_uris()} & written

    def assert_merged(epoch: int, again: bool) -> None:  # merged again, or its files committed once
        written, live = epoch_files(epoch)
        assert live and (written - live if again else written == live), epoch

    merge(1, day[0])
    empty = arrow_schema(COUNTS_COLUMNS).empty_table()
    merge(2, day[0], before_commit=on_first_call(lambda: write_deltalake(cfg.counts_path, empty, mode="append")))
    assert_merged(2, again=False)
    merge(3, day[0], before_commit=on_first_call(lambda: merge(4, day[0])))   # 4 rewrote the files 3 read
    assert_merged(3, again=True)
    # Backfills of a day without files: 6's files are where 5 would have read, though 5 read none.
    merge(5, day[1], scheduled=False, before_commit=on_first_call(lambda: merge(6, day[1], scheduled=False)))
    assert_merged(5, again=True)
    # A backfill of another day adds nothing a backfill of day 2 reads.
    merge(7, day[2], scheduled=False, before_commit=on_first_call(lambda: merge(8, day[3], scheduled=False)))
    assert_merged(7, again=False)
    rows = DeltaTable(cfg.counts_path).to_pyarrow_table(columns=["window_start", "ip"]).to_pylist()
    assert len(rows) == len({(r["window_start"], r["ip"]) for r in rows})
    assert counts(cfg) == Counter({(int(w.timestamp() * 1000), ip): n for (w, ip), n in expected.items()})
