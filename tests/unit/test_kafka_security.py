"""The Kafka security settings: validated together, and turned into each client's options
without the password ever being a setting."""
from __future__ import annotations

import pytest

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import ConfigError
from ipcount.rules.kafka_security import (connection_settings, jaas_config, java_client_properties,
                                          kafka_python_options, properties_file_text, property_value,
                                          read_group_id, read_private_file, sasl_password, spark_kafka_options)


@pytest.fixture
def password_file(tmp_path):
    path = tmp_path / "kafka.password"
    path.write_text('p"w\\d;x y=z,é\n')
    path.chmod(0o600)
    return path


def pem_file(tmp_path, name: str, mode: int = 0o600, key: str = "PRIVATE KEY") -> str:
    """A stand-in PEM file: a key block and a certificate block (the options builders look
    at the file; the clients read it)."""
    path = tmp_path / name
    path.write_text(f"-----BEGIN {key}-----\n-----BEGIN CERTIFICATE-----\n")
    path.chmod(mode)
    return str(path)


def secured(password_file, **extra) -> PipelineConfig:
    return PipelineConfig(kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="SCRAM-SHA-512",
                          kafka_sasl_username="ipcount", kafka_sasl_password_file=str(password_file),
                          kafka_ssl_cafile=pem_file(password_file.parent, "ca.pem", 0o644), **extra)


def test_plaintext_is_the_default_and_adds_nothing():
    cfg = PipelineConfig()
    assert kafka_python_options(cfg, None) == {"security_protocol": "PLAINTEXT"}
    assert spark_kafka_options(cfg, None) == {"kafka.security.protocol": "PLAINTEXT"}
    assert sasl_password(cfg) is None


@pytest.mark.parametrize("settings, message", [
    ({"kafka_security_protocol": "SASL_SSL"}, "needs kafka_sasl_mechanism, one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"),
    ({"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_mechanism": "SCRAM-SHA-256"},
     "needs kafka_sasl_username and kafka_sasl_password_file"),
    ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "GSSAPI"}, "found 'GSSAPI'"),
    ({"kafka_sasl_username": "x"}, "kafka_sasl_username set, but kafka_security_protocol is PLAINTEXT"),
    ({"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_mechanism": "PLAIN", "kafka_sasl_username": "u",
      "kafka_sasl_password_file": "/p", "kafka_ssl_cafile": "/ca.pem"}, "TLS settings need SSL or SASL_SSL"),
    ({"kafka_security_protocol": "TLS"}, "kafka_security_protocol must be one of PLAINTEXT, SSL, SASL_PLAINTEXT"),
])
def test_settings_that_do_not_fit_together_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        PipelineConfig(**settings)


def test_sasl_ssl_options_for_every_client(password_file):
    cfg = secured(password_file)
    ca = cfg.kafka_ssl_cafile
    password = sasl_password(cfg)
    assert password == 'p"w\\d;x y=z,é'  # one line end stripped, nothing else
    assert kafka_python_options(cfg, password) == {
        "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "ipcount",
        "sasl_plain_password": password, "ssl_cafile": ca, "ssl_check_hostname": True,
        "ssl_certfile": None}
    jaas = ('org.apache.kafka.common.security.scram.ScramLoginModule required username="ipcount" '
            'password="p\\"w\\\\d;x y=z,é";')
    assert spark_kafka_options(cfg, password) == {
        "kafka.security.protocol": "SASL_SSL", "kafka.sasl.mechanism": "SCRAM-SHA-512", "kafka.sasl.jaas.config": jaas,
        "kafka.ssl.truststore.type": "PEM", "kafka.ssl.truststore.location": ca}
    # The tools' properties file: backslashes doubled again, non-ASCII as \\uXXXX (ISO-8859-1 reader).
    text = properties_file_text(java_client_properties(cfg, password))
    assert r'password="p\\"w\\\\d;x y=z,\u00e9";' in text and text.isascii()
    # The password is in none of the settings.
    assert password not in " ".join(cfg.to_args()) and password not in str(cfg.to_env())


