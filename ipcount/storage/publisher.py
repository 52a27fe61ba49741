"""The sink topic's transactional producer: one Kafka transaction per published counts version, holding its records and
the publisher group's cursor (the next version), as Kafka Streams commits its input offsets with its output.

A stable ``transactional.id`` per pipeline fences any older publisher still running: the newest one's
``init_transactions`` aborts what the old one left open. The cursor is read only after that: the last committed one.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import InvalidProducerEpochError, KafkaTimeoutError, ProducerFencedError, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import BrokerUnavailableError, PublisherFenced
from ipcount.rules.publish import (SINK_CLEANUP_POLICY, Cursor, SinkRecord, check_never_published, check_sink_policy,
                                   cursor_after)
from ipcount.storage.broker import admin_client, client_options

log = logging.getLogger(__name__)
CURSOR_PARTITION = 0        # the cursor is an offset of the publisher group on this partition of the sink topic
TRANSACTION_TIMEOUT_MS = 120_000  # a transaction holds only Kafka I/O; after a crash it pins read_committed
                                  # consumers (the LSO) at most this long, unless the next publisher comes first


def publisher_id(cfg: PipelineConfig) -> str:
    """The transactional id and the cursor's consumer group: stable per pipeline."""
    return f"{cfg.pipeline_id}-publisher"


def create_sink_topic(cfg: PipelineConfig, topic: str, partitions: int = 3) -> bool:
    """Create the sink topic, compacted only (the latest count per key stays); False if it exists. One with any other
    cleanup.policy is refused (ConfigError)."""
    with admin_client(cfg) as client:
        try:
            client.create_topics({topic: {"num_partitions": partitions,
                                          "configs": {"cleanup.policy": SINK_CLEANUP_POLICY}}},
                                 wait_for_metadata=True)
            created = True
        except TopicAlreadyExistsError:
            created = False
        check_sink_policy(topic, _cleanup_policy(client, topic), cfg.bootstrap_servers)
    if created:
        log.info("created sink topic %s (%d partitions, compacted)", topic, partitions)
    return created


def _cleanup_policy(client: KafkaAdminClient, topic: str) -> str | None:
    """The topic's effective cleanup.policy, or None if the broker does not say (the login may not describe it)."""
    described = client.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic, ["cleanup.policy"])],
                                        config_filter="all")
    entry = described.get("topic", {}).get(topic, {}).get("cleanup.policy")
    return entry.get("value") if entry else None


def read_cursor(cfg: PipelineConfig, topic: str) -> Cursor | None:
    """The publisher's committed cursor, or None before its first publish. Reading it fences nobody (the monitor reads
    it too)."""
    with committed_reader(cfg, group_id=publisher_id(cfg)) as consumer:
        try:
            committed = consumer.committed(TopicPartition(topic, CURSOR_PARTITION), metadata=True,
                                           timeout_ms=cfg.kafka_timeout_seconds * 1000)
        except KafkaTimeoutError:
            raise BrokerUnavailableError(
                f"the publisher's cursor (group {publisher_id(cfg)}) could not be read within "
                f"{cfg.kafka_timeout_seconds} s: the broker is slow, or a publish is in flight (its open transaction "
                "holds the cursor until it commits, or aborts within the transaction timeout)") from None
    if committed is None or committed.offset < 0:
        return None
    return Cursor.from_committed(committed.offset, committed.metadata)


def committed_cursor(cfg: PipelineConfig, topic: str) -> Cursor | None:
    """The cursor, or, if Kafka expired it (``offsets.retention.minutes`` after the last commit of a group without
    members), the one the sink topic's committed records imply."""
    cursor = read_cursor(cfg, topic)
    if cursor is not None:
        return cursor
    cursor = cursor_after(r.headers for r in newest_records(cfg, topic))
    if cursor is not None:
        log.warning("the publisher's committed cursor is gone (Kafka expires an idle group's offsets); "
                    "the sink topic %s says counts version %d was the last one published", topic,
                    cursor.next_version - 1)
    return cursor


