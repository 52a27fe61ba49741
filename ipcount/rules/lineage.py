"""The names lineage gives the pipeline's datasets: Airflow Asset URIs and the OpenLineage (namespace, name) pairs they
stand for.

A Kafka topic is ``kafka://<first bootstrap server>/<topic>``, as OpenLineage names Kafka datasets (one server: every
process that parses the DAG must name it alike, and the list's order is configuration). Behind an Airflow connection the
servers are only known when a task runs, so the connection id stands in for them. A table is its location: a URI as
written, a local path as ``file://<path>``.
"""
from __future__ import annotations

import re

_URI = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<authority>[^/]*)(?P<path>/.*)?$")


def topic_uri(bootstrap_servers: str, topic: str, kafka_connection: str = "") -> str:
    """The Asset URI of a Kafka topic."""
    authority = kafka_connection or bootstrap_servers.split(",")[0].strip()
    return f"kafka://{authority}/{topic}"


def table_uri(location: str) -> str:
    """The Asset URI of a Delta table at ``location`` (a URI, or a local path)."""
    return location if _URI.match(location) else f"file://{location}"


def dataset_of(uri: str) -> tuple[str, str]:
    """OpenLineage's (namespace, name) for an Asset URI: ``kafka://h:p/t`` is (``kafka://h:p``, ``t``);
    ``s3://bucket/key`` is (``s3://bucket``, ``key``); ``file:///p`` is (``file``, ``/p``)."""
    m = _URI.match(uri)
    if not m:
        raise ValueError(f"not a dataset URI: {uri!r}")
    scheme, authority, path = m["scheme"].lower(), m["authority"], m["path"] or "/"
    if scheme == "file":
        return "file", path
    return f"{scheme}://{authority}", path.lstrip("/")
