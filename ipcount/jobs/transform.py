"""The epoch's Spark transformations: parse, classify late records, aggregate.

Built from Spark's own functions and the project's parse function (Java, jars/ipcount-parse), no Python UDFs, so records
never leave the JVM. The rules are those of :mod:`ipcount.rules.records`, which the tests use as ground truth.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from pyspark.sql import Column, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StructField, StructType

from ipcount.rules import records as R
from ipcount.rules.errors import MissingJarsError
from ipcount.storage.spark import PARSE_JAR, is_remote

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

T = TypeVar("T")


# "None" for the parse function's long arguments (RecordParser.NONE in jars/ipcount-parse).
NONE = -(2**63)
KAFKA_COLUMNS = ("topic", "partition", "offset", "timestamp", "key", "value")


def parse(raw: DataFrame, max_value_bytes: int, event_time: str = "payload", max_ahead_ms: int | None = None,
          planned_at_ms: int | None = None, watermark_ms: int | None = None) -> DataFrame:
    """Kafka rows -> rows with ``ip`` (canonical), ``event_ms`` and ``reason`` (NULL when well formed), as
    :func:`ipcount.rules.records.parse_value` says, keeping the Kafka columns for dead letters. With ``watermark_ms``
    the rows carry it too (``_watermark_ms``, for :func:`classify`): the epoch's constants are joined once.

    The rules run as ``ipcount.parse`` (jars/ipcount-parse, registered by :data:`ipcount.storage.spark.SESSION_CONF`):
    one pass over each value's bytes in generated code, far cheaper than built-in functions (docs/performance.md). Its
    result is a column of its own, whose fields the next select takes, so the optimizer does not copy it into each of
    its consumers.
    """
    with_planned_at = planned_at_ms is not None and planned_at_ms >= 0
    carry = watermark_ms is not None
    _columns(raw.sparkSession, ("parse function",), lambda: _check_parse_function(raw.sparkSession))
    stages = _columns(raw.sparkSession, ("parse", max_value_bytes, event_time, max_ahead_ms, with_planned_at, carry),
                      lambda: _parse_stages(max_value_bytes, event_time == "kafka", max_ahead_ms, with_planned_at,
                                            carry))
    constants = {name: value for name, value in (("_planned_at_ms", planned_at_ms if with_planned_at else None),
                                                 ("_watermark_ms", watermark_ms)) if value is not None}
    df = with_constants(raw.select(*KAFKA_COLUMNS), constants) if constants else raw
    for stage in stages:
        df = df.select(*stage)
    return df


# Columns are unresolved expressions, free to use on any DataFrame, and building them takes many py4j round trips
# (docs/performance.md): each Spark session builds them once per set of parameters.
_BUILT: weakref.WeakKeyDictionary[SparkSession, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def _columns(spark: SparkSession, key: tuple, build: Callable[[], T]) -> T:
    """``build()``, made once per Spark session and ``key``."""
    built = _BUILT.setdefault(spark, {})
    if key not in built:
        built[key] = build()
    return built[key]


Stage = list  # the arguments of one select: Columns and column names


def _check_parse_function(spark: SparkSession) -> bool:
    """Whether ``spark`` has ``ipcount.parse`` (analysis only: nothing runs); :class:`MissingJarsError` if not."""
    probe = F.call_function("ipcount.parse", F.lit(b"x"), F.lit(NONE), F.lit(NONE), F.lit(1), F.lit(False),
                            F.lit(NONE))
    try:
        spark.range(0).select(probe).schema
    except Exception as e:  # noqa: BLE001 - classic and Connect raise different classes
        cause = (str(e).splitlines() or [type(e).__name__])[0]  # whole: Connect's first line can be long
        raise MissingJarsError(
            f"this Spark has no function ipcount.parse ({cause}): its JVM needs "
            f"{PARSE_JAR.name} (an installation has it in {PARSE_JAR.parent}; a Spark Connect server of "
            "your own takes it in --jars) and spark.sql.catalog.ipcount=ipcount.parse.ParseCatalog") from e
    return True


def _parse_stages(max_value_bytes: int, from_kafka: bool, max_ahead_ms: int | None, with_planned_at: bool,
                  carry_watermark: bool) -> list[Stage]:
    """The parse's selects (:func:`parse`), after the epoch's constants are joined (``_planned_at_ms``, when
    ``with_planned_at``; ``_watermark_ms``, kept when ``carry_watermark``)."""
    kafka = [F.col(c) for c in KAFKA_COLUMNS]
    kept = ["_watermark_ms"] if carry_watermark else []
    planned_at = F.col("_planned_at_ms") if with_planned_at else F.lit(NONE)
    # The function takes an int and a long: larger settings mean the same as these (no value is over 2 GiB, no event
    # time that far ahead).
    max_bytes, max_ahead = min(max_value_bytes, 2**31 - 1), NONE if max_ahead_ms is None else min(max_ahead_ms, 2**62)
    parsed = F.call_function(
        "ipcount.parse", F.col("value"), F.coalesce(F.unix_millis(F.col("timestamp")), F.lit(NONE)), planned_at,
        F.lit(max_bytes), F.lit(from_kafka), F.lit(max_ahead))
    result = F.col("_parsed")
    return [[*kafka, *kept, parsed.alias("_parsed")],
            [*kafka, *kept, result["reason"].alias("reason"), result["ip"].alias("ip"),
             result["event_ms"].alias("event_ms")]]


def classify(parsed: DataFrame, window_ms: int, allowed_lateness_ms: int, watermark_ms: int | None) -> DataFrame:
    """Add ``window_start_ms`` and ``late`` (:func:`ipcount.rules.records.is_late`) against ``watermark_ms``, which
    ``parsed`` carries (None: nothing is late)."""
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
    """``df`` with a column per name holding its value in every row, joined from a one-row broadcast: a literal would be
    written into the generated code, making new classes to compile every epoch (docs/performance.md)."""
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
    """The epoch's records in one aggregation, from which everything it writes comes (:mod:`ipcount.jobs.tally` splits
    it). Two grouping sets of one pass:

    * per Kafka partition and outcome (``late``: false counted, true late, NULL malformed), a row of totals (``totals``
      true): the epoch's metrics;
    * a row per window and client for counted records (the counts), and a row per record not counted, with what its
      dead-letter or late-record row needs in one struct of the grouping key (NULL for counted records: a narrow key is
      cheaper to hash).

    ``records`` is how many records a row stands for. One pass and no cache: a cache read once per output cost as much
    as the parse (docs/performance.md).
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
