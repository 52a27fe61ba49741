"""The Kafka settings of an Airflow connection (``kafka_connection``), for the DAGs' tasks
and the monitor.

The connection is read where it is used (in a task, through the Task SDK; in the API
server, from its secrets backends), never when a DAG file is parsed. Its password, and a
client key kept apart from its certificate, go into a private directory that lives as long
as the block; the settings then name those files, as a file-based configuration would.
"""
from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import ConfigError, ConnectionUnavailable
from ipcount.rules.kafka_security import ConnectionSettings, connection_settings
from ipcount.rules.private_files import write_private_file


# What a connection decides, and so what a task passes on to its Spark command.
RESOLVED_SETTINGS = ("bootstrap_servers", "kafka_security_protocol", "kafka_sasl_mechanism", "kafka_sasl_username",
                     "kafka_sasl_password_file", "kafka_ssl_cafile", "kafka_ssl_client_pem",
                     "kafka_ssl_check_hostname", "kafka_connection")


def read_connection(conn_id: str) -> ConnectionSettings:
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = Connection.get(conn_id)  # registers its secrets with Airflow's log masker
    except AirflowNotFoundException:
        raise ConnectionUnavailable(f"kafka_connection {conn_id!r}: no such Airflow connection (or its secrets "
                                    "backend did not answer)") from None
    if conn.conn_type not in ("kafka", "generic", None, ""):
        raise ConfigError(f"kafka_connection {conn_id!r} is of type {conn.conn_type!r}; expected kafka")
    return connection_settings(conn_id, conn.extra_dejson, conn.login, conn.password)


@contextmanager
def resolved(cfg: PipelineConfig) -> Iterator[PipelineConfig]:
    """``cfg`` with the settings of its ``kafka_connection`` (unchanged without one); the
    files holding the connection's secrets exist until the block ends."""
    if not cfg.kafka_connection:
        yield cfg
        return
    conn = read_connection(cfg.kafka_connection)
    with tempfile.TemporaryDirectory(prefix="ipcount-kafka-") as private:  # mode 0700
        # The connection alone decides: what it leaves out takes the default.
        fresh = PipelineConfig()
        settings = {n: getattr(fresh, n) for n in RESOLVED_SETTINGS if n != "bootstrap_servers"}
        settings.update(conn.settings, kafka_connection="")
        if conn.password is not None:
            settings["kafka_sasl_password_file"] = str(write_private_file(Path(private) / "password",
                                                                          conn.password + "\n", exclusive=True))
        if conn.client_key:
            # One PEM holding key and chain is what both Kafka clients read (KIP-651).
            try:
                pem = Path(conn.client_key).read_text() + Path(conn.client_cert).read_text()
            except OSError as e:
                raise ConfigError(f"kafka_connection {cfg.kafka_connection!r}: ssl.key.location or "
                                  f"ssl.certificate.location cannot be read: {e}") from None
            settings["kafka_ssl_client_pem"] = str(write_private_file(Path(private) / "client.pem", pem,
                                                                      exclusive=True))
        elif conn.client_cert:
            settings["kafka_ssl_client_pem"] = conn.client_cert
        yield cfg.replace(**settings)
