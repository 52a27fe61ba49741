"""The results log (:mod:`ipcount_lab.bench_log`) drawn: SVG charts in docs/performance/ and the
table of current figures between the markers of docs/performance.md. Standard library only;
the same log gives the same bytes. The charts draw only what ``bin/benchmark`` measured.

``python -m ipcount_lab.bench_charts [--log PATH] [--out DIR] [--page PATH | --no-page]``
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from html import escape
from pathlib import Path

from ipcount_lab import bench_log

PAGE = bench_log.LOG.parents[1] / "performance.md"
BEGIN, END = "<!-- figures: from the results log by python -m ipcount_lab.bench_charts -->", "<!-- end of figures -->"
COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#9c755f", "#76b7b2")
W, H, L, R, T, B = 720, 340, 60, 20, 48, 96  # the size, and the plot area's margins
# The page's table: figure | part | variant | records | measure | targets, each met or not as
# its first "≥ x", "≤ x" or "> x" says.
FIGURES = [[cell.strip() for cell in line.split("|")] for line in """\
one 1M epoch, pipeline / peer (warm) | warm | pipeline/peer | 1000000 | ratio | ≥ 1.3; ≥ 2 (issue 37)
one 5M epoch, pipeline / peer (warm) | warm | pipeline/peer | 5000000 | ratio | ≥ 1.3; ≥ 2 (issue 37)
four 1M epochs, pipeline / peer | warm | pipeline_epochs/peer_epochs | 1000000 | ratio |
1M, pipeline / read-only count | warm | pipeline/read_limit | 1000000 | ratio | ≥ 0.5 (issue 37)
5M, pipeline / read-only count | warm | pipeline/read_limit | 5000000 | ratio | ≥ 0.5 (issue 37)
1M, Flink's warm job / the pipeline's epoch | flink | pipeline/flink | 1000000 | ratio_warm | ≥ 2 (issue 37)
5M, Flink's warm job / the pipeline's epoch | flink | pipeline/flink | 5000000 | ratio_warm | ≥ 2 (issue 37)
1M cold wall, Flink's process / the spark-submit | flink | pipeline/flink | 1000000 | ratio_cold | ≥ 1 (issue 37)
5M epoch, the driver's peak heap | warm | driver | 5000000 | peak_heap_mb | ≤ 1024 MB (the default)
a 2,000-record epoch, warm session | small | pipeline | 2000 | epoch_seconds | ≤ 3 s
a 2,000-record epoch on Spark Connect, warm | paths | connect | 2000 | epoch_seconds | ≤ 0.6 s (issue 34)
a client per record, 1M, pipeline / peer | cardinality | pipeline/peer | 1000000 | ratio | ≥ 1.5
a client per record, 5M, pipeline / peer | cardinality | pipeline/peer | 5000000 | ratio | ≥ 1.5
a client per record, 5M on 1 worker, rounds done | cluster | 1w | 5000000 | rounds_done | ≥ 10 of 10, driver 512 MB
... on 2 workers, the speed-up | cluster | 2w | 5000000 | speedup | > 1
1,000 epochs: the last 10 / epochs 6-15 | history | pipeline | 10000 | ratio | ≤ 1.2
a year-old table set / a 10-epoch one, maintained | year | 525600-on | 2000 | epoch_ratio | ≤ 1.2
latency p50 / p95, minute schedule | latency | * * * * * | | p50_seconds |
latency p50 / p95, `on-data` | latency | on-data | | p50_seconds |""".splitlines()]
TEST = {"≥": float.__ge__, "≤": float.__le__, ">": float.__gt__}


def latest(rows: list[dict], part: str, variant: str, records: str, measure: str) -> dict | None:
    """The log's last row of that figure (any records when ``records`` is ""), not measured by hand."""
    return next((row for row in reversed(rows) if (row["part"], row["variant"], row["measure"]) == (
        part, variant, measure) and records in ("", row["records"]) and row["source"] != "hand"), None)


def shown(row: dict) -> str:
    """'1.79 [1.74-1.82]', '0.37 s', '712 MB'."""
    unit = {"s": " s", "MB": " MB", "ms": " ms"}.get(row["unit"], "")
    value = row["value"] and f"{float(row['value']):.{0 if row['unit'] in ('MB', 'count') else 2}f}{unit}"
    spread = row["min"] and row["max"] and f"[{float(row['min']):.2f}-{float(row['max']):.2f}]"
    return " ".join(p for p in (value, spread) if p)


