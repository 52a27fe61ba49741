"""The table set's manifest on Delta: read and written once with delta-rs, the engine that writes the tables.

See :mod:`ipcount.rules.tableset` for what the manifest is and why.
"""
from __future__ import annotations

import logging
import time

from ipcount.rules import tableset
from ipcount.rules.config import PipelineConfig, join_location
from ipcount.rules.errors import MissingTablesError, TableSetMismatch
from ipcount.rules.requests import MAIN_TARGET
from ipcount.storage.delta import has_table, latest, rs_concurrent_errors, subdirectory_names, table_metadata
from ipcount.storage.sink import Sink

log = logging.getLogger(__name__)


def claim(cfg: PipelineConfig, rebuild_of: str | None = None, attempts: int = 10) -> None:
    """Record ``cfg``'s manifest on a new table set, or check it against the recorded one.

    All four tables must exist. A table without a manifest (new, or made by a version that recorded none on it) gets it,
    unless it holds epoch commits of another set (:func:`ipcount.rules.tableset.check_unclaimed`); a manifest recorded
    before the side tables joined it gains their ids. Once recorded, the manifests are read and checked again: a
    concurrent run that recorded another first makes the ALTER conflict, or the check fail.

    ``rebuild_of``: a rebuild claims its target as the rebuild of the ledger with this Delta table id, which only a
    fresh target, or one recording the same, accepts.
    """
    where = tableset.locations(cfg)
    for attempt in range(1, attempts + 1):
        found = {name: table_metadata(path) for name, path in where.items()}
        wanted = tableset.manifest(cfg, {name: table_id for name, (table_id, _) in found.items()}, rebuild_of)
        # Checked before anything is recorded: a run never records its settings on one table of a set whose other tables
        # hold another run's.
        for name, (_, props) in found.items():
            if tableset.has_manifest(props):
                tableset.check(where[name], props, wanted)
        bare = [name for name, (_, props) in found.items() if not tableset.has_manifest(props)]
        with_epochs = [where[name] for name in bare if _holds_epochs(cfg, where[name])]
        ledger = where[tableset.LEDGER_ID]
        tableset.check_unclaimed(with_epochs, ledger, tableset.LEDGER_ID in bare and ledger not in with_epochs,
                                 rebuild=rebuild_of is not None)
        stale = [name for name, (_, props) in found.items() if name in bare or tableset.missing(props)]
        if not stale:
            return
        try:
            for name in stale:
                log.info("recording the table set's manifest on %s: %s", where[name],
                         ", ".join(f"{k[len(tableset.PREFIX):]}={v}" for k, v in sorted(wanted.items())))
                latest(where[name]).alter.set_table_properties(wanted, raise_if_not_exists=False)
        except rs_concurrent_errors() as e:
            log.info("manifest of %s: concurrent change (%s); reading it again (%d/%d)", cfg.counts_path,
                     type(e).__name__, attempt, attempts)
            time.sleep(0.2 * attempt)
    raise TableSetMismatch(f"could not record the manifest of {cfg.counts_path} after {attempts} attempts")


def _holds_epochs(cfg: PipelineConfig, path: str) -> bool:
    """Whether the table at ``path`` holds epoch commits: data files, or the transaction of ``cfg``'s epoch 1 or a floor
    of retired epochs (a later epoch 1 of this pipeline id would be skipped for either)."""
    table, sink = latest(path), Sink(cfg)
    return bool(table.file_uris()) or any(table.transaction_version(app) is not None
                                          for app in (sink.txn_app_id(1), sink.floor_id))


def recorded(cfg: PipelineConfig) -> dict[str, str]:
    """The manifest recorded on ``cfg``'s counts table ({} if none, or no table)."""
    if not has_table(cfg.counts_path):
        return {}
    return {k: v for k, v in table_metadata(cfg.counts_path)[1].items() if k.startswith(tableset.PREFIX)}


def replay_targets(cfg: PipelineConfig) -> list[str]:
    """``main`` and the replay table sets that exist under the warehouse."""
    root = join_location(cfg.warehouse, "replays")
    return [MAIN_TARGET, *(name for name in subdirectory_names(root) if has_table(join_location(root, name, "ledger")))]


def existing(cfg: PipelineConfig, target: str = MAIN_TARGET, command: str = "this command",
             ledger: bool = True) -> PipelineConfig:
    """``cfg.for_target(target)`` when its counts table and (``ledger``) its ledger exist; else a
    :class:`MissingTablesError` saying what is there, for a command that reads them."""
    t = cfg.for_target(target)
    missing = [path for path in (t.ledger_path if ledger else None, t.counts_path) if path and not has_table(path)]
    if not missing:
        return t
    if target != MAIN_TARGET:
        found = [name for name in replay_targets(cfg) if name != MAIN_TARGET]
        raise MissingTablesError(f"no replay table set {target!r} under {join_location(cfg.warehouse, 'replays')} "
                                 f"(replays there: {', '.join(found) or 'none'}; `ipcount rebuild --into {target}` "
                                 "makes one)")
    raise MissingTablesError(f"no table set for {command} to read: {' and '.join(missing)} "
                             f"{'does' if len(missing) == 1 else 'do'} not exist (the first epoch creates them; "
                             "check warehouse, ledger_table and counts_table)")
