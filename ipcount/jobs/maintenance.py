"""The maintenance command: every table of a set compacted, checkpointed and vacuumed
(:mod:`ipcount.storage.maintenance`), with the publisher's position read from the sink topic so that a vacuum keeps what
publishing still reads."""
from __future__ import annotations

import logging

from ipcount.rules.config import PipelineConfig
from ipcount.rules.maintenance import MaintenanceRun
from ipcount.storage.maintenance import maintain
from ipcount.storage.publisher import committed_cursor
from ipcount.storage.sink import is_published

log = logging.getLogger(__name__)


def run_maintenance(cfg: PipelineConfig, run_id: str | None = None) -> MaintenanceRun:
    """Maintain ``cfg``'s table set once (see :func:`ipcount.storage.maintenance.maintain`)."""
    # A counts table published once keeps its log for the publisher, publish on here or not.
    published = cfg.publish or is_published(cfg.counts_path)
    run = maintain(cfg, run_id, next_unpublished=(lambda: next_unpublished_version(cfg)) if published else None)
    log.info("maintenance %s done in %.1f s", run.run_id, (run.finished_at - run.started_at).total_seconds())
    return run


def next_unpublished_version(cfg: PipelineConfig) -> int:
    """The oldest counts version the publisher has not sent (0 if it never published: it may read every version)."""
    cursor = committed_cursor(cfg, cfg.publish_topic)
    return 0 if cursor is None else cursor.next_version
