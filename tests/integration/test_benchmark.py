"""Smoke test of bin/benchmark at a tiny size: every measurement runs, the pipeline and the
peer count the same requests, and the JSON holds the figures and ratios. Not a timed test:
it asserts what was measured, never how fast."""
from __future__ import annotations

import json
import subprocess
import sys

from ipcount.benchmark import MEASUREMENTS


def test_benchmark_runs_every_measurement_and_writes_json(broker, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "ipcount.benchmark", "--records", "3000",
                           "--bootstrap-servers", broker.bootstrap_servers, "--json", str(out),
                           "--workdir", str(tmp_path / "work")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["records"] == 3000 and report["partitions"] == 3 and report["machine"]["cpus"] >= 1
    measured = report["measurements"]
    assert list(measured) == list(MEASUREMENTS)
    for m in measured.values():
        assert m["records"] == 3000 and m["wall_seconds"] >= m["work_seconds"] > 0 and m["records_per_second"] > 0
    for spark_run in ("pipeline", "peer", "spark_count"):
        assert measured[spark_run]["peak_driver_mb"] > 50  # a JVM was watched
    assert set(measured["pipeline"]["stages"]) == {"plan", "read", "aggregate", "merge", "ledger", "kafka_commit"}
    assert 0 < measured["pipeline"]["counted"] == measured["peer"]["counted"] < 3000  # some late/malformed
    assert set(report["ratios"]) == {f"{r} ({kind})" for r in ("pipeline / peer", "pipeline / spark read limit",
                                                                "pipeline / kafka-python drain")
                                     for kind in ("work", "wall")}
    assert "pipeline / peer (work)" in proc.stdout and "records/s (work)" in proc.stdout


def test_benchmark_refuses_bad_arguments():
    for args, message in ((["--records", "0"], "--records must be at least 1"),
                          (["--only", "pipeline,nope"], "--only takes names from")):
        proc = subprocess.run([sys.executable, "-m", "ipcount.benchmark", *args], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
