"""The alternative users would compare us with: Spark Structured Streaming, Kafka source,
``Trigger.AvailableNow``, the same parsing, the same tumbling windows with the watermark
delayed by the allowed lateness, written to Delta by ``foreachBatch`` + MERGE with
``txnAppId``/``txnVersion`` (Delta's documented idempotent recipe) and its own checkpoint.
It reads Kafka with as many tasks as the pipeline does
(:func:`ipcount.jobs.epoch.read_options`). Used by the benchmark only; it is not part of the
pipeline.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pyspark.sql import functions as F

from ipcount.jobs import transform
from ipcount.jobs.epoch import read_options
from ipcount.rules.config import STATE_DIR, PipelineConfig
from ipcount.rules.kafka_security import sasl_password, spark_kafka_options
from ipcount.storage.broker import client_options

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

PEER_APP_ID = "ipcount-peer"
# The peer writes with delta-spark, which the pipeline's sessions do not load: a session it
# runs in gets Delta's jars (bin/setup fetches them, jars/delta-spark.xml) and these.
DELTA_JARS_DIR = STATE_DIR / "jars" / "delta"
DELTA_CONF = {"spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
              "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
              "spark.databricks.delta.snapshotPartitions": "2"}


def delta_jars() -> list[str]:
    """Delta's jars for a Spark session (spark.jars), beside the pipeline's own."""
    jars = sorted(str(p) for p in DELTA_JARS_DIR.glob("delta-*.jar"))
    if not any(Path(j).name.startswith("delta-spark") for j in jars):
        raise FileNotFoundError(f"no delta-spark jar in {DELTA_JARS_DIR}: run bin/setup")
    return jars


@dataclass
class PeerRun:
    batches: int
    batch_seconds: list[float] = field(default_factory=list)  # each trigger's execution
    reached: dict[int, int] = field(default_factory=dict)     # partition -> the offset it stopped at
    job_group: str = ""  # its Spark jobs' group: the query's run id (Structured Streaming sets it)


def create_table(spark: SparkSession, table_path: str) -> None:
    """The peer's counts table, if it is not there."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, table_path):
        (DeltaTable.createIfNotExists(spark).location(table_path)
         .addColumn("window_start", "timestamp").addColumn("window_end", "timestamp")
         .addColumn("ip", "string").addColumn("count", "bigint").execute())