def test_plain_mechanism_client_certificates_and_no_hostname_check(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("secret")
    pw.chmod(0o400)
    cfg = PipelineConfig(kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="PLAIN", kafka_sasl_username="u",
                         kafka_sasl_password_file=str(pw), kafka_ssl_client_pem=pem_file(tmp_path, "client.pem"),
                         kafka_ssl_check_hostname=False)
    props = java_client_properties(cfg, sasl_password(cfg))
    assert props["sasl.jaas.config"] == jaas_config("PLAIN", "u", "secret") == \
        'org.apache.kafka.common.security.plain.PlainLoginModule required username="u" password="secret";'
    assert props["ssl.keystore.type"] == "PEM" and props["ssl.keystore.location"] == cfg.kafka_ssl_client_pem
    assert props["ssl.endpoint.identification.algorithm"] == "" and "ssl.truststore.location" not in props
    ssl_only = PipelineConfig(kafka_security_protocol="SSL", kafka_ssl_cafile=pem_file(tmp_path, "ca.pem"))
    assert kafka_python_options(ssl_only, sasl_password(ssl_only)) == {
        "security_protocol": "SSL", "ssl_cafile": ssl_only.kafka_ssl_cafile, "ssl_check_hostname": True,
        "ssl_certfile": None}


def test_tls_files_must_exist_and_the_client_key_be_private(tmp_path):
    missing = PipelineConfig(kafka_security_protocol="SSL", kafka_ssl_cafile=str(tmp_path / "nope.pem"))
    with pytest.raises(ConfigError, match=f"kafka_ssl_cafile: no file {tmp_path}/nope.pem"):
        kafka_python_options(missing, None)
    open_key = PipelineConfig(kafka_security_protocol="SSL", kafka_ssl_client_pem=pem_file(tmp_path, "c.pem", 0o644))
    with pytest.raises(ConfigError, match="kafka_ssl_client_pem: .* holds a private key but is open to others"):
        java_client_properties(open_key, None)
    # Java's PEM key store reads PKCS#8 only (Python would take PKCS#1): refused before Spark fails.
    pkcs1 = PipelineConfig(kafka_security_protocol="SSL",
                           kafka_ssl_client_pem=pem_file(tmp_path, "rsa.pem", key="RSA PRIVATE KEY"))
    with pytest.raises(ConfigError, match="unencrypted PKCS#8 private key .* openssl pkey"):
        kafka_python_options(pkcs1, None)


def test_jaas_values_escape_quotes_backslashes_and_line_ends():
    assert jaas_config("PLAIN", "u", 'a"b\\c\nd\re') == (
        'org.apache.kafka.common.security.plain.PlainLoginModule required username="u" '
        'password="a\\"b\\\\c\\nd\\re";')


def test_java_properties_values_survive_any_character():
    # Properties.load reads ISO-8859-1 and drops a value's leading blanks; UTF-16 units beyond it.
    assert property_value('a\\b"=:#!') == 'a\\\\b"=:#!'
    assert property_value(" lead") == "\\ lead"
    assert property_value("é\N{GRINNING FACE}\n") == "\\u00e9\\ud83d\\ude00\\u000a"


def test_the_password_file_must_be_private_and_not_empty(tmp_path):
    path = tmp_path / "pw"
    path.write_text("secret\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=f"kafka_sasl_password_file: {path} is open to others .*chmod 600 {path}"):
        read_private_file(path, "kafka_sasl_password_file")
    path.chmod(0o600)
    assert read_private_file(path, "kafka_sasl_password_file") == "secret"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_private_file(path, "kafka_sasl_password_file")
    with pytest.raises(ConfigError, match="kafka_sasl_password_file: no file"):
        read_private_file(tmp_path / "missing", "kafka_sasl_password_file")


def test_a_kafka_connections_extra_becomes_settings():
    extra = {"bootstrap.servers": "k1:9094,k2:9094", "security.protocol": "sasl_ssl", "sasl.mechanism": "SCRAM-SHA-256",
             "sasl.username": "ipcount", "sasl.password": "s3cret", "ssl.ca.location": "/etc/ca.pem",
             "ssl.endpoint.identification.algorithm": "none", "group.id": "ignored", "client.id": "ignored"}
    conn = connection_settings("kafka_prod", extra)
    assert conn.settings == {"bootstrap_servers": "k1:9094,k2:9094", "kafka_security_protocol": "SASL_SSL",
                             "kafka_sasl_mechanism": "SCRAM-SHA-256", "kafka_sasl_username": "ipcount",
                             "kafka_ssl_cafile": "/etc/ca.pem", "kafka_ssl_check_hostname": False}
    assert conn.password == "s3cret" and (conn.client_cert, conn.client_key) == ("", "")
    # The connection's own login and password fields are the fallback; librdkafka's plural spelling works.
    conn = connection_settings("k", {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanisms": "PLAIN"}, "u", "pw")
    assert conn.settings["kafka_sasl_username"] == "u" and conn.password == "pw"
    assert conn.settings["kafka_sasl_mechanism"] == "PLAIN"
    assert connection_settings("k", {"sasl.password": " p w "}).password == " p w "  # blanks are the password's
    # Nothing given: PLAINTEXT, and the pipeline's own brokers stay.
    assert connection_settings("k", {}).settings == {"kafka_security_protocol": "PLAINTEXT"}


@pytest.mark.parametrize("extra, message", [
    ({"sasl.kerberos.service.name": "kafka"}, "cannot honour sasl.kerberos.service.name"),
    ({"ssl.key.password": "x"}, "cannot honour ssl.key.password"),
    ({"enable.ssl.certificate.verification": "false"}, "cannot honour enable.ssl.certificate.verification"),
    ({"ssl.endpoint.identification.algorithm": "dns"}, "must be https or none; found 'dns'"),
    ({"sasl.username": ["a"]}, "sasl.username must be a string"),
])
def test_connection_options_the_pipeline_cannot_honour_are_refused(extra, message):
    with pytest.raises(ConfigError, match=f"kafka_connection 'k'.*{message}"):
        connection_settings("k", extra)


def test_an_unresolved_connection_never_makes_a_client():
    cfg = PipelineConfig(kafka_connection="kafka_prod")
    with pytest.raises(ConfigError, match="kafka_connection 'kafka_prod' is read by the Airflow tasks"):
        kafka_python_options(cfg, None)
    with pytest.raises(ConfigError, match="kafka_connection"):
        spark_kafka_options(cfg, None)


def test_the_read_group_id_changes_with_any_option_and_hides_them():
    options = {"kafka.bootstrap.servers": "k1:9092", "kafka.security.protocol": "SASL_SSL",
               "kafka.sasl.jaas.config": 'ScramLoginModule required username="u" password="pw-1";'}
    group = read_group_id(b"session", options)
    # the same options in any order, under the same key: one id, so consumers are reused
    assert group == read_group_id(b"session", dict(reversed(list(options.items()))))
    assert group.startswith("ipcount-read-") and len(group) == len("ipcount-read-") + 16
    # a changed option (a rotated password), an added one, or another key: another id, since
    # Spark's consumer pool refuses other options for an id it has seen
    rotated = {**options, "kafka.sasl.jaas.config": options["kafka.sasl.jaas.config"].replace("pw-1", "pw-2")}
    others = [read_group_id(b"session", rotated), read_group_id(b"session", {**options, "kafka.x": "1"}),
              read_group_id(b"other session", options)]
    assert len({group, *others}) == 4
    # the id reaches the broker: nothing of the options is in it
    assert not any(part in group for part in ("pw-1", "k1", "SASL"))
