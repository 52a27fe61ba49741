"""SIGKILL the epoch process at every step boundary, re-run, and compare with a clean run."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

from ipcount.jobs import group_commit
from ipcount.jobs.crash import CRASH_POINTS
from ipcount.rules.config import PipelineConfig
from ipcount.storage import broker as broker_io
from ipcount.storage.ledger import committed_epochs
from ipcount_lab.chaos import phase_of
from ipcount_lab.generator import TrafficGenerator, produce
from tests.conftest import run_until_idle
from tests.tables import ledger, snapshot

BASE_MS = 1_795_255_200_000


def run_to_end(cfg, spark):
    """Every epoch there is, then the group-offset commit, as the DAG would."""
    run_until_idle(cfg, spark)
    group_commit.commit_group_offsets_from_ledger(cfg)


@pytest.fixture(scope="module")
def source(broker, spark, tmp_path_factory):
    """One topic with a known data set, and the tables a crash-free run makes of it."""
    topic = f"crash_{uuid.uuid4().hex[:8]}"
    base = PipelineConfig(bootstrap_servers=broker.bootstrap_servers, topic=topic, max_records_per_epoch=250,
                          spark_master="local[2]", warehouse=str(tmp_path_factory.mktemp("clean")),
                          group_id=f"clean_{topic}")
    broker_io.create_topic(base, 3)
    gen = TrafficGenerator(seed=21, events_per_second=40, late_share=0.05, malformed_share=0.03)
    produced = produce(base.bootstrap_servers, topic, gen.records(600, BASE_MS), partition_of=lambda i, r: i % 3)
    run_to_end(base, spark)
    assert len(committed_epochs(base.ledger_path)) == 3
    return base, produced


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_then_rerun_gives_the_tables_of_a_clean_run(point, source, spark, tmp_path):
    clean, produced = source
    cfg = clean.replace(warehouse=str(Path(tmp_path) / "warehouse"), group_id=f"g_{point}_{clean.topic}")

    proc = subprocess.run([sys.executable, "-m", "ipcount.cli", "epoch", *cfg.to_args()],
                          env={**os.environ, "IPCOUNT_CRASH_AT": point}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]  # killed by SIGKILL, not a clean exit
    # The step markers chaos reads tell where the epoch was (ipcount.jobs.crash.step_line).
    assert phase_of(proc.stdout + proc.stderr) == ("writing" if point in ("after_plan", "after_sink")
                                                   else "committed")

    rows = ledger(cfg)
    assert {r["epoch"] for r in rows} == {1}
    status = {r["status"] for r in rows}
    assert status == ({"planned"} if point in ("after_plan", "after_sink") else {"committed"})
    assert broker_io.group_offsets(cfg) == {}  # the crash came before any group commit

    run_to_end(cfg, spark)  # the re-run: finishes epoch 1, then the rest
    assert snapshot(cfg) == snapshot(clean)
    ends = dict(Counter(p.partition for p in produced))
    assert broker_io.group_offsets(cfg) == ends


@pytest.fixture(scope="module")
def clean_backfill(source, spark, tmp_path_factory):
    """The tables a crash-free backfill of the whole topic makes (3 chunks of 250)."""
    from ipcount.jobs.backfill import run_backfill

    base, produced = source
    clean = base.replace(warehouse=str(tmp_path_factory.mktemp("clean_backfill")))
    spec = ",".join(f"{p}:0-{n}" for p, n in sorted(Counter(p.partition for p in produced).items()))
    report = run_backfill(clean, spark, _request(spec, clean))
    assert len(report.epochs) == 3
    return clean, spec


def _request(spec, cfg):
    from ipcount.rules.requests import BackfillRequest, parse_offsets
    return BackfillRequest(offsets=parse_offsets(spec, cfg.topic))


@pytest.mark.parametrize("point", ["after_sink"])  # (every crash point is covered for scheduled epochs)
def test_a_crashed_backfill_rerun_gives_the_tables_of_a_clean_one(point, clean_backfill, spark, tmp_path):
    from ipcount.jobs.backfill import run_backfill

    clean, spec = clean_backfill
    cfg = clean.replace(warehouse=str(Path(tmp_path) / "warehouse"))
    proc = subprocess.run([sys.executable, "-m", "ipcount.cli", "backfill", "--offsets", spec, *cfg.to_args()],
                          env={**os.environ, "IPCOUNT_CRASH_AT": point}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert {(r["epoch"], r["status"]) for r in ledger(cfg)} == {(1, "planned")}  # the first chunk was in flight

    report = run_backfill(cfg, spark, _request(spec, cfg))   # the same request again
    assert [s.epoch for s in report.resumed] == [1] and [s.epoch for s in report.epochs] == [2, 3]
    assert snapshot(cfg) == snapshot(clean)
