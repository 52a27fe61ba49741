"""The Spark parser (built-in functions) agrees with the Python format spec, record by record."""
from __future__ import annotations

import random
from datetime import datetime, timezone

import pytest
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructField, StructType, TimestampType

from ipcount.jobs import transform
from ipcount_lab.generator import MALFORMED_SAMPLES, TrafficGenerator
from tests.unit.test_records import FLAT_JSON
from ipcount.rules.records import REASONS, Event, parse_value

KAFKA_SCHEMA = StructType([
    StructField("topic", StringType()), StructField("partition", IntegerType()), StructField("offset", LongType()),
    StructField("timestamp", TimestampType()), StructField("key", BinaryType()), StructField("value", BinaryType()),
])

HAND_PICKED = [
    b'{"ip": "203.0.113.9", "ts": "2026-11-21T10:00:03.120Z"}',
    b'{"ip": "2001:DB8::A", "ts": "2026-11-21T11:00:03.5+01:00"}',
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03.987654321Z"}',
    b'  {"ip": "1.2.3.4", "ts": 1795255203120}\n',
    b'{"ip": "1.2.3.4", "ts": 1795255203000.5}', b'{"ip": "1.2.3.4", "ts": 1e12}', b'{"ip": "1.2.3.4", "ts": true}',
    b'{"ip": "1.2.3.4", "ts": 99999999999999999999}', b'{"ip": "1.2.3.4", "ts": -5}',
    b'{"ip": "1.2.3.4", "ts": "1795255203000"}', b'{"ip": "1.2.3.4", "ts": "2026-02-30T00:00:00Z"}',
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T24:00:00Z"}', b'{"ip": "1.2.3.4", "ts": "1999-12-31T23:59:59Z"}',
    b'{"ip": "1.2.3.4", "ip": "5.6.7.8", "ts": 1795255203000}', b'{"ip": "1.2.3.4", "ts": 1} trailing',
    # the whole-value check: one "}" at the end, a "}" inside a string, text after the object
    b'{"ip": "1.2.3.4", "ts": 1795255203000, "x": "a}b"}', b'{"ip": "1.2.3.4", "ts": 1795255203000}}',
    b'{"ip": "1.2.3.4", "ts": 1795255203000} {"ip": "5.6.7.8", "ts": 1795255203000}',
    b'{"ip": "1.2.3.4", "ts": 1795255203000}, 0], [0', b'{"ip": "1.2.3.4", "ts": 1795255203000}]',
    b'{"ip": "1.2.3.4\x01", "ts": 1795255203000}', b'{"ip": "1.2.3.4", "ts": NaN}', b'{"ip": "1.2.3.4", "ts": 01}',
    b'{"ip": null, "ts": 1795255203000}', b'{"ts": 1795255203000}', b'{}', b'{', b'{"a": [1, 2}',
    b'["1.2.3.4", 1795255203000]', b'"1.2.3.4"',
    # Nesting: 999 levels (the record's object included) parse, 1,000 and 30,000 do not.
    *(b'{"ip": "1.2.3.4", "ts": 1795255203000, "x": ' + o * (d - 1) + b'1' + c * (d - 1) + b'}'
      for d in (999, 1000, 30_000) for o, c in ((b'[', b']'), (b'{"a": ', b'}'))),
    b'{"ip": "1.2.3.4", "ts": 1795255203000, "x": "' + b'[' * 2000 + b'"}',
    *(b'{"ip": ' + b'[' * (d - 1) + b'1' + b']' * (d - 1) + b', "ts": 1795255203000}' for d in (999, 1000)),
    b'{"ip": "1.2.3.4", "ts": ' + b'{"a": ' * 998 + b'1' + b'}' * 998 + b'}',
    b'203.0.113.9 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512 "-" "curl/8"',
    b'203.0.113.9 - frank [21/Nov/2026:11:00:03 +0100] "POST /x HTTP/2.0" 404 -',
    b'::1 - - [21/Nov/2026:10:00:03 -0130] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [31/Feb/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/NOV/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03] "GET / HTTP/1.1" 200 512', b'01.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "G" 200 1',
    b'fe80::1%eth0 - - [21/Nov/2026:10:00:03 +0000] "G" 200 1', b"GET / 200", b"   ", b"\t\r\n", b"",
    b"\xff\xfe\xfd", b"\xc3\x28", b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03Z", "x": "\xe2\x82\xac"}',
    b"x" * 70_000, None,
    # time-zone offsets: java.time's limits (minutes < 60, at most 18:00 either way) hold in both
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03+18:00"}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03-18:00"}',
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03+18:01"}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03+19:00"}',
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03+05:99"}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03-05:60"}',
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03+23:59"}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03+05:45"}',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +1800] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 -1801] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +1900] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0599] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0560] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0545] "GET / HTTP/1.1" 200 512',
    # one address, many spellings: all counted as its canonical form
    b'{"ip": "2001:0db8:0000::1", "ts": 1795255203000}', b'{"ip": "2001:DB8:0:0:0:0:0:1", "ts": 1795255203000}',
    b'{"ip": "::ffff:1.2.3.4", "ts": 1795255203000}', b'{"ip": "::FFFF:0102:0304", "ts": 1795255203000}',
    b'{"ip": "::1.2.3.4", "ts": 1795255203000}', b'{"ip": "1:0:0:1:0:0:0:1", "ts": 1795255203000}',
    b'{"ip": "0:0:1:0:0:1:0:0", "ts": 1795255203000}', b'{"ip": "1:0:3:4:5:6:7:8", "ts": 1795255203000}',
    b'::ffff:10.0.0.1 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512',
    # ISO times read by Spark's cast: fraction digits past the microsecond, leap seconds,
    # impossible dates, year 0, zero offsets
    *(b'{"ip": "1.2.3.4", "ts": "%s"}' % t for t in (
        b"2026-11-21T10:00:03.1234567Z", b"2026-11-21T10:00:03.0009Z", b"2026-11-21T10:00:03.999999999-00:00",
        b"2026-11-21T23:59:60Z", b"2026-13-01T00:00:00Z", b"2026-00-10T00:00:00Z", b"2026-11-00T00:00:00Z",
        b"2028-02-29T00:00:00Z", b"2027-02-29T00:00:00Z", b"0000-01-01T00:00:00Z", b"2026-11-21T10:60:00+00:00",
        b"2026-11-21T10:00:03.Z", b"2026-11-21T10:00:03,5Z", b"2026-11-21t10:00:03Z", b"2026-11-21T10:00:03z")),
    # Line terminators at the end: Java's "$" matches before a final \n, \r, U+0085, U+2028 or U+2029
    b'{"ip":"1.2.3.4","ts":1795255203000}\xe2\x80\xa8', b'{"ip":"1.2.3.4","ts":1795255203000}\xc2\x85',
    b'{"ip": "1.2.3.4\\n", "ts": 1795255203000}', b'{"ip": "::1\\r", "ts": 1795255203000}',
    b'{"ip": "1.2.3.4\\u2028", "ts": 1795255203000}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03Z\\r"}',
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03Z\\n"}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03Z\\u2029"}',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512\xe2\x80\xa9',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000\xe2\x80\xa8] "GET / HTTP/1.1" 200 512',
    # a record from a bad clock, far ahead of its Kafka timestamp
    b'{"ip": "1.2.3.4", "ts": 4102444700000}',
]


