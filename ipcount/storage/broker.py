"""Talking to the broker outside Spark: partition offsets, topic set-up, group offset commits."""
from __future__ import annotations

import logging
import os
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from kafka import IsolationLevel, KafkaAdminClient, OffsetSpec, TopicPartition
from kafka.errors import (KafkaConnectionError, KafkaTimeoutError, NoError, RetriableError,
                          SaslAuthenticationFailedError, TopicAlreadyExistsError, UnsupportedSaslMechanismError)
from kafka.structs import OffsetAndMetadata

from ipcount.rules.config import REPO_ROOT, PipelineConfig, parse_host_port
from ipcount.rules.kafka_security import (SCRAM_MECHANISMS, check_resolved, java_client_properties,
                                          kafka_python_options, properties_file_text, sasl_password)
from ipcount.rules.errors import BrokerUnavailableError, StartPositionError, UnknownTopicError
from ipcount.storage.retry import retrying

log = logging.getLogger(__name__)
# kafka-python logs every connection at INFO; in task logs that buries the epoch's own lines. Its admin client also logs
# its whole configuration, SASL password included, at DEBUG: pinned here, so that a root logger at DEBUG never shows it.
logging.getLogger("kafka").setLevel(logging.WARNING)
logging.getLogger("kafka.admin.client").setLevel(logging.WARNING)


def client_options(cfg: PipelineConfig) -> dict[str, object]:
    """The security keyword arguments of every kafka-python client of ``cfg``."""
    return kafka_python_options(cfg, sasl_password(cfg))


