"""Kafka consumer properties passed through to the Java consumer that reads each epoch (Spark's Kafka source takes them
as ``kafka.<name>`` options) and to Kafka's Java tools: ``name=value;name=value``, with Kafka's own names, checked
against the consumer's (a value cannot hold ';').

The properties the pipeline sets from its own settings are refused here, naming the setting: a second way to set them
would disagree with the first.
"""
from __future__ import annotations

import difflib
import re

from ipcount.rules.errors import ConfigError

# ConsumerConfig.configNames() of the kafka-clients Spark's Kafka source ships with (3.9.2);
# tests/integration/test_kafka_security.py compares it with the jar's.
CONSUMER_NAMES = frozenset("""
    allow.auto.create.topics auto.commit.interval.ms auto.include.jmx.reporter auto.offset.reset
    bootstrap.servers check.crcs client.dns.lookup client.id client.rack connections.max.idle.ms
    default.api.timeout.ms enable.auto.commit enable.metrics.push exclude.internal.topics
    fetch.max.bytes fetch.max.wait.ms fetch.min.bytes group.id group.instance.id group.protocol
    group.remote.assignor heartbeat.interval.ms interceptor.classes internal.leave.group.on.close
    internal.throw.on.fetch.stable.offset.unsupported isolation.level key.deserializer
    max.partition.fetch.bytes max.poll.interval.ms max.poll.records metadata.max.age.ms
    metadata.recovery.strategy metric.reporters metrics.num.samples metrics.recording.level
    metrics.sample.window.ms partition.assignment.strategy receive.buffer.bytes
    reconnect.backoff.max.ms reconnect.backoff.ms request.timeout.ms retry.backoff.max.ms
    retry.backoff.ms sasl.client.callback.handler.class sasl.jaas.config sasl.kerberos.kinit.cmd
    sasl.kerberos.min.time.before.relogin sasl.kerberos.service.name
    sasl.kerberos.ticket.renew.jitter sasl.kerberos.ticket.renew.window.factor
    sasl.login.callback.handler.class sasl.login.class sasl.login.connect.timeout.ms
    sasl.login.read.timeout.ms sasl.login.refresh.buffer.seconds
    sasl.login.refresh.min.period.seconds sasl.login.refresh.window.factor
    sasl.login.refresh.window.jitter sasl.login.retry.backoff.max.ms sasl.login.retry.backoff.ms
    sasl.mechanism sasl.oauthbearer.clock.skew.seconds sasl.oauthbearer.expected.audience
    sasl.oauthbearer.expected.issuer sasl.oauthbearer.header.urlencode
    sasl.oauthbearer.jwks.endpoint.refresh.ms sasl.oauthbearer.jwks.endpoint.retry.backoff.max.ms
    sasl.oauthbearer.jwks.endpoint.retry.backoff.ms sasl.oauthbearer.jwks.endpoint.url
    sasl.oauthbearer.scope.claim.name sasl.oauthbearer.sub.claim.name
    sasl.oauthbearer.token.endpoint.url security.protocol security.providers send.buffer.bytes
    session.timeout.ms socket.connection.setup.timeout.max.ms socket.connection.setup.timeout.ms
    ssl.cipher.suites ssl.enabled.protocols ssl.endpoint.identification.algorithm
    ssl.engine.factory.class ssl.key.password ssl.keymanager.algorithm
    ssl.keystore.certificate.chain ssl.keystore.key ssl.keystore.location ssl.keystore.password
    ssl.keystore.type ssl.protocol ssl.provider ssl.secure.random.implementation
    ssl.trustmanager.algorithm ssl.truststore.certificates ssl.truststore.location
    ssl.truststore.password ssl.truststore.type value.deserializer
""".split())

# What the pipeline sets itself, and from which setting (or why). Every security property (ssl.*, sasl.*, security.*)
# comes from the kafka_* settings alone, so that every client of the pipeline, Java or Python, connects and logs in
# alike.
SECURITY_PREFIXES = ("ssl.", "sasl.", "security.")
SECURITY_SETTINGS = "the kafka_security_protocol, kafka_sasl_* and kafka_ssl_* settings"
OWNED = {
    "bootstrap.servers": "bootstrap_servers",
    "group.id": "the epoch's read (a group of its own per read)",
    "isolation.level": "the epoch's read (read_committed)",
    "key.deserializer": "Spark's Kafka source", "value.deserializer": "Spark's Kafka source",
    "enable.auto.commit": "Spark's Kafka source", "auto.offset.reset": "Spark's Kafka source",
    "interceptor.classes": "Spark's Kafka source",
}


def parse_properties(text: str, setting: str = "kafka_consumer_properties") -> dict[str, str]:
    """``name=value;name=value`` as a dict, every name a consumer property the pipeline does not set itself; a
    :class:`ConfigError` naming the entry otherwise."""
    out: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        name, eq, value = (part.strip() for part in entry.partition("="))
        if not eq or not name:
            raise ConfigError(f"{setting} entry {entry!r} is not name=value (entries are separated by ';')")
        if name not in CONSUMER_NAMES:
            close = difflib.get_close_matches(name, sorted(CONSUMER_NAMES), n=1)
            raise ConfigError(f"{setting}: {name!r} is no property of Kafka's consumer"
                              + (f" (did you mean {close[0]}?)" if close else ""))
        owner = SECURITY_SETTINGS if name.startswith(SECURITY_PREFIXES) else OWNED.get(name)
        if owner:
            raise ConfigError(f"{setting}: {name} is set by the pipeline from {owner}; it cannot be passed through")
        if name in out:
            raise ConfigError(f"{setting} names {name} twice")
        out[name] = value
    return out


def refused_property(error_text: str, passed: str) -> str | None:
    """What Kafka's consumer said of a value it refused, found in the text of a Spark error (the JVM's ConfigException),
    when the property is one of ``passed`` (the setting's text); None otherwise."""
    m = re.search(r"ConfigException: Invalid value (.*?) for configuration ([\w.-]+)(?::\s*([^\n]*))?", error_text)
    if not m or m[2] not in parse_properties(passed):
        return None
    return (f"Kafka's consumer refused {m[2]}={m[1]}" + (f" ({m[3].strip()})" if m[3] else "")
            + ": check kafka_consumer_properties")
