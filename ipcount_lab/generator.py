"""Traffic generator: access-log events as Kafka record values.

Seedable and deterministic for a given seed and start time. IPs follow a Zipf-like
distribution over a pool (a few heavy hitters, a long tail, some IPv6); event times are
out of order within ``disorder_ms`` of the stream's clock, a small share is much later
than that (to exercise allowed lateness), and a small share is malformed, cycling
through every malformed class of :mod:`ipcount.rules.records`.
"""
from __future__ import annotations

import ipaddress
import itertools
import json
import logging
import random
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterator, Mapping

log = logging.getLogger(__name__)

# One sample per malformed class (the reason code is what the parser must report).
MALFORMED_SAMPLES: tuple[tuple[str, bytes | None], ...] = (
    ("null_value", None),
    ("empty_value", b""),
    ("not_utf8", b'{"ip": "10.0.0.1", "ts": "2026-11-21T10:00:00Z"}\xff\xfe'),
    ("bad_json", b'{"ip": "10.0.0.1", "ts": '),
    ("bad_shape", b'{"ip": ["10.0.0.1"], "ts": 1795000000000}'),
    ("unrecognized_format", b"GET /index.html 200"),
    ("invalid_ip", b'{"ip": "300.1.2.3", "ts": "2026-11-21T10:00:00Z"}'),
    ("invalid_timestamp", b'10.1.2.3 - - [32/Nov/2026:10:00:00 +0000] "GET / HTTP/1.1" 200 5 "-" "x"'),
)
_AGENTS = ("curl/8.5.0", "Mozilla/5.0 (X11; Linux x86_64)", "python-requests/2.32", "Go-http-client/2.0")
_PATHS = ("/", "/index.html", "/api/v1/items", "/login", "/static/app.js", "/health")


@dataclass(frozen=True)
class Record:
    key: bytes | None
    value: bytes | None


def distinct_ip(n: int) -> str:
    """The ``n``-th of 2**32 distinct addresses (IPv4 in 10.0.0.0/8 first, then IPv6)."""
    if n < 1 << 24:
        return f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
    return f"2001:db8::{n >> 16 & 0xffff:x}:{n & 0xffff:x}"


