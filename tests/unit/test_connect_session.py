"""The id a pipeline's processes share their Spark Connect session under, and the URL that
asks for it (the server's side: tests/integration/test_spark_connect.py)."""
from __future__ import annotations

import json
import uuid

import pytest

from pyspark.sql.connect.client.core import DefaultChannelBuilder

from ipcount.storage.spark import SHARED_SESSION_SECONDS, _with_session_id, shared_session_id

HALF_HOUR_START = 1_795_255_200.0  # 2026-11-21T10:00:00Z, a multiple of the half hour


def test_one_id_per_pipeline_token_and_half_hour():
    same = {shared_session_id("p", "token", HALF_HOUR_START + s) for s in (0, 1, 900, SHARED_SESSION_SECONDS - 0.001)}
    assert len(same) == 1
    ids = {shared_session_id("p", "token", HALF_HOUR_START), shared_session_id("q", "token", HALF_HOUR_START),
           shared_session_id("p", "other", HALF_HOUR_START), shared_session_id("p", "", HALF_HOUR_START),
           shared_session_id("p", "token", HALF_HOUR_START + SHARED_SESSION_SECONDS),
           shared_session_id("p", "token", HALF_HOUR_START - 1)}
    assert len(ids) == 6
    for value in ids:
        assert uuid.UUID(value).version == 4 and str(uuid.UUID(value)) == value


def test_the_session_id_joins_the_urls_own_parameters():
    sid = shared_session_id("p", "", HALF_HOUR_START)
    for url, params in [("sc://localhost:15002", {}), ("sc://localhost:15002/", {}),
                        ("sc://localhost:15002/;token=abc", {"token": "abc"}),
                        ("sc://h:1/;user_id=me;token=a%3Db;use_ssl=True", {"user_id": "me", "token": "a=b",
                                                                          "use_ssl": "True"})]:
        built = DefaultChannelBuilder(_with_session_id(url, sid))
        assert built.session_id == sid
        assert {k: built.get(k) for k in params} == params
        assert built.endpoint == url.removeprefix("sc://").partition("/")[0]


def test_the_task_refuses_a_connection_it_cannot_share_a_session_on(monkeypatch):
    """Settings in a spark_connect connection's extra would change the session all of the
    pipeline's processes share; a connection of another type is no Spark Connect server.
    Both are refused before anything connects."""
    from ipcount.orchestration.operators import EpochConnectOperator
    from ipcount.rules.config import PipelineConfig
    from ipcount.rules.errors import ConfigError

    for conn_id, connection, message in [
            ("with_settings", {"conn_type": "spark_connect", "host": "localhost", "port": 1,
                               "extra": {"use_ssl": False, "spark.sql.shuffle.partitions": "9"}},
             "has spark.sql.shuffle.partitions in its extra, which may hold only use_ssl"),
            ("of_spark", {"conn_type": "spark", "host": "local[2]"}, "a connection of type 'spark', not 'spark_connect'")]:
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(connection))
        task = EpochConnectOperator(task_id="run_epoch", pipeline=PipelineConfig(), conn_id=conn_id,
                                    run_of=lambda cfg, context: None)
        with pytest.raises(ConfigError, match=message):
            task.session()


def test_a_server_address_is_read_as_a_url_ipv6_included():
    """The reachability check reads host and port as a URL does ([::1]:port too); a port that
    is no number is a clear error, not a traceback."""
    from ipcount.rules.errors import ConfigError, SparkConnectError
    from ipcount.storage.spark import connect_session

    for url in ("sc://[::1]:1", "sc://127.0.0.1:1/;token=a"):
        with pytest.raises(SparkConnectError, match="no Spark Connect server answers at"):
            connect_session(url, "the server", "p", 2)
    with pytest.raises(ConfigError, match="the server: not a Spark Connect address"):
        connect_session("sc://localhost:port", "the server", "p", 2)


def test_a_token_from_its_file_reaches_the_client_as_written(tmp_path):
    """pyspark unquotes the URL's token (as the Spark provider's hook quotes it), so a token
    with '%' or ';' in it must be quoted, or the server gets another token."""
    from ipcount.rules.config import PipelineConfig
    from ipcount.rules.private_files import write_private_file
    from ipcount.storage.spark import connect_url

    token = "a%41;b=c d/e"
    path = write_private_file(tmp_path / "token", token + "\n")
    url = connect_url(PipelineConfig(spark_remote="sc://localhost:15002", spark_remote_token_file=str(path)))
    assert DefaultChannelBuilder(url).get("token") == token
