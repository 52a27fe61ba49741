"""Where an epoch's read stage spends its time: the profile behind the benchmark's figures.

One Spark session reads the range from Kafka once and caches the raw rows; everything
below runs over that cache, each figure the median of ``repeats`` runs, each run forced to
completion with Spark's ``noop`` sink (every selected column computed, nothing written):

* ``path``: the epoch's read stage built up step by step, as :func:`ipcount.jobs.epoch.run_epoch`
  runs it - scan the cache; + parse (and the parse again with another planning time each
  run, as every epoch has its own); + classify; + tally (the one aggregation everything
  the epoch writes comes from); the tally collected as Arrow and its metrics taken (the
  epoch's read stage). Each step's cost is its figure less the one before.
* ``pieces``: the parse by record format, each over a cache of its own records: the JSON
  objects (``scan_json``, ``parse_json``) and the rest, access-log lines and malformed
  records (``scan_other``, ``parse_other``); a parse figure less its scan is that parse.
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Callable

from ipcount.jobs import transform
from ipcount.jobs.tally import EpochTally
from ipcount.rules import records as R
from ipcount.rules.config import PipelineConfig
from ipcount_lab import peer

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def _timed(df: DataFrame, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        started = time.monotonic()
        df.write.format("noop").mode("overwrite").save()
        seconds.append(time.monotonic() - started)
    return round(statistics.median(seconds), 3)


def profile(spark: SparkSession, cfg: PipelineConfig, ending: dict[int, int], repeats: int = 3,
            say: Callable[[str], None] = print) -> dict:
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    compiled_before = _codegen(spark)
    raw = peer.kafka_range(cfg, spark, ending).persist(StorageLevel.MEMORY_AND_DISK)
    records = raw.count()
    say(f"profile: {records:,} records cached; {repeats} runs per figure")
    path: dict[str, float] = {"scan": _timed(raw, repeats)}
    planned_at = int(time.time() * 1000)
    parsed = transform.parse(raw, cfg.max_value_bytes, cfg.event_time, cfg.max_event_time_ahead_ms, planned_at)
    path["parse"] = _timed(parsed, repeats)
    # Each epoch parses with its own planning time: a new literal in the generated code,
    # which Spark then compiles again.
    path["parse_new_plan_time"] = round(statistics.median(
        _timed(transform.parse(raw, cfg.max_value_bytes, cfg.event_time, cfg.max_event_time_ahead_ms,
                               planned_at + n + 1), 1) for n in range(repeats)), 3)
    # Late against a watermark in the middle of the data, so both outcomes occur.
    middle = parsed.agg(F.percentile_approx("event_ms", 0.5)).first()[0]
    classified = transform.classify(transform.parse(raw, cfg.max_value_bytes, cfg.event_time,
                                                    cfg.max_event_time_ahead_ms, planned_at, middle),
                                    cfg.window_ms, cfg.allowed_lateness_ms, middle)
    path["classify"] = _timed(classified, repeats)
    prefix = R.dead_letter_prefix_bytes(cfg.max_value_bytes)
    path["tally"] = _timed(transform.tally(classified, prefix), repeats)
    seconds = []
    for _ in range(repeats):  # the epoch's read stage: the tally collected as Arrow
        started = time.monotonic()
        # A new DataFrame each run: collecting the same one again reuses its shuffle output.
        read = sum(m.records_read for m in EpochTally(transform.tally(classified, prefix).toArrow()).metrics().values())
        seconds.append(time.monotonic() - started)
        if read != records:
            raise RuntimeError(f"profile: the tally holds {read} records of {records}")
    path["read_stage"] = round(statistics.median(seconds), 3)
    say("profile: path " + ", ".join(f"{k} {v:.2f} s" for k, v in path.items()))

    # The parse by record format: JSON objects and the rest (access-log lines, malformed).
    text = F.btrim(F.col("value").cast("string"), F.lit(R.WHITESPACE))
    pieces: dict[str, float] = {}
    for name, subset in (("json", text.startswith("{")), ("other", ~F.coalesce(text.startswith("{"), F.lit(False)))):
        part = raw.where(subset).persist(StorageLevel.MEMORY_AND_DISK)
        part.count()
        pieces[f"scan_{name}"] = _timed(part, repeats)
        pieces[f"parse_{name}"] = _timed(transform.parse(part, cfg.max_value_bytes, cfg.event_time,
                                                         cfg.max_event_time_ahead_ms, planned_at), repeats)
        part.unpersist()
    raw.unpersist()
    say("profile: pieces " + ", ".join(f"{k} {v:.2f} s" for k, v in pieces.items()))
    compiled = _codegen(spark)
    codegen = {"compiles": compiled[0] - compiled_before[0],
               "compile_seconds": round(compiled[1] - compiled_before[1], 3)}
    return {"records": records, "repeats": repeats, "path": path, "pieces": pieces, "codegen": codegen}


def _codegen(spark: SparkSession) -> tuple[int, float]:
    """(classes compiled, seconds spent compiling them) by Spark's code generator in this JVM
    so far, from its metrics (a histogram of compile times in ms)."""
    metrics = spark.sparkContext._jvm.org.apache.spark.metrics.source.CodegenMetrics  # noqa: SLF001
    times = metrics.METRIC_COMPILATION_TIME()
    count = times.getCount()
    return count, count * times.getSnapshot().getMean() / 1000
