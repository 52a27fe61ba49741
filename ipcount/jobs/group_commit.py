"""Step 7 of an epoch, optional: copy the ledger's committed positions to the Kafka consumer group, so that lag tools
(``kafka-consumer-groups``, Burrow, the monitor's lag page) see how far the pipeline is. For monitoring only: recovery
never reads them.

No Spark here: the DAG's ``commit_offsets`` task runs it in the Airflow worker.
"""
from __future__ import annotations

import logging

from ipcount.rules.config import PipelineConfig
from ipcount.storage import broker
from ipcount.storage.ledger import committed_positions

log = logging.getLogger(__name__)


def commit_group_offsets_from_ledger(cfg: PipelineConfig) -> bool:
    """Commit the ledger's committed positions to the consumer group (step 7, optional).

    Always the ledger's latest positions, so a commit that failed last time is caught up now. A failure only warns:
    recovery never reads these offsets.
    """
    if not cfg.commit_offsets:
        log.info("offset commits to Kafka are off (commit_offsets=false); group %s untouched", cfg.group_id)
        return False
    epoch, positions = committed_positions(cfg.ledger_path, cfg.topic)
    if not positions:
        log.info("ledger has no committed epoch yet; nothing to commit to group %s", cfg.group_id)
        return False
    try:
        broker.commit_group_offsets(cfg, positions, epoch)
    except Exception as e:  # noqa: BLE001 - monitoring only; must never fail the epoch
        log.warning("could not commit offsets to consumer group %s (monitoring only; retried after "
                    "the next epoch): %s", cfg.group_id, e)
        return False
    log.info("committed epoch %d positions to consumer group %s: %s", epoch, cfg.group_id,
             " ".join(f"p{p}={o}" for p, o in sorted(positions.items())))
    return True