def log_starts(cfg: PipelineConfig, topic: str) -> dict[int, int]:
    """Each partition's log start offset: past 0 once retention or a delete-records call deleted records."""
    with committed_reader(cfg) as consumer:
        return {tp.partition: begin for tp, (begin, _) in _partition_bounds(consumer, topic).items()}


def newest_records(cfg: PipelineConfig, topic: str) -> list:
    """Each partition's newest committed record, if any: read back from the end in growing steps (transaction markers
    and aborted records take offsets too)."""
    out = []
    with committed_reader(cfg) as consumer:
        for tp, (begin, end) in _partition_bounds(consumer, topic).items():
            step = 16
            while True:
                start = max(begin, end - step)
                records = read_range(consumer, tp, start, end, cfg.kafka_timeout_seconds)
                if records or start == begin:
                    out += records[-1:]
                    break
                step *= 8
    return out


def committed_records(cfg: PipelineConfig, topic: str, timeout_seconds: float | None = None) -> list:
    """Every committed record of ``topic`` (read_committed), partition by partition."""
    out = []
    with committed_reader(cfg) as consumer:
        for tp, (begin, end) in _partition_bounds(consumer, topic).items():
            out += read_range(consumer, tp, begin, end, timeout_seconds or cfg.kafka_timeout_seconds * 10)
    return out


def _partition_bounds(consumer: KafkaConsumer, topic: str) -> dict[TopicPartition, tuple[int, int]]:
    """Each partition's (log start, last stable offset), in partition order."""
    parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
    begins, ends = consumer.beginning_offsets(parts), consumer.end_offsets(parts)
    return {tp: (begins[tp], ends[tp]) for tp in parts}


@contextmanager
def committed_reader(cfg: PipelineConfig, group_id: str | None = None) -> Iterator[KafkaConsumer]:
    """A read_committed consumer (of no group by default) that commits nothing."""
    consumer = KafkaConsumer(bootstrap_servers=cfg.bootstrap_servers.split(","), group_id=group_id,
                             enable_auto_commit=False, isolation_level="read_committed", **client_options(cfg))
    try:
        yield consumer
    finally:
        consumer.close()


def read_range(consumer: KafkaConsumer, tp: TopicPartition, start: int, end: int, timeout_seconds: float) -> list:
    """The committed records of ``tp`` in offsets [start, end), where ``end`` is at most the last stable offset
    (``end_offsets`` of a read_committed consumer)."""
    consumer.assign([tp])
    consumer.seek(tp, start)
    deadline = time.monotonic() + timeout_seconds
    records: list = []
    while consumer.position(tp) < end:
        if time.monotonic() > deadline:
            raise BrokerUnavailableError(f"reading {tp.topic} partition {tp.partition} [{start}, {end}) took over "
                                         f"{timeout_seconds:.0f} s (at offset {consumer.position(tp)})")
        for batch in consumer.poll(timeout_ms=500).values():
            records += [r for r in batch if r.offset < end]
    return records


class SinkTopic(Protocol):
    """Where counts are published, as :func:`ipcount.jobs.publish.publish_pending` sees it (:class:`KafkaSinkTopic` in
    production; a simulated one in the model test)."""

    def create(self) -> None:
        """The topic, created if missing (or refused, ConfigError)."""

    def check_never_published(self) -> None:
        """For a publisher without a cursor: ConfigError if records were deleted from the topic."""

    def publisher(self) -> Publisher:
        """The one live publisher (fencing the ones before)."""


@dataclass(frozen=True)
class KafkaSinkTopic:
    cfg: PipelineConfig
    topic: str

    def create(self) -> None:
        create_sink_topic(self.cfg, self.topic)

    def check_never_published(self) -> None:
        check_never_published(self.topic, publisher_id(self.cfg), log_starts(self.cfg, self.topic))

    def publisher(self) -> Publisher:
        return Publisher(self.cfg, self.topic)


