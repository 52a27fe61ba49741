"""The Airflow Assets of a pipeline: its source topic, the tables a run writes and the sink
topic, so Airflow's asset graph (and OpenLineage, when installed) shows topic -> tables ->
sink. Every DAG file takes them from here, so each Asset is declared alike everywhere."""
from __future__ import annotations

from ipcount.rules.config import ON_DATA, PipelineConfig
from ipcount.rules.lineage import dataset_of, table_uri, topic_uri


class LineageMixin:
    """A task's OpenLineage datasets (with apache-airflow-providers-openlineage installed):
    its inlet Assets, and the Assets it writes, named by :func:`ipcount.rules.lineage.dataset_of`.
    What it writes are its outlets unless ``lineage_outputs`` says otherwise: the epoch task
    also writes the counts table, whose Asset event the summary task sends. The provider
    itself converts only the URI schemes an installed provider registers, which leaves
    kafka:// and s3:// Assets out; its default extractor calls this method for a task's
    start, end and skip alike."""

    lineage_outputs: list | None = None

    def get_openlineage_facets_on_start(self):
        from airflow.providers.common.compat.openlineage.facet import Dataset
        from airflow.providers.openlineage.extractors import OperatorLineage

        def datasets(assets) -> list:
            return [Dataset(*dataset_of(uri)) for uri in (getattr(a, "uri", None) for a in assets) if uri]

        outputs = self.outlets if self.lineage_outputs is None else self.lineage_outputs
        return OperatorLineage(inputs=datasets(self.inlets), outputs=datasets(outputs))


def source_asset(cfg: PipelineConfig):
    """The source topic, the inlet of every task that reads it. Under the on-data schedule
    it carries the watcher that starts the epoch DAG's runs; every DAG must declare it with
    that watcher, since Airflow keeps the watchers of the DAG file it parsed last."""
    from airflow.sdk import Asset, AssetWatcher

    watchers = []
    if cfg.schedule.strip() == ON_DATA:
        from ipcount.orchestration.watcher import NewRecordsTrigger, watch_settings

        watchers = [AssetWatcher(name=f"{cfg.pipeline_id}_new_records",
                                 trigger=NewRecordsTrigger(watch_settings(cfg), cfg.on_data_poll_seconds))]
    return Asset(name=f"{cfg.pipeline_id}_source",
                 uri=topic_uri(cfg.bootstrap_servers, cfg.topic, cfg.kafka_connection), watchers=watchers)


def counts_asset(cfg: PipelineConfig):
    """The Asset both DAGs update when they commit counts into the main table."""
    from airflow.sdk import Asset

    return Asset(name=f"{cfg.pipeline_id}_counts", uri=table_uri(cfg.counts_path))


def table_assets(cfg: PipelineConfig) -> list:
    """The tables an epoch writes beside the counts: the ledger, the dead letters and the
    late records (the counts table's own Asset is the summary task's)."""
    from airflow.sdk import Asset

    return [Asset(name=f"{cfg.pipeline_id}_{name}", uri=table_uri(path))
            for name, path in (("ledger", cfg.ledger_path), ("dead_letters", cfg.dead_letter_path),
                               ("late_records", cfg.late_path))]


def maintenance_asset(cfg: PipelineConfig):
    """The maintenance log, the maintenance DAG's outlet."""
    from airflow.sdk import Asset

    return Asset(name=f"{cfg.pipeline_id}_maintenance", uri=table_uri(cfg.maintenance_path))


def sink_assets(cfg: PipelineConfig) -> list:
    """The sink topic when the pipeline publishes; none otherwise."""
    from airflow.sdk import Asset

    if not cfg.publish:
        return []
    return [Asset(name=f"{cfg.pipeline_id}_sink",
                  uri=topic_uri(cfg.bootstrap_servers, cfg.publish_topic, cfg.kafka_connection))]
