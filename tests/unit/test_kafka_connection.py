"""An Airflow connection of type kafka as the source of the Kafka settings: resolved where a
task runs, its password in a private file for the block only, and passed on to the Spark
job in its run, which reads back the same settings. (Airflow reads the
connection from an AIRFLOW_CONN_* variable here, as any secrets backend would give it.)"""
from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from ipcount.jobs.runs import EPOCH, Run
from ipcount.orchestration.kafka_connection import resolved
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import ConnectionUnavailable


@pytest.fixture
def connection(monkeypatch, tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_PROD", json.dumps({"conn_type": "kafka", "extra": {
        "bootstrap.servers": "k1:9094,k2:9094", "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.username": "ipcount", "sasl.password": 'p"w d', "ssl.ca.location": str(ca)}}))
    return ca


def test_the_connection_decides_and_its_password_lives_only_as_long_as_the_block(connection, tmp_path):
    # The DAG's own settings name another broker and a TLS file: the connection alone counts.
    other_ca = tmp_path / "other.pem"
    other_ca.write_text("x")
    cfg = PipelineConfig(kafka_connection="kafka_prod", bootstrap_servers="127.0.0.1:1")
    with resolved(cfg) as kafka:
        assert (kafka.bootstrap_servers, kafka.kafka_security_protocol, kafka.kafka_sasl_mechanism,
                kafka.kafka_sasl_username, kafka.kafka_ssl_cafile, kafka.kafka_connection) == \
            ("k1:9094,k2:9094", "SASL_SSL", "SCRAM-SHA-256", "ipcount", str(connection), "")
        password_file = Path(kafka.kafka_sasl_password_file)
        assert password_file.read_text() == 'p"w d\n'
        assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(password_file.parent.stat().st_mode) == 0o700
        # The Spark job reads its run back to the same settings.
        assert Run.from_json(Run(EPOCH, kafka).to_json()).config == kafka
    assert not password_file.exists() and not password_file.parent.exists()


def test_without_a_connection_nothing_changes_and_a_missing_one_is_named(connection):
    plain = PipelineConfig()
    with resolved(plain) as same:
        assert same is plain
    with pytest.raises(ConnectionUnavailable, match="kafka_connection 'nope': no such Airflow connection"):
        with resolved(PipelineConfig(kafka_connection="nope")):
            pass
