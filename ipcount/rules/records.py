"""The record format, in plain Python: the specification the Spark job implements (docs/data-model.md, "Record format").

A Kafka record value is one access-log event, a JSON object ``{"ip": ..., "ts": ...}`` or an NGINX combined/common log
line; anything else is malformed, with exactly one reason code (the first of :data:`REASONS`). The Spark job runs the
same rules in Java (``ipcount.parse``, jars/ipcount-parse); the tests hold the two to each other record by record.
"""
from __future__ import annotations

import ipaddress
import json
import re
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

# Reason codes of the dead-letter table, in the order they are checked.
NULL_VALUE = "null_value"            # a tombstone: the record has no value
EMPTY_VALUE = "empty_value"          # zero bytes
TOO_LARGE = "too_large"              # more bytes than max_value_bytes
NOT_UTF8 = "not_utf8"                # bytes that are not valid UTF-8
BAD_JSON = "bad_json"                # starts with '{' but is not one valid JSON object
BAD_SHAPE = "bad_shape"              # JSON without a string "ip" and a string/integer "ts"
UNRECOGNIZED = "unrecognized_format"  # neither JSON nor an NGINX access-log line
INVALID_IP = "invalid_ip"            # not an IPv4 or IPv6 address
INVALID_TIMESTAMP = "invalid_timestamp"  # unparseable, or outside [MIN_EVENT_MS, MAX_EVENT_MS)
EVENT_TIME_AHEAD = "event_time_ahead"    # later than the record's Kafka timestamp (or the epoch's
                                         # planning time) plus max_event_time_ahead_seconds
REASONS = (NULL_VALUE, EMPTY_VALUE, TOO_LARGE, NOT_UTF8, BAD_JSON, BAD_SHAPE, UNRECOGNIZED,
           INVALID_IP, INVALID_TIMESTAMP, EVENT_TIME_AHEAD)
# A too_large dead letter keeps this much of its value (with its size and SHA-256): the size cap caps storage too.
DEAD_LETTER_PREFIX_BYTES = 1_024


def dead_letter_prefix_bytes(max_value_bytes: int) -> int:
    """How many bytes of a too_large value its dead letter keeps."""
    return min(DEAD_LETTER_PREFIX_BYTES, max_value_bytes)

# At most 999 levels of nesting, the record's object included (Spark's JSON parser, which the job once used, stopped at
# 1,000 and the job wrapped the record in one more).
MAX_JSON_DEPTH = 999
MIN_EVENT_MS = 946_684_800_000    # 2000-01-01T00:00:00Z
MAX_EVENT_MS = 4_102_444_800_000  # 2100-01-01T00:00:00Z
# Time-zone offsets as java.time accepts them (ZoneOffset): at most 18:00 either way.
MAX_OFFSET_MINUTES = 18 * 60
WHITESPACE = " \t\r\n"

# Explicit ASCII classes only (Python's \d and \s are Unicode-aware). The end of the text is "nothing follows": "$" also
# matches before a final "\n".
_END = r"(?![\s\S])"
ISO_PATTERN = (r"^([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})"
               r"(\.([0-9]{1,9}))?(Z|[+-][0-9]{2}:[0-9]{2})" + _END)
# remote_addr - remote_user [time_local] "request" status body_bytes_sent ["referer" "agent"]
NGINX_PATTERN = (r'^([^ ]+) [^ ]+ [^ ]+ \[([^\]]+)\] "[^"]*" [0-9]{3} ([0-9]+|-)'
                 r'( "[^"]*" "[^"]*")?' + _END)
NGINX_TIME_PATTERN = r"^[0-9]{2}/[A-Z][a-z]{2}/[0-9]{4}:[0-9]{2}:[0-9]{2}:[0-9]{2} [+-][0-9]{4}" + _END

_iso = re.compile(ISO_PATTERN)
_nginx = re.compile(NGINX_PATTERN)
_nginx_time = re.compile(NGINX_TIME_PATTERN)


@dataclass(frozen=True)
class Event:
    ip: str
    event_ms: int


@dataclass(frozen=True)
class Malformed:
    reason: str


def parse_value(value: bytes | None, max_value_bytes: int = 65_536, *, event_time: str = "payload",
                kafka_timestamp_ms: int | None = None, planned_at_ms: int | None = None,
                max_ahead_ms: int | None = None) -> Event | Malformed:
    """Parse one Kafka record value into an :class:`Event`, or say why it is malformed. With ``event_time = "kafka"``
    the event time is ``kafka_timestamp_ms`` and the payload's own time is neither required nor checked. With
    ``max_ahead_ms``, an event time that far past the Kafka timestamp or ``planned_at_ms`` is :data:`EVENT_TIME_AHEAD`:
    one record from a bad clock would otherwise move the watermark into the future and make every later record late."""
    if value is None:
        return Malformed(NULL_VALUE)
    if len(value) == 0:
        return Malformed(EMPTY_VALUE)
    if len(value) > max_value_bytes:
        return Malformed(TOO_LARGE)
    try:
        text = value.decode("utf-8").strip(WHITESPACE)
    except UnicodeDecodeError:
        return Malformed(NOT_UTF8)
    from_kafka = event_time == "kafka"
    if text.startswith("{"):
        parsed = _parse_json(text, from_kafka)
        if isinstance(parsed, Malformed):
            return parsed
        ip, ts = parsed
    else:
        m = _nginx.match(text)
        if not m:
            return Malformed(UNRECOGNIZED)
        ip, ts = m.group(1), m.group(2)
    if not is_valid_ip(ip):
        return Malformed(INVALID_IP)
    if from_kafka:
        event_ms = None if kafka_timestamp_ms is None else _in_range(kafka_timestamp_ms)
    elif isinstance(ts, int):
        event_ms = _in_range(ts)
    else:
        event_ms = parse_iso_time(ts) if text.startswith("{") else parse_nginx_time(ts)
        event_ms = None if event_ms is None else _in_range(event_ms)
    if event_ms is None:
        return Malformed(INVALID_TIMESTAMP)
    if max_ahead_ms is not None and is_ahead(event_ms, max_ahead_ms, kafka_timestamp_ms, planned_at_ms):
        return Malformed(EVENT_TIME_AHEAD)
    return Event(canonical_ip(ip), event_ms)


