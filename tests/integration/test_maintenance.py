"""Maintenance against real tables: run over and over while real epochs commit, it changes no
row, and afterwards every table is packed and vacuumed (real broker, Spark and Delta)."""
from __future__ import annotations

import threading
from collections import Counter

import pyarrow as pa
from deltalake import DeltaTable

from ipcount.cli import main as cli_main
from ipcount.rules.maintenance import first_open_hour
from ipcount.storage.ledger import Ledger
from ipcount.storage.maintenance import last_runs, maintain
from ipcount_lab.generator import TrafficGenerator, produce
from tests.conftest import run_until_idle
from tests.ground_truth import expected_tables
from tests.tables import counts, dead_letters, epoch_ranges, late_records

BASE_MS = 1_795_255_200_000  # 2026-11-21T10:00:00Z


def files_per_hour(path: str) -> Counter:
    files = pa.table(DeltaTable(path).get_add_actions(flatten=True))
    return Counter(files.column("partition.window_hour").to_pylist())


def test_maintenance_racing_epochs_changes_no_row_and_packs_every_table(cfg, spark, capsys):
    cfg = cfg.replace(max_records_per_epoch=150)
    # ~100 minutes of event time: hour 10's windows are final by the last epoch, hour 11's are not
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
    before = files_per_hour(cfg.counts_path)
    run = maintain(cfg, retention_hours=0)
    tables = {t.table: t for t in run.tables}
    watermark = Ledger(cfg.ledger_path).state(cfg.topic).watermark_ms
    open_hour = first_open_hour(watermark, cfg.window_ms, cfg.allowed_lateness_ms)
    after = files_per_hour(cfg.counts_path)
    assert open_hour == "2026-11-21T11" and before["2026-11-21T10"] >= 1
    assert {h: n for h, n in after.items() if h < open_hour} == {"2026-11-21T10": 1}  # final hours: one file
    assert after["2026-11-21T11"] == before["2026-11-21T11"]                        # the open hour: untouched
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
    newest = last_runs(cfg)
    assert sorted(r["table"] for r in newest) == ["counts", "dead_letters", "late_records", "ledger", "maintenance"]
    assert len({r["run_id"] for r in newest}) == 1 and newest[0]["run_id"] != run.run_id


def test_maintain_without_a_ledger_says_what_is_missing(tmp_path, caplog):
    assert cli_main(["maintain", f"--warehouse={tmp_path}/nowhere"]) != 0
    assert f"no ledger at {tmp_path}/nowhere/ledger" in caplog.text