def _mutations(rng: random.Random, values: list[bytes]) -> list[bytes]:
    out = []
    for v in values:
        for _ in range(3):
            b = bytearray(v)
            op = rng.randrange(3)
            if op == 0 and b:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif op == 1 and b:
                del b[rng.randrange(len(b)):]
            else:
                b.insert(rng.randrange(len(b) + 1), rng.choice(b' {}":,-[]0aZ\\'))
            out.append(bytes(b))
    return out


NO_TS = [b'{"ip": "203.0.113.9"}', b'{"ip": "203.0.113.9", "ts": [1]}', b'{"ts": 1795255203000}',
         b'203.0.113.9 - - [99/Xyz/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512']


@pytest.mark.parametrize("event_time", ["payload", "kafka"])
def test_spark_parser_matches_python_spec_on_every_record(spark, event_time):
    start = 1_795_255_203_000
    generated = [r.value for r in TrafficGenerator(seed=5, malformed_share=0.05).records(3000, start)]
    values = HAND_PICKED + [t.encode() for t in FLAT_JSON] + NO_TS + [v for _, v in MALFORMED_SAMPLES] + generated
    values += _mutations(random.Random(9), [v for v in generated[:400] if v])
    # Kafka timestamps: mostly plausible, some outside the valid event-time range, some
    # hours before the payload's time or after the planning time (event_time_ahead).
    rng = random.Random(4)
    hour, planned_at = 3_600_000, start + 2 * 3_600_000
    kafka_ms = [rng.choice((start + rng.randrange(-10**6, 10**6), start + rng.randrange(-10**6, 10**6),
                            631_152_000_000, 4_200_000_000_000, start - 3 * hour, planned_at + hour + 1))
                for _ in values]
    rows = [("t", 0, i, datetime.fromtimestamp(ms / 1000, tz=timezone.utc), None, v)
            for i, (ms, v) in enumerate(zip(kafka_ms, values))]
    df = spark.createDataFrame(rows, KAFKA_SCHEMA)
    parsed = transform.parse(df, 65_536, event_time, max_ahead_ms=hour, planned_at_ms=planned_at)
    got = {r.offset: (r.reason, r.ip, r.event_ms) for r in parsed.collect()}

    mismatches = []
    for i, v in enumerate(values):
        p = parse_value(v, 65_536, event_time=event_time, kafka_timestamp_ms=kafka_ms[i], planned_at_ms=planned_at,
                        max_ahead_ms=hour)
        want = (None, p.ip, p.event_ms) if isinstance(p, Event) else (p.reason, None, None)
        if got[i] != want:
            mismatches.append((v[:120] if v else v, want, got[i]))
    assert not mismatches, mismatches[:10]
    reasons = {g[0] for g in got.values()}
    assert reasons == {None, *REASONS}  # every malformed class and well-formed records occurred
