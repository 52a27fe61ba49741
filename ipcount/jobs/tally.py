"""An epoch's tally, split into what it writes and reports.

:func:`ipcount.jobs.transform.tally` aggregates the epoch's records in one Spark job: a row of totals per Kafka
partition and outcome (its metrics), one row per window and client for the counted records (over all partitions), one
row per record that is not counted. Mostly it is small (the counts the sink merges, plus the bad and late records it
appends), and :class:`EpochTally` splits it as Arrow, without Spark. One too large for this process stays in Spark
(:class:`SparkTally`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ipcount.rules.ledger import PartitionMetrics

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame


@dataclass(frozen=True)
class EpochTally:
    """The Arrow result of :func:`ipcount.jobs.transform.tally` for one epoch."""

    rows: pa.Table

    def _totals(self) -> pa.Table:
        return self.rows.filter(self.rows["totals"])

    def _rows(self) -> pa.Table:
        import pyarrow.compute as pc

        return self.rows.filter(pc.invert(self.rows["totals"]))

    def metrics(self) -> dict[int, PartitionMetrics]:
        """Records read, counted, late and malformed, per partition."""
        return _metrics(self._totals().select(["partition", "late", "records"]).to_pylist())

    def max_event_ms(self) -> int | None:
        """The latest event time of a record that is not malformed (late ones included)."""
        import pyarrow.compute as pc

        return pc.max(self._totals()["max_event_ms"]).as_py()

    def counts(self, window_ms: int) -> pa.Table:
        """Counts per window and client over all partitions: window_start, window_end, ip, count."""
        import pyarrow as pa
        import pyarrow.compute as pc

        rows = self._rows()
        counted = rows.filter(pc.invert(pc.fill_null(rows["late"], True)))
        start = counted["window_start_ms"]
        return pa.table({"window_start": _timestamps(start), "window_end": _timestamps(pc.add(start, window_ms)),
                         "ip": counted["ip"], "count": counted["records"]})

    def dead_letters(self, epoch: int) -> pa.Table:
        """The dead-letter rows (:data:`ipcount.storage.sink.DEAD_LETTER_COLUMNS`)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        rows = self._rows()
        bad = rows.filter(pc.is_valid(rows["reason"]))
        return pa.table({**_record(bad, epoch), "kafka_timestamp": bad["timestamp"], "key": bad["key"],
                         "value": bad["value"], "reason": bad["reason"], "value_bytes": bad["value_bytes"],
                         "value_sha256": bad["value_sha256"]})

    def late_records(self, epoch: int, window_ms: int, watermark_ms: int | None) -> pa.Table:
        """The late-record rows (:data:`ipcount.storage.sink.LATE_COLUMNS`), judged against ``watermark_ms``."""
        import pyarrow as pa
        import pyarrow.compute as pc

        rows = self._rows()
        late = rows.filter(pc.fill_null(rows["late"], False))
        start = late["window_start_ms"]
        watermark = pa.repeat(pa.scalar(watermark_ms, pa.int64()), late.num_rows)
        return pa.table({**_record(late, epoch), "ip": late["ip"], "event_time": _timestamps(late["event_ms"]),
                         "window_start": _timestamps(start), "window_end": _timestamps(pc.add(start, window_ms)),
                         "watermark": _timestamps(watermark)})


# Where a row of totals adds its records, by its ``late``: read, counted, late, malformed.
_OUTCOME = {False: 1, True: 2, None: 3}


def _metrics(totals: list[dict]) -> dict[int, PartitionMetrics]:
    """Per partition, the metrics of the tally's rows of totals."""
    sums: dict[int, list[int]] = {}
    for r in totals:
        of_partition = sums.setdefault(r["partition"], [0, 0, 0, 0])
        of_partition[0] += r["records"]
        of_partition[_OUTCOME[r["late"]]] += r["records"]
    return {p: PartitionMetrics(*m) for p, m in sums.items()}


def _record(rows: pa.Table, epoch: int) -> dict[str, pa.Array]:
    """The columns that say which record of which epoch a side-table row is."""
    import pyarrow as pa

    return {"epoch": pa.repeat(pa.scalar(epoch, pa.int64()), rows.num_rows), "topic": rows["topic"],
            "partition": rows["partition"], "offset": rows["offset"]}


