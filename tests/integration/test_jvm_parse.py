"""The JVM parser (jars/ipcount-parse, what the Spark job calls) agrees with the Python
format spec record by record, run without Spark through its command line."""
from __future__ import annotations

import random
import shutil
import subprocess

import pytest

from ipcount.rules.records import REASONS
from ipcount.storage.spark import PARSE_JAR
from tests import parse_cases


def _cli(lines: str, *args: str) -> list[str]:
    """The output lines of the jar's command line (ipcount.parse.Cli) for ``lines``."""
    java = shutil.which("java")
    assert java and PARSE_JAR.exists(), f"needs java and {PARSE_JAR}: run bin/setup"
    done = subprocess.run([java, "-cp", str(PARSE_JAR), "ipcount.parse.Cli", *args],
                          input=lines, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _jvm_parse(values: list[bytes | None], kafka_ms: list[int], event_time: str,
               *extra: str) -> list[tuple[str | None, str | None, int | None]]:
    lines = "".join(f"{'-' if v is None else v.hex()}\t{ms}\t{parse_cases.PLANNED_AT_MS}\n"
                    for v, ms in zip(values, kafka_ms))
    out = []
    for line in _cli(lines, "--event-time", event_time, "--max-value-bytes", "65536",
                     "--max-ahead-ms", str(parse_cases.HOUR_MS), *extra):
        reason, ip, event_ms = line.split("\t")
        out.append((None if reason == "-" else reason, None if ip == "-" else ip,
                    None if event_ms == "-" else int(event_ms)))
    assert len(out) == len(values)
    return out


_IPS = [b'"1.2.3.4"', b'"::ffff:1.2.3.4"', b'"2001:DB8:0:0:1::1"', b'"1.2.3.\\u0034"', b'"1:2:3:4:5:6:7:8:9"', b'"::"',
        b'"0:0:1:0:0:1:0:0"', b'"256.0.0.1"', b'"fe80::1%1"', b'1234', b'null', b'["1.2.3.4"]']
_TIMES = [b'"2026-11-21T10:00:03Z"', b'"2026-11-21T10:00:03.123456+05:30"', b'"2028-02-29T23:59:59-18:00"',
          b'"2027-02-29T00:00:00Z"', b'"2026-11-21T10:00:03\\u005a"', b'1795255203000', b'-0', b'1e12', b'true',
          b'9223372036854775808', b'"x"', b'{}']
_VALUES = [b'1', b'-2.5e-3', b'"s"', b'"\\ud83d\\ude00"', b'"\\ud83d"', b'"\xe2\x82\xac"', b'[]', b'[1, [2, {}]]',
           b'{"ip": 1, "a": {"b": null}}', b'false', b'"\\"\\\\\\/\\b\\f\\n\\r\\t"']
_KEYS = [b'"ip"', b'"ts"', b'"i\\u0070"', b'"a"', b'"a"', b'"\\u0061"', b'"\\ud83d\\ude00"', b'"\xf0\x9f\x98\x80"',
         b'""']
_TIMES_NGINX = [b'21/Nov/2026:10:00:03 +0000', b'29/Feb/2028:23:59:59 -1800', b'29/Feb/2027:00:00:00 +0000',
                b'21/Nov/2026:10:00:60 +0000', b'21/nov/2026:10:00:03 +0000', b'01/Jan/2000:00:00:00 +0001']
_MUTATION_BYTES = b' {}[]":,-0.eE\\u\x00\x7f\xc3\xa9\xed\xa0\x80'


def _fuzzed(rng: random.Random, count: int) -> list[bytes]:
    """Records from the grammar's pieces at random, most of them valid or one mutation away,
    so that the deeper rules (escapes, duplicates at any depth, IPv6, calendars) are reached,
    not only the first check that fails."""
    out = []
    for _ in range(count):
        if rng.random() < 0.6:
            members = [b'"ip": ' + rng.choice(_IPS), b'"ts": ' + rng.choice(_TIMES)]
            members += [rng.choice(_KEYS) + b': ' + rng.choice(_VALUES) for _ in range(rng.randrange(3))]
            rng.shuffle(members)
            value = bytearray(b'{' + b', '.join(members) + b'}')
        else:
            value = bytearray(rng.choice(_IPS).strip(b'"') + b' - - [' + rng.choice(_TIMES_NGINX)
                              + b'] "GET / HTTP/1.1" ' + rng.choice((b'200 512', b'404 -', b'200 512 "-" "curl/8"')))
        if rng.random() < 0.4:
            at = rng.randrange(len(value) + 1)
            if rng.random() < 0.5:
                value.insert(at, rng.choice(_MUTATION_BYTES))
            else:
                del value[at:at + rng.randrange(1, 4)]
        out.append(bytes(value))
    return out


@pytest.mark.parametrize("event_time", ["payload", "kafka"])
def test_jvm_parser_matches_python_spec_on_every_record(event_time):
    values = parse_cases.values(generated=20_000) + _fuzzed(random.Random(11), 20_000)
    kafka_ms = parse_cases.kafka_timestamps(len(values))
    got = _jvm_parse(values, kafka_ms, event_time)
    mismatches = [(v[:120] if v else v, want, g) for v, ms, g in zip(values, kafka_ms, got)
                  if g != (want := parse_cases.expected(v, ms, event_time))]
    assert not mismatches, mismatches[:10]
    assert {g[0] for g in got} == {None, *REASONS}


def test_jvm_parser_without_a_kafka_timestamp_or_planning_time():
    """A missing Kafka timestamp ("-": NONE) is no reference for event_time_ahead, and in
    "kafka" mode no event time."""
    value = b'{"ip": "1.2.3.4", "ts": 4102444700000}'
    lines = f"{value.hex()}\t-\t-\n{value.hex()}\t-\n{value.hex()}\n-\n"
    for event_time, want in (("payload", ["-\t1.2.3.4\t4102444700000"] * 3 + ["null_value\t-\t-"]),
                             ("kafka", ["invalid_timestamp\t-\t-"] * 3 + ["null_value\t-\t-"])):
        assert _cli(lines, "--event-time", event_time, "--max-ahead-ms", "0") == want
