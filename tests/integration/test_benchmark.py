"""Smoke test of bin/benchmark at a tiny size: every measurement runs, the pipeline and the
peer count the same requests, and the JSON holds the figures and ratios. Not a timed test:
it asserts what was measured, never how fast."""
from __future__ import annotations

import json
import subprocess
import sys

from ipcount.devtools.benchmark import MEASUREMENTS


def test_benchmark_runs_every_measurement_and_writes_json(broker, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "ipcount.devtools.benchmark", "--records", "3000", "--history-epochs", "3",
                           "--epoch-records", "300", "--bootstrap-servers", broker.bootstrap_servers,
                           "--json", str(out), "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["records"] == 3000 and report["partitions"] == 3 and report["machine"]["cpus"] >= 1
    measured = report["measurements"]
    small = ["epoch_after_1", "server_epoch_after_2", "empty_server", "empty_submit", "idle_check", "epoch_after_3",
             "server_epoch_after_4"]
    assert list(measured) == ["server_start", *MEASUREMENTS[:-1], *small]
    sizes = {"server_start": 0, **{m: 3000 for m in MEASUREMENTS[:-1]},
             **{m: 0 if m.startswith(("empty", "idle")) else 300 for m in small}}
    for name, m in measured.items():
        assert m["records"] == sizes[name] and m["wall_seconds"] >= m["work_seconds"] > 0, name
        assert (m["records_per_second"] > 0) == (sizes[name] > 0)
    for spark_run in ("pipeline", "pipeline_server", "peer", "spark_count", "epoch_after_1", "empty_submit",
                      "epoch_after_3", "server_epoch_after_2", "server_epoch_after_4"):
        assert measured[spark_run]["peak_driver_mb"] > 50, spark_run  # a JVM was watched
    stages = {"plan", "read", "aggregate", "merge", "ledger", "kafka_commit"}
    for epoch in ("pipeline", "pipeline_server", "epoch_after_3", "server_epoch_after_4"):
        assert set(measured[epoch]["stages"]) == stages, epoch
    # The same epoch through spark-submit and through the server counts the same, as does the peer.
    assert 0 < measured["pipeline"]["counted"] == measured["pipeline_server"]["counted"] \
        == measured["peer"]["counted"] < 3000  # some late/malformed
    pairs = [f"{p} / {o}" for p in ("pipeline", "pipeline_server")
             for o in ("peer", "spark read limit", "kafka-python drain")]
    pairs += ["epoch after 3 / after 1", "epoch server: epoch after 4 / after 2"]
    assert set(report["ratios"]) == {f"{r} ({kind})" for r in pairs for kind in ("work", "wall")} | {
        "empty epoch: spark-submit / idle check (wall)", "empty epoch: spark-submit / empty server (wall)"}
    tables = report["small_epochs"]["tables"]
    assert report["small_epochs"]["epochs"] == 5 and tables["counts"]["rows"] > 0
    assert 5 <= tables["ledger"]["rows"] <= 5 * 3  # a row per epoch and partition read
    assert "pipeline / peer (work)" in proc.stdout and "records/s (work)" in proc.stdout
    assert "empty epoch through spark-submit" in proc.stdout


def test_benchmark_refuses_bad_arguments():
    for args, message in ((["--records", "0"], "--records must be at least 1"),
                          (["--only", "pipeline,nope"], "--only takes names from"),
                          (["--history-epochs", "2"], "--history-epochs must be at least 3")):
        proc = subprocess.run([sys.executable, "-m", "ipcount.devtools.benchmark", *args], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
