"""The benchmark's arithmetic: medians with their spread, ratios taken round by round.

A figure from one run on this machine varies by ~20%, so every figure is the median of
several runs with its min and max, and a ratio is taken within each round (the two
contenders ran minutes apart, on the same JVM and the same page cache) before its median
is taken: a slow round slows both.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence


def spread(values: Iterable[float]) -> dict[str, float | int]:
    """Median, min and max (and how many) of ``values``; {} for none."""
    vs = sorted(values)
    if not vs:
        return {}
    return {"median": round(statistics.median(vs), 3), "min": round(vs[0], 3), "max": round(vs[-1], 3), "n": len(vs)}


def by_round(runs: Iterable[Mapping], contender: str, first_round: int = 1) -> dict[int, Mapping]:
    """``contender``'s runs by round, from ``first_round`` on."""
    return {r["round"]: r for r in runs if r["contender"] == contender and r["round"] >= first_round}


def paired_ratio(runs: Sequence[Mapping], faster: str, slower: str, first_round: int = 1) -> dict[str, float | int]:
    """The spread of ``slower``'s seconds / ``faster``'s seconds, round by round: a throughput
    ratio, > 1 when ``faster`` is faster. Rounds where either is missing are left out."""
    a, b = by_round(runs, faster, first_round), by_round(runs, slower, first_round)
    return spread(b[r]["seconds"] / a[r]["seconds"] for r in sorted(a.keys() & b.keys()) if a[r]["seconds"] > 0)


def contender_summary(runs: Sequence[Mapping], contender: str, first_warm_round: int = 2) -> dict:
    """Round 1 (cold) and the warm rounds' spread of ``contender``'s seconds, its stages'
    medians over the warm rounds, and what it read and counted (the same in every round)."""
    mine = by_round(runs, contender)
    if not mine:
        return {}
    warm = [r for n, r in sorted(mine.items()) if n >= first_warm_round]
    last = mine[max(mine)]
    stages = sorted({s for r in warm for s in r.get("stages", {})})
    out = {"cold_seconds": round(mine[min(mine)]["seconds"], 3) if min(mine) < first_warm_round else None,
           "warm": spread(r["seconds"] for r in warm),
           "stages": {s: spread(r["stages"].get(s, 0.0) for r in warm)["median"] for s in stages},
           **{k: last.get(k) for k in ("records", "counted", "late", "malformed", "batches")}}
    median = out["warm"].get("median")
    out["records_per_second"] = round(last["records"] / median) if median else None
    spill = [r.get("spill_bytes", 0) for r in warm]
    out["spill_bytes_max"] = max(spill) if spill else 0
    out["gc_seconds"] = spread(r.get("gc_seconds", 0.0) for r in warm).get("median", 0.0)
    return out


def steady(seconds: Sequence[float], skip: int = 3) -> dict[str, float | int]:
    """The spread of a series of epoch times without its first ``skip`` (their tables and
    code still warming up); all of them if there are no more."""
    return spread(seconds[skip:] if len(seconds) > skip else seconds)


def growth(seconds: Sequence[float], early: slice = slice(3, 6), late: int = 3) -> float | None:
    """How much dearer the last ``late`` epochs of a series are than its epochs 4-6 (the
    ratio of the medians; 1.0: no growth with history); None for a series too short."""
    if len(seconds) < early.stop + late:
        return None
    return round(statistics.median(seconds[-late:]) / statistics.median(seconds[early]), 3)


def history_summary(seconds: Sequence[float], stages: Sequence[Mapping[str, float]], early: slice = slice(5, 15),
                    last: int = 10, hour: int = 60) -> dict:
    """A long chain's epochs: the spread of epochs 6-15 and of the last ``last``, the ratio
    of their medians, each stage's median at both ends, and the median of each ``hour``
    epochs (an hour of event time at one minute an epoch: the counts table's partition)."""
    first, final = list(seconds[early]), list(seconds[-last:])
    if len(seconds) < early.stop + last:
        return {"epochs": len(seconds), "early": spread(first), "last": spread(final), "ratio": None,
                "stages": {}, "hours": []}
    names = sorted({name for epoch in stages for name in epoch})

    def stage_median(part: Sequence[Mapping[str, float]], name: str) -> float:
        return round(statistics.median(epoch.get(name, 0.0) for epoch in part), 4)
    return {"epochs": len(seconds), "early": spread(first), "last": spread(final),
            "ratio": round(statistics.median(final) / statistics.median(first), 3),
            "stages": {name: {"early": stage_median(stages[early], name), "last": stage_median(stages[-last:], name)}
                       for name in names},
            "hours": [round(statistics.median(seconds[i:i + hour]), 4) for i in range(0, len(seconds), hour)]}
