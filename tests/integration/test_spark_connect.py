"""Epochs on a Spark Connect server (``spark_remote``): the epoch runs in the calling process
with a remote session, planning and every Delta commit there, the Kafka read and the
aggregation on the server. A process gets either a classic or a Connect session, never both
(pyspark's Connect mode is process-wide), so the epochs here run as CLI processes, as a DAG
task would run them, and the tests' own Spark session is not used."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ipcount.devtools.generator import TrafficGenerator, produce
from ipcount.rules.errors import EXIT_USAGE
from ipcount.rules.private_files import write_private_file
from tests.conftest import free_port
from tests.ground_truth import expected_tables
from tests.tables import counts, dead_letters, epoch_ranges, late_records, ledger

BASE_MS = 1_795_255_200_000  # 2026-11-21T10:00:00Z


def ipcount(cfg, *args, env=None):
    return subprocess.run([sys.executable, "-m", "ipcount.cli", *args, *cfg.to_args()], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def test_epochs_on_a_connect_server_count_exactly_and_survive_a_crash(cfg, connect):
    cfg = cfg.replace(max_records_per_epoch=400, **connect.settings())
    gen = TrafficGenerator(seed=71, events_per_second=80, late_share=0.05, malformed_share=0.03)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(1000, BASE_MS), partition_of=lambda i, r: i % 3)
    crashed = ipcount(cfg, "epoch", env={"IPCOUNT_CRASH_AT": "after_sink"})
    assert crashed.returncode == -9, crashed.stderr[-3000:]      # its counts written, its ledger commit not
    assert {r["status"] for r in ledger(cfg)} == {"planned"}
    done = ipcount(cfg, "epoch", "--epochs", "10")
    assert done.returncode == 0, done.stderr[-3000:]
    assert {r["status"] for r in ledger(cfg)} == {"committed"} and len(epoch_ranges(cfg)) == 3
    want = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == want.counts and sum(want.counts.values()) > 900
    assert dead_letters(cfg) == want.dead and late_records(cfg) == want.late


def test_a_server_that_is_not_there_or_refuses_the_token_is_a_clear_error(cfg, connect, tmp_path):
    gone = ipcount(cfg.replace(spark_remote=f"sc://localhost:{free_port()}"), "epoch")
    assert gone.returncode == EXIT_USAGE and "no Spark Connect server answers at sc://localhost:" in gone.stderr
    wrong = write_private_file(tmp_path / "wrong-token", "not-the-token\n")
    refused = ipcount(cfg.replace(spark_remote=connect.url, spark_remote_token_file=str(wrong)), "epoch")
    assert refused.returncode == EXIT_USAGE, refused.stderr[-2000:]
    assert f"the Spark Connect server at {connect.url} refused this client's token" in refused.stderr
    assert "not-the-token" not in refused.stderr + refused.stdout
    assert "Traceback" not in refused.stderr
