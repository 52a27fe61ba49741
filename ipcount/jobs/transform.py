"""The epoch's Spark transformations: parse, classify late records, aggregate.

Built from Spark's own functions only (no Python UDFs), so records never leave the JVM.
The rules are those of :mod:`ipcount.rules.records`, which the tests use as ground truth.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pyspark.sql import Column
from pyspark.sql import functions as F

from ipcount.rules import records as R

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


def _variant_kind(variant: Column, path: str) -> Column:
    """Type name of a JSON field ("STRING", "BIGINT", ...), NULL when absent."""
    return F.schema_of_variant(F.try_variant_get(variant, path, "variant"))


def parse(raw: DataFrame, max_value_bytes: int, event_time: str = "payload") -> DataFrame:
    """Kafka rows -> rows with ``ip``, ``event_ms`` and ``reason`` (NULL when well formed).

    ``event_time`` is "payload" (the record's own time) or "kafka" (the Kafka record
    timestamp; the payload's time is then neither required nor checked). Keeps topic,
    partition, offset, timestamp, key and value so that malformed records can be written to
    the dead-letter table as they arrived.

    Built in stages, each costly value (trimmed text, parsed JSON, regex matches, event
    time, reason) a column of its own: Spark does not share a subexpression between the
    branches of a CASE, so written as one expression the JSON was parsed some 30 times per
    record. The optimizer keeps these stages apart, since it only merges a costly column into
    its consumer where it is used once.
    """
    from_kafka = event_time == "kafka"
    kafka = [F.col(c) for c in ("topic", "partition", "offset", "timestamp", "key", "value")]
    value, text, doc, is_json = F.col("value"), F.col("_text"), F.col("_doc"), F.col("_is_json")

    trimmed = raw.select(*kafka, F.btrim(value.cast("string"), F.lit(R.WHITESPACE)).alias("_text"))
    split = trimmed.select(
        *kafka, text, text.startswith("{").alias("_is_json"),
        F.when(text.startswith("{"), F.try_parse_json(text)).alias("_doc"),
        # NGINX's remote_addr group is never empty, so "" means the line did not match.
        F.when(~text.startswith("{"), F.regexp_extract(text, R.NGINX_PATTERN, 1)).alias("_nginx_ip"))
    json_ts = F.try_variant_get(doc, "$.ts", "string")
    fields = split.select(
        "*",
        # parse_json stops after the first value and ignores what follows; a record must be
        # exactly one object. Wrapped in an array, the text must be one element, and one more
        # element appended must make two (text that closes the array early fails the second).
        F.when(doc.isNotNull(),
               (F.json_array_length(F.concat(F.lit("["), text, F.lit("]"))) == 1)
               & (F.json_array_length(F.concat(F.lit("["), text, F.lit(",0]"))) == 2)).alias("_whole"),
        F.when(doc.isNotNull(), F.schema_of_variant(doc).startswith("OBJECT")).alias("_is_object"),
        _variant_kind(doc, "$.ip").alias("_ip_kind"), _variant_kind(doc, "$.ts").alias("_ts_kind"),
        F.when(is_json, F.try_variant_get(doc, "$.ip", "string")).otherwise(F.col("_nginx_ip")).alias("_ip"),
        json_ts.alias("_json_ts"),
        F.when(F.col("_nginx_ip") != "", F.regexp_extract(text, R.NGINX_PATTERN, 2)).alias("_nginx_time"))

    ts_kind, nginx_time = F.col("_ts_kind"), F.col("_nginx_time")
    if from_kafka:
        any_ms = F.unix_millis(F.col("timestamp"))
        ts_ok = F.lit(True)
    else:
        nginx_ms = F.when(nginx_time.rlike(R.NGINX_TIME_PATTERN),
                          F.unix_millis(F.try_to_timestamp(nginx_time, F.lit("dd/MMM/yyyy:HH:mm:ss Z"))))
        json_ms = F.when(ts_kind == "STRING", _iso_to_ms(F.col("_json_ts"))).otherwise(
            F.col("_json_ts").try_cast("long"))
        any_ms = F.when(is_json, json_ms).otherwise(nginx_ms)
        ts_ok = ts_kind.isNotNull() & ((ts_kind == "STRING") | (ts_kind == "BIGINT"))
    timed = fields.select("*", any_ms.alias("_any_ms"))
    any_ms = F.col("_any_ms")
    event_ms = F.when((any_ms >= R.MIN_EVENT_MS) & (any_ms < R.MAX_EVENT_MS), any_ms.cast("long"))

    ip, ip_kind = F.col("_ip"), F.col("_ip_kind")
    reason = (
        F.when(value.isNull(), R.NULL_VALUE)
        .when(F.length(value) == 0, R.EMPTY_VALUE)
        .when(F.length(value) > max_value_bytes, R.TOO_LARGE)
        .when(F.try_validate_utf8(value).isNull(), R.NOT_UTF8)
        .when(is_json & (doc.isNull() | ~F.coalesce(F.col("_whole"), F.lit(False))), R.BAD_JSON)
        .when(is_json & ~F.col("_is_object"), R.BAD_JSON)
        .when(is_json & (ip_kind.isNull() | (ip_kind != "STRING") | ~ts_ok), R.BAD_SHAPE)
        .when(~is_json & (F.col("_nginx_ip") == ""), R.UNRECOGNIZED)
        .when(~ip.rlike(R.IP_PATTERN), R.INVALID_IP)
        .when(F.col("_event_ms").isNull(), R.INVALID_TIMESTAMP)
    )
    return (timed.select("*", event_ms.alias("_event_ms"))
            .select(*kafka, ip, "_event_ms", reason.alias("reason"))
            .select(*kafka, "reason",
                    F.when(F.col("reason").isNull(), F.lower(ip)).alias("ip"),
                    F.when(F.col("reason").isNull(), F.col("_event_ms")).alias("event_ms")))


def _iso_to_ms(ts: Column) -> Column:
    """ISO-8601 text -> epoch ms, NULL unless it matches :data:`records.ISO_PATTERN` and is a
    real instant. Seconds are parsed without the fraction, which is then added in ms."""
    seconds_part = F.concat(F.regexp_extract(ts, R.ISO_PATTERN, 0).substr(1, 19),
                            F.regexp_extract(ts, R.ISO_PATTERN, 9))
    whole = F.unix_millis(F.try_to_timestamp(seconds_part, F.lit("yyyy-MM-dd'T'HH:mm:ssXXX")))
    fraction = F.rpad(F.regexp_extract(ts, R.ISO_PATTERN, 8), 3, "0").substr(1, 3).cast("long")
    return F.when(ts.rlike(R.ISO_PATTERN), whole + fraction)


def classify(parsed: DataFrame, window_ms: int, allowed_lateness_ms: int,
             watermark_ms: int | None) -> DataFrame:
    """Add ``window_start_ms`` and ``late`` (see :func:`ipcount.rules.records.is_late`)."""
    start = F.col("event_ms") - F.pmod(F.col("event_ms"), F.lit(window_ms))
    late = F.lit(False) if watermark_ms is None else (
        start + F.lit(window_ms + allowed_lateness_ms) <= F.lit(watermark_ms))
    return parsed.withColumn("window_start_ms", start).withColumn(
        "late", F.when(F.col("reason").isNull(), late))


def window_counts(classified: DataFrame, window_ms: int) -> DataFrame:
    """Counts per (window, ip) of the records that are neither malformed nor late."""
    return (classified.where(F.col("reason").isNull() & ~F.col("late"))
            .groupBy("window_start_ms", "ip").agg(F.count(F.lit(1)).alias("count"))
            .select(F.timestamp_millis("window_start_ms").alias("window_start"),
                    F.timestamp_millis(F.col("window_start_ms") + window_ms).alias("window_end"),
                    "ip", "count"))


def partition_metrics(classified: DataFrame) -> DataFrame:
    """Per partition: records read, counted, late, malformed, and the max event time."""
    is_bad = F.col("reason").isNotNull()
    return classified.groupBy("partition").agg(
        F.count(F.lit(1)).alias("records_read"),
        F.count(F.when(~is_bad & ~F.col("late"), 1)).alias("records_counted"),
        F.count(F.when(~is_bad & F.col("late"), 1)).alias("records_late"),
        F.count(F.when(is_bad, 1)).alias("records_malformed"),
        F.max("event_ms").alias("max_event_ms"),
    )
