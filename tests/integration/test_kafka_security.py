"""The pipeline on a secured broker: SASL (PLAIN, both SCRAMs) and TLS (with client
certificates), through every client it uses (kafka-python, Spark's Kafka source, Kafka's Java
tools), and what a user sees when a security setting is wrong. The session broker serves the
secured listeners; its user's password is one that needs quoting everywhere."""
from __future__ import annotations

import json
import logging
import socket
import ssl
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from ipcount.jobs import epoch as epoch_mod
from ipcount.jobs.backfill import run_backfill
from ipcount.jobs.group_commit import commit_group_offsets_from_ledger
from ipcount.orchestration.kafka_connection import resolved
from ipcount.orchestration.monitor.data import BrokerProbe
from ipcount.rules.config import COMMAND_SETTINGS, REPO_ROOT
from ipcount.rules.errors import BrokerUnavailableError
from ipcount.rules.requests import BackfillRequest, parse_offsets
from ipcount.storage import broker as broker_io
from ipcount_lab.dev_tls import DevTls
from ipcount_lab.generator import TrafficGenerator, produce
from tests.conftest import BROKER_PASSWORD
from tests.ground_truth import Expected, expected_tables
from tests.tables import counts, lanes

BASE_MS = 1_795_255_200_000
LISTENERS = [("SASL_SSL", "SCRAM-SHA-512"), ("SASL_SSL", "SCRAM-SHA-256"), ("SASL_PLAINTEXT", "PLAIN"), ("SSL", "")]


def secured(cfg, broker, protocol, mechanism="SCRAM-SHA-512", **settings):
    """``cfg`` reaching the session broker over one of its secured listeners."""
    return cfg.replace(**{**broker.client_settings(protocol, mechanism), **settings})


def produce_over(cfg, n, seed):
    gen = TrafficGenerator(seed=seed, events_per_second=50, late_share=0.03, malformed_share=0.03)
    return produce(cfg.bootstrap_servers, cfg.topic, gen.records(n, BASE_MS + seed * 60_000),
                   partition_of=lambda i, r: i % 3, client_options=broker_io.client_options(cfg))


@pytest.mark.parametrize("protocol,mechanism", LISTENERS, ids=[f"{p}-{m or 'mTLS'}" for p, m in LISTENERS])
def test_python_and_java_clients_on_each_secured_listener(cfg, broker, protocol, mechanism):
    secure = secured(cfg, broker, protocol, mechanism)
    produced = produce_over(secure, 30, seed=1)
    ends = dict(Counter(p.partition for p in produced))
    assert broker_io.partition_offsets(secure)[1] == ends
    assert [r.offset for r in broker_io.read_range(secure, 0, 0, ends[0])] == list(range(ends[0]))
    broker_io.commit_group_offsets(secure, ends, epoch=1)
    assert broker_io.group_offsets(secure) == ends

    # Kafka's own tool, logged in from a private properties file that is gone afterwards.
    out = subprocess.run([sys.executable, "-m", "ipcount.cli", "consumer-groups",
                          *secure.to_args(COMMAND_SETTINGS["consumer-groups"]), "--", "--describe", "--group", secure.group_id],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith(secure.group_id)]
    assert sorted((int(r[2]), int(r[3])) for r in rows) == sorted(ends.items()), out.stdout
    assert BROKER_PASSWORD not in out.stdout + out.stderr


def test_epochs_a_backfill_and_lag_over_secured_listeners(cfg, broker, spark, caplog, monkeypatch):
    """One table set: an epoch over SASL_SSL with SCRAM, one over mutual TLS, then a backfill,
    a group commit and the monitor's broker probe through an Airflow connection of type kafka
    (as the DAGs' tasks and the monitor read it). The tables equal a plain-Python recount."""
    caplog.set_level(logging.DEBUG)
    sasl = secured(cfg, broker, "SASL_SSL")
    first = produce_over(sasl, 200, seed=2)
    s1 = epoch_mod.run_epoch(sasl, spark)
    mtls = secured(cfg, broker, "SSL")
    second = produce_over(mtls, 150, seed=3)
    s2 = epoch_mod.run_epoch(mtls, spark)
    assert (s1.records_read, s2.records_read) == (200, 150)

    chain_end = broker_io.partition_offsets(sasl)[1]
    third = produce_over(sasl, 90, seed=4)
    log_end = broker_io.partition_offsets(sasl)[1]
    monkeypatch.setenv("AIRFLOW_CONN_IPCOUNT_KAFKA", json.dumps({"conn_type": "kafka", "extra": {
        "bootstrap.servers": sasl.bootstrap_servers, "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.username": "ipcount", "sasl.password": BROKER_PASSWORD, "ssl.ca.location": str(broker.tls.ca_pem)}}))
    via_connection = cfg.replace(kafka_connection="ipcount_kafka")
    spec = ",".join(f"{p}:{chain_end[p]}-{log_end[p]}" for p in sorted(log_end))
    with resolved(via_connection) as conn_cfg:
        assert conn_cfg.kafka_sasl_mechanism == "SCRAM-SHA-256" and conn_cfg.kafka_sasl_password_file
        report = run_backfill(conn_cfg, spark, BackfillRequest(offsets=parse_offsets(spec, cfg.topic)))
        assert commit_group_offsets_from_ledger(conn_cfg)
    assert sum(e.records_read for e in report.epochs) == 90
    assert not Path(conn_cfg.kafka_sasl_password_file).exists()  # the connection's password file is gone

    positions = BrokerProbe().positions(via_connection)
    assert positions.error is None and positions.log_end == log_end
    want = Expected()
    for epochs in lanes(cfg).values():
        lane = expected_tables(first + second + third, epochs)
        want.counts += lane.counts
    assert counts(cfg) == want.counts and sum(want.counts.values()) > 350
    # The password is read where a client is made; it is in no argument, variable or log line.
    assert BROKER_PASSWORD not in " ".join(sasl.to_args()) + repr(sasl.to_env())
    assert f"--kafka-sasl-password-file={sasl.kafka_sasl_password_file}" in sasl.to_args()
    assert BROKER_PASSWORD not in caplog.text and "sasl_plain_password" not in caplog.text