def table(rows: list[dict]) -> list[str]:
    """The page's table of current figures: the latest of each, its run, its targets."""
    out = ["| figure | now | run | target |", "|---|---|---|---|"]
    for label, part, variant, records, measure, targets in FIGURES:
        row = latest(rows, part, variant, records, measure)
        if row is None:
            continue
        now, p95 = shown(row), part == "latency" and latest(rows, part, variant, row["records"], "p95_seconds")
        if p95:
            now = f"{float(row['value']):.1f} s / {float(p95['value']):.1f} s"
        said = []
        for target in filter(None, targets.split("; ")):
            test = re.match(r"([≥≤>]) ([\d.]+)", target)
            if test and row["value"]:
                target += ": met" if TEST[test[1]](float(row["value"]), float(test[2])) else ": not met"
            said.append(target)
        out.append(f"| {label} | {now} | {row['date']} {row['commit']} | {'; '.join(said)} |".replace("  |", " |"))
    return out


def svg(title: str, legend: list[str], body: list[str]) -> str:
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{W / 2:.0f}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>', *body,
        *(f'<rect x="{L + 8 + 150 * i}" y="30" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>\n'
          f'<text x="{L + 22 + 150 * i}" y="39">{escape(name)}</text>' for i, name in enumerate(legend)),
        "</svg>", ""])


def axis(values: list[float], log: bool, label: str, hlines: Sequence[tuple[float, str]]) -> tuple:
    """A y scale from 0 (from a power of ten when ``log``) past ``values``, its grid, its label and
    the dashed target lines ``hlines``."""
    values = [*values, *(v for v, _ in hlines)]
    if log:
        lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
        ticks, f = [10.0 ** e for e in range(lo, hi + 1)], math.log10
    else:
        top = max(values) * 1.15
        mag = 10.0 ** math.floor(math.log10(top / 5))
        step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= top / 5)  # 1, 2 or 5 times a power of ten
        ticks, f = [round(step * i, 9) for i in range(math.ceil(top / step - 1e-9) + 1)], float

    def y(v: float) -> float:
        return H - B - (f(v) - f(ticks[0])) / (f(ticks[-1]) - f(ticks[0])) * (H - B - T)
    body = [f'<text x="14" y="{(H - B + T) / 2:.0f}" transform="rotate(-90 14 {(H - B + T) / 2:.0f})" '
            f'text-anchor="middle">{escape(label)}</text>']
    body += [f'<line x1="{L}" x2="{W - R}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#ddd"/>\n'
             f'<text x="{L - 4}" y="{y(t) + 4:.1f}" text-anchor="end">{t:g}</text>' for t in ticks]
    body += [f'<line x1="{L}" x2="{W - R}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e15759" stroke-dasharray="5 3"/>\n'
             f'<text x="{L + 4}" y="{y(v) - 3:.1f}" fill="#e15759">{escape(text)}</text>' for v, text in hlines]
    return y, body