def run_peer(cfg: PipelineConfig, spark: SparkSession, table_path: str, checkpoint: str,
             ending: dict[int, int], max_offsets_per_trigger: int | None = None) -> PeerRun:
    """Count everything available now into ``table_path`` (created if missing), in
    micro-batches of at most ``max_offsets_per_trigger`` offsets if given. ``ending``
    (partition -> offset) is only checked: AvailableNow stops at what was there when it
    started."""
    from delta.tables import DeltaTable

    create_table(spark, table_path)
    reader = spark.readStream.format("kafka").options(
        **read_options(spark, max_offsets_per_trigger or sum(ending.values()), len(ending)))
    if max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    raw = (reader
           .option("kafka.bootstrap.servers", cfg.bootstrap_servers)
           .option("subscribe", cfg.topic)
           .option("startingOffsets", "earliest")
           .option("kafka.isolation.level", "read_committed")
           .option("failOnDataLoss", "true")
           .options(**spark_kafka_options(cfg, sasl_password(cfg)))
           .load())
    parsed = (transform.parse(raw, cfg.max_value_bytes, cfg.event_time, cfg.max_event_time_ahead_ms)
              .where(F.col("reason").isNull()))
    counts = (parsed.withColumn("event_time", F.timestamp_millis("event_ms"))
              .withWatermark("event_time", f"{cfg.allowed_lateness_seconds} seconds")
              .groupBy(F.window("event_time", f"{cfg.window_seconds} seconds"), "ip").count()
              .select(F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
                      "ip", "count"))
    batches = []

    def merge(batch: DataFrame, batch_id: int) -> None:
        # Update mode hands over each changed (window, ip) with its full count so far.
        session = batch.sparkSession
        session.conf.set("spark.databricks.delta.write.txnAppId", PEER_APP_ID)
        session.conf.set("spark.databricks.delta.write.txnVersion", str(batch_id))
        try:
            (DeltaTable.forPath(session, table_path).alias("t")
             .merge(batch.alias("s"), "t.window_start = s.window_start AND t.ip = s.ip")
             .whenMatchedUpdate(set={"count": "s.count"}).whenNotMatchedInsertAll().execute())
        finally:
            session.conf.unset("spark.databricks.delta.write.txnAppId")
            session.conf.unset("spark.databricks.delta.write.txnVersion")
        batches.append(batch_id)

    query = (counts.writeStream.outputMode("update").foreachBatch(merge)
             .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
    query.awaitTermination()
    progress = query.lastProgress or {}
    end = (progress.get("sources") or [{}])[0].get("endOffset") or {}
    end = json.loads(end) if isinstance(end, str) else end
    reached = {int(p): o for p, o in (end.get(cfg.topic) or {}).items()}
    if ending and reached and reached != ending:
        raise RuntimeError(f"the peer stopped at {reached}, not at the log end {ending}")
    # (recentProgress keeps the last 100 triggers: spark.sql.streaming.numRecentProgressUpdates.)
    seconds = [p["durationMs"]["triggerExecution"] / 1000 for p in query.recentProgress
               if p.get("numInputRows", 0) > 0]
    return PeerRun(len(batches), seconds, reached, str(query.runId))


def kafka_range(cfg: PipelineConfig, spark: SparkSession, ending: dict[int, int]) -> DataFrame:
    """The whole range, from offset 0 to ``ending``, as a batch Kafka read."""
    start = json.dumps({cfg.topic: {str(p): 0 for p in ending}})
    end = json.dumps({cfg.topic: {str(p): o for p, o in ending.items()}})
    return (spark.read.format("kafka").options(**read_options(spark, sum(ending.values()), len(ending)))
            .option("kafka.bootstrap.servers", cfg.bootstrap_servers)
            .option("subscribe", cfg.topic).option("startingOffsets", start).option("endingOffsets", end)
            .option("kafka.isolation.level", "read_committed")
            .options(**spark_kafka_options(cfg, sasl_password(cfg))).load())


def spark_count(cfg: PipelineConfig, spark: SparkSession, ending: dict[int, int]) -> int:
    """The read-only limit in Spark: a batch Kafka read of the whole range, counted."""
    return kafka_range(cfg, spark, ending).count()


def parse_floor(cfg: PipelineConfig, spark: SparkSession, ending: dict[int, int]) -> tuple[int, int]:
    """What the peer and the pipeline both stand on: Spark's batch Kafka read of the range
    and the shared parse (:func:`ipcount.jobs.transform.parse`), its outputs (reason, ip,
    event time) computed and written nowhere (Spark's noop sink), nothing else. (records
    read, records parsed into a request), both counted while the rows go by."""
    from pyspark.sql import Observation

    seen = Observation("parse_floor")
    parsed = transform.parse(kafka_range(cfg, spark, ending), cfg.max_value_bytes, cfg.event_time,
                             cfg.max_event_time_ahead_ms)
    (parsed.select("reason", "ip", "event_ms")
     .observe(seen, F.count(F.lit(1)).alias("records"), F.count_if(F.col("reason").isNull()).alias("requests"))
     .write.format("noop").mode("overwrite").save())
    return seen.get["records"], seen.get["requests"]


def drain(cfg: PipelineConfig, ending: dict[int, int]) -> int:
    """The read-only limit without Spark: a plain kafka-python consumer reading every record."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=cfg.bootstrap_servers, enable_auto_commit=False,
                             isolation_level="read_committed", max_partition_fetch_bytes=8 << 20,
                             fetch_max_bytes=64 << 20, **client_options(cfg))
    try:
        tps = [TopicPartition(cfg.topic, p) for p, end in ending.items() if end > 0]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        left = {tp: ending[tp.partition] for tp in tps}
        seen = 0
        while left:
            for tp, records in consumer.poll(timeout_ms=1000, max_records=50_000).items():
                for r in records:
                    if tp in left and r.offset < left[tp]:
                        seen += 1
                if tp in left and consumer.position(tp) >= left[tp]:
                    del left[tp]
        return seen
    finally:
        consumer.close()