class Publisher:
    """The one live publisher of a pipeline (making one fences the ones before)."""

    def __init__(self, cfg: PipelineConfig, topic: str) -> None:
        self.cfg, self.topic = cfg, topic
        self.cursor_partition = TopicPartition(topic, CURSOR_PARTITION)
        self.producer = KafkaProducer(bootstrap_servers=cfg.bootstrap_servers.split(","),
                                      transactional_id=publisher_id(cfg), acks="all",
                                      transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
                                      max_block_ms=cfg.kafka_timeout_seconds * 1000, **client_options(cfg))
        # Completes or aborts what an earlier publisher left open, and fences it.
        try:
            self._bounded(self.producer.init_transactions, "fencing earlier publishers")
        except Exception:
            self.producer.close(timeout=0)
            raise

    def cursor(self) -> Cursor | None:
        """The committed cursor (after this publisher's init: the last one committed), or what the topic implies if it
        expired."""
        return committed_cursor(self.cfg, self.topic)

    def publish(self, records: Iterable[SinkRecord], after: Cursor, crash: Callable[[str], None] = lambda p: None
                ) -> int:
        """Send ``records`` and move the cursor to ``after`` in one transaction; how many were sent. Every send is
        confirmed before the commit, and the cursor read back after it (kafka-python can report a commit whose sends
        failed as done)."""
        futures: list = []
        try:
            self.producer.begin_transaction()
            futures = [self.producer.send(self.topic, key=r.key, value=r.value, headers=list(r.headers))
                       for r in records]
            self.producer.flush(timeout=self.cfg.kafka_timeout_seconds)
            for future in futures:
                future.get(timeout=self.cfg.kafka_timeout_seconds)
            offsets = {self.cursor_partition: OffsetAndMetadata(after.next_version, after.metadata(), -1)}
            self._bounded(lambda: self.producer.send_offsets_to_transaction(offsets, publisher_id(self.cfg)),
                          "committing the cursor")
            if futures:  # (crash points for tests: only where records are in flight)
                crash("publish_before_commit")
            self._bounded(self.producer.commit_transaction, "committing the transaction")
        except Exception as e:
            if self._fenced(e):  # nothing to abort: the newer publisher did
                raise PublisherFenced(f"another publisher with transactional.id {publisher_id(self.cfg)} took "
                                      "over; this one stops, and its transaction counts for nothing: the newer "
                                      "one publishes from the cursor") from e
            self._abort()
            raise
        if futures:
            crash("publish_after_commit")
        now = read_cursor(self.cfg, self.topic)
        # (A newer publisher may have moved it on since: that is no failure of this one.)
        if now is None or now.table_id != after.table_id or now.next_version < after.next_version:
            raise BrokerUnavailableError(f"the publisher committed up to counts version {after.next_version}, but "
                                         f"the broker's cursor says {now}: the transaction did not hold; "
                                         "publishing again from the broker's cursor")
        return len(futures)

    def _bounded(self, call: Callable[[], object], what: str) -> None:
        """kafka-python's transaction calls wait without a limit; this one waits for the pipeline's broker timeout (plus
        the transaction's own), then gives up loudly."""
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                call()
                outcome.append(None)
            except BaseException as e:  # handed to the caller's thread
                outcome.append(e)
        worker = threading.Thread(target=run, name=f"publisher: {what}", daemon=True)
        worker.start()
        worker.join(self.cfg.kafka_timeout_seconds + TRANSACTION_TIMEOUT_MS / 1000)
        if not outcome:
            raise BrokerUnavailableError(f"the broker at {self.cfg.bootstrap_servers} did not answer while {what} "
                                         f"for {publisher_id(self.cfg)}; the next publish finishes or aborts it")
        if outcome[0] is not None:
            raise outcome[0]

    def _fenced(self, error: BaseException) -> bool:
        if isinstance(error, (ProducerFencedError, InvalidProducerEpochError)):
            return True
        # Once fenced, kafka-python's producer fails every call with a plain KafkaError and keeps the cause here.
        manager = getattr(self.producer, "_transaction_manager", None)
        return isinstance(getattr(manager, "_last_error", None), ProducerFencedError)

    def _abort(self) -> None:
        try:
            self._bounded(self.producer.abort_transaction, "aborting the transaction")
        except Exception as e:  # fenced, or the broker gone: the next publisher's init cleans up
            log.warning("could not abort the publisher's transaction: %s", e)

    def close(self) -> None:
        self.producer.close(timeout=self.cfg.kafka_timeout_seconds)
