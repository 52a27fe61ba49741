"""Talking to the broker outside Spark: partition offsets, topic set-up, group offset commits."""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Iterator, Mapping

from kafka import IsolationLevel, KafkaAdminClient, OffsetSpec, TopicPartition
from kafka.errors import KafkaConnectionError, KafkaTimeoutError, RetriableError, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import BrokerUnavailableError, StartPositionError, UnknownTopicError

log = logging.getLogger(__name__)
# kafka-python logs every connection at INFO; in task logs that buries the epoch's own lines.
logging.getLogger("kafka").setLevel(logging.WARNING)


@contextmanager
def admin_client(cfg: PipelineConfig) -> Iterator[KafkaAdminClient]:
    try:
        client = KafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers.split(","),
                                  client_id=f"{cfg.pipeline_id}-admin",
                                  request_timeout_ms=cfg.kafka_timeout_seconds * 1000,
                                  bootstrap_timeout_ms=cfg.kafka_timeout_seconds * 1000)
    except (KafkaTimeoutError, KafkaConnectionError) as e:
        raise BrokerUnavailableError(
            f"no Kafka broker answered at {cfg.bootstrap_servers} (setting bootstrap_servers / "
            "IPCOUNT_BOOTSTRAP_SERVERS); is it running? The embedded one starts with "
            "`bin/ipcount kafka start`") from e
    try:
        yield client
    finally:
        client.close()


def partitions_of(client: KafkaAdminClient, topic: str) -> list[int]:
    described = client.describe_topics([topic])
    if not described or described[0].get("error_code", 0) != 0 or not described[0].get("partitions"):
        raise UnknownTopicError(
            f"topic {topic!r} does not exist on the broker (setting topic / IPCOUNT_TOPIC); "
            f"create it, e.g. `bin/ipcount kafka create-topic --topic {topic}`")
    return sorted(p["partition_index"] for p in described[0]["partitions"])


def partition_offsets(cfg: PipelineConfig) -> tuple[dict[int, int], dict[int, int]]:
    """(earliest, latest) offset per partition of the topic. ``latest`` is the last stable
    offset (read_committed): an epoch never plans past an open transaction."""
    with admin_client(cfg) as client:
        tps = [TopicPartition(cfg.topic, p) for p in partitions_of(client, cfg.topic)]
        earliest = client.list_partition_offsets({tp: OffsetSpec.EARLIEST for tp in tps})
        latest = client.list_partition_offsets({tp: OffsetSpec.LATEST for tp in tps},
                                               isolation_level=IsolationLevel.READ_COMMITTED)
    return ({tp.partition: earliest[tp].offset for tp in tps},
            {tp.partition: latest[tp].offset for tp in tps})


def start_offsets(cfg: PipelineConfig, earliest: Mapping[int, int], latest: Mapping[int, int]) -> dict[int, int]:
    """Resolve ``cfg.start_position`` to an offset per partition, for a pipeline whose ledger
    is empty (the ledger always wins once it has entries)."""
    position = cfg.start_position
    if position == "earliest":
        return dict(earliest)
    if position == "latest":
        return dict(latest)
    if position == "timestamp":
        return offsets_for_time(cfg, cfg.start_timestamp_ms, latest)
    if position == "group-offsets":
        return _group_start(cfg, earliest, latest)
    specific = cfg.specific_start_offsets
    unknown = sorted(set(specific) - set(latest))
    if unknown:
        raise StartPositionError(f"start_offsets names partition(s) {unknown} that {cfg.topic} does not have "
                                 f"(it has {sorted(latest)})")
    for p, offset in sorted(specific.items()):
        if not earliest[p] <= offset <= latest[p]:
            raise StartPositionError(
                f"start_offsets {cfg.topic}-{p}:{offset} is outside the partition's offsets "
                f"[{earliest[p]}, {latest[p]}]")
    return {p: specific.get(p, earliest[p]) for p in latest}


def offsets_for_time(cfg: PipelineConfig, timestamp_ms: int, latest: Mapping[int, int]) -> dict[int, int]:
    """Per partition, the first offset whose record timestamp is >= ``timestamp_ms`` (the
    broker's offsets-for-times lookup); a partition with no such record yet -> its end."""
    with admin_client(cfg) as client:
        found = client.list_partition_offsets(
            {TopicPartition(cfg.topic, p): timestamp_ms for p in latest},
            isolation_level=IsolationLevel.READ_COMMITTED)
    return {tp.partition: (o.offset if o.offset >= 0 else latest[tp.partition]) for tp, o in found.items()}


