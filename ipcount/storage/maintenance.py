"""Maintenance of a table set with delta-rs: compaction, the retirement of final epochs' transactions
(:meth:`ipcount.storage.sink.Sink.retire`), checkpoints, expired logs and vacuum (the rules:
:mod:`ipcount.rules.maintenance`), and the maintenance log. Safe beside running epochs: a compaction that loses to an
epoch's commit is left for the next run, checkpoints and log cleanup add no version, and a vacuum deletes only files
unreferenced for the retention and never one the publisher still reads.
"""
from __future__ import annotations

import logging
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from ipcount.rules.config import PipelineConfig, location_scheme
from ipcount.rules.ledger import PLANNED, SUMMARY
from ipcount.rules.errors import MaintenanceFailed, first_line
from ipcount.rules.maintenance import (MAINTENANCE_COLUMNS, TOMBSTONE_MARGIN_HOURS, MaintenanceRun, TableMaintenance,
                                       UNCOMMITTED_FILE_HOURS, first_open_partition, log_cleanup_due, log_properties,
                                       retirement_floor, uncommitted_files_due, vacuum_retention_hours)
from ipcount.storage import tableset as tableset_io
from ipcount.storage.delta import (arrow_schema, commit_infos, latest, open_table, query_table, retry_on_conflict,
                                   rs_concurrent_errors, rs_create_table)
from ipcount.storage.ledger import LEDGER_FILE_BYTES, Ledger
from ipcount.storage.sink import Sink, counts_partition, is_published

log = logging.getLogger(__name__)

# Marks the commits maintenance makes (commit info userMetadata).
MAINTENANCE_METADATA = "ipcount maintenance"
DELETED_FILE_RETENTION = "delta.deletedFileRetentionDuration"


def table_roles(cfg: PipelineConfig) -> tuple[tuple[str, str], ...]:
    """(role, location) of every table maintenance keeps, the maintenance log last."""
    return (("counts", cfg.counts_path), ("ledger", cfg.ledger_path), ("dead_letters", cfg.dead_letter_path),
            ("late_records", cfg.late_path), ("maintenance", cfg.maintenance_path))


def maintain(cfg: PipelineConfig, run_id: str | None = None,
             next_unpublished: Callable[[], int] | None = None,
             retention_hours: int | None = None) -> MaintenanceRun:
    """Maintain every table of ``cfg``'s set once and log it to the maintenance log. ``next_unpublished``: for a
    published counts table, its oldest unpublished version, whose commits and files are kept. ``retention_hours``
    overrides ``vacuum_retention_hours`` (0, for tests: deletes what no version references).

    Retirement needs the tables' manifest to match: a ledger of another set would retire epochs these tables have yet to
    see. A step that fails on one table is noted and the others go on; then :class:`MaintenanceFailed`."""
    retention_hours = cfg.vacuum_retention_hours if retention_hours is None else retention_hours
    run = MaintenanceRun(run_id or f"maintenance-{uuid.uuid4().hex[:12]}", datetime.now(timezone.utc))
    now_ms = int(run.started_at.timestamp() * 1000)
    sink = Sink(cfg)
    whole_set = all(open_table(path) is not None for path in (cfg.ledger_path, *sink.paths()))
    if whole_set:
        tableset_io.claim(cfg)  # (TableSetMismatch: nothing is written)
    rs_create_table(cfg.maintenance_path, arrow_schema(MAINTENANCE_COLUMNS), log_properties(cfg.log_retention_hours))
    retired: tuple[str, ...] = ()
    failed: list[str] = []
    if whole_set:
        try:
            retired = _retire(cfg, sink)  # before the checkpoints, which then leave out what it expired
        except Exception as e:  # noqa: BLE001 - noted on the tables, raised after the log
            retired = (f"retirement failed: {first_line(e)}",)
            failed.append(retired[0])
    for role, path in table_roles(cfg):
        if open_table(path) is None:
            run.tables.append(TableMaintenance(role, path, notes=("no table",)))
            continue
        notes: list[str] = list(retired) if path in sink.paths() else []
        partitions = _final_partitions(cfg) if role == "counts" else None
        if role == "counts" and partitions is None:
            notes.append("no counts partition final yet (or an unpartitioned older table): not compacted")
        retention, unsent = retention_hours, None
        if role == "counts":
            retention, unsent = _kept_for_publisher(path, retention_hours, now_ms, next_unpublished, notes)
        try:
            done = _maintain_table(role, path, partitions, retention, retention_hours + TOMBSTONE_MARGIN_HOURS,
                                   notes, unsent)
        except Exception as e:  # noqa: BLE001 - noted, the other tables go on, raised after the log
            failed.append(f"{role}: {first_line(e)}")
            done = TableMaintenance(role, path, notes=(*notes, f"failed: {first_line(e)}"))
        run.tables.append(done)
        log.info("maintenance %s: %s", run.run_id, done.line())
    run.finished_at = datetime.now(timezone.utc)
    _record(cfg, run)
    if failed:
        raise MaintenanceFailed(f"maintenance {run.run_id} failed in part (logged to {cfg.maintenance_path}): "
                                + "; ".join(failed))
    return run


