"""The benchmark's arithmetic and its printed report: medians with their spread, ratios
taken round by round, the cold round kept apart."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from ipcount_lab.bench_stats import contender_summary, growth, history_summary, paired_ratio, spread, steady
from ipcount_lab.benchmark import ProcessFailed, render, run_process


def run(contender, rnd, seconds, **extra):
    return {"contender": contender, "round": rnd, "seconds": seconds, "records": 1000, "counted": 990, "late": 0,
            "malformed": 10, "batches": 1, "stages": {}, "spill_bytes": 0, **extra}


def test_spread_is_the_median_with_min_and_max():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert spread([]) == {}


def test_ratios_are_taken_round_by_round_before_the_median():
    # Round 3 is slow for both: per-round ratios stay 2.0; a ratio of medians would not.
    runs = [run("pipeline", 2, 5.0), run("peer", 2, 10.0), run("pipeline", 3, 50.0), run("peer", 3, 100.0),
            run("pipeline", 4, 6.0), run("peer", 4, 12.0), run("pipeline", 1, 1.0), run("peer", 1, 99.0)]
    assert paired_ratio(runs, "pipeline", "peer", first_round=2) == {"median": 2.0, "min": 2.0, "max": 2.0, "n": 3}
    assert paired_ratio(runs, "pipeline", "peer")["max"] == 99.0  # round 1 only when asked for
    assert paired_ratio(runs, "pipeline", "nobody") == {}


def test_a_contender_summary_keeps_round_1_apart_and_takes_stage_medians_of_the_warm_rounds():
    runs = [run("pipeline", 1, 20.0, stages={"read": 9.0}), run("pipeline", 2, 10.0, stages={"read": 4.0}),
            run("pipeline", 3, 12.0, stages={"read": 6.0}, spill_bytes=7, gc_seconds=0.5),
            run("pipeline", 4, 11.0, stages={"read": 5.0}, gc_seconds=0.7)]
    s = contender_summary(runs, "pipeline")
    assert s["cold_seconds"] == 20.0 and s["warm"] == {"median": 11.0, "min": 10.0, "max": 12.0, "n": 3}
    assert s["stages"] == {"read": 5.0} and s["records_per_second"] == round(1000 / 11.0)
    assert (s["counted"], s["malformed"], s["spill_bytes_max"], s["gc_seconds"]) == (990, 10, 7, 0.5)
    assert contender_summary(runs, "peer") == {}


def test_small_epoch_series_skip_their_first_three_and_growth_compares_the_last_three_with_4_to_6():
    series = [9.0, 5.0, 4.0, 2.0, 2.0, 2.0, 2.5, 3.0, 3.0, 3.0]
    assert steady(series) == {"median": 2.5, "min": 2.0, "max": 3.0, "n": 7}
    assert growth(series) == 1.5
    assert growth(series[:8]) is None  # too short to say
    assert steady([4.0, 2.0]) == spread([4.0, 2.0])


def test_the_report_prints_warm_cold_paths_and_the_drain():
    runs = [run(c, r, s) for r in (1, 2, 3) for c, s in (("spark_count", 2.0), ("peer", 10.0), ("pipeline", 8.0))]
    contenders = {c: contender_summary(runs, c) for c in ("spark_count", "peer", "pipeline")}
    report = {"records": 1000, "partitions": 3,
              "warm": {"rounds": 3, "contenders": contenders,
                       "ratios": {"pipeline / peer": paired_ratio(runs, "pipeline", "peer", 2)},
                       "memory": {"peak_heap_mb": 812.5, "gc_seconds": 1.2},
                       "small": {"records_per_epoch": 2000,
                                 "pipeline": {"seconds": [3.0] * 9, "steady": steady([3.0] * 9), "growth": 1.0}}},
              "cold": {"repeats": 1, "contenders": {"pipeline": {"work": spread([30.0]), "wall": spread([41.0]),
                                                                 "peak_driver_mb": 900.0, "counted": 990}},
                       "ratios": {"pipeline / peer (work)": spread([0.8])}},
              "paths": {"records_per_epoch": 2000, "connect_start": {"wall_seconds": 20.0},
                        "first_epoch": {"wall_seconds": 9.0}, "epoch": {"wall_seconds": 4.0},
                        "empty_epoch": {"wall_seconds": 0.1}, "idle_check": {"wall_seconds": 1.2},
                        "warm": {"epochs": 5, "first_epoch_seconds": 2.5, "epoch": spread([0.5, 0.4, 0.6, 0.5, 0.7]),
                                 "warmup_epochs": 3, "warmup": spread([0.9, 0.8, 1.0]),
                                 "stages": {"read": 0.3, "merge": 0.1}, "empty_epoch_seconds": 0.05},
                        "warm_in_process": {"epoch": spread([0.6, 0.7, 0.8])}},
              "kafka_python": {"seconds": spread([3.0, 4.0, 5.0])}}
    text = render(report)
    warm_line, cold_line = (line.split() for line in text.splitlines() if line.startswith("pipeline "))
    assert warm_line[:5] == ["pipeline", "8.00", "8.00", "[8.00-8.00]", "125"]
    assert cold_line == ["pipeline", "30.00", "[30.00-30.00]", "41.00", "[41.00-41.00]", "900", "990"]
    assert "pipeline / peer                    1.25 [1.25-1.25]" in text
    assert "peak heap 812.5 MB" in text and "small epochs of 2,000 records, pipeline: 9 epochs" in text
    assert "pipeline / peer (work)             0.80 [0.80-0.80]" in text
    assert "paths: Spark Connect server start 20.0 s" in text
    assert "a 2,000-record epoch 4.00 s" in text and "idle check (no JVM) 1.20 s" in text
    assert ("warm, one process and remote session: a 2,000-record epoch 0.50 s [0.40-0.70] (5 epochs after its "
            "first, 2.50 s, and 3 warm-up epochs, 0.90 s [0.80-1.00]), an empty epoch 0.05 s; stages (median s) read 0.300 merge 0.100") in text
    assert ("  the same epochs in an in-process session (no Connect): 0.70 s [0.60-0.80]; Connect / in-process 0.71"
            in text)
    assert "kafka_python: a plain consumer draining the range: 4.00 s [3.00-5.00]" in text


def test_a_long_chain_compares_epochs_6_to_15_with_the_last_ten_overall_and_stage_by_stage():
    # 130 epochs: 1.0 s early, the merge stage creeping up, the last ten 1.5 s.
    seconds = [3.0] * 5 + [1.0] * 115 + [1.5] * 10
    stages = [{"read": 0.5, "merge": 0.1 + n / 1000} for n in range(130)]
    h = history_summary(seconds, stages)
    assert h["epochs"] == 130 and h["early"] == spread([1.0] * 10) and h["last"] == spread([1.5] * 10)
    assert h["ratio"] == 1.5
    assert h["stages"] == {"merge": {"early": 0.1095, "last": 0.2245}, "read": {"early": 0.5, "last": 0.5}}
    assert h["hours"] == [1.0, 1.0, 1.5]  # epochs 1-60, 61-120, 121-130
    assert history_summary(seconds[:20], stages[:20])["ratio"] is None  # too short to say


def test_the_report_prints_the_history():
    seconds = [1.0] * 20 + [1.2] * 10
    stages = [{"merge": 0.1}] * 30
    history = {"records_per_epoch": 10_000, **history_summary(seconds, stages),
               "tables": {"counts": {"rows": 5000, "files": 3, "version": 31}}}
    text = render({"records": 0, "partitions": 3, "history": history})
    assert "history: 30 epochs of 10,000 records, a minute of event time each: epochs 6-15 1.00 s [1.00-1.00]" in text
    assert "the last 10 1.20 s [1.20-1.20] (x1.20)" in text and "merge 0.100 -> 0.100" in text
    assert "counts 5,000 rows in 3 files (version 31)" in text


def test_the_report_prints_each_cluster_its_failure_and_what_adding_workers_buys():
    def on(workers, seconds):
        runs = [run("pipeline", r, s, stages={"read": s - 1.0}) for r, s in enumerate(seconds, 1)]
        return {"ok": True, "exit": 0, "log": f"cluster-{workers}w.log", "rounds_done": len(runs),
                "peak_rss_mb": 700.4, "runs": runs,
                "memory": {"peak_heap_mb": 301.6, "gc_seconds": 0.0, "python_peak_rss_mb": 210.4},
                "pipeline": contender_summary(runs, "pipeline")}
    cluster = {"records": 5_000_000, "rounds": 3, "driver_memory": "512m", "executor_memory": "1g",
               "workers": {"1": on(1, [90.0, 80.0, 82.0]), "2": on(2, [60.0, 50.0, 52.0]),
                           "4": {"ok": False, "exit": 52, "log": "logs/cluster-4w.log", "rounds_done": 1}},
               "speedup": {"2": 1.577}}
    text = render({"records": 0, "partitions": 3, "cluster": cluster})
    assert "cluster: 5,000,000 records, each from a client of its own" in text
    assert "executors 1g, driver heap 512m; 3 rounds in one session, the first cold" in text
    assert ("   1 worker: 3 of 3 rounds; round 1 90.00 s, warm 81.00 s [80.00-82.00]; 990 counted; driver peak heap "
            "302 MB, its JVM's peak RSS 700 MB, its Python's 210 MB; stages read 80.00") in text
    assert "   2 workers: 3 of 3 rounds; round 1 60.00 s, warm 51.00 s [50.00-52.00]" in text
    assert "   4 workers: 1 of 3 rounds, then the spark-submit failed (exit 52; logs/cluster-4w.log)" in text
    assert "adding workers (the 1-worker warm median / this one's, > 1: faster): 2 workers x1.58" in text


def test_the_report_prints_flink_beside_the_pipeline_as_ratios_of_medians():
    spread_of = (lambda m: {"median": m, "min": m, "max": m, "n": 1})
    flink = {"jobs": 3, "repeats": 1, "counted": 990,
             "warm": {"first_job_seconds": 8.0, "job": spread_of(6.0), "peak_mb": 900.0},
             "cold": {"job": spread_of(9.0), "wall": spread_of(20.0), "peak_mb": 700.0}}
    report = {"flink": flink, "warm": {"contenders": {"pipeline": {"warm": spread_of(2.0)}}},
              "cold": {"contenders": {"pipeline": {"wall": spread_of(10.0)}}}}
    from ipcount_lab.benchmark import _render_flink

    text = "\n".join(_render_flink(report))
    assert "990 requests counted by every job" in text and "the first 8.00, the rest 6.00 [6.00-6.00]" in text
    assert "process wall 20.00 [20.00-20.00]; peak JVM 700 MB" in text
    assert "pipeline / flink, warm (the pipeline's warm epoch against Flink's warm job): 3.00" in text
    assert "pipeline / flink, cold (process wall against process wall): 2.00" in text
    alone = "\n".join(_render_flink({"flink": flink}))  # no pipeline figures: no ratios
    assert "pipeline / flink" not in alone
    assert _render_flink({"flink": {"skipped": "no PyFlink"}}) == ["flink: skipped: no PyFlink", ""]


def test_the_flink_contender_says_what_is_missing_until_it_is_set_up(tmp_path, monkeypatch):
    from ipcount_lab import bench_flink

    monkeypatch.setattr(bench_flink, "FLINK_PYTHON", tmp_path / "venv" / "bin" / "python")
    monkeypatch.setattr(bench_flink, "FLINK_JARS", tmp_path / "jars")
    assert "no PyFlink virtualenv" in bench_flink.not_set_up() and "bin/setup --flink" in bench_flink.not_set_up()
    bench_flink.FLINK_PYTHON.parent.mkdir(parents=True)
    bench_flink.FLINK_PYTHON.touch()
    assert "no flink-sql-connector-kafka jar" in bench_flink.not_set_up()
    (tmp_path / "jars").mkdir()
    (tmp_path / "jars" / "flink-sql-connector-kafka-5.0.0-2.2.jar").touch()
    assert bench_flink.not_set_up() is None
    assert bench_flink.connector_jar().name == "flink-sql-connector-kafka-5.0.0-2.2.jar"


def test_a_measured_command_that_hangs_is_killed_with_its_children_and_fails(tmp_path):
    pid_file = tmp_path / "child.pid"
    # A child process that outlives its parent's kill unless the whole session is killed.
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    started = time.monotonic()
    with pytest.raises(ProcessFailed, match="stopped after 1 s"):
        run_process(["bash", "-c", script], tmp_path / "hang.log", timeout=1)
    assert time.monotonic() - started < 10
    child = int(pid_file.read_text())
    time.sleep(0.2)
    status = Path(f"/proc/{child}/status")
    # Gone with its parent, or dead and not yet reaped by whichever process adopted it.
    assert not status.exists() or "\nState:\tZ" in status.read_text()
