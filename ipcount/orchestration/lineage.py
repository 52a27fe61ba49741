"""The Airflow Assets of a pipeline: its source topic, the tables a run writes and the sink
topic, so Airflow's asset graph (and OpenLineage, when installed) shows topic -> tables ->
sink. Every DAG file takes them from here, so each Asset is declared alike everywhere."""
from __future__ import annotations

from ipcount.rules.config import ON_DATA, PipelineConfig
from ipcount.rules.lineage import table_uri, topic_uri


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
