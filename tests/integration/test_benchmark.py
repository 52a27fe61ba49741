"""Smoke test of bin/benchmark at a tiny size: every measurement runs, every contender's
total is read back from its table and agrees with the others, and the JSON holds the
figures. Not a timed test: it asserts what was measured, never how fast."""
from __future__ import annotations

import json
import subprocess
import sys

from ipcount_lab import bench_flink
from ipcount_lab.bench_rounds import CONTENDERS, EPOCH_CONTENDERS
from ipcount_lab.benchmark import COLD


def test_benchmark_runs_every_measurement_and_writes_json(broker, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "ipcount_lab.benchmark", "--records", "3000", "--rounds", "2",
                           "--epochs", "2", "--small-epochs", "2", "--epoch-records", "150", "--paths-epochs", "5",
                           "--paths-warmup", "2",
                           "--cold-repeats", "1",
                           "--growth-epochs", "12", "--growth-ips", "20", "--history-epochs", "3",
                           "--history-records", "120", "--year-ages", "5,40", "--year-unmaintained-max", "40",
                           "--year-rounds", "2", "--year-epochs", "1", "--year-warmup", "1", "--year-records", "60",
                           "--cardinality-records", "3000", "--cardinality-rounds", "2",
                           "--cardinality-driver-memory", "512m",
                           "--max-driver-tally-rows", "1000",
                           "--bootstrap-servers", broker.bootstrap_servers, "--json", str(out),
                           "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["records"] == 3000 and report["partitions"] == 3 and report["machine"]["cpus"] >= 1

    warm = report["warm"]
    assert [(r["round"], r["contender"]) for r in warm["runs"]] == [
        (1, "spark_count"), (1, "parse_floor"), (1, "peer"), (1, "pipeline"), (1, "peer_epochs"),
        (1, "pipeline_epochs"), (2, "parse_floor"), (2, "peer"), (2, "pipeline"), (2, "peer_epochs"),
        (2, "pipeline_epochs"), (2, "spark_count")]  # rotated
    c = warm["contenders"]
    assert set(c) == {*CONTENDERS, *EPOCH_CONTENDERS}
    for name, summary in c.items():
        assert summary["records"] == 3000 and summary["cold_seconds"] > 0 and summary["warm"]["n"] == 1, name
    # Read back from the tables: one batch counts the same either way; in two epochs the
    # watermark moves and the pipeline keeps every record it finds late in its late table.
    # (What Spark's watermark drops is its own affair: counted, not asserted.)
    assert c["spark_count"]["counted"] == 3000
    assert c["parse_floor"]["counted"] == c["pipeline"]["counted"]  # what it parsed into requests, in flight
    assert 0 < c["pipeline"]["counted"] == c["peer"]["counted"] < 3000 and c["pipeline"]["late"] == 0
    assert c["pipeline"]["counted"] + c["pipeline"]["malformed"] == 3000
    assert c["pipeline_epochs"]["batches"] == 2 and c["peer_epochs"]["batches"] >= 2  # (+ a no-data batch)
    assert c["pipeline_epochs"]["late"] > 0
    assert c["pipeline_epochs"]["counted"] + c["pipeline_epochs"]["late"] == c["pipeline"]["counted"]
    assert 0 < c["peer_epochs"]["counted"] <= c["peer"]["counted"]
    assert set(c["pipeline"]["stages"]) == {"plan", "read", "aggregate", "side_tables", "merge", "ledger",
                                               "kafka_commit"}
    assert set(warm["ratios"]) == {"pipeline / peer", "pipeline / read limit", "pipeline / parse floor",
                                   "parse floor / peer (the ceiling)", "pipeline_epochs / peer_epochs",
                                   "pipeline_epochs / read limit"}
    assert all(r["n"] == 1 and r["median"] > 0 for r in warm["ratios"].values())
    assert warm["memory"]["peak_heap_mb"] > 50 and warm["peak_rss_mb"] > 50
    small = warm["small"]
    assert len(small["pipeline"]["seconds"]) == 2 and len(small["peer"]["seconds"]) >= 2
    assert small["pipeline"]["steady"]["n"] == 2 and small["pipeline"]["growth"] is None  # too few to say
    assert small["tables"]["ledger"]["version"] >= 2 and small["tables"]["counts"]["rows"] > 0

    cold = report["cold"]["contenders"]
    assert set(cold) == set(COLD)
    for name, summary in cold.items():
        assert summary["wall"]["median"] > summary["work"]["median"] > 0 and summary["peak_driver_mb"] > 50, name
    assert cold["pipeline"]["counted"] == cold["peer"]["counted"] == c["pipeline"]["counted"]
    assert {"pipeline / peer (work)", "pipeline / peer (wall)"} <= set(report["cold"]["ratios"])

    flink = report["flink"]  # the seeds' job in Flink SQL, when bin/setup --flink has set it up (bin/test does)
    if bench_flink.not_set_up():
        assert "bin/setup --flink" in flink["skipped"] and "flink: skipped: " in proc.stdout
    else:
        # Every job's sink topic was read back read_committed and matched the recount window by
        # window (else it raises); the recount agrees with the pipeline's count of the range.
        assert flink["counted"] == c["pipeline"]["counted"] and flink["jobs"] == 2 and flink["repeats"] == 1
        assert [r["round"] for r in flink["warm"]["runs"]] == [1, 2] and flink["warm"]["job"]["n"] == 1
        assert all(r["seconds"] > 0 and r["submitted_seconds"] >= r["seconds"] for r in flink["warm"]["runs"])
        cold_run, = flink["cold"]["runs"]
        assert cold_run["wall_seconds"] > cold_run["submitted_seconds"] > 0 and cold_run["peak_mb"] > 50
        assert flink["warm"]["peak_mb"] > 50
        for text in ("flink: the seeds' job in Flink SQL", "pipeline / flink, warm", "pipeline / flink, cold"):
            assert text in proc.stdout, text

    paths = report["paths"]
    assert paths["connect_start"]["wall_seconds"] > 0 and paths["epoch"]["wall_seconds"] > 0
    assert paths["empty_epoch"]["stages"] == {"kafka_commit": paths["empty_epoch"]["stages"]["kafka_commit"]}
    assert paths["idle_check"]["wall_seconds"] > 0 and report["kafka_python"]["seconds"]["n"] == 1
    # Read back from each table set (else it raises): every record produced read once, and
    # counted, late or dead-lettered.
    totals = paths["totals"]
    assert totals["records"] == 300 == totals["counted"] + totals["late"] + totals["malformed"]
    assert totals["counted"] > 0
    warm_paths = paths["warm"]  # after its first, 2 untimed epochs, 5 timed, then an empty one
    assert warm_paths["epochs"] == 5 == warm_paths["epoch"]["n"] == len(warm_paths["seconds"])
    assert warm_paths["warmup_epochs"] == 2 == warm_paths["warmup"]["n"]
    assert all(s > 0 for s in warm_paths["seconds"]) and warm_paths["epoch"]["median"] > 0
    assert warm_paths["first_epoch_seconds"] > 0 and warm_paths["wall_seconds"] > sum(warm_paths["seconds"])
    assert {"plan", "read", "merge", "ledger", "kafka_commit"} <= set(warm_paths["stages"])
    totals = warm_paths["totals"]
    assert totals["records"] == 8 * 150 == totals["counted"] + totals["late"] + totals["malformed"]
    assert totals["counted"] > 0
    in_process = paths["warm_in_process"]  # the same epochs in an in-process session, its own tables
    assert in_process["epoch"]["n"] == 5 and in_process["warmup"]["n"] == 2
    assert in_process["totals"] == totals
    profile = report["profile"]
    assert profile["records"] == 3000
    assert list(profile["path"]) == ["scan", "parse", "parse_new_plan_time", "classify", "tally", "read_stage"]
    assert set(profile["pieces"]) == {"scan_json", "parse_json", "scan_other", "parse_other"}
    assert all(v > 0 for part in ("path", "pieces") for v in profile[part].values())
    assert profile["codegen"]["compiles"] > 0 and profile["codegen"]["compile_seconds"] > 0
    history = report["history"]  # a chain of whole epochs, each a minute of event time
    assert history["epochs"] == 3 == history["run"]["batches"] and len(history["seconds"]) == 3
    assert history["ratio"] is None and history["early"] == {}  # too short to say
    run = history["run"]
    assert run["records"] == 360 and run["counted"] + run["late"] + run["malformed"] == 360 and run["counted"] > 0
    assert history["tables"]["ledger"]["rows"] > 0 and history["tables"]["counts"]["rows"] > 0
    grown = report["growth"]  # its total read back from the table equals what was merged (else it raises)
    assert grown["epochs"] == 12 and len(grown["seconds"]) == 12 and grown["rows_per_epoch"] == 7 * 20
    assert grown["requests"] > 12 * 7 * 20 and 0 < grown["table_rows"] <= 12 * 7 * 20 and grown["files"] >= 1
    year = report["year"]  # real epochs on synthesized table sets, maintained and not
    assert set(year["sets"]) == {"5-on", "5-off", "40-on", "40-off"}
    for name, s in year["sets"].items():
        assert s["epochs"] == 2 and s["stages"]["epoch"]["median"] > 0, name
        assert {"plan", "read", "side_tables", "merge", "ledger", "group_commit", "idle_check", "monitor"} <= \
            set(s["stages"]), name
    # each age's sets read the same 180 records (checked, else it raises) and counted the same
    assert year["sets"]["5-on"]["counted"] == year["sets"]["5-off"]["counted"] > 0
    assert year["sets"]["40-on"]["stages"]["epoch"]["ratio"] > 0
    assert year["sets"]["5-on"]["stages"]["epoch"]["ratio"] == 1   # (the base of the ratios)
    tables = year["tables"]
    assert tables["40-off"]["dead_letter"]["transactions"] >= 40 and tables["40-on"]["dead_letter"]["transactions"] < 10
    assert tables["40-off"]["ledger"]["version"] > 80 and tables["40-on"]["counts"]["files"] >= 1
    card = report["cardinality"]  # every record a client of its own: the executors write the tally
    sized = card["sizes"]["3000"]
    assert card["driver_memory"] == "512m" and card["max_driver_tally_rows"] == 1000
    assert [(r["round"], r["contender"]) for r in sized["runs"]] == [(1, "peer"), (1, "pipeline"), (2, "pipeline"),
                                                                    (2, "peer")]
    pipeline = sized["contenders"]["pipeline"]
    assert pipeline["counted"] == sized["contenders"]["peer"]["counted"] > 2900 and pipeline["batches"] == 1
    assert "aggregate" not in pipeline["stages"] and pipeline["stages"]["merge"] > 0  # (the executors' path)
    assert sized["ratio"]["n"] == 1 and sized["ratio"]["median"] > 0
    for text in ("cardinality: every record from a client of its own", "warm: one Spark session", "pipeline / peer",
                 "cold: each contender",
                 "paths: Spark Connect server start", "warm, one process and remote session: a 150-record epoch",
                 "kafka_python: a plain consumer", "profile: 3,000 records", "history: 3 epochs of 120",
                 "growth: 12 epochs", "year: real epochs of 60 records"):
        assert text in proc.stdout, text


def test_benchmark_runs_the_pipeline_on_clusters_of_one_and_two_workers(broker, tmp_path):
    """``--only cluster`` at a tiny size: a cluster of each count of workers, the rounds of one
    session on each, the tally written by the executors, both clusters counting the same."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "ipcount_lab.benchmark", "--only", "cluster",
                           "--cluster-records", "3000", "--cluster-workers", "1,2", "--cluster-rounds", "2",
                           "--cluster-driver-memory", "512m", "--cluster-executor-memory", "512m",
                           "--max-driver-tally-rows", "1000",
                           "--bootstrap-servers", broker.bootstrap_servers, "--json", str(out),
                           "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    cluster = json.loads(out.read_text())["cluster"]
    assert (cluster["records"], cluster["rounds"], cluster["driver_memory"], cluster["executor_memory"]) == (
        3000, 2, "512m", "512m")
    assert list(cluster["workers"]) == ["1", "2"]
    for n, w in cluster["workers"].items():
        assert w["ok"] and w["exit"] == 0 and w["rounds_done"] == 2, (n, w)
        assert [(r["round"], r["contender"]) for r in w["runs"]] == [(1, "pipeline"), (2, "pipeline")]
        pipeline = w["pipeline"]
        assert pipeline["batches"] == 1 and pipeline["counted"] > 2900
        assert pipeline["counted"] + pipeline["late"] + pipeline["malformed"] == 3000
        assert "aggregate" not in pipeline["stages"] and pipeline["stages"]["merge"] > 0  # (the executors' path)
        assert w["peak_rss_mb"] > 0 and w["memory"]["peak_heap_mb"] > 0 and w["memory"]["python_peak_rss_mb"] > 20
    assert cluster["workers"]["1"]["pipeline"]["counted"] == cluster["workers"]["2"]["pipeline"]["counted"]
    assert list(cluster["speedup"]) == ["2"] and cluster["speedup"]["2"] > 0
    for text in ("cluster: 3,000 records", "   1 worker: 2 of 2 rounds", "   2 workers: 2 of 2 rounds",
                 "adding workers"):
        assert text in proc.stdout, text


def test_benchmark_refuses_bad_arguments():
    for args, message in ((["--records", "0"], "--records must be at least 1"),
                          (["--only", "pipeline,nope"], "--only takes names from"),
                          (["--rounds", "1"], "--rounds must be at least 2"),
                          (["--small-epochs", "1"], "--small-epochs must be at least 2"),
                          (["--paths-epochs", "4"], "--paths-epochs must be at least 5"),
                          (["--history-records", "2"], "--history-records must be at least --partitions"),
                          (["--year-ages", "10,x"], "--year-ages takes distinct whole numbers"),
                          (["--cardinality-records", "1000,1000"], "--cardinality-records takes distinct"),
                          (["--cluster-workers", "1,0"], "--cluster-workers takes distinct whole numbers"),
                          (["--cluster-rounds", "0"], "--cluster-rounds must be at least 1"),
                          (["--cluster-driver-memory", "512"], "--cluster-driver-memory takes a JVM memory size")):
        proc = subprocess.run([sys.executable, "-m", "ipcount_lab.benchmark", *args], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
