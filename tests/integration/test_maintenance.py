"""Maintenance against real tables: run over and over while real epochs commit, it changes no
row, and afterwards every table is packed and vacuumed (real broker, Spark and Delta)."""
from __future__ import annotations

import os
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from ipcount.cli import main as cli_main
from ipcount.jobs.epoch import run_epoch
from ipcount.storage.ledger import Ledger
from ipcount.storage.maintenance import maintain
from ipcount_lab.generator import TrafficGenerator, produce
from tests.conftest import run_until_idle
from tests.ground_truth import expected_tables
from tests.tables import counts, dead_letters, epoch_ranges, last_maintenance, late_records

BASE_MS = 1_795_302_000_000  # 2026-11-21T23:00:00Z


def datetime_us(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, timezone.utc)


def files_per_partition(path: str) -> Counter:
    files = pa.table(DeltaTable(path).get_add_actions(flatten=True)).to_pylist()
    return Counter((f["partition.window_day"], f["partition.is_final"]) for f in files)


def test_maintenance_racing_epochs_changes_no_row_and_packs_every_table(cfg, spark, capsys):
    cfg = cfg.replace(max_records_per_epoch=150)
    # ~100 minutes of event time: day 21's windows (from 23:00) are final by the last epoch, day 22's not
    gen = TrafficGenerator(seed=23, events_per_second=0.25, late_share=0.04, malformed_share=0.04)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(1_500, BASE_MS), partition_of=lambda i, r: i % 3)

    stop, runs, errors = threading.Event(), [], []

    def maintain_over_and_over() -> None:
        while not stop.is_set():
            try:
                if Ledger(cfg.ledger_path).state(cfg.topic).last_epoch:
                    runs.append(maintain(cfg))  # the default retention: epochs may read what it replaced
            except Exception as e:  # noqa: BLE001 - the test reports every failure
                errors.append(e)
                return

    racer = threading.Thread(target=maintain_over_and_over)
    racer.start()
    try:
        summaries = run_until_idle(cfg, spark, limit=30)
    finally:
        stop.set()
        racer.join(120)
    assert not errors, errors
    assert len(summaries) >= 10 and len(runs) >= 2
    assert sum(t.compacted_files for r in runs for t in r.tables) > 0  # it did race the epochs

    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts
    assert dead_letters(cfg) == expected.dead
    assert late_records(cfg) == expected.late
    assert expected.dead and expected.late

    # Once more with the epochs done, through the command, deleting whatever no version holds.
    before = files_per_partition(cfg.counts_path)
    run = maintain(cfg, retention_hours=0)
    tables = {t.table: t for t in run.tables}
    after = files_per_partition(cfg.counts_path)
    assert set(before) == {("2026-11-21", True), ("2026-11-22", True), ("2026-11-22", False)}, before
    assert {p: n for p, n in after.items() if p[1]} == {("2026-11-21", True): 1, ("2026-11-22", True): 1}  # final
    assert after[("2026-11-22", False)] == before[("2026-11-22", False)]   # rows epochs still update: untouched
    for role, path in (("dead_letters", cfg.dead_letter_path), ("late_records", cfg.late_path)):
        assert tables[role].files_after == 1 == len(DeltaTable(path).file_uris())
    assert sum(t.vacuumed_files for t in run.tables) > 0
    for t in run.tables:
        assert t.log_bytes and t.checkpoint_bytes, t
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead  # nothing changed
    assert late_records(cfg) == expected.late

    # the command, and the log it keeps
    assert cli_main(["maintain", f"--warehouse={cfg.warehouse}", f"--pipeline-id={cfg.pipeline_id}",
                     f"--topic={cfg.topic}", f"--bootstrap-servers={cfg.bootstrap_servers}"]) == 0
    out = capsys.readouterr().out
    assert "counts: " in out and "ledger: " in out and f"logged to {cfg.maintenance_path}" in out
    newest = last_maintenance(cfg)
    assert sorted(r["table"] for r in newest) == ["counts", "dead_letters", "late_records", "ledger", "maintenance"]
    assert len({r["run_id"] for r in newest}) == 1 and newest[0]["run_id"] != run.run_id


def test_maintain_without_a_ledger_says_what_is_missing(tmp_path, caplog):
    assert cli_main(["maintain", f"--warehouse={tmp_path}/nowhere"]) == 2
    assert (f"no table set for maintain to read: {tmp_path}/nowhere/ledger and {tmp_path}/nowhere/counts do not "
            "exist") in caplog.text


def test_a_vacuum_meets_files_whose_tombstones_a_checkpoint_would_drop(tmp_path):
    """A checkpoint leaves out the tombstones of files removed longer ago than
    delta.deletedFileRetentionDuration (a week by default, as long as the vacuum's retention),
    and a vacuum deletes only files it finds a tombstone of: maintenance keeps them longer."""
    import time

    from deltalake import write_deltalake

    from ipcount.rules.config import PipelineConfig
    from ipcount.storage import tableset
    from ipcount.storage.delta import arrow_schema
    from ipcount.storage.sink import LATE_COLUMNS, Sink

    cfg = PipelineConfig(warehouse=str(tmp_path / "w"), pipeline_id="p", topic="t")
    Sink(cfg).ensure()
    Ledger(cfg.ledger_path).ensure()
    tableset.claim(cfg)
    t = datetime_us(BASE_MS)
    for k in range(3):
        write_deltalake(cfg.late_path, pa.table({"epoch": [k], "topic": ["t"], "partition": [0], "offset": [k],
                                                 "ip": ["10.0.0.1"], "event_time": [t], "window_start": [t],
                                                 "window_end": [t], "watermark": [t]},
                                                schema=arrow_schema(LATE_COLUMNS)), mode="append")
    # (a second here stands for the week a real table's tombstones are kept)
    DeltaTable(cfg.late_path).alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 1 seconds"})
    assert DeltaTable(cfg.late_path).optimize.compact()["numFilesRemoved"] == 3
    time.sleep(2)

    late = {t.table: t for t in maintain(cfg, retention_hours=0).tables}["late_records"]
    assert late.vacuumed_files == 3 and late.files_after == 1
    assert DeltaTable(cfg.late_path).metadata().configuration["delta.deletedFileRetentionDuration"] == \
        "interval 48 hours"