def trend(runs: list[list[dict]], title: str, label: str, series: list[tuple], hlines: list[tuple[float, str]],
          log: bool = False) -> str:
    """A point per run and series (name, part, variant, records, measure), the runs in order."""
    points = [[(i, float(row["value"])) for i, run in enumerate(runs) for row in run if row["value"] and (
        row["part"], row["variant"], row["records"], row["measure"]) == (p, v, str(n), m)] for _, p, v, n, m in series]
    used = sorted({i for ps in points for i, _ in ps})
    y, body = axis([v for ps in points for _, v in ps], log, label, hlines)

    def x(i: int) -> float:
        return L + (W - L - R) / len(used) * (used.index(i) + 0.5)
    body += [f'<text x="{x(i):.1f}" y="{H - B + 12}" transform="rotate(-45 {x(i):.1f} {H - B + 12})" '
             f'text-anchor="end" font-size="9">{runs[i][0]["date"][5:]} {escape(runs[i][0]["commit"] or "-")}</text>'
             for i in used]
    for k, ps in enumerate(points):
        color = COLORS[k % len(COLORS)]
        line = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in ps)
        body.append(f'<polyline fill="none" stroke="{color}" points="{line}"/>')
        body += [f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="3" fill="{color}"/>' for i, v in ps]
    return svg(title, [s[0] for s in series], body)


def bars(title: str, label: str, groups: list[tuple[str, list[tuple[str, float | None, str]]]],
         hlines: tuple[tuple[float, str], ...] = (), digits: int = 0) -> str:
    """Grouped bars (group, [(bar, value, caption)]): the caption under the bar, or in its place."""
    y, body = axis([v for _, bs in groups for _, v, _ in bs if v is not None], False, label, hlines)
    names = list(dict.fromkeys(b for _, bs in groups for b, _, _ in bs))
    width = (W - L - R) / len(groups)
    bar = width * 0.8 / len(names)
    for g, (group, bs) in enumerate(groups):
        x0 = L + width * (g + 0.1)
        body.append(f'<text x="{x0 + width * 0.4:.1f}" y="{H - B + 44}" text-anchor="middle" font-size="12">'
                    f'{escape(group)}</text>')
        for name, value, caption in bs:
            x = x0 + bar * names.index(name) + bar * 0.45
            if value is None:
                body.append(f'<text x="{x:.1f}" y="{y(0) - 4:.1f}" text-anchor="middle" fill="#888">'
                            f'{escape(caption)}</text>')
                continue
            body += [f'<rect x="{x - bar * 0.45:.1f}" y="{y(value):.1f}" width="{bar * 0.9:.1f}" '
                     f'height="{y(0) - y(value):.1f}" fill="{COLORS[names.index(name) % len(COLORS)]}"/>',
                     f'<text x="{x:.1f}" y="{y(value) - 3:.1f}" text-anchor="middle">{value:.{digits}f}</text>',
                     f'<text x="{x:.1f}" y="{H - B + 14}" text-anchor="middle" font-size="9">{escape(caption)}</text>']
    return svg(title, names, body)


def charts(rows: list[dict]) -> dict[str, str]:
    """Each chart's file name and SVG."""
    bench = [r for r in rows if r["source"].startswith("bin/benchmark")]
    runs = bench_log.runs(bench)
    now = []
    for records in sorted({r["records"] for r in bench if r["part"] == "warm" and r["measure"] == "seconds"
                           and r["variant"] == "pipeline"}, key=int):
        bs = [(name, latest(bench, part, variant, records, measure)) for name, part, variant, measure in (
            ("count floor", "warm", "spark_count", "seconds"), ("parse floor", "warm", "parse_floor", "seconds"),
            ("pipeline", "warm", "pipeline", "seconds"), ("peer", "warm", "peer", "seconds"),
            ("Flink", "flink", "flink", "job_seconds"))]
        now.append((f"{int(records):,} records", [(name, int(records) / float(row["value"]) / 1000, row["commit"])
                                                  if row and row["value"] else (name, None, "") for name, row in bs]))
    year_run = next((run for run in reversed(runs) if any(r["part"] == "year" for r in run)), [])
    year = {r["variant"]: float(r["value"]) for r in year_run if r["measure"] == "epoch_ratio"}
    ages = sorted({int(r["variant"].split("-")[0]) for r in year_run})
    return {
        "now.svg": bars("Throughput now, warm: thousand records a second (the latest run of each)", "k records/s",
                        now),
        "ratio-trend.svg": trend(runs, "The pipeline against the peer and the read-only count, run by run",
                                 "throughput ratio",
                                 [("/ peer, 1M", "warm", "pipeline/peer", 1_000_000, "ratio"),
                                  ("/ peer, 5M", "warm", "pipeline/peer", 5_000_000, "ratio"),
                                  ("/ read-only count, 1M", "warm", "pipeline/read_limit", 1_000_000, "ratio"),
                                  ("/ read-only count, 5M", "warm", "pipeline/read_limit", 5_000_000, "ratio")],
                                 [(1.3, "1.3x the peer"), (2.0, "2x (issue 37)"), (0.5, "0.5 of the read limit")]),
        "small-epoch-trend.svg": trend(runs, "A 2,000-record epoch, run by run (log scale)", "seconds",
                                       [("pipeline, warm session", "small", "pipeline", 2000, "epoch_seconds"),
                                        ("peer's micro-batch", "small", "peer", 2000, "epoch_seconds"),
                                        ("pipeline on Spark Connect", "paths", "connect", 2000, "epoch_seconds")],
                                       [(3.0, "3 s"), (0.6, "0.6 s on Connect (issue 34)")], log=True),
        "year.svg": bars("An epoch on a table set of each age / on a 10-epoch maintained one"
                         + (f" ({year_run[0]['date']} {year_run[0]['commit']})" if year_run else ""), "ratio",
                         [(f"{age:,} epochs", [(f"maintained {m}", year.get(f"{age}-{m}"), "" if f"{age}-{m}" in year
                                                else "base" if (age, m) == (ages[0], "on") else "not run")
                                               for m in ("on", "off")]) for age in ages], ((1.2, "1.2x"),), 2),
    }


def write(log: Path = bench_log.LOG, out: Path = bench_log.LOG.parent, page: Path | None = PAGE) -> list[Path]:
    """Draw the charts into ``out`` and the table between ``page``'s markers; the files written."""
    rows, written = bench_log.read(log), []
    for name, text in charts(rows).items():
        (out / name).write_text(text)
        written.append(out / name)
    if page is not None:
        head, rest = page.read_text().split(BEGIN + "\n", 1)
        page.write_text(head + BEGIN + "\n" + "\n".join(table(rows)) + "\n" + END + rest.split(END, 1)[1])
        written.append(page)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ipcount_lab.bench_charts", description=__doc__.split("\n\n")[0])
    p.add_argument("--log", type=Path, default=bench_log.LOG, help="the results log (default: docs/performance/)")
    p.add_argument("--out", type=Path, default=bench_log.LOG.parent, help="the charts' directory (default: the log's)")
    p.add_argument("--page", type=Path, default=PAGE, help="the page of the table (default docs/performance.md)")
    p.add_argument("--no-page", action="store_true", help="the charts only")
    args = p.parse_args(argv)
    print("\n".join(map(str, write(args.log, args.out, None if args.no_page else args.page))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
