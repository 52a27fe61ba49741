"""The results log: every benchmark run's figures as rows of ``docs/performance/results.csv``,
which the page's table and charts are drawn from (:mod:`ipcount_lab.bench_charts`).

A row is one figure, in long format: the run (``date``, ``commit``, ``machine``), what was
measured (``part``: a part of ``bin/benchmark --only``, or ``small`` for the warm part's
small-epoch series; ``variant``: the contender, ratio or set; ``records``: how many records
it ran over; ``measure``), the figure (``value``, the median where there is a spread, with its
``min``, ``max`` and ``n``: how many runs it is the median of) and its ``unit`` (s, ms, MB, x
for a ratio, count), the command that produced it (``source``: a ``bin/benchmark`` command,
or ``hand`` for a measurement outside it) and a ``note``. A figure stated only as a range or a
bound has ``min`` or ``max`` or both, and no ``value``.

A run's rows are sorted (part, variant, records, measure) and follow one another; runs are
in the order they ran, which the charts keep. A run is a stretch of rows with the same date,
commit, machine and source: where the sort order starts over, the next run begins (:func:`runs`).

``python -m ipcount_lab.bench_log append REPORT.json [--log PATH]`` appends a report's rows
(``bin/benchmark --log`` does it after writing the report).
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

LOG = Path(__file__).resolve().parents[1] / "docs" / "performance" / "results.csv"
HEADER = ("date", "commit", "machine", "part", "variant", "records", "measure", "value", "min", "max", "n", "unit",
          "source", "note")
# The report's ratio labels (benchmark.WARM_RATIOS) as the log's variants.
RATIOS = {"pipeline / peer": "pipeline/peer", "pipeline / read limit": "pipeline/read_limit",
          "pipeline / parse floor": "pipeline/parse_floor", "parse floor / peer (the ceiling)": "parse_floor/peer",
          "pipeline_epochs / peer_epochs": "pipeline_epochs/peer_epochs",
          "pipeline_epochs / read limit": "pipeline_epochs/read_limit"}
# Flags of bin/benchmark that say where, not what: left out of a row's source.
WHERE_FLAGS = {"--json": 1, "--workdir": 1, "--bootstrap-servers": 1, "--log": "?"}
MB = 2 ** 20


def machine_label(machine: Mapping) -> str:
    """'2c-24g-jdk17-py3.11': cores, GB of memory (rounded), Java's and Python's major versions."""
    java = re.search(r'version "(\d+)(?:\.(\d+))?', machine.get("java") or "")
    jdk = "nojdk" if not java else f"jdk{java[2] if java[1] == '1' and java[2] else java[1]}"
    python = ".".join((machine.get("python") or "?").split(".")[:2])
    return f"{machine.get('cpus')}c-{int(float(machine.get('memory_gb') or 0) + 0.5)}g-{jdk}-py{python}"


def command(argv: list[str] | None) -> str:
    """The bin/benchmark command of ``argv``, without the flags that only say where things go."""
    words, rest = ["bin/benchmark"], list(argv or [])
    while rest:
        arg = rest.pop(0)
        flag = arg.split("=", 1)[0]
        if flag not in WHERE_FLAGS:
            words.append(arg)
        elif "=" not in arg and rest and (WHERE_FLAGS[flag] == 1 or not rest[0].startswith("-")):
            rest.pop(0)
    return " ".join(words)


def number(value: object) -> str:
    """A figure as the log writes it: the same value, the same text."""
    if value is None:
        return ""
    if isinstance(value, int):  # bool too
        return str(int(value))
    return f"{float(value):.10g}"


def figures(report: Mapping) -> Iterator[tuple]:
    """(part, variant, records, measure, figure, unit, note) for each figure of ``report``: a
    figure is a number or a spread (bench_stats.spread)."""
    n = report.get("records")
    warm = report.get("warm") or {}
    for name, c in warm.get("contenders", {}).items():
        yield "warm", name, n, "seconds", c.get("warm"), "s", ""
        yield "warm", name, n, "round1_seconds", c.get("cold_seconds"), "s", ""
        for stage, seconds in c.get("stages", {}).items():
            yield "warm", name, n, f"stage_{stage}_seconds", seconds, "s", ""
    for label, sp in warm.get("ratios", {}).items():
        yield "warm", RATIOS.get(label, label), n, "ratio", sp, "x", ""
    memory = warm.get("memory") or {}
    yield "warm", "driver", n, "peak_heap_mb", memory.get("peak_heap_mb"), "MB", ""
    yield "warm", "driver", n, "gc_seconds", memory.get("gc_seconds"), "s", ""
    small = warm.get("small") or {}
    for name in ("pipeline", "peer"):
        if name in small:
            per = small["records_per_epoch"]
            yield "small", name, per, "epoch_seconds", small[name].get("steady"), "s", ""
            yield "small", name, per, "growth", small[name].get("growth"), "x", ""
    cold = report.get("cold") or {}
    for name, c in cold.get("contenders", {}).items():
        yield "cold", name, n, "work_seconds", c.get("work"), "s", ""
        yield "cold", name, n, "wall_seconds", c.get("wall"), "s", ""
        yield "cold", name, n, "peak_driver_mb", c.get("peak_driver_mb"), "MB", ""
    for label, sp in cold.get("ratios", {}).items():
        ratio, kind = label.rsplit(" (", 1)
        yield "cold", RATIOS.get(ratio, ratio), n, f"ratio_{kind.rstrip(')')}", sp, "x", ""
    flink = report.get("flink") or {}
    if "warm" in flink:
        yield "flink", "flink", n, "first_job_seconds", flink["warm"].get("first_job_seconds"), "s", ""
        yield "flink", "flink", n, "job_seconds", flink["warm"].get("job"), "s", ""
        yield "flink", "flink", n, "peak_mb", flink["warm"].get("peak_mb"), "MB", ""
        yield "flink", "flink", n, "cold_job_seconds", flink["cold"].get("job"), "s", ""
        yield "flink", "flink", n, "cold_wall_seconds", flink["cold"].get("wall"), "s", ""
        yield "flink", "flink", n, "cold_peak_mb", flink["cold"].get("peak_mb"), "MB", ""
        for kind, ratio in flink.get("ratios", {}).items():
            yield "flink", "pipeline/flink", n, f"ratio_{kind}", ratio, "x", ""
    paths = report.get("paths") or {}
    if paths:
        per = paths["records_per_epoch"]
        yield "paths", "connect", None, "start_seconds", paths["connect_start"]["wall_seconds"], "s", ""
        for kind in ("first_epoch", "epoch", "empty_epoch"):
            yield "paths", "fresh_process", per, f"{kind}_seconds", paths[kind]["wall_seconds"], "s", ""
        for variant, series in (("connect", paths.get("warm")), ("in_process", paths.get("warm_in_process"))):
            if series:
                yield "paths", variant, per, "epoch_seconds", series["epoch"], "s", ""
                yield "paths", variant, per, "empty_epoch_seconds", series["empty_epoch_seconds"], "s", ""
                yield "paths", variant, per, "warmup_epoch_seconds", series.get("warmup"), "s", ""
                for stage, seconds in series["stages"].items():
                    yield "paths", variant, per, f"stage_{stage}_seconds", seconds, "s", ""
        yield "paths", "connect/in_process", per, "ratio", paths.get("connect_over_in_process"), "x", ""
        yield "paths", "idle_check", None, "seconds", paths["idle_check"]["wall_seconds"], "s", ""
    if report.get("kafka_python"):
        yield "kafka_python", "consumer", n, "seconds", report["kafka_python"]["seconds"], "s", ""
    profile = report.get("profile") or {}
    for kind in ("path", "pieces"):
        for name, seconds in profile.get(kind, {}).items():
            yield "profile", kind, profile["records"], f"{name}_seconds", seconds, "s", ""
    if profile.get("codegen"):
        yield "profile", "codegen", profile["records"], "classes", profile["codegen"]["compiles"], "count", ""
        yield ("profile", "codegen", profile["records"], "compile_seconds", profile["codegen"]["compile_seconds"],
               "s", "")
    history = report.get("history") or {}
    if history:
        per, note = history["records_per_epoch"], f"{history['epochs']} epochs"
        for measure, figure, unit in (("early_seconds", history["early"], "s"), ("last_seconds", history["last"], "s"),
                                      ("ratio", history["ratio"], "x")):
            yield "history", "pipeline", per, measure, figure, unit, note
        for hour, seconds in enumerate(history["hours"], 1):
            yield "history", "pipeline", per, f"hour{hour:02d}_seconds", seconds, "s", note
        for stage, s in history["stages"].items():
            yield "history", "pipeline", per, f"stage_{stage}_early_seconds", s["early"], "s", note
            yield "history", "pipeline", per, f"stage_{stage}_last_seconds", s["last"], "s", note
        for table, t in history.get("tables", {}).items():
            yield "history", "pipeline", per, f"{table}_rows", t.get("rows"), "count", note
            yield "history", "pipeline", per, f"{table}_files", t.get("files"), "count", note
    growth = report.get("growth") or {}
    if growth:
        note = f"{growth['epochs']} epochs of {growth['rows_per_epoch']:,} counts rows"
        for measure, figure, unit in (("early_seconds", growth["early_median"], "s"),
                                      ("last_seconds", growth["last10_median"], "s"), ("ratio", growth["ratio"], "x"),
                                      ("files", growth["files"], "count")):
            yield "growth", "merge", None, measure, figure, unit, note
    year = report.get("year") or {}
    for name, s in year.get("sets", {}).items():
        for stage, c in s["stages"].items():
            yield "year", name, year["records_per_epoch"], f"{stage}_seconds", c["median"], "s", ""
            yield "year", name, year["records_per_epoch"], f"{stage}_ratio", c["ratio"], "x", ""
        for role, t in year.get("tables", {}).get(name, {}).items():
            for measure, figure, unit in (("files", t.get("files"), "count"),
                                          ("log_entries", t.get("log_entries"), "count"),
                                          ("transactions", t.get("transactions"), "count"),
                                          ("checkpoint_mb", None if t.get("checkpoint_bytes") is None
                                           else round(t["checkpoint_bytes"] / MB, 3), "MB")):
                yield "year", name, year["records_per_epoch"], f"{role}_{measure}", figure, unit, ""
    card = report.get("cardinality") or {}
    for size, sized in card.get("sizes", {}).items():
        note = f"driver heap {card['driver_memory']}"
        for name in ("pipeline", "peer"):
            c = sized["contenders"][name]
            yield "cardinality", name, int(size), "seconds", c.get("warm"), "s", note
            yield "cardinality", name, int(size), "round1_seconds", c.get("cold_seconds"), "s", note
        for stage, seconds in sized["contenders"]["pipeline"].get("stages", {}).items():
            yield "cardinality", "pipeline", int(size), f"stage_{stage}_seconds", seconds, "s", note
        yield "cardinality", "pipeline/peer", int(size), "ratio", sized["ratio"], "x", note
        yield "cardinality", "session", int(size), "peak_rss_mb", sized.get("peak_rss_mb"), "MB", note
    cluster = report.get("cluster") or {}
    for workers, w in cluster.get("workers", {}).items():
        n, note = cluster["records"], (f"driver {cluster['driver_memory']}, executors {cluster['executor_memory']}, "
                                       f"{cluster['rounds']} rounds")
        yield "cluster", f"{workers}w", n, "rounds_done", w["rounds_done"], "count", note
        if w["ok"]:
            p, memory = w["pipeline"], w.get("memory") or {}
            yield "cluster", f"{workers}w", n, "seconds", p.get("warm"), "s", note
            yield "cluster", f"{workers}w", n, "round1_seconds", p.get("cold_seconds"), "s", note
            for stage, seconds in p.get("stages", {}).items():
                yield "cluster", f"{workers}w", n, f"stage_{stage}_seconds", seconds, "s", note
            yield "cluster", f"{workers}w", n, "peak_heap_mb", memory.get("peak_heap_mb"), "MB", note
            yield "cluster", f"{workers}w", n, "jvm_peak_rss_mb", w.get("peak_rss_mb"), "MB", note
            yield "cluster", f"{workers}w", n, "python_peak_rss_mb", memory.get("python_peak_rss_mb"), "MB", note
        if workers in cluster.get("speedup", {}):
            yield "cluster", f"{workers}w", n, "speedup", cluster["speedup"][workers], "x", note


def rows(report: Mapping) -> list[dict[str, str]]:
    """The log's rows of ``report`` (the JSON bin/benchmark writes), sorted; figures the
    report does not hold (None, an empty spread) are left out."""
    run = {"date": str(report.get("date", ""))[:10], "commit": report.get("commit") or "",
           "machine": machine_label(report.get("machine") or {}), "source": command(report.get("argv"))}
    out = []
    for part, variant, records, measure, figure, unit, note in figures(report):
        if isinstance(figure, Mapping):
            if not figure:
                continue
            value, low, high, n = figure.get("median"), figure.get("min"), figure.get("max"), figure.get("n")
        else:
            value, low, high, n = figure, None, None, None
        if value is None:
            continue
        out.append({**run, "part": part, "variant": variant, "records": number(records), "measure": measure,
                    "value": number(value), "min": number(low), "max": number(high), "n": number(n), "unit": unit,
                    "note": note})
    out.sort(key=sort_key)
    return [{k: r[k] for k in HEADER} for r in out]


def read(log: Path = LOG) -> list[dict[str, str]]:
    """The log's rows, in its order."""
    with log.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != HEADER:
            raise ValueError(f"{log}: the header is {reader.fieldnames}, not {list(HEADER)}")
        return list(reader)


