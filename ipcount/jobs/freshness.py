"""Is the chain keeping up? The epoch DAG's ``check_freshness`` task: the lag past the
chain (the broker's read_committed log ends against the ledger's positions) and the age of
the chain's last commit, judged by :func:`ipcount.rules.alerts.breaches`. Read with
delta-rs and kafka-python: no JVM."""
from __future__ import annotations

from datetime import datetime, timezone

from ipcount.rules.alerts import breaches
from ipcount.rules.config import PipelineConfig
from ipcount.rules.ledger import COMMITTED, Folded, newest_chain_epoch
from ipcount.rules.ledger_summary import committed_chain
from ipcount.storage import broker
from ipcount.storage.delta import open_table, query_table, sql_literal
from ipcount.storage.ledger import Ledger


def lag_and_age(cfg: PipelineConfig) -> tuple[dict[int, int], float | None]:
    """(partition -> offsets past the chain, seconds since its last commit or None)."""
    table = open_table(cfg.ledger_path)
    view = Ledger(cfg.ledger_path).view(table)
    _, positions, _ = committed_chain(view.summary, cfg.topic, view.tail)
    earliest, latest = broker.partition_offsets(cfg)
    lag = {p: end - positions.get(p, earliest[p]) for p, end in latest.items()}
    folded = view.summary.folded(cfg.topic) if view.summary is not None else Folded()
    newest = newest_chain_epoch((r for r in view.tail if r["topic"] == cfg.topic), folded)
    if newest is None:
        return lag, None
    rows = query_table(table, f"SELECT max(committed_at) AS at FROM t WHERE topic = {sql_literal(cfg.topic)} "
                              f"AND epoch = {int(newest[0])} AND status = {sql_literal(COMMITTED)}")
    at = rows[0]["at"] if rows else None
    return lag, None if at is None else (datetime.now(timezone.utc) - at).total_seconds()


def check(cfg: PipelineConfig) -> list[str]:
    """What is over the alert thresholds now ([] when all is well, or alerts are off)."""
    lag, age = lag_and_age(cfg)
    return breaches(lag, age, cfg.alert_lag_records, cfg.alert_stale_seconds)
