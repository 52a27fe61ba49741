"""An epoch's tally, split in Arrow into what it writes and reports.

:func:`ipcount.jobs.transform.tally` aggregates the epoch's records in one Spark job and
hands the result over as Arrow: one row per topic, partition, window and client for the
counted records, one row per record that is not counted. It is small (the counts the sink merges,
plus the bad and late records it appends), and this module splits it without Spark: the
per-partition metrics, the counts per window and client, the dead letters and the late
records.
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

    def _counted(self) -> pa.Table:
        import pyarrow.compute as pc

        return self.rows.filter(pc.invert(pc.fill_null(self.rows["late"], True)))

    def metrics(self) -> dict[int, PartitionMetrics]:
        """Records read, counted, late and malformed, per partition."""
        import pyarrow as pa
        import pyarrow.compute as pc

        records, zero = self.rows["records"], pa.scalar(0, pa.int64())
        late = pc.fill_null(self.rows["late"], False)
        bad = pc.is_valid(self.rows["reason"])
        by_kind = pa.table({
            "partition": self.rows["partition"], "read": records,
            "counted": pc.if_else(pc.or_(bad, late), zero, records),
            "late": pc.if_else(late, records, zero), "malformed": pc.if_else(bad, records, zero)})
        sums = by_kind.group_by("partition").aggregate(
            [("read", "sum"), ("counted", "sum"), ("late", "sum"), ("malformed", "sum")]).to_pylist()
        return {r["partition"]: PartitionMetrics(r["read_sum"], r["counted_sum"], r["late_sum"], r["malformed_sum"])
                for r in sums}

    def max_event_ms(self) -> int | None:
        """The latest event time of a record that is not malformed (late ones included)."""
        import pyarrow.compute as pc

        return pc.max(self.rows["max_event_ms"]).as_py()

    def counts(self, window_ms: int) -> pa.Table:
        """Counts per window and client over all partitions: window_start, window_end, ip, count."""
        import pyarrow as pa
        import pyarrow.compute as pc

        sums = self._counted().group_by(["window_start_ms", "ip"]).aggregate([("records", "sum")])
        start = sums["window_start_ms"]
        return pa.table({"window_start": _timestamps(start), "window_end": _timestamps(pc.add(start, window_ms)),
                         "ip": sums["ip"], "count": sums["records_sum"]})

    def dead_letters(self, epoch: int) -> pa.Table:
        """The dead-letter rows (:data:`ipcount.storage.sink.DEAD_LETTER_COLUMNS`)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        bad = self.rows.filter(pc.is_valid(self.rows["reason"]))
        return pa.table({**_record(bad, epoch), "kafka_timestamp": bad["timestamp"], "key": bad["key"],
                         "value": bad["value"], "reason": bad["reason"], "value_bytes": bad["value_bytes"],
                         "value_sha256": bad["value_sha256"]})

    def late_records(self, epoch: int, window_ms: int, watermark_ms: int | None) -> pa.Table:
        """The late-record rows (:data:`ipcount.storage.sink.LATE_COLUMNS`), judged against
        ``watermark_ms``."""
        import pyarrow as pa
        import pyarrow.compute as pc

        late = self.rows.filter(pc.fill_null(self.rows["late"], False))
        start = late["window_start_ms"]
        watermark = pa.repeat(pa.scalar(watermark_ms, pa.int64()), late.num_rows)
        return pa.table({**_record(late, epoch), "ip": late["ip"], "event_time": _timestamps(late["event_ms"]),
                         "window_start": _timestamps(start), "window_end": _timestamps(pc.add(start, window_ms)),
                         "watermark": _timestamps(watermark)})


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
    """An epoch's tally too large to collect (:data:`~ipcount.rules.config.PipelineConfig.max_driver_tally_rows`):
    the same split as :class:`EpochTally`, as DataFrames over the persisted tally, which
    Spark's executors write to the tables (:meth:`ipcount.storage.sink.Sink.write_from_spark`).
    Its metrics and newest event time are computed once, as the size was."""

    rows: DataFrame
    partition_metrics: dict[int, PartitionMetrics]
    newest_event_ms: int | None
    size: int  # the tally's rows

    @classmethod
    def measure(cls, rows: DataFrame) -> SparkTally:
        """The tally ``rows`` (persisted by the caller) with its metrics, in one small job."""
        from pyspark.sql import functions as F

        records, late, bad = F.col("records"), F.coalesce(F.col("late"), F.lit(False)), F.col("reason").isNotNull()
        zero = F.lit(0).cast("long")
        sums = rows.groupBy("partition").agg(
            F.sum(records).alias("read"), F.sum(F.when(bad | late, zero).otherwise(records)).alias("counted"),
            F.sum(F.when(late, records).otherwise(zero)).alias("late"),
            F.sum(F.when(bad, records).otherwise(zero)).alias("malformed"),
            F.max("max_event_ms").alias("max_event_ms"), F.count(F.lit(1)).alias("rows")).collect()
        metrics = {r["partition"]: PartitionMetrics(r["read"], r["counted"], r["late"], r["malformed"]) for r in sums}
        newest = max((r["max_event_ms"] for r in sums if r["max_event_ms"] is not None), default=None)
        return cls(rows, metrics, newest, sum(r["rows"] for r in sums))

    def metrics(self) -> dict[int, PartitionMetrics]:
        return self.partition_metrics

    def max_event_ms(self) -> int | None:
        return self.newest_event_ms

    def counts(self, window_ms: int) -> DataFrame:
        """Counts per window and client (as :meth:`EpochTally.counts`)."""
        from pyspark.sql import functions as F

        sums = (self.rows.where(F.col("late") == F.lit(False))
                .groupBy("window_start_ms", "ip").agg(F.sum("records").alias("count")))
        return sums.select(F.timestamp_millis("window_start_ms").alias("window_start"),
                           F.timestamp_millis(F.col("window_start_ms") + F.lit(window_ms)).alias("window_end"),
                           "ip", "count")

    def dead_letters(self, epoch: int) -> DataFrame:
        """The dead-letter rows (as :meth:`EpochTally.dead_letters`)."""
        from pyspark.sql import functions as F

        bad = self.rows.where(F.col("reason").isNotNull())
        return bad.select(*_spark_record(epoch), F.col("timestamp").alias("kafka_timestamp"), "key", "value",
                          "reason", "value_bytes", "value_sha256")

    def late_records(self, epoch: int, window_ms: int, watermark_ms: int | None) -> DataFrame:
        """The late-record rows (as :meth:`EpochTally.late_records`)."""
        from pyspark.sql import functions as F

        late = self.rows.where(F.col("late") == F.lit(True))
        start = F.col("window_start_ms")
        return late.select(*_spark_record(epoch), "ip", F.timestamp_millis("event_ms").alias("event_time"),
                           F.timestamp_millis(start).alias("window_start"),
                           F.timestamp_millis(start + F.lit(window_ms)).alias("window_end"),
                           F.timestamp_millis(F.lit(watermark_ms).cast("long")).alias("watermark"))


def _spark_record(epoch: int) -> list:
    from pyspark.sql import functions as F

    return [F.lit(epoch).cast("long").alias("epoch"), "topic", "partition", "offset"]