def _kept_for_publisher(path: str, retention_hours: int, now_ms: int, next_unpublished: Callable[[], int] | None,
                        notes: list[str]) -> tuple[int | None, int | None]:
    """(vacuum retention in hours, None: no vacuum; the version from which the counts log keeps its commits, None: as
    its retention says) for the counts table at ``path``: what its publisher has yet to read stays."""
    if next_unpublished is None:
        # a published table, and no publisher's position to go by: keep its log
        return retention_hours, 0 if is_published(path) else None
    try:
        unsent = next_unpublished()
        retention = vacuum_retention_hours(retention_hours, now_ms, _commit_ms_from(path, unsent))
    except Exception as e:  # noqa: BLE001 - (the broker, say): what the publisher needs is unknown
        notes.append(f"not vacuumed, log kept: the publisher's position is unknown ({first_line(e)})")
        return None, 0
    if retention is not None and retention > retention_hours:
        notes.append(f"vacuum kept {retention} h of files for the publisher")
    return retention, unsent


def _retire(cfg: PipelineConfig, sink: Sink) -> tuple[str, ...]:
    """Retire the sink tables' transactions of every epoch the ledger holds as final, from the lowest floor up
    (:meth:`ipcount.storage.sink.Sink.retire`); what happened, as notes."""
    floor = min(sink.floors().values())  # (tables an interrupted run left lower catch up)
    # Only the epochs above the floor: files of older ones are skipped by their statistics.
    rows = query_table(latest(cfg.ledger_path), f"SELECT epoch, bool_or(status = '{PLANNED}') AS planned FROM t "
                                                f"WHERE epoch > {int(floor)} AND status <> '{SUMMARY}' GROUP BY epoch")
    through, blocked = retirement_floor(floor, ((r["epoch"], r["planned"]) for r in rows))
    notes = []
    if through > floor:
        reached = min(sink.retire(through).values())
        notes.append(f"transactions retired through epoch {reached}" + (
            "" if reached >= through else f" (of {through}: concurrent commits kept coming first; next run)"))
    if blocked is not None:
        notes.append(f"retirement waits for epoch {blocked} (still planned, or missing: a rebuilt ledger lacks "
                     "the epochs its source gave up)")
    return tuple(notes)


def _final_partitions(cfg: PipelineConfig) -> list[tuple[str, str, str]] | None:
    """The counts partitions compaction may pack, as a delta-rs partition filter (None: none): every final partition
    (:data:`~ipcount.storage.sink.COUNTS_PARTITION_BY`: scheduled epochs only add to them, the open day's included); in
    an older table, the hours before the first open one of the chain's watermark."""
    table = latest(cfg.counts_path)
    column = counts_partition(table)
    if column is None:
        return None
    if "is_final" in table.metadata().partition_columns:
        return [("is_final", "=", "true")]
    watermark = Ledger(cfg.ledger_path).state(cfg.topic).watermark_ms
    first_open = first_open_partition(column, watermark, cfg.window_ms, cfg.allowed_lateness_ms)
    return None if first_open is None else [(column, "<", first_open)]


def _commit_ms_from(path: str, first: int) -> int | None:
    """When the oldest of the table's versions from ``first`` on was committed (None: there is none; 0: its commit info
    is no longer in the log, so it may be as old as any)."""
    if first > latest(path).version():
        return None
    infos = commit_infos(path, first) or {}
    versions = range(first, max(infos, default=first) + 1)
    return min(int(infos[v]["timestamp"]) for v in versions) if infos and all(v in infos for v in versions) else 0


