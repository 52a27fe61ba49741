"""The names lineage gives the pipeline's datasets (ipcount.rules.lineage)."""
from __future__ import annotations

import pytest

from ipcount.rules.lineage import dataset_of, table_uri, topic_uri


def test_a_topic_is_named_after_the_first_bootstrap_server():
    assert topic_uri("127.0.0.1:9092", "ip_count_source") == "kafka://127.0.0.1:9092/ip_count_source"
    assert topic_uri(" b1:9093 , b2:9093,b3:9093", "a.b-c") == "kafka://b1:9093/a.b-c"
    # behind a connection the servers are known only when a task runs: the connection names it
    assert topic_uri("127.0.0.1:9092", "t", kafka_connection="kafka_prod") == "kafka://kafka_prod/t"


def test_a_table_is_its_location():
    assert table_uri("/data/warehouse/counts") == "file:///data/warehouse/counts"
    assert table_uri("s3://bucket/warehouse/ledger") == "s3://bucket/warehouse/ledger"
    assert table_uri("file:///x/y") == "file:///x/y"


@pytest.mark.parametrize("uri, dataset", [
    ("kafka://127.0.0.1:9092/ip_count_source", ("kafka://127.0.0.1:9092", "ip_count_source")),
    ("kafka://kafka_prod/a.b-c", ("kafka://kafka_prod", "a.b-c")),
    ("s3://bucket/warehouse/ledger", ("s3://bucket", "warehouse/ledger")),
    ("file:///data/warehouse/counts", ("file", "/data/warehouse/counts")),
    ("S3A://b/k", ("s3a://b", "k")),
])
def test_openlineage_datasets_of_asset_uris(uri, dataset):
    assert dataset_of(uri) == dataset


def test_a_path_is_not_a_dataset_uri():
    with pytest.raises(ValueError, match="not a dataset URI"):
        dataset_of("/data/warehouse/counts")


def test_a_task_names_its_assets_to_openlineage():
    pytest.importorskip("airflow.providers.openlineage", reason="the optional provider: bin/setup --lineage")
    from airflow.sdk import DAG, Asset

    from ipcount.orchestration.operators import lineage_task

    topic = Asset(name="s", uri="kafka://b1:9093/web.requests")
    counts, ledger = Asset(name="c", uri="s3://bucket/wh/counts"), Asset(name="l", uri="file:///srv/wh/ledger")
    with DAG("lineage_unit", schedule=None):
        @lineage_task(inlets=[topic], outlets=[ledger])
        def declared() -> None:
            pass

        @lineage_task(inlets=[topic], outlets=[ledger], lineage_outputs=[counts, ledger])
        def writes_more() -> None:
            pass

        declared_task, writer = declared().operator, writes_more().operator

    def named(lineage) -> tuple[list, list]:
        return ([(d.namespace, d.name) for d in lineage.inputs], [(d.namespace, d.name) for d in lineage.outputs])

    source = [("kafka://b1:9093", "web.requests")]
    assert named(declared_task.get_openlineage_facets_on_start()) == (source, [("file", "/srv/wh/ledger")])
    assert named(writer.get_openlineage_facets_on_start()) == (source, [("s3://bucket", "wh/counts"),
                                                                         ("file", "/srv/wh/ledger")])
    assert writer.outlets == [ledger]     # Airflow's Asset events stay the declared outlets'
    assert declared_task.custom_operator_name == "@task"
