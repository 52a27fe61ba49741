"""Read the pipeline's Delta tables into plain Python values for comparison (delta-rs)."""
from __future__ import annotations

from collections import Counter

from ipcount.rules.config import PipelineConfig
from ipcount.storage.delta import read_rows


def _rows(path: str) -> list[dict]:
    return read_rows(path)


def _ms(ts) -> int:
    return int(ts.timestamp() * 1000)


def counts(cfg: PipelineConfig) -> Counter:
    return Counter({(_ms(r["window_start"]), r["ip"]): r["count"] for r in _rows(cfg.counts_path)})


def finality(cfg: PipelineConfig) -> dict:
    """(window_start_ms, ip) -> is_final."""
    return {(_ms(r["window_start"]), r["ip"]): r["is_final"] for r in _rows(cfg.counts_path)}


def counts_merges(cfg: PipelineConfig) -> list[dict]:
    """The counts table's MERGE commits, oldest first: version, epoch, whether it finalized
    through a full pass (a NOT MATCHED BY SOURCE clause), and the target files it skipped."""
    from deltalake import DeltaTable

    merges = [h for h in DeltaTable(cfg.counts_path).history() if h.get("operation") == "MERGE"]
    return [{"version": h["version"], "epoch": h.get("userMetadata"),
             "full_pass": h["operationParameters"].get("notMatchedBySourcePredicates", "[]") != "[]",
             "metrics": h.get("operationMetrics", {})} for h in sorted(merges, key=lambda h: h["version"])]


def dead_letters(cfg: PipelineConfig) -> set:
    return {(r["partition"], r["offset"], r["reason"]) for r in _rows(cfg.dead_letter_path)}


def late_records(cfg: PipelineConfig) -> set:
    return {(r["partition"], r["offset"], _ms(r["window_start"]), _ms(r["watermark"]))
            for r in _rows(cfg.late_path)}


def ledger_rows(path: str) -> list[dict]:
    """The ledger's epoch rows: its summary rows are bookkeeping that the rows imply."""
    return [r for r in _rows(path) if r["status"] != "summary"]


def ledger(cfg: PipelineConfig) -> list[dict]:
    return sorted(ledger_rows(cfg.ledger_path), key=lambda r: (r["epoch"], r["partition"]))


def epoch_ranges(cfg: PipelineConfig) -> list[dict[int, tuple[int, int]]]:
    """Committed epochs in order, each as partition -> (from, until)."""
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for r in ledger(cfg):
        assert r["status"] == "committed", r
        out.setdefault(r["epoch"], {})[r["partition"]] = (r["from_offset"], r["until_offset"])
    return [out[e] for e in sorted(out)]


def snapshot(cfg: PipelineConfig, also_ignore: frozenset = frozenset()) -> dict:
    """Every table as sorted rows, minus the ledger's wall-clock columns: what an
    exactly-once comparison between two runs looks at."""
    wall_clock = {"planned_at", "committed_at", "duration_seconds", "stage_seconds", "run_id"} | also_ignore

    def rows(path: str, drop: set = frozenset(), read=_rows) -> list[tuple]:
        return sorted((tuple((k, v) for k, v in r.items() if k not in drop) for r in read(path)), key=repr)

    return {"counts": rows(cfg.counts_path), "dead_letters": rows(cfg.dead_letter_path),
            "late": rows(cfg.late_path), "ledger": rows(cfg.ledger_path, wall_clock, ledger_rows)}


def lanes(cfg: PipelineConfig) -> dict[str, list[dict[int, tuple[int, int]]]]:
    """Committed epochs per lane ('scheduled', or the backfill request id), in epoch order:
    each lane chains its own watermark, so ground truth is replayed lane by lane."""
    by_lane: dict[str, dict[int, dict[int, tuple[int, int]]]] = {}
    for r in ledger(cfg):
        if r["status"] != "committed":
            continue
        lane = r["request_id"] if r.get("kind") == "backfill" else "scheduled"
        by_lane.setdefault(lane, {}).setdefault(r["epoch"], {})[r["partition"]] = (r["from_offset"], r["until_offset"])
    return {lane: [epochs[e] for e in sorted(epochs)] for lane, epochs in by_lane.items()}


def owned_offsets(cfg: PipelineConfig) -> dict[int, list[tuple[int, int]]]:
    """Per partition, every ledger row's range sorted; asserts no two overlap."""
    out: dict[int, list[tuple[int, int]]] = {}
    for r in ledger(cfg):
        if r["until_offset"] > r["from_offset"]:
            out.setdefault(r["partition"], []).append((r["from_offset"], r["until_offset"]))
    for p, spans in out.items():
        spans.sort()
        for (a, b), (c, d) in zip(spans, spans[1:]):
            assert c >= b, f"partition {p}: ledger ranges [{a},{b}) and [{c},{d}) overlap"
    return out


def last_maintenance(cfg: PipelineConfig) -> list[dict]:
    """The maintenance log's rows of its newest run ([] if it never ran)."""
    rows = _rows(cfg.maintenance_path)
    if not rows:
        return []
    newest = max(rows, key=lambda r: r["started_at"])["run_id"]
    return [r for r in rows if r["run_id"] == newest]
