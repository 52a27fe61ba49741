"""The epoch's Spark transformations: parse, classify late records, aggregate.

Built from Spark's own functions only (no Python UDFs), so records never leave the JVM.
The rules are those of :mod:`ipcount.rules.records`, which the tests use as ground truth.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from pyspark.sql import Column, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StructField, StructType, TimestampType

from ipcount.rules import records as R
from ipcount.storage.spark import is_remote

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

T = TypeVar("T")


def _variant_kind(variant: Column, path: str) -> Column:
    """Type name of a JSON field ("STRING", "BIGINT", ...), NULL when absent."""
    return F.schema_of_variant(F.try_variant_get(variant, path, "variant"))


def parse(raw: DataFrame, max_value_bytes: int, event_time: str = "payload", max_ahead_ms: int | None = None,
          planned_at_ms: int | None = None, watermark_ms: int | None = None) -> DataFrame:
    """Kafka rows -> rows with ``ip`` (canonical), ``event_ms`` and ``reason`` (NULL when well
    formed).

    ``event_time`` is "payload" (the record's own time) or "kafka" (the Kafka record
    timestamp; the payload's time is then neither required nor checked). With
    ``max_ahead_ms``, event times further than that past the record's Kafka timestamp or
    ``planned_at_ms`` are malformed (:func:`ipcount.rules.records.is_ahead`). Keeps topic,
    partition, offset, timestamp, key and value so that malformed records can be written to
    the dead-letter table as they arrived. With ``watermark_ms``, the rows carry it too
    (``_watermark_ms``, for :func:`classify`): the epoch's constants are joined once.

    Built in stages, each costly value (trimmed text, parsed JSON, regex matches, event
    time, reason) a column of its own: Spark does not share a subexpression between the
    branches of a CASE, so written as one expression the JSON was parsed some 30 times per
    record. The optimizer keeps these stages apart, since it only merges a costly column into
    its consumer where it is used once.
    """
    with_planned_at = planned_at_ms is not None and planned_at_ms >= 0
    carry = watermark_ms is not None
    before, after = _columns(raw.sparkSession,
                             ("parse", max_value_bytes, event_time, max_ahead_ms, with_planned_at, carry),
                             lambda: _parse_stages(max_value_bytes, event_time == "kafka", max_ahead_ms,
                                                   with_planned_at, carry))
    df = raw
    for stage in before:
        df = df.select(*stage)
    constants = {name: value for name, value in (("_planned_at_ms", planned_at_ms if with_planned_at else None),
                                                 ("_watermark_ms", watermark_ms)) if value is not None}
    if constants:
        df = with_constants(df, constants)
    for stage in after:
        df = df.select(*stage)
    return df


# Columns are unresolved expressions, free to use on any DataFrame, and building those of the
# parse, classify and tally takes thousands of py4j round trips, a fixed cost of every epoch
# (docs/performance.md): each Spark session builds them once per set of parameters.
_BUILT: weakref.WeakKeyDictionary[SparkSession, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def _columns(spark: SparkSession, key: tuple, build: Callable[[], T]) -> T:
    """``build()``, made once per Spark session and ``key``."""
    built = _BUILT.setdefault(spark, {})
    if key not in built:
        built[key] = build()
    return built[key]


Stage = list  # the arguments of one select: Columns and column names


def _parse_stages(max_value_bytes: int, from_kafka: bool, max_ahead_ms: int | None,
                  with_planned_at: bool, carry_watermark: bool) -> tuple[list[Stage], list[Stage]]:
    """The parse's selects (:func:`parse`), those before the epoch's constants are joined
    (``_planned_at_ms``, when ``with_planned_at``; ``_watermark_ms``, kept to the end when
    ``carry_watermark``) and those after."""
    kafka = [F.col(c) for c in ("topic", "partition", "offset", "timestamp", "key", "value")]
    value, text, doc, is_json = F.col("value"), F.col("_text"), F.col("_doc"), F.col("_is_json")

    trimmed = [*kafka, F.btrim(value.cast("string"), F.lit(R.WHITESPACE)).alias("_text")]
    # Most JSON records are flat {"ip", "ts"} objects, read with one regex match as "ip ts";
    # the JSON parser, the whole-value check and the type lookups are for the others.
    flat = [[*kafka, text, text.startswith("{").alias("_is_json")],
            ["*", F.when(is_json, flat_fields(text)).alias("_flat")]]
    is_flat = F.coalesce(~F.col("_flat").startswith("{"), F.lit(False))
    split = [
        "*", F.when(is_json & ~is_flat, F.try_parse_json(text)).alias("_doc"),
        # NGINX's remote_addr group is never empty, so "" means the line did not match.
        F.when(~is_json, F.regexp_extract(text, R.NGINX_PATTERN, 1)).alias("_nginx_ip")]
    flat_ts = F.substring_index(F.col("_flat"), " ", -1)
    fields = [
        "*",
        F.when(is_flat, F.lit(True)).when(doc.isNotNull(), whole_value(text)).alias("_whole"),
        F.when(is_flat, F.lit("STRING")).otherwise(_variant_kind(doc, "$.ip")).alias("_ip_kind"),
        F.when(is_flat, F.when(flat_ts.startswith('"'), F.lit("STRING")).otherwise(F.lit("BIGINT")))
        .otherwise(_variant_kind(doc, "$.ts")).alias("_ts_kind"),
        F.when(is_flat, F.substring_index(F.col("_flat"), " ", 1))
        .when(is_json, F.try_variant_get(doc, "$.ip", "string")).otherwise(F.col("_nginx_ip")).alias("_ip"),
        F.when(is_flat, F.btrim(flat_ts, F.lit('"'))).otherwise(F.try_variant_get(doc, "$.ts", "string"))
        .alias("_json_ts"),
        F.when(F.col("_nginx_ip") != "", F.regexp_extract(text, R.NGINX_PATTERN, 2)).alias("_nginx_time")]

    ts_kind, nginx_time = F.col("_ts_kind"), F.col("_nginx_time")
    if from_kafka:
        any_ms = F.unix_millis(F.col("timestamp"))
        ts_ok = F.lit(True)
    else:
        nginx_ms = F.when(nginx_time.rlike(R.NGINX_TIME_PATTERN),
                          F.unix_millis(F.try_to_timestamp(nginx_time, F.lit("dd/MMM/yyyy:HH:mm:ss Z"))))
        json_ms = F.when(ts_kind == "STRING", iso_to_ms(F.col("_json_ts"))).otherwise(
            F.col("_json_ts").try_cast("long"))
        any_ms = F.when(is_json, json_ms).otherwise(nginx_ms)
        ts_ok = ts_kind.isNotNull() & ((ts_kind == "STRING") | (ts_kind == "BIGINT"))
    timed = ["*", any_ms.alias("_any_ms")]
    any_ms = F.col("_any_ms")
    event_ms = F.when((any_ms >= R.MIN_EVENT_MS) & (any_ms < R.MAX_EVENT_MS), any_ms.cast("long"))

    ip, ip_kind = F.col("_ip"), F.col("_ip_kind")
    kafka_ms = F.unix_millis(F.col("timestamp"))
    planned_at = F.col("_planned_at_ms") if with_planned_at else F.lit(None).cast("long")
    # least() skips NULLs: a missing (negative) Kafka timestamp leaves the planning time.
    reference = F.least(F.when(kafka_ms >= 0, kafka_ms), planned_at)
    ahead = F.lit(False) if max_ahead_ms is None else F.coalesce(
        F.col("_event_ms") > reference + F.lit(max_ahead_ms), F.lit(False))
    reason = (
        F.when(value.isNull(), R.NULL_VALUE)
        .when(F.length(value) == 0, R.EMPTY_VALUE)
        .when(F.length(value) > max_value_bytes, R.TOO_LARGE)
        .when(F.try_validate_utf8(value).isNull(), R.NOT_UTF8)
        .when(is_json & ~F.coalesce(F.col("_whole"), F.lit(False)), R.BAD_JSON)  # NULL: did not parse
        .when(is_json & (ip_kind.isNull() | (ip_kind != "STRING") | ~ts_ok), R.BAD_SHAPE)
        .when(~is_json & (F.col("_nginx_ip") == ""), R.UNRECOGNIZED)
        .when(~is_ip_syntax(ip), R.INVALID_IP)
        .when(F.col("_event_ms").isNull(), R.INVALID_TIMESTAMP)
        .when(ahead, R.EVENT_TIME_AHEAD)
    )
    well_formed = F.col("reason").isNull()
    # The canonical IPv6 text in stages (tail, groups, framed groups), each a column of its
    # own for the reason given above; IPv4 addresses are canonical as they are.
    kept = ["_watermark_ms"] if carry_watermark else []
    after = [["*", event_ms.alias("_event_ms")],
             [*kafka, *kept, ip, "_event_ms", reason.alias("reason")],
             [*kafka, *kept, "reason", "_event_ms", F.when(well_formed & ~ip.contains(":"), ip).alias("_ipv4"),
              F.when(well_formed & ip.contains(":"), _without_ipv4_tail(F.lower(ip))).alias("_ipv6")],
             [*kafka, *kept, "reason", "_event_ms", "_ipv4", _ipv6_groups(F.col("_ipv6")).alias("_groups")],
             ["*", F.concat(F.lit(":"), F.array_join("_groups", ":"), F.lit(":")).alias("_framed")],
             [*kafka, *kept, "reason",
              F.coalesce("_ipv4", _canonical_ipv6(F.col("_groups"), F.col("_framed"))).alias("ip"),
              F.when(F.col("reason").isNull(), F.col("_event_ms")).alias("event_ms")]]
    return [trimmed, *flat, split, fields, timed], after


def flat_fields(text: Column) -> Column:
    """``text`` (JSON, trimmed) as "ip ts" when it matches :data:`records.FLAT_JSON_PATTERN`
    (ts a string with its quotes, or the integer's digits), else ``text`` unchanged."""
    return F.regexp_replace(text, R.FLAT_JSON_PATTERN, "$1$4 $2$3")


def whole_value(text: Column) -> Column:
    """Whether ``text``, which parses as JSON, is exactly one JSON value: parse_json stops
    after the first value and ignores what follows.

    The object parsed ends at a "}", so when the text's only "}" is its last character,
    nothing follows it: most records, at the cost of two searches. The text must hold no "["
    either, since the wrapped parse below is also what caps the nesting
    (:data:`ipcount.rules.records.MAX_JSON_DEPTH`), and without "[" and with one "}" there is
    no nesting. Otherwise, wrapped in an array, the text must be one element, and one more
    element appended must make two (text that closes the array early fails the second): two
    more parses.
    """
    simple = (F.instr(text, "}") == F.length(text)) & (F.instr(text, "[") == 0)
    return F.when(simple, F.lit(True)).otherwise(
        (F.json_array_length(F.concat(F.lit("["), text, F.lit("]"))) == 1)
        & (F.json_array_length(F.concat(F.lit("["), text, F.lit(",0]"))) == 2))


def _without_ipv4_tail(ip: Column) -> Column:
    """``::ffff:1.2.3.4`` -> ``::ffff:102:304``: an IPv4 tail as the two groups it stands for."""
    v4 = r"([0-9]+)\.([0-9]+)\.([0-9]+)\.([0-9]+)$"

    def group(i: int) -> Column:
        value = F.regexp_extract(ip, v4, i).cast("int") * 256 + F.regexp_extract(ip, v4, i + 1).cast("int")
        return F.lower(F.hex(value))
    return F.when(ip.contains("."), F.regexp_replace(ip, F.lit(v4), F.concat(group(1), F.lit(":"), group(3)))
                  ).otherwise(ip)


def _ipv6_groups(ip: Column) -> Column:
    """IPv6 text without an IPv4 tail -> its eight groups in hex without leading zeros
    ("::" expanded to the zero groups it stands for)."""
    halves = F.split(ip, "::", -1)

    def groups_of(part: Column) -> Column:
        return F.when(part == "", F.array().cast("array<string>")).otherwise(F.split(part, ":", -1))
    left, right = groups_of(F.get(halves, 0)), groups_of(F.get(halves, 1))
    expanded = F.when(F.size(halves) == 2, F.concat(
        left, F.array_repeat(F.lit("0"), F.lit(8) - F.size(left) - F.size(right)), right)).otherwise(
        F.split(ip, ":", -1))
    return F.transform(expanded, lambda g: F.lower(F.conv(g, 16, 16)))


def _canonical_ipv6(groups: Column, framed: Column) -> Column:
    """Eight groups (and the same joined as ``:g1:...:g8:``) -> RFC 5952 text: the longest
    run of two or more zero groups, the first of equals, becomes "::"; an IPv4-mapped
    address (``::ffff:a.b.c.d``) becomes its IPv4 address. The rule is
    :func:`ipcount.rules.records.canonical_ip`."""
    mapped = F.array_join(F.slice(groups, 1, 6), ":") == "0:0:0:0:0:ffff"

    def octet_pair(i: int) -> Column:
        g = F.conv(F.get(groups, i), 16, 10).cast("int")
        return F.concat_ws(".", F.shiftright(g, 8).cast("string"), (g % 256).cast("string"))
    text = F.array_join(groups, ":")
    for run in range(2, 9):  # each longer run wraps the shorter ones, so it is tested first
        zeros = ":" + "0:" * run
        at = F.locate(zeros, framed)
        before = F.regexp_replace(F.substring(framed, F.lit(1), at - 1), "^:", "")
        after = F.regexp_replace(F.substring(framed, at + len(zeros), F.lit(64)), ":$", "")
        text = F.when(at > 0, F.concat(before, F.lit("::"), after)).otherwise(text)
    return F.when(mapped, F.concat_ws(".", octet_pair(6), octet_pair(7))).otherwise(text)


def is_ip_syntax(ip: Column) -> Column:
    """Whether ``ip`` matches :data:`records.IP_PATTERN`: text without ":" can only match its
    IPv4 branch, which alone costs a third of the whole pattern."""
    return F.when(ip.contains(":"), ip.rlike(R.IP_PATTERN)).otherwise(ip.rlike(R.IPV4_PATTERN))


def iso_to_ms(ts: Column) -> Column:
    """ISO-8601 text -> epoch ms, NULL unless it matches :data:`records.ISO_PATTERN` and is a
    real instant. The pattern admits only forms Spark's own string-to-timestamp cast reads
    (fraction digits past the microsecond dropped, offsets checked by java.time), and
    unix_millis drops the fraction past the ms: one cast instead of three regex extractions
    and a formatted parse. The type is TimestampType (with local time zone), not the name
    "timestamp", which spark.sql.timestampType could make one without a time zone."""
    return F.when(ts.rlike(R.ISO_PATTERN), F.unix_millis(ts.try_cast(TimestampType())))


def classify(parsed: DataFrame, window_ms: int, allowed_lateness_ms: int, watermark_ms: int | None) -> DataFrame:
    """Add ``window_start_ms`` and ``late`` (see :func:`ipcount.rules.records.is_late`):
    against ``watermark_ms``, which ``parsed`` carries (:func:`parse` was given the same),
    or with None nothing is late (an epoch before any watermark)."""
    with_watermark = watermark_ms is not None
    def build() -> tuple[Column, Column]:
        start = F.col("event_ms") - F.pmod(F.col("event_ms"), F.lit(window_ms))
        late = (start + F.lit(window_ms + allowed_lateness_ms) <= F.col("_watermark_ms")) if with_watermark \
            else F.lit(False)
        return start, F.when(F.col("reason").isNull(), late)
    start, late = _columns(parsed.sparkSession, ("classify", window_ms, allowed_lateness_ms, with_watermark), build)
    classified = parsed.withColumns({"window_start_ms": start, "late": late})
    return classified.drop("_watermark_ms") if with_watermark else classified


def with_constants(df: DataFrame, values: dict[str, int]) -> DataFrame:
    """``df`` with a column per name holding its value in every row, joined from one one-row
    broadcast: Spark writes a literal long into the code it generates, so each epoch's own
    planning time and watermark made new classes to compile and warm up in the JIT, about
    0.7 s of a 250,000-record epoch. Joined values leave the code the same every epoch."""
    spark = df.sparkSession
    if is_remote(spark):
        # A local relation made by the client: one config request, not two SQL commands.
        one = spark.createDataFrame([tuple(int(v) for v in values.values())],
                                    StructType([StructField(name, LongType(), False) for name in values]))
    else:
        # VALUES: a local relation (createDataFrame of a list would be a Python RDD here).
        columns = ", ".join(f"CAST({int(v)} AS BIGINT)" for v in values.values())
        one = spark.sql(f"SELECT * FROM VALUES ({columns}) AS constants({', '.join(f'`{n}`' for n in values)})")
    return df.crossJoin(F.broadcast(one))


def tally(classified: DataFrame, dead_letter_prefix: int) -> DataFrame:
    """The epoch's records in one aggregation, from which everything it writes comes
    (:mod:`ipcount.jobs.tally` splits it). Two grouping sets of one pass:

    * per Kafka partition and outcome (``late``: false counted, true late, NULL malformed),
      a row of totals (``totals`` true): the epoch's metrics;
    * counted records collapse into one row per window and client, over all partitions:
      the counts, with no second aggregation; a record that is not counted (malformed or
      late) stays a row of its own, its topic, partition and offset in the grouping key, with
      what its dead-letter or late-record row needs. (A counted row has no topic or
      partition.)

    ``records`` is how many records a row stands for. One pass over the records and no
    cache: a cache of the classified records, read once for each output, cost as much to
    build as the parse itself. Grouping keys may be of any width, unlike aggregation
    buffers, so Spark keeps its hash aggregation. What only a record that is not counted
    needs is one struct in the key, NULL for counted records: every record's key is hashed
    and compared, so a few columns cost less than thirteen.
    """
    keys, sets, aggregates, columns = _columns(classified.sparkSession, ("tally", dead_letter_prefix),
                                               lambda: _tally_columns(dead_letter_prefix))
    return classified.select(*keys).groupingSets(sets, *(k for s in sets for k in s)).agg(*aggregates) \
        .select(*columns)


def _tally_columns(dead_letter_prefix: int) -> tuple[list[Column], list[list[str]], list[Column],
                                                     list[Column | str]]:
    """:func:`tally`'s grouping columns, grouping sets, aggregates and output columns."""
    reason, late, value = F.col("reason"), F.col("late"), F.col("value")
    bad = reason.isNotNull()
    kept = bad | late  # not counted: late is NULL exactly when the record is malformed
    # What only a record that is not counted needs, in the order of the tally's columns.
    details = {
        "topic": F.col("topic"), "partition": F.col("partition"), "reason": reason, "late": late,
        "offset": F.col("offset"), "timestamp": F.when(bad, F.col("timestamp")),
        "event_ms": F.when(late, F.col("event_ms")), "key": F.when(bad, F.col("key")),
        # A too_large dead letter keeps a prefix of its value, with the whole value's size and hash.
        "value": F.when(bad, F.when(reason == R.TOO_LARGE, F.substring(value, 1, dead_letter_prefix)).otherwise(value)),
        "value_bytes": F.when(bad, F.length(value).cast("long")), "value_sha256": F.when(bad, F.sha2(value, 256))}
    keys = [F.col("partition"), late, F.when(~bad, F.col("window_start_ms")).alias("window_start_ms"),
            F.when(~bad, F.col("ip")).alias("ip"),
            F.when(kept, F.struct(*(column.alias(name) for name, column in details.items()))).alias("_kept"),
            F.col("event_ms")]
    sets = [["partition", "late"], ["window_start_ms", "ip", "_kept"]]
    aggregates = [F.count(F.lit(1)).alias("records"), F.max("event_ms").alias("max_event_ms"),
                  (F.grouping("ip") == F.lit(1)).alias("_totals")]  # a row of the first set
    kept_row, totals = F.col("_kept"), F.col("_totals")
    columns = [totals.alias("totals"), kept_row["topic"].alias("topic"),
               F.coalesce(F.col("partition"), kept_row["partition"]).alias("partition"),
               kept_row["reason"].alias("reason"),
               F.when(totals, F.col("late")).when(kept_row.isNull(), F.lit(False)).otherwise(kept_row["late"])
               .alias("late"), "window_start_ms", "ip",
               *(kept_row[name].alias(name) for name in details
                 if name not in ("topic", "partition", "reason", "late")),
               "records", "max_event_ms"]
    return keys, sets, aggregates, columns