@dataclass
class TrafficGenerator:
    seed: int = 7
    ip_pool: int = 500
    events_per_second: float = 200.0
    disorder_ms: int = 3_000
    late_share: float = 0.01
    late_delay_ms: tuple[int, int] = (12_000, 40_000)
    malformed_share: float = 0.01
    # Every record from a client of its own (how a flood of spoofed sources looks to an IP
    # counter): an epoch's tally then has a row per record.
    distinct_clients: bool = False

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._ips = [self._make_ip(i) for i in range(self.ip_pool)]
        # Zipf-like weights: the first few addresses are heavy hitters.
        self._cum = list(itertools.accumulate(1.0 / (i + 1) ** 1.1 for i in range(self.ip_pool)))
        self._malformed = itertools.cycle(MALFORMED_SAMPLES)

    def reseed(self, seed: int | str) -> None:
        """Draw what follows from ``seed``, the same address pool kept: a run that pauses
        between batches (chaos) produces the batches an unpaused run would."""
        self._rng = random.Random(seed)
        self._malformed = itertools.cycle(MALFORMED_SAMPLES)

    def _make_ip(self, i: int) -> str:
        r = self._rng
        if i % 10 == 9:
            # As the record spec writes it (2001:db8:0::1 is 2001:db8::1): a contender that
            # counts addresses as written must count the same clients.
            return str(ipaddress.IPv6Address(f"2001:db8:{r.randrange(65536):x}::{r.randrange(1, 65536):x}"))
        return f"{r.choice((203, 198, 192, 10, 172, 100))}.{r.randrange(256)}.{r.randrange(256)}.{r.randrange(1, 255)}"

    def records(self, count: int | None, start_ms: int) -> Iterator[Record]:
        """``count`` records (forever if None) whose clock starts at ``start_ms`` and advances
        ``1000 / events_per_second`` ms per record."""
        r = self._rng
        step = 1000.0 / self.events_per_second
        for n in itertools.count() if count is None else range(count):
            clock = start_ms + int(n * step)
            if r.random() < self.malformed_share:
                _, value = next(self._malformed)
                # Keyless, so malformed records spread over partitions (a tombstone needs a key).
                yield Record(key=b"tombstone" if value is None else None, value=value)
                continue
            ip = distinct_ip(n) if self.distinct_clients else r.choices(self._ips, cum_weights=self._cum)[0]
            if r.random() < self.late_share:
                event_ms = clock - r.randint(*self.late_delay_ms)
            else:
                event_ms = clock - r.randint(0, self.disorder_ms)
            yield Record(key=ip.encode(), value=self._format(ip, event_ms))

    def _format(self, ip: str, event_ms: int) -> bytes:
        r = self._rng
        kind = r.random()
        if kind < 0.35:
            ts = datetime.fromtimestamp(event_ms / 1000, tz=timezone.utc)
            iso = ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{event_ms % 1000:03d}Z"
            return json.dumps({"ip": ip, "ts": iso}).encode()
        if kind < 0.55:
            return json.dumps({"ip": ip, "ts": event_ms}).encode()
        # NGINX time has whole seconds: the event moves to the start of its second.
        when = datetime.fromtimestamp(event_ms // 1000, tz=timezone.utc).strftime("%d/%b/%Y:%H:%M:%S +0000")
        status = r.choice((200, 200, 200, 304, 404, 500))
        return (f'{ip} - - [{when}] "GET {r.choice(_PATHS)} HTTP/1.1" {status} {r.randrange(100, 50_000)} '
                f'"-" "{r.choice(_AGENTS)}"').encode()


@dataclass(frozen=True)
class Produced:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int = -1


def produce(bootstrap_servers: str, topic: str, records: Iterator[Record] | list[Record],
            partition_of=None, timestamp_of=None, client_options: Mapping[str, object] | None = None) -> list[Produced]:
    """Send records (to ``partition_of(i, record)`` if given, else by key; with Kafka
    timestamp ``timestamp_of(i, record)`` if given) and return where each landed. Used by
    tests to know the exact ground truth. ``client_options``: the security keyword arguments
    (``storage.broker.client_options``)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap_servers, acks="all", linger_ms=5,
                             batch_size=256 * 1024, **(client_options or {}))
    sent = []
    for i, rec in enumerate(records):
        partition = partition_of(i, rec) if partition_of else None
        timestamp = timestamp_of(i, rec) if timestamp_of else None
        sent.append((rec, producer.send(topic, key=rec.key, value=rec.value, partition=partition,
                                        timestamp_ms=timestamp)))
    producer.flush()
    out = []
    for rec, future in sent:
        meta = future.get(timeout=30)
        out.append(Produced(meta.partition, meta.offset, rec.key, rec.value, meta.timestamp))
    producer.close()
    return out


def stream(bootstrap_servers: str, topic: str, generator: TrafficGenerator, count: int | None = None,
           client_options: Mapping[str, object] | None = None) -> int:
    """Produce in real time: event clocks follow the wall clock at ``events_per_second``."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap_servers, acks="all", linger_ms=20, **(client_options or {}))
    start_wall = time.time()
    sent = 0
    try:
        for rec in generator.records(count, int(start_wall * 1000)):
            producer.send(topic, key=rec.key, value=rec.value)
            sent += 1
            due = start_wall + sent / generator.events_per_second
            pause = due - time.time()
            if pause > 0:
                time.sleep(pause)
            if sent % 5000 == 0:
                log.info("generator: %d records sent to %s", sent, topic)
    finally:
        producer.flush()
        producer.close()
    return sent