def sort_key(row: Mapping[str, str]) -> tuple:
    return row["part"], row["variant"], int(row["records"] or -1), row["measure"]


def runs(rows: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """The log's rows run by run, in its order."""
    out: list[list[dict[str, str]]] = []
    last: tuple = ()
    for row in rows:
        run, key = (row["date"], row["commit"], row["machine"], row["source"]), sort_key(row)
        if not out or run != last[0] or key <= last[1]:
            out.append([])
        out[-1].append(row)
        last = (run, key)
    return out


def append(report: Mapping, log: Path = LOG) -> int:
    """Append ``report``'s rows to ``log`` (with the header if it is new); how many."""
    new = rows(report)
    log.parent.mkdir(parents=True, exist_ok=True)
    fresh = not log.exists() or log.stat().st_size == 0
    if not fresh:
        read(log)  # its header is this one
    with log.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=HEADER, lineterminator="\n")
        if fresh:
            writer.writeheader()
        writer.writerows(new)
    return len(new)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ipcount_lab.bench_log", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("append", help="append a benchmark report's figures to the log")
    add.add_argument("report", type=Path, help="the JSON bin/benchmark wrote (.local/benchmark/<time>.json)")
    add.add_argument("--log", type=Path, default=LOG, help=f"the log (default {LOG.relative_to(LOG.parents[2])})")
    args = p.parse_args(argv)
    n = append(json.loads(args.report.read_text()), args.log)
    print(f"{n} rows appended to {args.log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
