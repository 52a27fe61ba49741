"""What a table set means is fixed when it is created: changed settings, another pipeline
id, or a ledger and counts table that were not created together are refused before
anything is written; verify and rebuild read the recorded meaning."""
from __future__ import annotations

import shutil
import threading

import pytest

from ipcount.jobs.epoch import EpochRunner, run_epoch
from ipcount.jobs.verify import verify
from ipcount.rules.errors import TableSetMismatch
from ipcount.storage import tableset as tableset_io
from ipcount.storage.delta import read_rows, table_metadata
from ipcount_lab.generator import TrafficGenerator, produce
from tests.conftest import run_until_idle
from tests.ground_truth import expected_tables
from tests.tables import counts, dead_letters, epoch_ranges, late_records, snapshot

BASE_MS = 1_795_255_200_000


def _produce(cfg, n=120, seed=81):
    gen = TrafficGenerator(seed=seed, events_per_second=50, malformed_share=0.03)
    return produce(cfg.bootstrap_servers, cfg.topic, gen.records(n, BASE_MS), partition_of=lambda i, r: i % 3)


def test_changed_settings_and_foreign_tables_are_refused(cfg, spark):
    produced = _produce(cfg)
    run_until_idle(cfg, spark)
    recorded = tableset_io.recorded(cfg)
    assert recorded["ipcount.window_seconds"] == "5" and recorded["ipcount.pipeline_id"] == cfg.pipeline_id
    later = _produce(cfg, 60, seed=82)
    before = snapshot(cfg)

    with pytest.raises(TableSetMismatch, match=r"window_seconds: recorded 5, now 60.*new table set"):
        run_epoch(cfg.replace(window_seconds=60), spark)
    with pytest.raises(TableSetMismatch, match=r"max_value_bytes: recorded 65536, now 100"):
        run_epoch(cfg.replace(max_value_bytes=100), spark)
    with pytest.raises(TableSetMismatch, match=r"pipeline_id: recorded p_\w+, now other.*counted twice"):
        run_epoch(cfg.replace(pipeline_id="other"), spark)
    assert snapshot(cfg) == before  # nothing was written

    # a new ledger beside the old counts table: Delta would skip its epochs 1..N as done
    with pytest.raises(TableSetMismatch, match=r"ledger_table_id: recorded .* not created together"):
        run_epoch(cfg.replace(ledger_table=cfg.ledger_path + "_new"), spark)
    # verify recounts with the recorded settings, whatever today's say
    assert verify(cfg.replace(window_seconds=60, max_value_bytes=100)).ok
    # and the recorded settings still count as before
    run_until_idle(cfg, spark)
    assert counts(cfg) == expected_tables(produced + later, epoch_ranges(cfg)).counts


def test_a_recreated_ledger_is_refused(cfg, spark):
    _produce(cfg)
    run_until_idle(cfg, spark)
    shutil.rmtree(cfg.ledger_path)
    with pytest.raises(TableSetMismatch, match=r"ledger_table_id"):
        run_epoch(cfg, spark)


def test_first_epochs_started_together_on_a_new_warehouse_both_open_it(cfg, spark):
    barrier, errors = threading.Barrier(2), []

    def open_tables(c):
        try:
            barrier.wait()
            EpochRunner.open(c, spark)
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)
    threads = [threading.Thread(target=open_tables, args=(cfg,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # the losers of the races see one table set, with one manifest
    assert tableset_io.recorded(cfg)["ipcount.window_seconds"] == "5"


def test_a_table_whose_creation_was_killed_is_created_again(cfg, spark):
    """A creator killed before its first commit leaves a log directory and perhaps a
    temporary commit file: no table, and no obstacle to creating one."""
    from pathlib import Path

    from deltalake import DeltaTable

    paths = (cfg.counts_path, cfg.ledger_path, cfg.dead_letter_path, cfg.late_path)
    for path in paths:
        leftover = Path(path) / "_delta_log" / ".00000000000000000000.json.1b2c.tmp"
        leftover.parent.mkdir(parents=True)
        leftover.write_text("{")
    EpochRunner.open(cfg, spark)
    assert tableset_io.recorded(cfg)["ipcount.pipeline_id"] == cfg.pipeline_id
    for path in paths:
        assert DeltaTable(path).history()[-1]["operation"] == "CREATE TABLE", path


def _manifest(path):
    return {k: v for k, v in table_metadata(path)[1].items() if k.startswith("ipcount.")}


def _strip_manifest(spark, path, names=None):
    """Take manifest entries off a table, as a version that did not record them left it."""
    keys = ", ".join(f"'{k}'" for k in (names if names is not None else _manifest(path)))
    if keys:
        spark.sql(f"ALTER TABLE delta.`{path}` UNSET TBLPROPERTIES IF EXISTS ({keys})")


def _assert_names_all_four(error):
    message = str(error.value)
    assert "new counts, ledger, dead-letter and late-record locations" in message, message


def test_counts_and_ledger_moved_beside_the_old_side_tables_are_refused(cfg, spark):
    """New counts and ledger locations beside the old dead-letter and late tables: their
    transaction ids would make Delta skip the new set's epochs 1..N there, and its dead
    letters and late records would vanish."""
    _produce(cfg, seed=83)
    run_until_idle(cfg, spark)
    assert read_rows(cfg.dead_letter_path), "the data set must give dead letters"
    before = snapshot(cfg)
    moved = cfg.replace(counts_table=cfg.counts_path + "_new", ledger_table=cfg.ledger_path + "_new")
    refused = r"dead_letters does not match .*ledger_table_id: .* not created together"
    with pytest.raises(TableSetMismatch, match=refused) as e:
        run_epoch(moved, spark)
    _assert_names_all_four(e)
    # the same, with side tables of a version that kept no manifest on them
    for path in (cfg.dead_letter_path, cfg.late_path):
        _strip_manifest(spark, path)
    with pytest.raises(TableSetMismatch, match=r"another table set are in .* the ledger .*_new is new") as e:
        run_epoch(moved, spark)
    _assert_names_all_four(e)
    assert snapshot(cfg) == before and read_rows(moved.ledger_path) == []  # nothing was written


def test_side_tables_without_a_manifest_get_it_and_the_set_goes_on(cfg, spark):
    """A table set whose manifest (of an earlier version) is on its counts table and ledger
    only, naming just those two, keeps running: its side tables gain the manifest, and all
    four tables the ids of the side tables."""
    produced = _produce(cfg, seed=84)
    run_until_idle(cfg, spark)
    side_ids = ["ipcount.dead_letter_table_id", "ipcount.late_table_id"]
    for path in (cfg.counts_path, cfg.ledger_path):
        _strip_manifest(spark, path, side_ids)
    for path in (cfg.dead_letter_path, cfg.late_path):
        _strip_manifest(spark, path)
        assert _manifest(path) == {}
    later = _produce(cfg, 60, seed=85)
    run_until_idle(cfg, spark)
    want = expected_tables(produced + later, epoch_ranges(cfg))
    assert counts(cfg) == want.counts and dead_letters(cfg) == want.dead and late_records(cfg) == want.late
    manifests = [_manifest(p) for p in (cfg.counts_path, cfg.ledger_path, cfg.dead_letter_path, cfg.late_path)]
    assert all(m == manifests[0] for m in manifests), manifests
    assert manifests[0]["ipcount.dead_letter_table_id"] == table_metadata(cfg.dead_letter_path)[0]
    assert manifests[0]["ipcount.late_table_id"] == table_metadata(cfg.late_path)[0]
