"""The performance page is a reference drawn from the results log: the log parses, a
benchmark report maps to its rows, and the charts and the page's table are what the log
draws, byte for byte."""
from __future__ import annotations

import csv
import re
import shutil
from datetime import date

from ipcount.rules.config import REPO_ROOT
from ipcount_lab import bench_charts, bench_log
from ipcount_lab.benchmark import arguments, flink_ratios

PAGE = REPO_ROOT / "docs" / "performance.md"
UNITS = {"s", "ms", "MB", "x", "count"}
PARTS = {"warm", "small", "cold", "flink", "paths", "kafka_python", "profile", "history", "growth", "year",
         "cardinality", "cluster", "latency", "ledger"}
CHARTS = ("now.svg", "ratio-trend.svg", "small-epoch-trend.svg", "year.svg")


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_page_is_a_reference_of_at_most_300_lines_whose_linked_sections_exist():
    text = PAGE.read_text()
    assert len(text.splitlines()) <= 300
    headings = re.findall(r"(?m)^#+ (.+)$", text)
    assert {"Latency", "A year of minute epochs", "Started by new records"} <= set(headings)  # linked, cited
    anchors = {slug(h) for h in headings}
    linked = [(page.name, anchor) for page in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
              for anchor in re.findall(r"\]\((?:docs/)?performance\.md#([^)]+)\)", page.read_text())]
    linked += [("performance.md", anchor) for anchor in re.findall(r"\]\(#([^)]+)\)", text)]
    assert [(page, a) for page, a in linked if a not in anchors] == []
    assert len(linked) >= 5
    for other in (REPO_ROOT / "docs").glob("*.md"):
        assert len(other.read_text().splitlines()) <= 400, other.name


def test_the_results_log_parses_with_its_header_and_typed_columns():
    with bench_log.LOG.open(newline="") as f:
        assert tuple(next(csv.reader(f))) == bench_log.HEADER
    rows = bench_log.read()
    assert len(rows) > 500
    last = ""
    for row in rows:
        assert date.fromisoformat(row["date"]) and row["date"] >= last, row  # runs in the order they ran
        last = row["date"]
        assert re.fullmatch(r"([0-9a-f]{7,40}(\+dirty)?)?", row["commit"]), row
        assert re.fullmatch(r"(\d+c-\d+g-(jdk\d+|nojdk)-py\d+\.\d+)?", row["machine"]), row
        assert row["part"] in PARTS and row["variant"] and row["measure"] and row["unit"] in UNITS, row
        assert row["records"] == "" or int(row["records"]) >= 0
        assert row["n"] == "" or int(row["n"]) >= 1
        low, high = (float(row[k]) if row[k] else None for k in ("min", "max"))
        if row["value"]:
            value = float(row["value"])
            assert (low is None or low <= value) and (high is None or value <= high), row
        else:
            assert (low, high) != (None, None) and (None in (low, high) or low <= high), row  # a range, a bound
        assert row["source"] == "hand" or row["source"].startswith(("bin/benchmark", "bin/run")), row
    runs = bench_log.runs(rows)
    assert all(len({(r["date"], r["commit"], r["source"]) for r in run}) == 1 for run in runs)
    assert len(runs) > 50


def test_the_charts_and_the_pages_table_are_the_logs_drawn_again(tmp_path):
    page = tmp_path / "performance.md"
    shutil.copy(PAGE, page)
    bench_charts.write(bench_log.LOG, tmp_path, page)
    stale = [name for name in CHARTS if (tmp_path / name).read_bytes() != (bench_log.LOG.parent / name).read_bytes()]
    assert stale == [], "redraw them: python -m ipcount_lab.bench_charts"
    assert page.read_text() == PAGE.read_text(), "redraw the table: python -m ipcount_lab.bench_charts"
    assert bench_charts.charts(bench_log.read()) == bench_charts.charts(bench_log.read())
    for name in CHARTS:
        assert f"](performance/{name})" in PAGE.read_text()


