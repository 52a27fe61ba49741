"""The Spark parse (ipcount.parse, the project's JVM function) agrees with the Python format spec, record by
record, in a Spark job."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructField, StructType, TimestampType

from ipcount.jobs import transform
from ipcount.rules.errors import MissingJarsError
from ipcount.rules.records import REASONS
from tests import parse_cases

KAFKA_SCHEMA = StructType([
    StructField("topic", StringType()), StructField("partition", IntegerType()), StructField("offset", LongType()),
    StructField("timestamp", TimestampType()), StructField("key", BinaryType()), StructField("value", BinaryType()),
])


@pytest.mark.parametrize("event_time", ["payload", "kafka"])
def test_spark_parser_matches_python_spec_on_every_record(spark, event_time):
    values = parse_cases.values()
    kafka_ms = parse_cases.kafka_timestamps(len(values))
    rows = [("t", 0, i, datetime.fromtimestamp(ms / 1000, tz=timezone.utc), None, v)
            for i, (ms, v) in enumerate(zip(kafka_ms, values))]
    df = spark.createDataFrame(rows, KAFKA_SCHEMA)
    parsed = transform.parse(df, 65_536, event_time, max_ahead_ms=parse_cases.HOUR_MS,
                             planned_at_ms=parse_cases.PLANNED_AT_MS)
    got = {r.offset: (r.reason, r.ip, r.event_ms) for r in parsed.collect()}

    mismatches = [(v[:120] if v else v, want, got[i]) for i, v in enumerate(values)
                  if got[i] != (want := parse_cases.expected(v, kafka_ms[i], event_time))]
    assert not mismatches, mismatches[:10]
    reasons = {g[0] for g in got.values()}
    assert reasons == {None, *REASONS}  # every malformed class and well-formed records occurred


def test_a_spark_without_the_parse_function_is_a_clear_error(spark):
    """A session whose JVM lacks the parse (a Spark Connect server started without the jar, a
    conf left out) fails before any work, saying what it needs."""
    other = spark.newSession()
    other.conf.unset("spark.sql.catalog.ipcount")
    with pytest.raises(MissingJarsError, match=r"ipcount\.parse.*ipcount-parse\.jar"):
        transform.parse(other.createDataFrame([], KAFKA_SCHEMA), 65_536)