class _BootstrapFailures(logging.Handler):
    """Why a bootstrap failed (a refused login, say): kafka-python only logs it, then raises a timeout."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        self.seen += [a for a in args if isinstance(a, BaseException) and not isinstance(a, KafkaTimeoutError)]

    @property
    def reason(self) -> BaseException | None:
        """A refused login outweighs the disconnects that follow it (the broker hangs up)."""
        logins = [e for e in self.seen if isinstance(e, (SaslAuthenticationFailedError, UnsupportedSaslMechanismError))]
        return (logins or self.seen or [None])[-1]

    @classmethod
    @contextmanager
    def watching(cls) -> Iterator[_BootstrapFailures]:
        """Meanwhile kafka-python's lines are kept here, not printed: a failed bootstrap is told once, in the error.
        (Process-wide: the last watcher out puts printing back as the first found it.)"""
        global _watchers, _propagate
        handler, logger = cls(), logging.getLogger("kafka")
        logger.addHandler(handler)
        with _WATCHING:
            if _watchers == 0:
                _propagate, logger.propagate = logger.propagate, False
            _watchers += 1
        try:
            yield handler
        finally:
            with _WATCHING:
                _watchers -= 1
                if _watchers == 0:
                    logger.propagate = _propagate
            logger.removeHandler(handler)


_WATCHING = threading.Lock()
_watchers, _propagate = 0, True


@contextmanager
def admin_client(cfg: PipelineConfig) -> Iterator[KafkaAdminClient]:
    try:
        with _BootstrapFailures.watching() as failures:
            client = KafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers.split(","),
                                      client_id=f"{cfg.pipeline_id}-admin",
                                      request_timeout_ms=cfg.kafka_timeout_seconds * 1000,
                                      bootstrap_timeout_ms=cfg.kafka_timeout_seconds * 1000, **client_options(cfg))
    except (KafkaTimeoutError, KafkaConnectionError) as e:
        raise BrokerUnavailableError(_unreachable(cfg, failures.reason)) from e
    try:
        yield client
    finally:
        client.close()


def _unreachable(cfg: PipelineConfig, failure: BaseException | None) -> str:
    """Why no client of ``cfg`` got through, naming the settings to look at."""
    if isinstance(failure, SaslAuthenticationFailedError):
        reason = str(failure).rsplit(": ", 1)[-1]
        return (f"the Kafka broker at {cfg.bootstrap_servers} refused the login of {cfg.kafka_sasl_username!r} "
                f"({cfg.kafka_sasl_mechanism}): check kafka_sasl_username, kafka_sasl_password_file and "
                f"kafka_sasl_mechanism ({reason})")
    if isinstance(failure, UnsupportedSaslMechanismError):
        return (f"the Kafka broker at {cfg.bootstrap_servers} does not take kafka_sasl_mechanism "
                f"{cfg.kafka_sasl_mechanism} ({str(failure).rsplit(': ', 1)[-1]})")
    tls_problem = tls_handshake_problem(cfg) if cfg.uses_tls else None
    if tls_problem:
        return f"no TLS connection to the Kafka broker at {cfg.bootstrap_servers}: {tls_problem}"
    if cfg.uses_sasl and _accepts_connections(cfg):
        # A broker that refuses a login hangs up; kafka-python often sees only the hang-up.
        return (f"the Kafka broker at {cfg.bootstrap_servers} takes connections but closed each one while "
                f"{cfg.kafka_sasl_username!r} logged in ({cfg.kafka_sasl_mechanism}): check kafka_sasl_username, "
                f"kafka_sasl_password_file and kafka_sasl_mechanism, and that the port's listener is "
                f"{cfg.kafka_security_protocol} (kafka_security_protocol)")
    return (f"no Kafka broker answered at {cfg.bootstrap_servers} (setting bootstrap_servers / "
            "IPCOUNT_BOOTSTRAP_SERVERS); is it running, and is that its address?"
            + (f" (last error: {failure})" if failure is not None else ""))


def _first_bootstrap(cfg: PipelineConfig) -> tuple[str, int]:
    return parse_host_port(cfg.bootstrap_servers.split(",")[0], "bootstrap_servers entry")


def _accepts_connections(cfg: PipelineConfig) -> bool:
    host, port = _first_bootstrap(cfg)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        return True
    except (OSError, ValueError):
        return False


def tls_handshake_problem(cfg: PipelineConfig, timeout: float = 5.0) -> str | None:
    """Why a TLS handshake with the first bootstrap server fails, naming the setting; None if it succeeds or nothing
    listens (kafka-python only logs the reason, then times out)."""
    host, port = _first_bootstrap(cfg)
    try:
        context = ssl.create_default_context(cafile=cfg.kafka_ssl_cafile or None)
    except ssl.SSLError as e:
        return f"kafka_ssl_cafile {cfg.kafka_ssl_cafile} holds no PEM certificate that loads ({e.reason or e})"
    context.check_hostname = cfg.kafka_ssl_check_hostname
    try:
        if cfg.kafka_ssl_client_pem:
            context.load_cert_chain(cfg.kafka_ssl_client_pem)
    except ssl.SSLError as e:
        return (f"kafka_ssl_client_pem {cfg.kafka_ssl_client_pem} must hold an unencrypted private key and its "
                f"certificate chain, in PEM ({e.reason or e})")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as raw, \
                context.wrap_socket(raw, server_hostname=host) as tls:
            tls.settimeout(1.0)  # TLS 1.3 reports a refused client certificate only on the first read
            try:
                tls.recv(1)
            except TimeoutError:
                pass
    except ssl.SSLCertVerificationError as e:
        if "mismatch" in (e.verify_message or "").lower():  # "Hostname mismatch" or "IP address mismatch"
            return (f"the broker's certificate does not name {host!r} ({e.verify_message}); connect by a name it "
                    "holds, or (test brokers only) set kafka_ssl_check_hostname = false")
        return (f"the broker's certificate is not trusted ({e.verify_message}); set kafka_ssl_cafile to the CA "
                f"that signed it (now {cfg.kafka_ssl_cafile or 'the system CAs'!r})")
    except ssl.SSLError as e:
        if any(alert in str(e) for alert in ("CERTIFICATE_REQUIRED", "BAD_CERTIFICATE", "UNKNOWN_CA")):
            if not cfg.kafka_ssl_client_pem:
                return "the broker wants a client certificate: set kafka_ssl_client_pem"
            return (f"the broker refused the client certificate in kafka_ssl_client_pem ({e.reason}); is it "
                    "signed by a CA the broker trusts?")
        return (f"the TLS handshake failed ({e.reason or e}); is {host}:{port} a TLS listener? "
                f"(kafka_security_protocol is {cfg.kafka_security_protocol})")
    except (OSError, ValueError):
        return None
    return None


def partitions_of(client: KafkaAdminClient, topic: str) -> list[int]:
    described = client.describe_topics([topic])
    if not described or described[0].get("error_code", 0) != 0 or not described[0].get("partitions"):
        raise UnknownTopicError(
            f"topic {topic!r} does not exist on the broker (setting topic / IPCOUNT_TOPIC); "
            f"create it, e.g. `bin/ipcount create-topic --topic {topic}`")
    return sorted(p["partition_index"] for p in described[0]["partitions"])


def partition_offsets(cfg: PipelineConfig) -> tuple[dict[int, int], dict[int, int]]:
    """(earliest, latest) offset per partition of the topic; ``latest`` is the last stable offset (read_committed)."""
    with admin_client(cfg) as client:
        return offsets_with(client, cfg.topic)


def offsets_with(client: KafkaAdminClient, topic: str) -> tuple[dict[int, int], dict[int, int]]:
    """:func:`partition_offsets` through an open admin client (a watcher keeps one)."""
    tps = [TopicPartition(topic, p) for p in partitions_of(client, topic)]
    earliest = client.list_partition_offsets({tp: OffsetSpec.EARLIEST for tp in tps})
    latest = client.list_partition_offsets({tp: OffsetSpec.LATEST for tp in tps},
                                           isolation_level=IsolationLevel.READ_COMMITTED)
    return ({tp.partition: earliest[tp].offset for tp in tps},
            {tp.partition: latest[tp].offset for tp in tps})


def start_offsets(cfg: PipelineConfig, earliest: Mapping[int, int], latest: Mapping[int, int]) -> dict[int, int]:
    """``cfg.start_position`` as an offset per partition (for an empty ledger only)."""
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
    """Per partition, the first offset whose record timestamp is >= ``timestamp_ms``, else its end."""
    with admin_client(cfg) as client:
        found = client.list_partition_offsets(
            {TopicPartition(cfg.topic, p): timestamp_ms for p in latest},
            isolation_level=IsolationLevel.READ_COMMITTED)
    return {tp.partition: (o.offset if o.offset >= 0 else latest[tp.partition]) for tp, o in found.items()}


def read_range(cfg: PipelineConfig, partition: int, from_offset: int, until_offset: int) -> Iterator:
    """The committed records of ``[from_offset, until_offset)`` of one partition, read by a plain consumer (no group):
    an independent reader for verification."""
    from kafka import KafkaConsumer

    if until_offset <= from_offset:
        return
    consumer = KafkaConsumer(bootstrap_servers=cfg.bootstrap_servers.split(","), group_id=None,
                             enable_auto_commit=False, isolation_level="read_committed",
                             client_id=f"{cfg.pipeline_id}-verify",
                             request_timeout_ms=cfg.kafka_timeout_seconds * 1000 + 1000,
                             max_partition_fetch_bytes=8 * 1024 * 1024, **client_options(cfg))
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
        # An offset retention has since passed: start at what is left, as Kafka's reset does.
        out[p] = min(max(offset, earliest[p]), latest[p])
    return out


def create_topic(cfg: PipelineConfig, partitions: int) -> bool:
    """Create the topic (replicated by the brokers' default); False if it already exists."""
    with admin_client(cfg) as client:
        try:
            client.create_topics({cfg.topic: {"num_partitions": partitions}}, wait_for_metadata=True)
        except TopicAlreadyExistsError:
            log.info("topic %s already exists", cfg.topic)
            return False
    log.info("created topic %s with %d partitions", cfg.topic, partitions)
    return True


def commit_group_offsets(cfg: PipelineConfig, positions: Mapping[int, int], epoch: int) -> None:
    """Write the ledger's positions to the consumer group, for lag monitoring only: the ledger is the source of truth,
    so a lost or stale group commit costs nothing but a lag reading."""
    offsets = {TopicPartition(cfg.topic, p): OffsetAndMetadata(o, f"{cfg.pipeline_id} epoch {epoch}", -1)
               for p, o in sorted(positions.items())}

    def commit() -> None:
        # A client per attempt: one that saw the coordinator die keeps asking that broker.
        with admin_client(cfg) as client:
            answer = client.alter_group_offsets(cfg.group_id, offsets)
        # The answer names an error per partition instead of raising: raised here, so retriable ones are retried.
        refused = {tp.partition: error for tp, error in answer.items() if error is not NoError}
        if refused:
            error = next(iter(refused.values()))
            raise error(f"group {cfg.group_id} refused offsets of partitions "
                        f"{', '.join(f'{p} ({e.__name__})' for p, e in sorted(refused.items()))}")

    _retrying(commit, cfg)


def _retrying(call, cfg: PipelineConfig):
    """``call()``, retried on retriable broker errors (e.g. the group coordinator is still loading) for up to the broker
    timeout."""
    return retrying(call, RetriableError, "the broker is not ready", pause=lambda n: min(0.2 * 2 ** (n - 1), 2.0),
                    deadline=time.monotonic() + cfg.kafka_timeout_seconds, again="retrying")


def group_offsets(cfg: PipelineConfig) -> dict[int, int]:
    """The consumer group's committed offsets for the topic (for monitoring and tests)."""
    with admin_client(cfg) as client:
        result = _retrying(lambda: client.list_group_offsets({cfg.group_id: None}), cfg)
    entries = result.get(cfg.group_id, result) if isinstance(result, dict) else result
    return {tp.partition: meta.offset for tp, meta in dict(entries).items()
            if tp.topic == cfg.topic and meta.offset >= 0}


@contextmanager
def java_tool_config(cfg: PipelineConfig) -> Iterator[Path | None]:
    """A private ``--command-config`` file for Kafka's Java tools with ``cfg``'s client properties (None if there are
    none), removed afterwards: the password is in no command line."""
    check_resolved(cfg)
    if cfg.kafka_security_protocol == "PLAINTEXT" and not cfg.kafka_consumer_properties.strip():
        yield None
        return
    fd, name = tempfile.mkstemp(prefix="ipcount-kafka-", suffix=".properties")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="iso-8859-1") as f:
            f.write(properties_file_text(java_client_properties(cfg, sasl_password(cfg))))
        yield Path(name)
    finally:
        os.unlink(name)


