"""The table set's manifest on Delta: read and written once with delta-rs, the engine that
writes the tables.

See :mod:`ipcount.rules.tableset` for what the manifest is and why.
"""
from __future__ import annotations

import logging
import time

from ipcount.rules import tableset
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import TableSetMismatch
from ipcount.storage.delta import has_table, rs_concurrent_errors, table_metadata

log = logging.getLogger(__name__)


def claim(cfg: PipelineConfig, attempts: int = 10) -> None:
    """Record ``cfg``'s manifest on a new table set, or check it against the recorded one.

    Both tables must exist. A table without a manifest (new, or made by a version without
    manifests) gets it; if a concurrent run recorded another first, the ALTER conflicts,
    and the loop reads again and checks against the winner's.
    """
    from deltalake import DeltaTable

    for attempt in range(1, attempts + 1):
        (ledger_id, ledger_props), (counts_id, counts_props) = (table_metadata(cfg.ledger_path),
                                                                table_metadata(cfg.counts_path))
        wanted = tableset.manifest(cfg, ledger_id, counts_id)
        bare = []
        # Checked before anything is recorded: a run never records its settings on one table
        # of a set whose other table holds another run's.
        for path, props in ((cfg.counts_path, counts_props), (cfg.ledger_path, ledger_props)):
            if tableset.has_manifest(props):
                tableset.check(path, props, wanted)
            else:
                bare.append(path)
        if not bare:
            return
        try:
            for path in bare:
                log.info("recording the table set's manifest on %s: %s", path,
                         ", ".join(f"{k[len(tableset.PREFIX):]}={v}" for k, v in sorted(wanted.items())))
                DeltaTable(path).alter.set_table_properties(wanted, raise_if_not_exists=False)
        except rs_concurrent_errors() as e:
            log.info("manifest of %s: concurrent change (%s); reading it again (%d/%d)", cfg.counts_path,
                     type(e).__name__, attempt, attempts)
            time.sleep(0.2 * attempt)
    raise TableSetMismatch(f"could not record the manifest of {cfg.counts_path} after {attempts} attempts")


def recorded(cfg: PipelineConfig) -> dict[str, str]:
    """The manifest recorded on ``cfg``'s counts table ({} if none, or no table)."""
    if not has_table(cfg.counts_path):
        return {}
    return {k: v for k, v in table_metadata(cfg.counts_path)[1].items() if k.startswith(tableset.PREFIX)}