def read_range(cfg: PipelineConfig, partition: int, from_offset: int, until_offset: int) -> Iterator:
    """The committed records of ``[from_offset, until_offset)`` of one partition, with a plain
    consumer (no group, read_committed): an independent reader for verification."""
    from kafka import KafkaConsumer

    if until_offset <= from_offset:
        return
    consumer = KafkaConsumer(bootstrap_servers=cfg.bootstrap_servers.split(","), group_id=None,
                             enable_auto_commit=False, isolation_level="read_committed",
                             client_id=f"{cfg.pipeline_id}-verify", request_timeout_ms=cfg.kafka_timeout_seconds * 1000 + 1000,
                             max_partition_fetch_bytes=8 * 1024 * 1024)
    try:
        tp = TopicPartition(cfg.topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, from_offset)
        deadline = time.monotonic() + cfg.kafka_timeout_seconds
        while consumer.position(tp) < until_offset:
            batch = consumer.poll(timeout_ms=1000).get(tp, [])
            if batch:
                deadline = time.monotonic() + cfg.kafka_timeout_seconds
            elif time.monotonic() > deadline:
                raise BrokerUnavailableError(f"reading {cfg.topic}-{partition} stalled at offset "
                                             f"{consumer.position(tp)} (wanted up to {until_offset})")
            for record in batch:
                if record.offset >= until_offset:
                    return
                yield record
    finally:
        consumer.close()


def _group_start(cfg: PipelineConfig, earliest: Mapping[int, int], latest: Mapping[int, int]) -> dict[int, int]:
    committed = group_offsets(cfg)
    missing = sorted(set(latest) - set(committed))
    if missing and cfg.group_offsets_reset == "none":
        raise StartPositionError(
            f"consumer group {cfg.group_id!r} has no committed offset for {cfg.topic} partition(s) {missing} "
            "and group_offsets_reset is 'none'; set it to earliest or latest, or commit offsets for them")
    fallback = earliest if cfg.group_offsets_reset == "earliest" else latest
    out = {}
    for p in latest:
        offset = committed.get(p, fallback[p])
        # A committed offset that retention has since deleted is the group's problem, not
        # data this pipeline ever owned: start at what is left, as Kafka's reset does.
        out[p] = min(max(offset, earliest[p]), latest[p])
    return out


def create_topic(cfg: PipelineConfig, partitions: int) -> bool:
    """Create the topic; False (and a log line) if it already exists."""
    with admin_client(cfg) as client:
        try:
            client.create_topics({cfg.topic: {"num_partitions": partitions, "replication_factor": 1}})
        except TopicAlreadyExistsError:
            log.info("topic %s already exists", cfg.topic)
            return False
    log.info("created topic %s with %d partitions", cfg.topic, partitions)
    return True


def commit_group_offsets(cfg: PipelineConfig, positions: Mapping[int, int], epoch: int) -> None:
    """Write the ledger's positions to the consumer group, for lag monitoring only.

    The pipeline never reads these back once its ledger has entries: the ledger is the
    source of truth, so a lost or stale group commit costs nothing but a lag reading.
    """
    offsets = {TopicPartition(cfg.topic, p): OffsetAndMetadata(o, f"{cfg.pipeline_id} epoch {epoch}", -1)
               for p, o in sorted(positions.items())}
    with admin_client(cfg) as client:
        _retrying(lambda: client.alter_group_offsets(cfg.group_id, offsets), cfg.kafka_timeout_seconds)


def _retrying(call, timeout_seconds: float):
    """Retry retriable broker errors (e.g. the group coordinator is still loading)."""
    deadline = time.monotonic() + timeout_seconds
    delay = 0.2
    while True:
        try:
            return call()
        except RetriableError as e:
            if time.monotonic() + delay > deadline:
                raise
            log.info("retrying after %s", e)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def group_offsets(cfg: PipelineConfig) -> dict[int, int]:
    """The consumer group's committed offsets for the topic (for monitoring and tests)."""
    with admin_client(cfg) as client:
        result = _retrying(lambda: client.list_group_offsets({cfg.group_id: None}), cfg.kafka_timeout_seconds)
    entries = result.get(cfg.group_id, result) if isinstance(result, dict) else result
    return {tp.partition: meta.offset for tp, meta in dict(entries).items()
            if tp.topic == cfg.topic and meta.offset >= 0}