def consumer_groups_command(cfg: PipelineConfig, tool_args: list[str]) -> int:
    """Run Kafka's kafka-consumer-groups against ``cfg``'s broker; its exit code. The broker must answer first: the tool
    prints Java's stack trace when it does not, and exits 0."""
    if not {"--help", "--version"} & set(tool_args):
        with admin_client(cfg):
            pass
    with java_tool_config(cfg) as command_config:
        security = ["--command-config", str(command_config)] if command_config else []
        return subprocess.run([str(REPO_ROOT / "bin" / "kafka-consumer-groups"),
                               "--bootstrap-server", cfg.bootstrap_servers, *security, *tool_args]).returncode


def upsert_scram_user(cfg: PipelineConfig, username: str, password: str) -> None:
    """Give ``username`` SCRAM-SHA-256 and -512 credentials (an upsert), through ``cfg``'s admin login."""
    from kafka.admin import UserScramCredentialUpsertion

    with admin_client(cfg) as client:
        for mechanism in SCRAM_MECHANISMS:  # one request each: the broker refuses a user twice in one
            errors = client.alter_user_scram_credentials([UserScramCredentialUpsertion(username, mechanism, password)])
            if errors.get(username):
                raise BrokerUnavailableError(f"the broker at {cfg.bootstrap_servers} did not take {mechanism} "
                                             f"credentials for {username!r}: {errors[username]}")
    log.info("SCRAM credentials of %r set (%s)", username, ", ".join(SCRAM_MECHANISMS))
