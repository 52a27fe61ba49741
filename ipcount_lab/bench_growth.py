"""How the counts MERGE's cost grows with the table: many scheduled epochs' counts merged
through the sink's own code (delta-rs, no Spark, no Kafka), each timed.

Each epoch brings one minute of event time: six windows of ten seconds plus the one
before (late records), ``ips`` clients in each. The chain's watermark moves a minute per
epoch, so the bounded finality path runs, as in a live chain. What grows is what a MERGE
rewrites: the files that hold the windows it touches, with whatever older rows share them.
"""
from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

WINDOW_MS, LATENESS_MS, EPOCH_MS = 10_000, 10_000, 60_000
BASE_MS = 1_795_255_200_000


def epoch_counts(epoch: int, ips: list[str], per_window: int, rng: random.Random):
    """The epoch's counts as the Spark job hands them over: one row per window and client."""
    import pyarrow as pa

    first = BASE_MS + (epoch - 1) * EPOCH_MS
    starts, clients, counts = [], [], []
    for w in range(-1, EPOCH_MS // WINDOW_MS):
        for ip in rng.sample(ips, per_window):
            starts.append((first + w * WINDOW_MS) * 1000)
            clients.append(ip)
            counts.append(rng.randint(1, 5))
    us = pa.timestamp("us", "UTC")
    return pa.table({"window_start": pa.array(starts, us),
                     "window_end": pa.array([s + WINDOW_MS * 1000 for s in starts], us),
                     "ip": clients, "count": pa.array(counts, pa.int64())})


def growth(workdir: Path, epochs: int, per_window: int, seed: int = 7, say=print) -> dict:
    """Merge ``epochs`` epochs into fresh tables; seconds per epoch, the table's files, and its
    total read back against the total merged."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    from ipcount.rules.config import PipelineConfig
    from ipcount.rules.finality import ChainCommit
    from ipcount.storage.sink import Sink

    cfg = PipelineConfig(warehouse=str(workdir / "growth"), window_seconds=WINDOW_MS // 1000,
                         allowed_lateness_seconds=LATENESS_MS // 1000)
    sink = Sink(cfg)
    sink.ensure()
    rng = random.Random(seed)
    ips = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(per_window * 3)]
    chain: list[ChainCommit] = []
    seconds, merged = [], 0
    for epoch in range(1, epochs + 1):
        counts = epoch_counts(epoch, ips, per_window, rng)
        merged += pc.sum(counts["count"]).as_py()
        watermark = BASE_MS + epoch * EPOCH_MS
        started = time.monotonic()
        version = sink._merge_counts(epoch, counts, watermark, finalize_untouched=True, chain=chain[:2])
        seconds.append(time.monotonic() - started)
        chain.insert(0, ChainCommit(version, watermark))
        if epoch % max(epochs // 10, 1) == 0:
            say(f"growth: epoch {epoch}: {seconds[-1]:.3f} s")
    table = DeltaTable(cfg.counts_path)
    files = pa.table(table.get_add_actions(flatten=True))
    stored = pc.sum(table.to_pyarrow_dataset().to_table(columns=["count"])["count"]).as_py()
    if stored != merged:
        raise RuntimeError(f"growth: the counts table holds {stored} requests, {merged} were merged")
    early = seconds[4:15] or seconds
    return {"epochs": epochs, "rows_per_epoch": counts.num_rows, "requests": merged,
            "seconds": [round(s, 4) for s in seconds],
            "early_median": statistics.median(early), "last10_median": statistics.median(seconds[-10:]),
            "ratio": statistics.median(seconds[-10:]) / statistics.median(early),
            "files": files.num_rows, "largest_file_rows": pc.max(files["num_records"]).as_py(),
            "table_rows": pc.sum(files["num_records"]).as_py()}