def test_a_wrong_password_is_named_not_shown(cfg, broker, tmp_path):
    wrong = tmp_path / "password"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)
    for protocol, mechanism in (("SASL_SSL", "SCRAM-SHA-512"), ("SASL_PLAINTEXT", "PLAIN")):
        bad = secured(cfg, broker, protocol, mechanism, kafka_sasl_password_file=str(wrong),
                      kafka_timeout_seconds=5)
        with pytest.raises(BrokerUnavailableError) as e:
            broker_io.partition_offsets(bad)
        # The refusal itself, or (when kafka-python saw only the broker hanging up) the login named.
        assert "refused the login of 'ipcount'" in str(e.value) or "while 'ipcount' logged in" in str(e.value)
        assert "kafka_sasl_password_file" in str(e.value) and "not-the-password" not in str(e.value)


def test_an_untrusted_broker_and_a_missing_client_certificate_are_named(cfg, broker, tmp_path):
    other_ca = DevTls(tmp_path / "other").ensure()
    untrusted = secured(cfg, broker, "SASL_SSL", kafka_ssl_cafile=str(other_ca.ca_pem), kafka_timeout_seconds=3)
    with pytest.raises(BrokerUnavailableError) as e:
        broker_io.partition_offsets(untrusted)
    assert "not trusted" in str(e.value) and "kafka_ssl_cafile" in str(e.value)

    anonymous = secured(cfg, broker, "SSL", kafka_ssl_client_pem="", kafka_timeout_seconds=3)
    with pytest.raises(BrokerUnavailableError) as e:
        broker_io.partition_offsets(anonymous)
    assert "kafka_ssl_client_pem" in str(e.value)


def test_a_certificate_for_another_host_is_named(cfg, tmp_path):
    """A TLS server whose certificate names only kafka.example, reached as 127.0.0.1."""
    tls = DevTls(tmp_path / "tls").ensure(hosts=("kafka.example",))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.broker_pem)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        for _ in range(2):
            conn, _ = listener.accept()
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass
    threading.Thread(target=serve, daemon=True).start()
    try:
        mismatch = cfg.replace(bootstrap_servers=f"127.0.0.1:{port}", kafka_security_protocol="SSL",
                               kafka_ssl_cafile=str(tls.ca_pem))
        problem = broker_io.tls_handshake_problem(mismatch)
        assert problem and "does not name '127.0.0.1'" in problem and "kafka_ssl_check_hostname" in problem
        assert broker_io.tls_handshake_problem(mismatch.replace(kafka_ssl_check_hostname=False)) is None
    finally:
        listener.close()


def test_the_consumer_properties_the_pipeline_checks_are_the_jars_own(spark):
    """kafka_consumer_properties is checked against a list of the consumer's names: the one of
    the kafka-clients jar Spark's Kafka source runs (an upgrade that changes them fails here)."""
    from ipcount.rules.kafka_properties import CONSUMER_NAMES

    names = spark._jvm.org.apache.kafka.clients.consumer.ConsumerConfig.configNames()
    assert CONSUMER_NAMES == {str(n) for n in names}


def test_consumer_properties_reach_the_epochs_read(cfg, spark):
    """Passed through, a property is the Java consumer's: harmless ones leave the counts as
    the recount says; a value Kafka refuses fails the read naming it, with the plan recorded
    (write-ahead) and finished by the next run with a good value."""
    produced = produce_over(cfg, 120, seed=5)
    bad = cfg.replace(kafka_consumer_properties="client.rack=r1;metadata.max.age.ms=soon")
    with pytest.raises(Exception, match="metadata.max.age.ms"):
        epoch_mod.run_epoch(bad, spark)
    good = cfg.replace(kafka_consumer_properties="client.rack=r1;fetch.max.bytes=1048576")
    summary = epoch_mod.run_epoch(good, spark)
    assert summary.resumed and summary.records_read == 120
    want = Expected()
    for epochs in lanes(cfg).values():
        want.counts += expected_tables(produced, epochs).counts
    assert counts(cfg) == want.counts and sum(want.counts.values()) > 100
