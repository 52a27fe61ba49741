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
