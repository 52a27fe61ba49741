"""How the pipeline's Kafka security settings reach each client (pure: no Kafka, no Spark).

The ``kafka_*`` settings become the options of Spark's Kafka source, the keyword arguments of every kafka-python client
and the properties of the Java tools. The password is never a setting, only the file that holds it, read where a client
is made: it is in no command line, variable, ledger row or log line.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import ConfigError
from ipcount.rules.kafka_properties import parse_properties
from ipcount.rules.private_files import open_to_others, read_private_file

SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
JAAS_MODULES = {"PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
                "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
                "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule"}


def check_resolved(cfg: PipelineConfig) -> None:
    """A client is made from resolved settings only: an unresolved ``kafka_connection`` would silently mean
    PLAINTEXT."""
    if cfg.kafka_connection:
        raise ConfigError(f"kafka_connection {cfg.kafka_connection!r} is read by the Airflow tasks and the monitor "
                          "only; here give the kafka_* settings themselves (e.g. in a --config file)")


def check_tls_files(cfg: PipelineConfig) -> None:
    """The TLS files exist, and the client key is private and unencrypted PKCS#8 (what both Kafka clients read)."""
    for setting in ("kafka_ssl_cafile", "kafka_ssl_client_pem"):
        path = getattr(cfg, setting)
        if not path:
            continue
        if not Path(path).is_file():
            raise ConfigError(f"{setting}: no file {path}")
        if setting == "kafka_ssl_client_pem":
            mode = open_to_others(path)
            if mode is not None:
                raise ConfigError(f"{setting}: {path} holds a private key but is open to others (mode {mode:o}); "
                                  f"make it private: chmod 600 {path}")
            text = Path(path).read_text(encoding="ascii", errors="replace")
            if "-----BEGIN PRIVATE KEY-----" not in text:
                raise ConfigError(f"{setting}: {path} must hold an unencrypted PKCS#8 private key (BEGIN PRIVATE "
                                  f"KEY) and the certificate chain; convert a key with: openssl pkey -in KEY -out "
                                  "KEY8.pem")


def sasl_password(cfg: PipelineConfig) -> str | None:
    """The SASL password (read from ``kafka_sasl_password_file``), or None without SASL."""
    return read_private_file(cfg.kafka_sasl_password_file, "kafka_sasl_password_file") if cfg.uses_sasl else None


def jaas_quoted(text: str) -> str:
    """``text`` as a quoted JAAS option value (any character is safe in it)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped + '"'


def jaas_config(mechanism: str, username: str, password: str) -> str:
    """A client ``sasl.jaas.config`` line (values quoted, so any character is safe)."""
    return f"{JAAS_MODULES[mechanism]} required username={jaas_quoted(username)} password={jaas_quoted(password)};"


def java_client_properties(cfg: PipelineConfig, password: str | None) -> dict[str, str]:
    """The Java client's properties: ``kafka_consumer_properties``, then the security ones (Spark's source adds
    ``kafka.`` to each)."""
    check_resolved(cfg)
    check_tls_files(cfg)
    props = {**parse_properties(cfg.kafka_consumer_properties), "security.protocol": cfg.kafka_security_protocol}
    if cfg.uses_sasl:
        props["sasl.mechanism"] = cfg.kafka_sasl_mechanism
        props["sasl.jaas.config"] = jaas_config(cfg.kafka_sasl_mechanism, cfg.kafka_sasl_username, password or "")
    if cfg.uses_tls:
        if cfg.kafka_ssl_cafile:
            props.update({"ssl.truststore.type": "PEM", "ssl.truststore.location": cfg.kafka_ssl_cafile})
        if cfg.kafka_ssl_client_pem:
            props.update({"ssl.keystore.type": "PEM", "ssl.keystore.location": cfg.kafka_ssl_client_pem})
        if not cfg.kafka_ssl_check_hostname:
            props["ssl.endpoint.identification.algorithm"] = ""
    return props


def spark_kafka_options(cfg: PipelineConfig, password: str | None) -> dict[str, str]:
    """Options of ``spark.read.format("kafka")`` beyond the bootstrap servers."""
    return {f"kafka.{k}": v for k, v in java_client_properties(cfg, password).items()}


def read_group_id(key: bytes, kafka_options: Mapping[str, str]) -> str:
    """The ``kafka.group.id`` of an epoch's read: the same for every read with the same ``kafka_options`` under the same
    ``key``, so that the next epoch borrows the pooled consumers Spark keeps per group id (its default is a new id, and
    new consumers, per read). It changes with any option, as the pool requires, and is a keyed hash: it reaches the
    broker and must not let anyone test guesses of the password. Reads commit nothing: no group forms, no ACL needed."""
    canonical = json.dumps(sorted(kafka_options.items()), separators=(",", ":"))
    return "ipcount-read-" + hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()[:16]


def property_value(value: str) -> str:
    """``value`` escaped for a Java ``.properties`` file (read as ISO-8859-1): anything beyond printable ASCII as
    ``\\uXXXX``."""
    units = value.replace("\\", "\\\\").encode("utf-16-be")
    chars = (int.from_bytes(units[i:i + 2], "big") for i in range(0, len(units), 2))
    text = "".join(chr(c) if 0x20 <= c <= 0x7E else f"\\u{c:04x}" for c in chars)
    return "\\" + text if text.startswith(" ") else text  # a leading blank would be dropped


def properties_file_text(props: dict[str, str]) -> str:
    """A Java ``.properties`` text of ``props`` (values escaped)."""
    return "".join(f"{k}={property_value(v)}\n" for k, v in props.items())


def kafka_python_options(cfg: PipelineConfig, password: str | None) -> dict[str, object]:
    """Keyword arguments for kafka-python's admin client, consumer and producer (the keys all three accept)."""
    check_resolved(cfg)
    check_tls_files(cfg)
    options: dict[str, object] = {"security_protocol": cfg.kafka_security_protocol}
    if cfg.uses_sasl:
        options.update(sasl_mechanism=cfg.kafka_sasl_mechanism, sasl_plain_username=cfg.kafka_sasl_username,
                       sasl_plain_password=password)
    if cfg.uses_tls:
        options.update(ssl_cafile=cfg.kafka_ssl_cafile or None, ssl_check_hostname=cfg.kafka_ssl_check_hostname,
                       ssl_certfile=cfg.kafka_ssl_client_pem or None)
    return options