REPORT = {
    "date": "2026-12-01T10:00:00+00:00", "commit": "abc1234+dirty",
    "argv": ["--only", "warm,flink", "--json", "/tmp/r.json", "--log", "--small-epochs", "30"],
    "machine": {"cpus": 2, "memory_gb": 23.5, "python": "3.11.7", "java": 'openjdk version "17.0.9" 2023-10-17'},
    "records": 1000, "partitions": 3,
    "warm": {"contenders": {"pipeline": {"warm": {"median": 2.0, "min": 1.9, "max": 2.5, "n": 3}, "cold_seconds": 5.0,
                                         "stages": {"read": 1.5}},
                            "peer": {"warm": {"median": 4.0, "min": 3.5, "max": 4.5, "n": 3}, "cold_seconds": 9.0,
                                     "stages": {}}},
             "ratios": {"pipeline / peer": {"median": 2.0, "min": 1.8, "max": 2.1, "n": 3}},
             "memory": {"peak_heap_mb": 600.5, "gc_seconds": 1.25},
             "small": {"records_per_epoch": 2000,
                       "pipeline": {"steady": {"median": 0.4, "min": 0.3, "max": 1.9, "n": 27}, "growth": None}}},
    "flink": {"warm": {"first_job_seconds": 20.0, "job": {"median": 15.0, "min": 14.0, "max": 16.0, "n": 3},
                       "peak_mb": 1300.0},
              "cold": {"job": {}, "wall": {"median": 25.0, "min": 24.0, "max": 26.0, "n": 2}, "peak_mb": 1000.0},
              "ratios": {"warm": 7.5}},
}
RUN = {"date": "2026-12-01", "commit": "abc1234+dirty", "machine": "2c-24g-jdk17-py3.11"}
SOURCE = "bin/benchmark --only warm,flink --small-epochs 30"  # without --json's path and --log
ROWS = [  # part, variant, records, measure, value, min, max, n, unit: sorted, what the report holds
    ("flink", "flink", "1000", "cold_peak_mb", "1000", "", "", "", "MB"),
    ("flink", "flink", "1000", "cold_wall_seconds", "25", "24", "26", "2", "s"),
    ("flink", "flink", "1000", "first_job_seconds", "20", "", "", "", "s"),
    ("flink", "flink", "1000", "job_seconds", "15", "14", "16", "3", "s"),
    ("flink", "flink", "1000", "peak_mb", "1300", "", "", "", "MB"),
    ("flink", "pipeline/flink", "1000", "ratio_warm", "7.5", "", "", "", "x"),
    ("small", "pipeline", "2000", "epoch_seconds", "0.4", "0.3", "1.9", "27", "s"),
    ("warm", "driver", "1000", "gc_seconds", "1.25", "", "", "", "s"),
    ("warm", "driver", "1000", "peak_heap_mb", "600.5", "", "", "", "MB"),
    ("warm", "peer", "1000", "round1_seconds", "9", "", "", "", "s"),
    ("warm", "peer", "1000", "seconds", "4", "3.5", "4.5", "3", "s"),
    ("warm", "pipeline", "1000", "round1_seconds", "5", "", "", "", "s"),
    ("warm", "pipeline", "1000", "seconds", "2", "1.9", "2.5", "3", "s"),
    ("warm", "pipeline", "1000", "stage_read_seconds", "1.5", "", "", "", "s"),
    ("warm", "pipeline/peer", "1000", "ratio", "2", "1.8", "2.1", "3", "x"),
]


def test_a_report_maps_to_sorted_rows_of_the_log_and_appends_as_a_run(tmp_path):
    expected = [{**RUN, **dict(zip(("part", "variant", "records", "measure", "value", "min", "max", "n", "unit"), r)),
                 "source": SOURCE, "note": ""} for r in ROWS]
    assert bench_log.rows(REPORT) == [{k: row[k] for k in bench_log.HEADER} for row in expected]
    log = tmp_path / "results.csv"
    assert bench_log.append(REPORT, log) == len(ROWS) and bench_log.append(REPORT, log) == len(ROWS)
    assert log.read_text().count("date,commit,") == 1
    assert bench_log.read(log) == expected + expected
    assert [len(run) for run in bench_log.runs(bench_log.read(log))] == [len(ROWS), len(ROWS)]  # two runs


def test_the_machine_label_and_the_command_of_a_row():
    assert bench_log.machine_label({"cpus": 8, "memory_gb": 62.7, "python": "3.12.1",
                                    "java": 'java version "1.8.0_392"'}) == "8c-63g-jdk8-py3.12"
    assert bench_log.machine_label({"cpus": 2, "memory_gb": 7.4, "python": "3.11.7", "java": None}) == (
        "2c-7g-nojdk-py3.11")
    assert bench_log.command(["--log", "x.csv", "--workdir=/tmp/w", "--bootstrap-servers", "h:9092", "--only",
                              "year"]) == "bin/benchmark --only year"
    assert bench_log.command(None) == "bin/benchmark"


def test_the_log_flag_is_opt_in_and_defaults_to_the_results_log():
    parse = arguments().parse_args
    assert parse([]).log is None  # the smoke test's runs write no log
    assert parse(["--log"]).log == bench_log.LOG
    assert parse(["--log", "elsewhere.csv"]).log.name == "elsewhere.csv"
    assert (parse(["--log", "--only", "warm"]).log, parse(["--log", "--only", "warm"]).only) == (bench_log.LOG, "warm")


def test_the_report_stores_the_ratios_to_flink_it_prints():
    spread_of = (lambda m: {"median": m, "min": m, "max": m, "n": 1})
    report = {"flink": {"warm": {"job": spread_of(6.0)}, "cold": {"wall": spread_of(20.0)}},
              "warm": {"contenders": {"pipeline": {"warm": spread_of(2.0)}}},
              "cold": {"contenders": {"pipeline": {"wall": spread_of(10.0)}}}}
    assert flink_ratios(report) == {"warm": 3.0, "cold": 2.0}
    assert flink_ratios({"flink": {"skipped": "no PyFlink"}}) == {} and flink_ratios({}) == {}