def _timestamps(ms):
    import pyarrow as pa

    return ms.cast(pa.int64()).cast(pa.timestamp("ms", tz="UTC"))


@dataclass(frozen=True)
class SparkTally:
    """An epoch's tally too large to collect (:data:`~ipcount.rules.config.PipelineConfig.max_driver_tally_rows`): the
    same split as :class:`EpochTally`, as DataFrames over the persisted tally, which Spark's executors write to the
    tables (:meth:`ipcount.storage.sink.Sink.write_from_spark`). Its metrics, newest event time and counted windows are
    computed once, as the size was."""

    rows: DataFrame
    partition_metrics: dict[int, PartitionMetrics]
    newest_event_ms: int | None
    size: int  # the tally's rows but its totals
    counted_windows_ms: tuple[int, int] | None  # the first and last window counted into (their starts)

    @classmethod
    def measure(cls, rows: DataFrame) -> SparkTally:
        """The tally ``rows`` (persisted by the caller) with its metrics, in one small job."""
        from pyspark.sql import functions as F

        start = F.when(_counted(), F.col("window_start_ms"))
        # A row per partition and outcome for the totals, a few for the other rows.
        groups = rows.groupBy("totals", "partition", "late").agg(
            F.sum("records").alias("records"), F.max("max_event_ms").alias("max_event_ms"),
            F.count(F.lit(1)).alias("rows"), F.min(start).alias("first"), F.max(start).alias("last")).collect()
        totals = [r for r in groups if r["totals"]]
        others = [r for r in groups if not r["totals"]]
        newest = max((r["max_event_ms"] for r in totals if r["max_event_ms"] is not None), default=None)
        firsts = [r["first"] for r in others if r["first"] is not None]
        windows = (min(firsts), max(r["last"] for r in others if r["last"] is not None)) if firsts else None
        return cls(rows, _metrics([r.asDict() for r in totals]), newest, sum(r["rows"] for r in others), windows)

    def metrics(self) -> dict[int, PartitionMetrics]:
        return self.partition_metrics

    def max_event_ms(self) -> int | None:
        return self.newest_event_ms

    def _rows(self) -> DataFrame:
        from pyspark.sql import functions as F

        return self.rows.where(~F.col("totals"))

    def counts(self, window_ms: int) -> DataFrame:
        """Counts per window and client (as :meth:`EpochTally.counts`), in the windows of :attr:`counted_windows_ms`:
        the same rows, so the merge reads every file they can touch."""
        from pyspark.sql import functions as F

        counted = self.rows.where(_counted())
        return counted.select(F.timestamp_millis("window_start_ms").alias("window_start"),
                              F.timestamp_millis(F.col("window_start_ms") + F.lit(window_ms)).alias("window_end"),
                              "ip", F.col("records").alias("count"))

    def dead_letters(self, epoch: int) -> DataFrame:
        """The dead-letter rows (as :meth:`EpochTally.dead_letters`)."""
        from pyspark.sql import functions as F

        bad = self._rows().where(F.col("reason").isNotNull())
        return bad.select(*_spark_record(epoch), F.col("timestamp").alias("kafka_timestamp"), "key", "value",
                          "reason", "value_bytes", "value_sha256")

    def late_records(self, epoch: int, window_ms: int, watermark_ms: int | None) -> DataFrame:
        """The late-record rows (as :meth:`EpochTally.late_records`)."""
        from pyspark.sql import functions as F

        late = self._rows().where(F.col("late") == F.lit(True))
        start = F.col("window_start_ms")
        return late.select(*_spark_record(epoch), "ip", F.timestamp_millis("event_ms").alias("event_time"),
                           F.timestamp_millis(start).alias("window_start"),
                           F.timestamp_millis(start + F.lit(window_ms)).alias("window_end"),
                           F.timestamp_millis(F.lit(watermark_ms).cast("long")).alias("watermark"))


def _counted():
    """Which of the tally's rows are counts (a Spark column)."""
    from pyspark.sql import functions as F

    return ~F.col("totals") & (F.col("late") == F.lit(False))


def _spark_record(epoch: int) -> list:
    from pyspark.sql import functions as F

    return [F.lit(epoch).cast("long").alias("epoch"), "topic", "partition", "offset"]