def _maintain_table(role: str, path: str, partitions, retention_hours: int | None, tombstone_hours: int,
                    notes: list[str], unsent: int | None = None) -> TableMaintenance:
    from deltalake import CommitProperties

    properties = CommitProperties(custom_metadata={"userMetadata": MAINTENANCE_METADATA})
    started = latest(path)
    before = _files(started)
    compacted = 0
    if role != "counts" or partitions is not None:
        try:
            # The ledger keeps its files small: readers skip those of old epochs by their statistics.
            target = LEDGER_FILE_BYTES if role == "ledger" else None
            metrics = latest(path).optimize.compact(partition_filters=partitions, target_size=target,
                                                    commit_properties=properties)
            compacted = int(metrics.get("numFilesRemoved", 0))
        except rs_concurrent_errors() as e:
            notes.append(f"compaction lost to a concurrent commit ({type(e).__name__}): next run")
    # A vacuum deletes only files whose tombstone the snapshot still has, and a checkpoint leaves out those older than
    # delta.deletedFileRetentionDuration (a week by default, the vacuum's own retention): keep them longer, or the
    # vacuum would never meet a file.
    wanted = {DELETED_FILE_RETENTION: f"interval {tombstone_hours} hours"}
    if latest(path).metadata().configuration.get(DELETED_FILE_RETENTION) != wanted[DELETED_FILE_RETENTION]:
        retry_on_conflict(lambda: latest(path).alter.set_table_properties(wanted, raise_if_not_exists=False),
                          f"setting {DELETED_FILE_RETENTION} of {path}")
    table = latest(path)
    table.create_checkpoint()
    if log_cleanup_due(unsent, table.version()):
        table.cleanup_metadata()  # (commits older than delta.logRetentionDuration, below its checkpoint)
    else:
        notes.append(f"log kept: the publisher has yet to send version {unsent} and after")
    vacuumed = 0
    try:
        if retention_hours is not None:
            vacuumed = len(latest(path).vacuum(retention_hours=retention_hours, dry_run=False,
                                               enforce_retention_duration=False, commit_properties=properties))
            # As of the version the publisher's position was read against: this run's own commits (and epochs' since)
            # came after it, and their removed files' tombstones are fresh.
            if uncommitted_files_due(unsent, started.version()):
                # (delta-rs's default vacuum deletes only removed files; a full one, files of no commit too)
                vacuumed += len(latest(path).vacuum(retention_hours=max(retention_hours, UNCOMMITTED_FILE_HOURS),
                                                    dry_run=False, enforce_retention_duration=False, full=True,
                                                    commit_properties=properties))
            else:
                notes.append("files of no commit kept: the publisher has yet to send a version")
    except rs_concurrent_errors() as e:
        notes.append(f"vacuum lost to a concurrent commit ({type(e).__name__}): next run")
    table = latest(path)
    files = _files(table)
    log_bytes, checkpoint_bytes, transactions = _log_sizes(path)
    return TableMaintenance(role, path, files_before=len(before), files_after=len(files),
                            bytes_after=sum(files), compacted_files=compacted, vacuumed_files=vacuumed,
                            log_bytes=log_bytes, checkpoint_bytes=checkpoint_bytes, transactions=transactions,
                            notes=tuple(notes))


def _files(table) -> list[int]:
    """The sizes of the data files of a snapshot."""
    import pyarrow as pa

    return pa.table(table.get_add_actions(flatten=True)).column("size_bytes").to_pylist()


def _log_sizes(path: str) -> tuple[int | None, int | None, int | None]:
    """(bytes of ``_delta_log``, bytes of its newest checkpoint, app transactions in it), for a table in a local
    directory; (None, None, None) on object storage, where it would take a listing of its own."""
    import pyarrow.parquet as pq

    if location_scheme(path):
        return None, None, None
    log_dir = Path(path) / "_delta_log"
    entries = [p for p in log_dir.iterdir() if p.is_file()]
    checkpoints = sorted((p for p in entries if ".checkpoint" in p.name and p.suffix == ".parquet"),
                         key=lambda p: p.name)
    if not checkpoints:
        return sum(p.stat().st_size for p in entries), 0, None
    newest = [p for p in checkpoints if p.name.split(".")[0] == checkpoints[-1].name.split(".")[0]]
    transactions = sum(pq.read_table(p, columns=["txn"]).column("txn").drop_null().length() for p in newest)
    return sum(p.stat().st_size for p in entries), sum(p.stat().st_size for p in newest), transactions


def _record(cfg: PipelineConfig, run: MaintenanceRun) -> None:
    import pyarrow as pa
    from deltalake import write_deltalake

    rows = pa.Table.from_pylist(run.rows(), schema=arrow_schema(MAINTENANCE_COLUMNS))
    write_deltalake(cfg.maintenance_path, rows, mode="append")