def is_ahead(event_ms: int, max_ahead_ms: int, kafka_timestamp_ms: int | None, planned_at_ms: int | None) -> bool:
    """Whether ``event_ms`` is more than ``max_ahead_ms`` after the earlier of the Kafka timestamp and the planning time
    (a negative Kafka timestamp means none)."""
    known = [t for t in (kafka_timestamp_ms, planned_at_ms) if t is not None and t >= 0]
    return bool(known) and event_ms > min(known) + max_ahead_ms


def _in_range(event_ms: int) -> int | None:
    return event_ms if MIN_EVENT_MS <= event_ms < MAX_EVENT_MS else None


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate key")
    return dict(pairs)


def _json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays, outside strings (for any text: invalid JSON fails to parse either
    way)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "}]":
            depth -= 1
    return deepest


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def _parse_json(text: str, from_kafka: bool) -> tuple[str, str | int | None] | Malformed:
    """(ip, ts) of a JSON record whose shape is right; ts is None when not needed."""
    deep = text.count("{") + text.count("[") > 100  # cheap: most records cannot nest deeply
    if deep and _json_depth(text) > MAX_JSON_DEPTH:
        return Malformed(BAD_JSON)
    limit = sys.getrecursionlimit()
    try:
        if deep:  # the parser recurses once per level: room for MAX_JSON_DEPTH of them
            sys.setrecursionlimit(limit + MAX_JSON_DEPTH + 100)
        obj = json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant)
    except ValueError:
        return Malformed(BAD_JSON)
    finally:
        sys.setrecursionlimit(limit)
    if not isinstance(obj, dict):
        return Malformed(BAD_JSON)
    ip, ts = obj.get("ip"), obj.get("ts")
    ts_is_int = isinstance(ts, int) and not isinstance(ts, bool) and -2**63 <= ts < 2**63
    if not isinstance(ip, str) or not (from_kafka or isinstance(ts, str) or ts_is_int):
        return Malformed(BAD_SHAPE)
    return ip, (None if from_kafka else ts)


def is_valid_ip(text: str) -> bool:
    """IPv4 (dotted quad, no leading zeros) or IPv6 (any standard form, no zone id)."""
    if "%" in text or not text.isascii():
        return False
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def canonical_ip(text: str) -> str:
    """One spelling per address, so that one client is one row: IPv4 as is (the pattern allows no leading zeros), IPv6
    compressed and lower case (RFC 5952), and an IPv4-mapped IPv6 address (``::ffff:1.2.3.4``) as its IPv4 address."""
    address = ipaddress.ip_address(text)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return address.compressed


def offset_minutes(sign: str, hours: int, minutes: int) -> int | None:
    """A time-zone offset in minutes, None unless java.time would accept it (minutes < 60, at most 18:00 either way):
    Spark's parser reads offsets with java.time."""
    total = hours * 60 + minutes
    if minutes > 59 or total > MAX_OFFSET_MINUTES:
        return None
    return total if sign == "+" else -total


def parse_iso_time(text: str) -> int | None:
    m = _iso.match(text)
    if not m:
        return None
    year, month, day, hour, minute, second = (int(m.group(i)) for i in range(1, 7))
    fraction, zone = m.group(8) or "", m.group(9)
    offset = 0 if zone == "Z" else offset_minutes(zone[0], int(zone[1:3]), int(zone[4:6]))
    if offset is None:
        return None
    try:
        instant = datetime(year, month, day, hour, minute, second, tzinfo=timezone(timedelta(minutes=offset)))
    except ValueError:
        return None
    return _epoch_ms(instant) + int((fraction + "000")[:3])


def parse_nginx_time(text: str) -> int | None:
    if not _nginx_time.match(text) or offset_minutes(text[-5], int(text[-4:-2]), int(text[-2:])) is None:
        return None
    try:
        instant = datetime.strptime(text, "%d/%b/%Y:%H:%M:%S %z")
    except ValueError:
        return None
    return _in_range(_epoch_ms(instant))


def _epoch_ms(instant: datetime) -> int:
    delta = instant - datetime(1970, 1, 1, tzinfo=timezone.utc)
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


# -- event-time windows ----------------------------------------------------------------

def window_start(event_ms: int, window_ms: int) -> int:
    """Start of the tumbling window holding ``event_ms`` (windows are aligned to the epoch)."""
    return event_ms - event_ms % window_ms


def is_late(event_ms: int, window_ms: int, allowed_lateness_ms: int, watermark_ms: int | None) -> bool:
    """The watermark rule: a record is late when ``window_end + allowed_lateness <= watermark``, the watermark the
    previous committed epoch left (the newest event time of all earlier epochs' well-formed records; None before any).
    Records of one epoch never make each other late, so every replay judges the same."""
    if watermark_ms is None:
        return False
    return window_start(event_ms, window_ms) + window_ms + allowed_lateness_ms <= watermark_ms