# An Airflow connection of type ``kafka`` (the apache-kafka provider's) keeps the client settings in its extra under
# librdkafka's names; these are the ones the pipeline honours.
CONNECTION_SETTINGS = {"bootstrap.servers": "bootstrap_servers", "security.protocol": "kafka_security_protocol",
                       "sasl.mechanism": "kafka_sasl_mechanism", "sasl.mechanisms": "kafka_sasl_mechanism",
                       "sasl.username": "kafka_sasl_username", "ssl.ca.location": "kafka_ssl_cafile"}
CONNECTION_SECURITY_PREFIXES = ("security.", "sasl.", "ssl.", "enable.ssl.")


@dataclass(frozen=True)
class ConnectionSettings:
    """What a ``kafka`` connection says, as pipeline settings. The password and the client key are not settings: the
    caller writes them to private files for the run."""
    settings: dict[str, object]
    password: str | None = None
    client_cert: str = ""      # PEM: the key too, unless client_key names it
    client_key: str = ""


def connection_settings(conn_id: str, extra: Mapping[str, object], login: str | None = None,
                        password: str | None = None) -> ConnectionSettings:
    """The Kafka settings of connection ``conn_id`` from its extra (librdkafka names) and, as a fallback, its login and
    password. Security options the pipeline cannot honour are refused, naming them."""
    def text(key: str) -> str:
        value = extra.get(key, "")
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ConfigError(f"kafka_connection {conn_id!r}: {key} must be a string; found {value!r}")
        return str(value).strip()

    unsupported = sorted(k for k in extra if k.startswith(CONNECTION_SECURITY_PREFIXES)
                         and k not in CONNECTION_SETTINGS and k not in
                         ("sasl.password", "ssl.certificate.location", "ssl.key.location",
                          "ssl.endpoint.identification.algorithm"))
    if unsupported:
        raise ConfigError(f"kafka_connection {conn_id!r}: the pipeline cannot honour {', '.join(unsupported)} "
                          "(it takes bootstrap.servers, security.protocol, sasl.mechanism, sasl.username, "
                          "sasl.password, ssl.ca.location, ssl.certificate.location, ssl.key.location (unencrypted) "
                          "and ssl.endpoint.identification.algorithm)")
    settings: dict[str, object] = {name: text(key) for key, name in CONNECTION_SETTINGS.items() if text(key)}
    settings.setdefault("kafka_security_protocol", "PLAINTEXT")
    settings["kafka_security_protocol"] = str(settings["kafka_security_protocol"]).upper()
    if "kafka_sasl_mechanism" in settings:
        settings["kafka_sasl_mechanism"] = str(settings["kafka_sasl_mechanism"]).upper()
    if login and "kafka_sasl_username" not in settings:
        settings["kafka_sasl_username"] = login
    algorithm = text("ssl.endpoint.identification.algorithm").lower()
    if algorithm not in ("", "https", "none"):
        raise ConfigError(f"kafka_connection {conn_id!r}: ssl.endpoint.identification.algorithm must be https or "
                          f"none; found {algorithm!r}")
    if algorithm == "none":
        settings["kafka_ssl_check_hostname"] = False
    given = extra.get("sasl.password")
    if given is not None and not isinstance(given, str):
        raise ConfigError(f"kafka_connection {conn_id!r}: sasl.password must be a string")
    secret = given or password or None  # as given: blanks may belong to a password
    return ConnectionSettings(settings, secret, text("ssl.certificate.location"), text("ssl.key.location"))
