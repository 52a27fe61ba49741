"""The record format spec: both formats, every malformed class, windows and lateness."""
from __future__ import annotations

import ipaddress
import re

import pytest

from ipcount.rules import records as R
from ipcount.rules.records import Event, Malformed, is_late, parse_value, window_start
from ipcount_lab.generator import MALFORMED_SAMPLES, TrafficGenerator

MS_2026_11_21_10_00_03 = 1_795_255_203_000


def test_json_with_iso_timestamp():
    got = parse_value(b'{"ip": "203.0.113.9", "ts": "2026-11-21T10:00:03.120Z"}')
    assert got == Event("203.0.113.9", MS_2026_11_21_10_00_03 + 120)


def test_json_with_epoch_millis_and_offset_timestamps():
    assert parse_value(b'{"ip": "203.0.113.9", "ts": 1795255203120}') == Event("203.0.113.9", 1_795_255_203_120)
    assert parse_value(b'{"ts": "2026-11-21T11:00:03+01:00", "ip": "::1"}') == Event("::1", MS_2026_11_21_10_00_03)
    # Nanosecond fractions are truncated to milliseconds.
    assert parse_value(b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03.987654321Z"}').event_ms == \
        MS_2026_11_21_10_00_03 + 987


def test_nginx_combined_and_common_lines():
    combined = b'203.0.113.9 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512 "-" "curl/8"'
    common = b'203.0.113.9 - frank [21/Nov/2026:11:00:03 +0100] "POST /x HTTP/2.0" 404 -'
    assert parse_value(combined) == Event("203.0.113.9", MS_2026_11_21_10_00_03)
    assert parse_value(common) == Event("203.0.113.9", MS_2026_11_21_10_00_03)
    assert parse_value(combined + b"\n") == Event("203.0.113.9", MS_2026_11_21_10_00_03)


def test_ipv6_is_lowercased():
    assert parse_value(b'{"ip": "2001:DB8::A", "ts": 1795255203000}').ip == "2001:db8::a"


@pytest.mark.parametrize("spellings, canonical", [
    (["2001:0db8:0000::1", "2001:db8::1", "2001:DB8:0:0:0:0:0:1"], "2001:db8::1"),
    (["::ffff:1.2.3.4", "::FFFF:102:304", "0:0:0:0:0:ffff:0102:0304", "1.2.3.4"], "1.2.3.4"),
    (["1:0:0:1:0:0:0:1"], "1:0:0:1::1"),        # the longest run of zero groups
    (["0:0:1:0:0:1:0:0"], "::1:0:0:1:0:0"),     # the first of equally long runs
    (["1:0:3:4:5:6:7:8", "1::3:4:5:6:7:8"], "1:0:3:4:5:6:7:8"),  # one zero group stays
    (["::1.2.3.4"], "::102:304"),               # IPv4-compatible (not mapped) stays IPv6
])
def test_one_address_is_one_client_however_it_is_spelled(spellings, canonical):
    for ip in spellings:
        assert parse_value(b'{"ip": "%s", "ts": 1795255203000}' % ip.encode()).ip == canonical, ip


@pytest.mark.parametrize("ts, ok", [
    ("2026-11-21T10:00:03+18:00", True), ("2026-11-21T10:00:03-18:00", True), ("2026-11-21T10:00:03+05:45", True),
    ("2026-11-21T10:00:03+18:01", False), ("2026-11-21T10:00:03+19:00", False),
    ("2026-11-21T10:00:03+05:99", False), ("2026-11-21T10:00:03-05:60", False),
    ("21/Nov/2026:10:00:03 +1800", True), ("21/Nov/2026:10:00:03 -1801", False),
    ("21/Nov/2026:10:00:03 +1900", False), ("21/Nov/2026:10:00:03 +0599", False),
])
def test_time_zone_offsets_within_what_java_time_accepts(ts, ok):
    """Spark reads offsets with java.time: at most 18:00 either way, minutes below 60."""
    value = (b'{"ip": "1.2.3.4", "ts": "%s"}' % ts.encode() if "T" in ts
             else b'1.2.3.4 - - [%s] "GET / HTTP/1.1" 200 1' % ts.encode())
    assert isinstance(parse_value(value), Event) == ok
    if not ok:
        assert parse_value(value) == Malformed(R.INVALID_TIMESTAMP)


def test_event_time_far_ahead_of_its_kafka_timestamp_is_dead_lettered():
    hour, kafka_ms = 3_600_000, MS_2026_11_21_10_00_03
    year_2099 = b'{"ip": "1.2.3.4", "ts": 4102444700000}'
    assert parse_value(year_2099, max_ahead_ms=hour, kafka_timestamp_ms=kafka_ms) == Malformed(R.EVENT_TIME_AHEAD)
    assert parse_value(year_2099) == Event("1.2.3.4", 4_102_444_700_000)  # no bound, no check
    at = b'{"ip": "1.2.3.4", "ts": %d}'
    assert isinstance(parse_value(at % (kafka_ms + hour), max_ahead_ms=hour, kafka_timestamp_ms=kafka_ms), Event)
    assert parse_value(at % (kafka_ms + hour + 1), max_ahead_ms=hour, kafka_timestamp_ms=kafka_ms) == \
        Malformed(R.EVENT_TIME_AHEAD)
    # the planning time bounds it too, and alone bounds Kafka timestamps (event_time = kafka)
    assert parse_value(at % kafka_ms, max_ahead_ms=0, kafka_timestamp_ms=kafka_ms + 5,
                       planned_at_ms=kafka_ms - 1) == Malformed(R.EVENT_TIME_AHEAD)
    assert parse_value(b'{"ip": "1.2.3.4"}', event_time="kafka", max_ahead_ms=hour, kafka_timestamp_ms=kafka_ms,
                       planned_at_ms=kafka_ms - 2 * hour) == Malformed(R.EVENT_TIME_AHEAD)
    # a negative Kafka timestamp (none) bounds nothing
    assert isinstance(parse_value(at % kafka_ms, max_ahead_ms=hour, kafka_timestamp_ms=-1), Event)


@pytest.mark.parametrize("value, reason", [
    (None, R.NULL_VALUE),
    (b"", R.EMPTY_VALUE),
    (b"x" * 101, R.TOO_LARGE),
    (b"\xff\xfe{}", R.NOT_UTF8),
    (b'{"ip": "1.2.3.4", "ts": ', R.BAD_JSON),
    (b'{"ip": "1.2.3.4", "ts": 1} trailing', R.BAD_JSON),
    (b'{"ip": "1.2.3.4", "ip": "5.6.7.8", "ts": 1795255203000}', R.BAD_JSON),
    (b'{"ip": 1234, "ts": 1795255203000}', R.BAD_SHAPE),
    (b'{"ip": "1.2.3.4"}', R.BAD_SHAPE),
    (b'{"ip": "1.2.3.4", "ts": 1795255203000.5}', R.BAD_SHAPE),
    (b'{"ip": "1.2.3.4", "ts": true}', R.BAD_SHAPE),
    (b"GET / 200", R.UNRECOGNIZED),
    (b"   ", R.UNRECOGNIZED),
    (b'{"ip": "256.1.1.1", "ts": 1795255203000}', R.INVALID_IP),
    (b'{"ip": "01.1.1.1", "ts": 1795255203000}', R.INVALID_IP),
    (b'{"ip": "fe80::1%eth0", "ts": 1795255203000}', R.INVALID_IP),
    (b'not-an-ip - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512', R.INVALID_IP),
    (b'{"ip": "1.2.3.4", "ts": "2026-13-01T00:00:00Z"}', R.INVALID_TIMESTAMP),
    (b'{"ip": "1.2.3.4", "ts": "yesterday"}', R.INVALID_TIMESTAMP),
    (b'{"ip": "1.2.3.4", "ts": "1795255203000"}', R.INVALID_TIMESTAMP),
    (b'{"ip": "1.2.3.4", "ts": -5}', R.INVALID_TIMESTAMP),
    (b'{"ip": "1.2.3.4", "ts": 99999999999999}', R.INVALID_TIMESTAMP),
    (b'1.2.3.4 - - [31/Feb/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512', R.INVALID_TIMESTAMP),
])
def test_each_malformed_class_has_its_reason(value, reason):
    assert parse_value(value, max_value_bytes=100) == Malformed(reason)


@pytest.mark.parametrize("depth, nested", [(d, n) for d in (2, 998, 999, 1000, 30_000) for n in ("[]", "{}")])
def test_json_nested_deeper_than_spark_parses_is_bad_json_not_a_crash(depth, nested):
    open_, close = ('{"a": ', "}") if nested == "{}" else ("[", "]")
    value = ('{"ip": "1.2.3.4", "ts": 1795255203000, "x": ' + open_ * (depth - 1) + "1" + close * (depth - 1)
             + "}").encode()
    got = parse_value(value, 1 << 20)
    assert (got == Event("1.2.3.4", 1_795_255_203_000)) if depth <= R.MAX_JSON_DEPTH else got == Malformed(R.BAD_JSON)


def test_brackets_inside_strings_do_not_count_as_nesting():
    value = ('{"ip": "1.2.3.4", "ts": 1795255203000, "x": "' + "[{" * 2000 + '\\"]"}').encode()
    assert R._json_depth(value.decode()) == 1
    assert parse_value(value, 1 << 20) == Event("1.2.3.4", 1_795_255_203_000)


def test_generator_malformed_samples_have_the_reason_they_claim():
    for reason, value in MALFORMED_SAMPLES:
        assert parse_value(value) == Malformed(reason), value


@pytest.mark.parametrize("value, reason", [
    (b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03Z\\n"}', R.INVALID_TIMESTAMP),
    (b'{"ip": "1.2.3.4\\n", "ts": 1795255203000}', R.INVALID_IP),
    (b'{"ip": "1.2.3.4", "ts": 1795255203000}\xe2\x80\xa8', R.BAD_JSON),
    (b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512\xc2\x85', R.UNRECOGNIZED),
])
def test_a_line_terminator_at_the_end_is_not_the_end_of_the_text(value, reason):
    """Every pattern ends where the text ends, not before a final line terminator as "$" does."""
    assert parse_value(value) == Malformed(reason)
    assert not re.match(R.ISO_PATTERN, "2026-11-21T10:00:03Z\n")


def test_windows_are_tumbling_and_aligned():
    assert window_start(12_345, 5_000) == 10_000
    assert window_start(10_000, 5_000) == 10_000
    assert window_start(9_999, 5_000) == 5_000


def test_lateness_rule():
    # window [10s, 15s) with 5 s allowed lateness closes when the watermark reaches 20 s.
    assert not is_late(12_000, 5_000, 5_000, None)
    assert not is_late(12_000, 5_000, 5_000, 19_999)
    assert is_late(12_000, 5_000, 5_000, 20_000)
    assert is_late(12_000, 5_000, 0, 15_000)


def test_generator_is_seedable_and_mixes_formats():
    a = list(TrafficGenerator(seed=1).records(2000, MS_2026_11_21_10_00_03))
    b = list(TrafficGenerator(seed=1).records(2000, MS_2026_11_21_10_00_03))
    assert a == b
    parsed = [parse_value(x.value) for x in a]
    events = [p for p in parsed if isinstance(p, Event)]
    assert 0 < len(parsed) - len(events) < 60           # ~1% malformed
    assert any(x.value and x.value.startswith(b"{") for x in a)
    assert any(x.value and x.value[:1].isdigit() for x in a)
    assert any(":" in e.ip for e in events)             # some IPv6
    top = max(sum(1 for e in events if e.ip == ip) for ip in {e.ip for e in events})
    assert top > 10 * len(events) / len({e.ip for e in events})  # heavy hitters
    # out of order, but a record's event time is never after the stream's clock
    assert any(events[i].event_ms > events[i + 1].event_ms for i in range(len(events) - 1))


@pytest.mark.parametrize("seed", [1496, 2450, 2881])
def test_generator_writes_each_address_in_its_canonical_form(seed):
    # A contender that counts the address as written (Flink's job) must agree with the
    # record spec, which counts canonical forms: these seeds drew 2001:db8:0::/48 addresses.
    pool = TrafficGenerator(seed=seed)._ips
    assert [ip for ip in pool if str(ipaddress.ip_address(ip)) != ip] == []
