"""Small SVG charts rendered on the server: the pages need no JavaScript, so they work in the Airflow UI's sandboxed
iframes and in any browser. Pure functions of their data."""
from __future__ import annotations

from datetime import datetime
from html import escape
from typing import Mapping, Sequence

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 760, 220, 56, 110, 12, 28
PLOT_WIDTH = WIDTH - LEFT - RIGHT


def _y(value: float, top: float) -> float:
    return TOP + (HEIGHT - TOP - BOTTOM) * (1 - value / top)


def _top(series: Mapping[str, Sequence[float | None]]) -> float:
    """The y axis' top: the largest value (1 when there is none above 0)."""
    return max((v for values in series.values() for v in values if v is not None), default=0) or 1


def _frame(chart_id: str, title: str, top: float, x_labels: tuple[str, str], body: list[str]) -> str:
    lines = [f'<svg id="{escape(chart_id)}" class="chart" role="img" xmlns="http://www.w3.org/2000/svg" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}">',
             f"<title>{escape(title)}</title>",
             f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}" stroke="#999"/>',
             f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}" stroke="#999"/>',
             f'<text x="{LEFT - 6}" y="{TOP + 10}" text-anchor="end" font-size="11">{_short(top)}</text>',
             f'<text x="{LEFT - 6}" y="{HEIGHT - BOTTOM}" text-anchor="end" font-size="11">0</text>',
             f'<text x="{LEFT}" y="{HEIGHT - 8}" font-size="11">{escape(x_labels[0])}</text>',
             f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 8}" text-anchor="end" font-size="11">'
             f'{escape(x_labels[1])}</text>']
    return "\n".join(lines + body + ["</svg>"])


def line_chart(chart_id: str, title: str, xs: Sequence[int], series: Mapping[str, Sequence[float | None]]) -> str:
    """One polyline per series over the shared ``xs`` (None: no point)."""
    if not xs:
        return empty_chart(chart_id, title)
    top, step = _top(series), PLOT_WIDTH / max(1, len(xs) - 1)
    body = []
    for i, (name, values) in enumerate(series.items()):
        body += _series(i, name, [(LEFT + j * step, _y(v, top), str(xs[j]), v)
                                  for j, v in enumerate(values) if v is not None])
    return _frame(chart_id, title, top, (str(xs[0]), str(xs[-1])), body)


def _series(i: int, name: str, points: list[tuple[float, float, str, float]]) -> list[str]:
    """The ``i``-th series' polyline, its points (x, y, label, value: each with a tooltip) and its legend entry."""
    color = PALETTE[i % len(PALETTE)]
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in points)
    return [f'<polyline class="series" data-series="{escape(name)}" fill="none" stroke="{color}" '
            f'stroke-width="2" points="{path}"/>',
            *(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"><title>{escape(name)} '
              f'at {label}: {v:g}</title></circle>' for x, y, label, v in points),
            f'<rect x="{WIDTH - RIGHT + 12}" y="{TOP + 16 * i}" width="10" height="10" fill="{color}"/>'
            f'<text x="{WIDTH - RIGHT + 26}" y="{TOP + 9 + 16 * i}" font-size="11">{escape(name)}</text>']


def time_chart(chart_id: str, title: str, times: Sequence[datetime | None],
               series: Mapping[str, Sequence[float | None]]) -> str:
    """One polyline per series, points placed by time (None: no point): a pause between epochs is a long segment."""
    known = [t for t in times if t is not None]
    if not known:
        return empty_chart(chart_id, title)
    first, last = min(known), max(known)
    span, top = (last - first).total_seconds(), _top(series)

    def x(t: datetime) -> float:
        return LEFT + (PLOT_WIDTH * (t - first).total_seconds() / span if span else PLOT_WIDTH / 2)
    body = []
    for i, (name, values) in enumerate(series.items()):
        body += _series(i, name, [(x(t), _y(v, top), f"{t:%H:%M:%S}", v)
                                  for t, v in zip(times, values) if t is not None and v is not None])
    return _frame(chart_id, title, top, (f"{first:%Y-%m-%d %H:%M:%S}", f"{last:%H:%M:%S} UTC"), body)


def bar_chart(chart_id: str, title: str, labels: Sequence[str], values: Sequence[float],
              muted: Sequence[bool] | None = None) -> str:
    """One bar per value; ``muted`` bars (e.g. windows not final yet) are drawn lighter."""
    if not values:
        return empty_chart(chart_id, title)
    top, width = max(values) or 1, PLOT_WIDTH / len(values)
    body = []
    for j, (label, v) in enumerate(zip(labels, values)):
        y = _y(v, top)
        light = muted[j] if muted else False
        body.append(f'<rect class="bar" x="{LEFT + j * width:.1f}" y="{y:.1f}" width="{max(width - 1, 0.5):.1f}" '
                    f'height="{HEIGHT - BOTTOM - y:.1f}" fill="{PALETTE[0]}" opacity="{0.45 if light else 1}">'
                    f"<title>{escape(label)}: {v:g}</title></rect>")
    return _frame(chart_id, title, top, (labels[0], labels[-1]), body)


def empty_chart(chart_id: str, title: str) -> str:
    return (f'<svg id="{escape(chart_id)}" class="chart empty" xmlns="http://www.w3.org/2000/svg" '
            f'viewBox="0 0 {WIDTH} 40" width="{WIDTH}" height="40"><title>{escape(title)}</title>'
            f'<text x="8" y="24" font-size="13" fill="#666">no data yet</text></svg>')


def _short(value: float) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:g}"
