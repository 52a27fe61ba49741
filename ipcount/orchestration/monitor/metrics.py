"""The pipeline's metrics in Prometheus's text format (``/ipcount/metrics``; the list: docs/monitoring.md), from what
the pages read: the ledger (through delta-rs, cached per version), the broker's offsets (asked at most every few
seconds) and Airflow's runs. A scrape between two epochs reads no table. Every series has the label ``pipeline``.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from ipcount.orchestration.monitor import model
from ipcount.orchestration.monitor.data import TOTALS, PipelineTables
from ipcount.rules.requests import MAIN_TARGET

HEALTH_STATES = ("ok", "late", "idle", "failing")


class PipelineCollector(Collector):
    """One scrape's metrics of the pipeline ``monitor`` watches, as ``access`` may see them."""

    def __init__(self, monitor: Any, access: model.Access) -> None:
        self.monitor, self.access = monitor, access

    def collect(self) -> Iterator[Metric]:
        cfg = self.monitor.cfg
        pipeline = cfg.pipeline_id
        tables = PipelineTables(cfg, self.monitor.reader)
        positions, partitions = self.monitor.partitions(cfg, tables)
        health = self.monitor.health(MAIN_TARGET, self.access, (positions, partitions))

        def gauge(name: str, text: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=("pipeline", *labels))

        up = gauge("ipcount_broker_up", "1 when the broker answered the last look at the log ends")
        up.add_metric([pipeline], 0 if positions.error else 1)
        yield up
        end = gauge("ipcount_log_end_offset", "the topic's last stable offset (read_committed)", ("partition",))
        at = gauge("ipcount_chain_position", "the next offset the scheduled chain counts (the ledger)", ("partition",))
        lag = gauge("ipcount_lag_records", "offsets past the chain's position not counted yet", ("partition",))
        for row in partitions:
            labels = [pipeline, str(row["partition"])]
            if row["log_end"] is not None:
                end.add_metric(labels, row["log_end"])
                lag.add_metric(labels, row["lag"])
            if row["ledger_position"] is not None:
                at.add_metric(labels, row["ledger_position"])
        yield from (end, at, lag)

        state = gauge("ipcount_health", "1 for the health line's state (ok, late, idle, failing)", ("state",))
        for s in HEALTH_STATES:
            state.add_metric([pipeline, s], 1 if health.state == s else 0)
        yield state
        unfinished = gauge("ipcount_unfinished_epochs", "epochs planned and not committed yet")
        unfinished.add_metric([pipeline], len(health.unfinished))
        yield unfinished
        if health.last_epoch is not None and health.last_committed_at is not None:
            yield from self._last_epoch(tables, pipeline, health, gauge)
        if health.maintained_at is not None:
            maintained = gauge("ipcount_maintenance_last_run_timestamp_seconds",
                               "when the newest maintenance run finished (Unix time)")
            maintained.add_metric([pipeline], health.maintained_at.timestamp())
            yield maintained
        if cfg.publish:
            status = self.monitor.broker.publish(cfg, None)
            behind = gauge("ipcount_publish_versions_behind", "counts table versions not published to the sink topic")
            if status.get("versions_behind") is not None:
                behind.add_metric([pipeline], status["versions_behind"])
            yield behind
        yield from self._totals(tables, pipeline)

    def _last_epoch(self, tables: PipelineTables, pipeline: str, health: model.Health, gauge) -> Iterator[Metric]:
        epoch = gauge("ipcount_last_committed_epoch", "the scheduled chain's newest committed epoch")
        epoch.add_metric([pipeline], health.last_epoch)
        committed = gauge("ipcount_last_commit_timestamp_seconds", "when that epoch committed (Unix time)")
        committed.add_metric([pipeline], health.last_committed_at.timestamp())
        age = gauge("ipcount_last_commit_age_seconds", "seconds since that epoch committed")
        age.add_metric([pipeline], (datetime.now(timezone.utc) - health.last_committed_at).total_seconds())
        yield from (epoch, committed, age)
        rows = [r for r in tables.epoch_rows([health.last_epoch]) if r["status"] == "committed"]
        if rows:
            took = gauge("ipcount_epoch_duration_seconds", "how long the newest committed epoch took")
            took.add_metric([pipeline], max(r["duration_seconds"] or 0 for r in rows))
            stages = gauge("ipcount_epoch_stage_seconds", "the newest committed epoch's seconds per stage",
                           ("stage",))
            for stage, seconds in sorted(dict(rows[0].get("stage_seconds") or {}).items()):
                stages.add_metric([pipeline, stage], seconds)
            yield from (took, stages)

    def _totals(self, tables: PipelineTables, pipeline: str) -> Iterator[Metric]:
        totals = tables.record_totals()
        kinds = self.access.kinds(model.KINDS)
        for name in TOTALS:
            text = ("epochs committed" if name == "epochs" else name.replace("_", " ") + " by committed epochs")
            counter = CounterMetricFamily(f"ipcount_{name}", f"{text}, per kind of epoch", labels=("pipeline", "kind"))
            for kind in kinds:
                counter.add_metric([pipeline, kind], totals.get(kind, {}).get(name, 0))
            yield counter


def exposition(monitor: Any, access: model.Access, accept: str | None) -> tuple[bytes, str]:
    """The scrape's body and content type (OpenMetrics when the scraper asks for it)."""
    from prometheus_client.exposition import choose_encoder

    registry = CollectorRegistry(auto_describe=False)
    registry.register(PipelineCollector(monitor, access))
    encode, content_type = choose_encoder(accept or "")
    return encode(registry), content_type
