"""Shared fixtures: one real Kafka broker and one Spark session for the whole run."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from ipcount.rules.config import PipelineConfig
from ipcount_lab.service import free_port  # noqa: F401 - tests import it from here

# The suite's Spark drivers (sessions, spark-submit, Connect servers; the tests' own children
# inherit this) are short-lived JVMs on a small machine: with C1 alone they spend less of it
# compiling than tiered compilation does, and no test here is timed.
_C1_ONLY = "-XX:TieredStopAtLevel=1"
if _C1_ONLY not in os.environ.get("SPARK_SUBMIT_OPTS", ""):
    os.environ["SPARK_SUBMIT_OPTS"] = f"{os.environ.get('SPARK_SUBMIT_OPTS', '')} {_C1_ONLY}".strip()


def run_until_idle(cfg: PipelineConfig, spark, limit: int = 20) -> list:
    """Run epochs until one finds nothing new; their summaries. Bounded, so a planning bug
    fails the test instead of hanging it."""
    from ipcount.jobs.epoch import run_epoch

    summaries = []
    for _ in range(limit):
        s = run_epoch(cfg, spark)
        if s is None:
            return summaries
        summaries.append(s)
    raise AssertionError(f"still planning epochs after {limit}")


# The secured listeners' password: quotes, a backslash, separators and a non-ASCII letter, so
# every place that quotes or escapes it (JAAS, Java properties, SCRAM) is tried for real.
BROKER_PASSWORD = 'p"w\\d;x y=z,\u00e9'


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    """The run's broker: PLAINTEXT for most tests, and SASL_SSL, SASL_PLAINTEXT and mutual-TLS
    SSL listeners for the Kafka security tests."""
    from ipcount_lab.embedded_kafka import EmbeddedKafka, SecureListeners

    kafka = EmbeddedKafka(state_dir=tmp_path_factory.mktemp("kafka"), port=free_port(), controller_port=free_port(),
                          secure=SecureListeners(free_port(), free_port(), free_port()))
    kafka.password_file.parent.mkdir(mode=0o700)
    kafka.password_file.write_text(BROKER_PASSWORD + "\n")
    kafka.password_file.chmod(0o600)
    kafka.start()
    yield kafka
    kafka.stop()


@pytest.fixture(scope="session")
def spark(broker):
    """The pipeline's session, with delta-spark too: some tests make tables as older versions
    of the pipeline did, with delta-spark, or read them with it as a second reader."""
    from ipcount.storage.spark import get_spark
    from ipcount_lab.peer import DELTA_CONF, delta_jars

    session = get_spark(PipelineConfig(spark_master="local[2]"), app_name="ipcount-tests", more_jars=delta_jars(),
                        more_conf=DELTA_CONF)
    yield session
    session.stop()


@pytest.fixture
def cfg(broker, tmp_path) -> PipelineConfig:
    """A pipeline of its own: fresh topic (3 partitions), warehouse and consumer group."""
    from ipcount.storage.broker import create_topic

    name = f"t_{uuid.uuid4().hex[:10]}"
    config = PipelineConfig(bootstrap_servers=broker.bootstrap_servers, topic=name, group_id=f"g_{name}",
                            pipeline_id=f"p_{name}",
                            warehouse=str(Path(tmp_path) / "warehouse"), spark_master="local[2]")
    create_topic(config, 3)
    return config


@pytest.fixture
def table_loads(monkeypatch) -> list[str]:
    """The path of every Delta table load (``deltalake.DeltaTable(path)``) from here on."""
    import deltalake

    loads: list[str] = []

    class CountedLoads(deltalake.DeltaTable):
        def __init__(self, table_uri, *args, **kwargs):
            loads.append(str(table_uri))
            super().__init__(table_uri, *args, **kwargs)

    monkeypatch.setattr(deltalake, "DeltaTable", CountedLoads)
    return loads


@pytest.fixture(scope="session")
def object_store(tmp_path_factory):
    """The run's S3-compatible server (s3proxy), with a bucket for the tests' warehouses."""
    from ipcount_lab.embedded_s3 import EmbeddedS3

    store = EmbeddedS3(state_dir=tmp_path_factory.mktemp("s3"), port=free_port())
    store.start()
    yield store
    store.stop()


@pytest.fixture
def s3_cfg(cfg, object_store, monkeypatch) -> PipelineConfig:
    """``cfg`` with its tables on the object store (a warehouse of its own in the bucket),
    and the AWS variables that point delta-rs there set for the test (and its children)."""
    for name, value in object_store.environment().items():
        monkeypatch.setenv(name, value)
    return cfg.replace(warehouse=object_store.uri(cfg.topic, "warehouse"))


@pytest.fixture(scope="session")
def connect(broker, tmp_path_factory):
    """The run's Spark Connect server (``bin/lab spark-connect``), for epochs run with a
    remote session (in CLI processes: a process gets either a classic or a Connect session)."""
    from ipcount_lab.embedded_connect import EmbeddedSparkConnect

    server = EmbeddedSparkConnect(state_dir=tmp_path_factory.mktemp("spark-connect"), port=free_port(),
                                  master="local[2]", cores=2)
    server.start()
    yield server
    server.stop()


def connect_connection(server, conn_id: str = "ipcount_connect") -> dict[str, str]:
    """The Airflow ``spark_connect`` connection ``conn_id`` to the Connect ``server`` (its token
    the password), as the environment variable that defines it."""
    return {f"AIRFLOW_CONN_{conn_id.upper()}": json.dumps({"conn_type": "spark_connect", "host": "localhost",
                                                             "port": server.port, "password": server.token()})}