def test_a_published_table_s_files_of_no_commit_go_once_the_publisher_is_caught_up(tmp_path):
    """Files no commit names (an executor-write attempt that died) go once a day old, on a
    published counts table too, when the publisher has sent every version there was when
    maintenance started - whatever maintenance itself commits meanwhile (its compaction here)."""
    from datetime import timedelta

    from ipcount.rules.config import PipelineConfig
    from ipcount.storage import tableset
    from ipcount.storage.sink import Sink

    cfg = PipelineConfig(warehouse=str(tmp_path / "w"), pipeline_id="p", topic="t", publish=True)
    sink = Sink(cfg)
    sink.ensure()
    Ledger(cfg.ledger_path).ensure()
    tableset.claim(cfg)
    start = datetime_us(BASE_MS)
    for epoch in (1, 2, 3):  # three files in one final partition: compaction packs them
        sink._merge_counts(epoch, pa.table({"window_start": [start + timedelta(seconds=5 * epoch)],  # noqa: SLF001
                                            "window_end": [start + timedelta(seconds=5 * epoch + 5)],
                                            "ip": ["10.0.0.1"], "count": [epoch]}), BASE_MS + 86_400_000,
                           finalize_untouched=False)
    orphan = Path(cfg.counts_path) / "window_day=2026-11-21" / "is_final=true" / "epoch-9-dead.parquet"
    orphan.write_bytes(b"a killed attempt's file")
    day_old = time.time() - 25 * 3600
    os.utime(orphan, (day_old, day_old))
    sent_all = DeltaTable(cfg.counts_path).version() + 1
    run = {t.table: t for t in maintain(cfg, next_unpublished=lambda: sent_all, retention_hours=0).tables}
    assert run["counts"].compacted_files == 3            # maintenance committed after the publisher's position
    assert not orphan.exists() and sorted(counts(cfg).values()) == [1, 2, 3]
    assert not any("files of no commit kept" in n for n in run["counts"].notes)


def test_maintenance_refuses_a_ledger_of_another_table_set(tmp_path):
    """Retirement is for good: a ledger of another set would retire epochs these tables have
    yet to see, so the manifest is checked first and nothing is written."""
    from ipcount.rules.config import PipelineConfig
    from ipcount.rules.errors import TableSetMismatch
    from ipcount.storage import tableset
    from ipcount.storage.sink import Sink

    main = PipelineConfig(warehouse=str(tmp_path / "main"), pipeline_id="p", topic="t")
    other = PipelineConfig(warehouse=str(tmp_path / "other"), pipeline_id="p", topic="t")
    for cfg in (main, other):
        Sink(cfg).ensure()
        Ledger(cfg.ledger_path).ensure()
        tableset.claim(cfg)
    mixed = other.replace(ledger_table=main.ledger_path)  # --ledger-table of main by mistake
    with pytest.raises(TableSetMismatch):
        maintain(mixed)
    assert Sink(other).floors() == {path: 0 for path in Sink(other).paths()}
    assert not DeltaTable(other.counts_path).history(1)[0]["operation"].startswith("OPTIMIZE")


def _log_versions(path: str) -> list[int]:
    """The commit versions in a table's ``_delta_log``, oldest first."""
    return sorted(int(p.name.split(".")[0]) for p in (Path(path) / "_delta_log").glob("*.json"))


def _age_log(path: str, hours: float) -> None:
    """Date every file of a table's log ``hours`` back (how delta-rs tells a commit's age)."""
    when = time.time() - hours * 3600
    for p in (Path(path) / "_delta_log").iterdir():
        os.utime(p, (when, when))


def test_every_log_keeps_its_retention_and_epochs_count_on_across_the_cleanup(cfg, spark):
    """Commits older than log_retention_hours leave each table's log at its next checkpoint,
    so what every commit lists stays short; the epochs after that chain on and count exactly."""
    cfg = cfg.replace(max_records_per_epoch=100)
    gen = TrafficGenerator(seed=29, events_per_second=0.5, late_share=0.1, malformed_share=0.05)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(3_000, BASE_MS), partition_of=lambda i, r: i % 3)
    paths = (cfg.ledger_path, cfg.counts_path, cfg.dead_letter_path, cfg.late_path)
    # Until every table is past its first checkpoint (every 10 commits): delta-rs keeps the
    # commits from the checkpoint that the oldest version within the retention is read from.
    first = []
    while min(DeltaTable(p).version() if first else 0 for p in paths) < 11:
        first.append(run_epoch(cfg, spark))
        assert first[-1] is not None and len(first) < 20, [DeltaTable(p).version() for p in paths]
    for path in paths:
        assert _log_versions(path)[0] == 0
        _age_log(path, 2)   # an hour past the retention (1 h)
    rest = run_until_idle(cfg, spark, limit=30)
    assert len(rest) >= 10   # each table past another checkpoint
    for path in paths:
        table = DeltaTable(path)
        assert table.metadata().configuration["delta.logRetentionDuration"] == "interval 1 hours"
        assert _log_versions(path)[0] > 0, path   # the aged commits are gone (at a checkpoint)
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts
    assert dead_letters(cfg) == expected.dead
    assert late_records(cfg) == expected.late
    assert expected.dead and expected.late
