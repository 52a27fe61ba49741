"""A year of minute epochs (``bin/benchmark --only year``): real epochs timed stage by stage
on table sets as old as 10, 10,000, 100,000 and 525,600 minute epochs, maintained and not.

Running a year of epochs would take a year (a week at full speed), so each table set is
synthesized as the pipeline leaves it after ``age`` scheduled epochs, one a minute, each a
minute of event time ending an hour ago; then real epochs run on it through the product's
own code (:func:`ipcount.jobs.epoch.run_epoch`, the group commit, the idle check and the
monitor's reads), all sets side by side in one Spark session, round after round.

What is synthesized, table by table (``maintained``: as maintenance leaves it):

* ledger: a committed row per partition and epoch (each epoch owns one offset of each
  partition, ``[e-1, e)``, and its counts commit is version ``e``), in files of up to
  1 MiB as the ledger compacts itself either way, and the summary the product's ``fold``
  makes of them;
* counts: a few rows an hour, in a file per hour and finality (a new table's partitions are
  the day and finality; the epochs leave a file per epoch in the final ones, so an
  unmaintained set has fewer files than the pipeline would leave); maintained, the final
  partitions are packed by the maintenance run: an epoch reads only the windows it touches,
  so old rows do not matter to it, their files in the snapshot do;
* dead letters and late records: one row per epoch; unmaintained, a file and a transaction
  per epoch; maintained, compacted, with no transaction;
* transactions: unmaintained, every epoch's (its own, its counts version and watermark);
  maintained, only the floor under which :meth:`ipcount.storage.sink.Sink.retire` expired
  them;
* the log: one commit per epoch and table (two and a bit for the ledger), so each table's
  checkpoint is re-numbered to the version its age gives, and the commit files of the log
  retention (``log_retention_hours``) lie beside it, dated a commit apart (commit-info-only
  files of the right names and times: a load lists them, never reads them).

The maintained sets then get a real maintenance run (:func:`ipcount.storage.maintenance.maintain`).
Each set's topic holds one record per partition for each synthesized epoch (owned by the
ledger, never read), then the records the real epochs read, their event time where the
history's ends. Every set of an age reads the same records, so they must count the same.
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from ipcount.rules.config import PipelineConfig

AGES = (10, 10_000, 100_000, 525_600)
QUICK_AGES = (10, 1_000, 10_000)
MINUTE_MS = 60_000
SYNTH_BATCH = 20_000      # epochs per synthesized commit
SYNTH_FILES = 2_000       # counts files per synthesized commit
COMMITS_PER_EPOCH = {"counts": 1.0, "ledger": 2 + 1 / 16, "dead_letter": 1.0, "late": 1.0}
HOUR_ROWS = 10            # rows of each synthesized hour of counts
STAGES = ("plan", "read", "aggregate", "side_tables", "merge", "ledger", "group_commit", "run_summary", "idle_check",
          "monitor")


@dataclass(frozen=True)
class TableSet:
    """One synthesized table set: its age in epochs, maintained or not, and where."""

    age: int
    maintained: bool
    warehouse: str
    topic: str
    history_end_ms: int   # event time (and wall time) of the last synthesized epoch's end
    log_retention_hours: int = PipelineConfig.log_retention_hours

    @property
    def name(self) -> str:
        return f"{self.age}-{'on' if self.maintained else 'off'}"

    def config(self, cfg: PipelineConfig) -> PipelineConfig:
        return cfg.replace(warehouse=self.warehouse, topic=self.topic, pipeline_id=f"year_{self.age}",
                           group_id=f"{cfg.group_id}_year_{self.name}", publish=False,
                           log_retention_hours=self.log_retention_hours)

    def to_dict(self) -> dict:
        return {"age": self.age, "maintained": self.maintained, "warehouse": self.warehouse, "topic": self.topic,
                "history_end_ms": self.history_end_ms, "log_retention_hours": self.log_retention_hours}


def history_end(now_ms: int) -> int:
    """Where every set's history ends: an hour ago on the minute, so that the real epochs'
    records are not ahead of the clock."""
    return (now_ms - 3_600_000) // MINUTE_MS * MINUTE_MS


def fill_topic(cfg: PipelineConfig, per_partition: int, partitions: int) -> None:
    """The records the synthesized epochs own: ``per_partition`` small ones in each partition."""
    from kafka import KafkaProducer

    from ipcount.storage.broker import client_options, create_topic

    create_topic(cfg, partitions)
    producer = KafkaProducer(bootstrap_servers=cfg.bootstrap_servers, acks=1, linger_ms=50,
                             batch_size=1024 * 1024, **client_options(cfg))
    for _ in range(per_partition):
        for p in range(partitions):
            producer.send(cfg.topic, value=b"-", partition=p)
    producer.flush()
    producer.close()


# -- synthesis -----------------------------------------------------------------------------

def synthesize(cfg: PipelineConfig, ts: TableSet, partitions: int, say: Callable[[str], None] = print) -> dict:
    """Build ``ts``'s tables (see the module's doc); what was written, and in how long."""
    from ipcount.storage import tableset
    from ipcount.storage.ledger import Ledger
    from ipcount.storage.sink import Sink

    cfg = ts.config(cfg)
    started = time.monotonic()
    Ledger(cfg.ledger_path).ensure(cfg.log_retention_hours)
    sink = Sink(cfg)
    sink.ensure()
    tableset.claim(cfg)
    first_ms = ts.history_end_ms - ts.age * MINUTE_MS
    _ledger(cfg, ts, partitions, first_ms)
    _counts(cfg, ts, first_ms)
    for path, late in ((cfg.dead_letter_path, False), (cfg.late_path, True)):
        _side_table(cfg, ts, path, late, first_ms)
    if not ts.maintained:
        _transactions(cfg, ts)
    else:
        _floor(cfg, ts)
    now_ms = int(time.time() * 1000)
    for role, path in (("ledger", cfg.ledger_path), ("counts", cfg.counts_path),
                       ("dead_letter", cfg.dead_letter_path), ("late", cfg.late_path)):
        renumber(path, round(ts.age * COMMITS_PER_EPOCH[role]) + 1, COMMITS_PER_EPOCH[role], now_ms,
                 ts.log_retention_hours)
    out = {"synthesis_seconds": round(time.monotonic() - started, 1)}
    if ts.maintained:
        from ipcount.storage.maintenance import maintain

        t = time.monotonic()
        run = maintain(cfg, f"bench-year-{ts.name}")
        out["maintenance_seconds"] = round(time.monotonic() - t, 1)
        out["maintenance"] = [table.line() for table in run.tables]
    say(f"year: {ts.name} synthesized in {out['synthesis_seconds']} s"
        + (f", maintained in {out['maintenance_seconds']} s" if ts.maintained else ""))
    return out


def _ledger(cfg: PipelineConfig, ts: TableSet, partitions: int, first_ms: int) -> None:
    """Committed rows of epochs 1..age, then their summary (folded a batch at a time, as the
    plans fold it every few epochs) in its own commit."""
    import pyarrow as pa
    from deltalake import CommitProperties, Transaction, write_deltalake

    from ipcount.rules.ledger import COMMITTED, SCHEDULED, SUMMARY, VIEW_COLUMNS
    from ipcount.rules.ledger_summary import fold
    from ipcount.storage.delta import latest
    from ipcount.storage.ledger import LEDGER_FILE_BYTES, SUMMARY_TXN, arrow_rows, ledger_schema

    schema, summary = ledger_schema(), None
    for lo in range(1, ts.age + 1, SYNTH_BATCH):
        epochs = range(lo, min(ts.age, lo + SYNTH_BATCH - 1) + 1)
        n = len(epochs) * partitions
        epoch = [e for e in epochs for _ in range(partitions)]
        part = list(range(partitions)) * len(epochs)
        at_us = [(first_ms + e * MINUTE_MS) * 1000 for e in epoch]
        wm_after = [first_ms + e * MINUTE_MS for e in epoch]
        # Airflow's run ids of a minute schedule, which sort as time does
        run_ids = [datetime.fromtimestamp((w - MINUTE_MS) / 1000, timezone.utc).isoformat() for w in wm_after]
        run_ids = [f"scheduled__{r}" for r in run_ids]
        columns = {
            "epoch": epoch, "topic": [cfg.topic] * n, "partition": part,
            "from_offset": [e - 1 for e in epoch], "until_offset": epoch, "status": [COMMITTED] * n,
            "planned_at": [t - 2_000_000 for t in at_us], "committed_at": at_us,
            "records_read": [1] * n, "records_counted": [1] * n, "records_late": [0] * n,
            "records_malformed": [0] * n, "watermark_before_ms": [w - MINUTE_MS for w in wm_after],
            "watermark_after_ms": wm_after, "sink_version": epoch, "duration_seconds": [1.5] * n,
            "run_id": run_ids, "lag_after": [0] * n,
            "stage_seconds": [[("plan", 0.05), ("read", 1.0), ("merge", 0.2), ("ledger", 0.1)]] * n,
            "kind": [SCHEDULED] * n, "request_id": [None] * n,
            "chain_watermark_ms": [w - MINUTE_MS for w in wm_after], "planned_by": run_ids,
            "summary": [None] * n}
        batch = pa.table({f.name: pa.array(columns[f.name], f.type) for f in schema}, schema=schema)
        write_deltalake(cfg.ledger_path, batch, mode="append", target_file_size=LEDGER_FILE_BYTES)
        view = batch.select(list(VIEW_COLUMNS)).to_pylist()
        summary = fold(summary, view)
    version = latest(cfg.ledger_path).version() + 1
    row = {"epoch": ts.age, "topic": "", "partition": -1, "from_offset": -version, "until_offset": -version,
           "status": SUMMARY, "planned_at": datetime.fromtimestamp(ts.history_end_ms / 1000, timezone.utc),
           "summary": summary.to_json()}
    write_deltalake(cfg.ledger_path, arrow_rows([row]), mode="append",
                    commit_properties=CommitProperties(app_transactions=[Transaction(SUMMARY_TXN, version)]))


def _counts(cfg: PipelineConfig, ts: TableSet, first_ms: int) -> None:
    """A few rows in each hour of the history, one file per hour (and finality); final where
    the watermark at its end has passed their windows' end and lateness."""
    import pyarrow as pa

    from ipcount.rules.maintenance import COUNTS_PARTITIONS, partition_value
    from ipcount.storage.delta import arrow_schema, latest
    from ipcount.storage.sink import COUNTS_COLUMNS, COUNTS_PARTITION_BY

    window, lateness = cfg.window_ms, cfg.allowed_lateness_ms
    starts = list(range(first_ms, first_ms + ts.age * MINUTE_MS, max(1, 60 // HOUR_ROWS) * MINUTE_MS))
    schema = arrow_schema(COUNTS_COLUMNS)
    epoch = [(s - first_ms) // MINUTE_MS + 1 for s in starts]
    rows = {"window_start": [s * 1000 for s in starts], "window_end": [(s + window) * 1000 for s in starts],
            "ip": [f"10.0.{e % 256}.{e // 256 % 256}" for e in epoch], "count": [1] * len(starts),
            "first_epoch": epoch, "last_epoch": epoch,
            "is_final": [s + window + lateness <= ts.history_end_ms for s in starts],
            **{column: [partition_value(column, s) for s in starts] for column in COUNTS_PARTITIONS}}
    table = pa.table({f.name: pa.array(rows[f.name], f.type) for f in schema}, schema=schema)
    stored = [f.name for f in schema if f.name not in COUNTS_PARTITION_BY]   # (partition values live in the log)

    def iso(ms: int) -> str:
        return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")

    adds, lo = [], 0
    for n in (len(list(group)) for _, group in itertools.groupby(zip(rows["window_hour"], rows["is_final"]))):
        part = {c: str(rows[c][lo]).lower() for c in COUNTS_PARTITION_BY}   # ("true"/"false": Delta's)
        first, last = starts[lo], starts[lo + n - 1]
        stats = {"numRecords": n,
                 "minValues": {"window_start": iso(first), "window_end": iso(first + window),
                               "first_epoch": epoch[lo], "last_epoch": epoch[lo]},
                 "maxValues": {"window_start": iso(last), "window_end": iso(last + window),
                               "first_epoch": epoch[lo + n - 1], "last_epoch": epoch[lo + n - 1]},
                 "nullCount": {"window_start": 0, "window_end": 0, "ip": 0, "count": 0}}
        adds.append(_data_file(cfg.counts_path, table.slice(lo, n).select(stored), stats, part, last + MINUTE_MS))
        if len(adds) == SYNTH_FILES or lo + n == table.num_rows:
            now = latest(cfg.counts_path)
            now.create_write_transaction(adds, mode="append", schema=now.schema())
            adds = []
        lo += n


def _data_file(path: str, rows, stats: dict, partition: dict[str, str], modified_ms: int):
    """``rows`` written as a new data file of the table at ``path``, in ``partition``'s
    directory: the add action that commits it (``stats``: Delta's statistics of it)."""
    import pyarrow.parquet as pq
    from deltalake.transaction import AddAction

    name = "".join(f"{c}={v}/" for c, v in partition.items()) + f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    full = os.path.join(path, name)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    pq.write_table(rows, full, compression="snappy")
    return AddAction(name, os.path.getsize(full), partition, modified_ms, True, json.dumps(stats))


def _side_rows(cfg: PipelineConfig, epochs: range, late: bool, first_ms: int):
    import pyarrow as pa

    from ipcount.storage.delta import arrow_schema
    from ipcount.storage.sink import DEAD_LETTER_COLUMNS, LATE_COLUMNS

    schema = arrow_schema(LATE_COLUMNS if late else DEAD_LETTER_COLUMNS)
    n, at = len(epochs), [(first_ms + e * MINUTE_MS) * 1000 for e in epochs]
    rows = {"epoch": list(epochs), "topic": [cfg.topic] * n, "partition": [0] * n,
            "offset": [e - 1 for e in epochs]}
    if late:
        rows.update({"ip": ["10.9.9.9"] * n, "event_time": [t - 90_000_000 for t in at],
                     "window_start": [t - 90_000_000 for t in at], "window_end": [t - 80_000_000 for t in at],
                     "watermark": at})
    else:
        rows.update({"kafka_timestamp": at, "key": [None] * n, "value": [b"not a request"] * n,
                     "reason": ["malformed"] * n, "value_bytes": [13] * n, "value_sha256": ["0" * 64] * n})
    return pa.table({f.name: pa.array(rows[f.name], f.type) for f in schema}, schema=schema)


def _side_table(cfg: PipelineConfig, ts: TableSet, path: str, late: bool, first_ms: int) -> None:
    """A row per epoch: maintained, in compacted files; unmaintained, a file per epoch, added
    (with its epoch's transaction) a batch of epochs per commit."""
    from deltalake import CommitProperties, Transaction, write_deltalake

    from ipcount.storage.delta import latest
    from ipcount.storage.sink import Sink

    if ts.maintained:
        for lo in range(1, ts.age + 1, SYNTH_BATCH * 5):
            write_deltalake(path, _side_rows(cfg, range(lo, min(ts.age, lo + SYNTH_BATCH * 5 - 1) + 1), late,
                                             first_ms), mode="append")
        return
    sink = Sink(cfg)
    for lo in range(1, ts.age + 1, SYNTH_BATCH):
        epochs = range(lo, min(ts.age, lo + SYNTH_BATCH - 1) + 1)
        rows, adds = _side_rows(cfg, epochs, late, first_ms), []
        for i, e in enumerate(epochs):
            stats = {"numRecords": 1, "minValues": {"epoch": e, "offset": e - 1, "partition": 0},
                     "maxValues": {"epoch": e, "offset": e - 1, "partition": 0}, "nullCount": {"epoch": 0}}
            adds.append(_data_file(path, rows.slice(i, 1), stats, {}, first_ms + e * MINUTE_MS))
        latest(path).create_write_transaction(
            adds, mode="append", schema=latest(path).schema(),
            commit_properties=CommitProperties(app_transactions=[Transaction(sink.txn_app_id(e), e) for e in epochs]))


def _transactions(cfg: PipelineConfig, ts: TableSet) -> None:
    """Unmaintained: every epoch's transactions in the counts table, as its MERGEs left them."""
    from deltalake import CommitProperties, Transaction, write_deltalake

    from ipcount.storage.delta import arrow_schema
    from ipcount.storage.sink import COUNTS_COLUMNS, COUNTS_VERSION, WATERMARK, Sink

    sink, first_ms = Sink(cfg), ts.history_end_ms - ts.age * MINUTE_MS
    for lo in range(1, ts.age + 1, SYNTH_BATCH):
        txns = [Transaction(app, v) for e in range(lo, min(ts.age, lo + SYNTH_BATCH - 1) + 1)
                for app, v in ((sink.txn_app_id(e), e), (sink._fact(e, COUNTS_VERSION), e),  # noqa: SLF001
                               (sink._fact(e, WATERMARK), first_ms + e * MINUTE_MS))]  # noqa: SLF001
        write_deltalake(cfg.counts_path, arrow_schema(COUNTS_COLUMNS).empty_table(), mode="append",
                        commit_properties=CommitProperties(app_transactions=txns))


def _floor(cfg: PipelineConfig, ts: TableSet) -> None:
    """Maintained: each sink table's floor at the last epoch (retirement's one transaction)."""
    from deltalake import CommitProperties, Transaction, write_deltalake

    from ipcount.storage.delta import arrow_schema
    from ipcount.storage.sink import Sink

    sink = Sink(cfg)
    for path, columns in sink.tables():
        write_deltalake(path, arrow_schema(columns).empty_table(), mode="append",
                        commit_properties=CommitProperties(app_transactions=[Transaction(sink.floor_id, ts.age)]))


def renumber(path: str, version: int, commits_per_minute: float, now_ms: int, retention_hours: int) -> None:
    """Make the table's state, checkpointed, version ``version`` of a log that kept the last
    ``retention_hours`` of commits: the checkpoint re-numbered, a commit-info-only commit at
    ``version``, and commit-info-only files of the retained versions before it, each dated
    as ``commits_per_minute`` commits a minute give."""
    from deltalake import DeltaTable

    table = DeltaTable(path)
    table.create_checkpoint()
    was = table.version()
    if version <= was:
        return
    log_dir = Path(path) / "_delta_log"
    for entry in log_dir.iterdir():
        stem = entry.name.split(".")[0]
        if stem.isdigit() and int(stem) < was or entry.name.endswith(".crc") or (
                stem.isdigit() and int(stem) == was and entry.suffix == ".json"):
            entry.unlink()
    (log_dir / f"{was:020}.checkpoint.parquet").rename(log_dir / f"{version:020}.checkpoint.parquet")
    last = json.loads((log_dir / "_last_checkpoint").read_text())
    last["version"] = version
    last.pop("checksum", None)
    (log_dir / "_last_checkpoint").write_text(json.dumps(last))
    retained = min(version, int(retention_hours * 60 * commits_per_minute))
    seconds_apart = 60 / commits_per_minute
    for v in range(version - retained + 1, version + 1):
        at_ms = now_ms - int((version - v) * seconds_apart * 1000)
        f = log_dir / f"{v:020}.json"
        f.write_text(json.dumps({"commitInfo": {"timestamp": at_ms, "operation": "WRITE",
                                                "operationParameters": {}, "clientVersion": "ipcount-bench-year"}})
                     + "\n")
        os.utime(f, (at_ms / 1000, at_ms / 1000))


# -- the timed epochs (in the Spark job) ---------------------------------------------------

def run_rounds(spark, cfg: PipelineConfig, sets: list[TableSet], rounds: int, epochs: int, warmup: int,
               say: Callable[[str], None] = print) -> dict:
    """``warmup`` untimed epochs on every set, then ``rounds`` rounds of ``epochs`` epochs on
    each, the sets in a rotated order; every epoch timed by stage. Returns, per set, its
    epochs' stages by round and what it counted."""
    from ipcount.jobs import idle
    from ipcount.jobs.epoch import EpochRunner, run_epoch
    from ipcount.jobs.group_commit import commit_group_offsets_from_ledger
    from ipcount.orchestration.dags import epoch_summary
    from ipcount.orchestration.monitor.data import PipelineTables
    from ipcount.storage.delta import DeltaReader

    cfgs = {ts.name: ts.config(cfg) for ts in sets}
    readers = {ts.name: DeltaReader() for ts in sets}
    timed: dict[str, list[dict]] = {ts.name: [] for ts in sets}
    records = {ts.name: 0 for ts in sets}

    def one(ts: TableSet, r: int) -> dict:
        c, run_id = cfgs[ts.name], f"scheduled__{datetime.now(timezone.utc).isoformat()}"
        t = time.monotonic()
        summary = run_epoch(c, spark, run_id=run_id)
        if summary is None:
            raise RuntimeError(f"year: set {ts.name} found nothing to read in round {r}")
        total = time.monotonic() - t
        records[ts.name] += summary.records_read
        stages = dict(summary.stage_seconds)
        t = time.monotonic()
        commit_group_offsets_from_ledger(c)
        stages["group_commit"] = time.monotonic() - t
        t = time.monotonic()
        epoch_summary(c, run_id)   # the DAG run's summary task
        stages["run_summary"] = time.monotonic() - t
        t = time.monotonic()
        idle.check(c)
        stages["idle_check"] = time.monotonic() - t
        t = time.monotonic()
        monitor_reads(PipelineTables(c, readers[ts.name]))
        stages["monitor"] = time.monotonic() - t
        return {"round": r, "epoch": summary.epoch, "epoch_seconds": round(total, 4),
                "stages": {k: round(v, 4) for k, v in stages.items()}, "records": summary.records_read}

    for ts in sets:
        EpochRunner.open(cfgs[ts.name], spark)
        for _ in range(warmup):
            one(ts, 0)
        say(f"year: {ts.name}: {warmup} warm-up epoch(s) done")
    for r in range(1, rounds + 1):
        shift = (r - 1) % len(sets)
        for ts in sets[shift:] + sets[:shift]:
            for _ in range(epochs):
                timed[ts.name].append(one(ts, r))
            last = timed[ts.name][-1]
            say(f"year: round {r} {ts.name}: last epoch {last['epoch_seconds']:.3f} s "
                + ", ".join(f"{k} {v:.3f}" for k, v in last["stages"].items()))
    from ipcount_lab.bench_rounds import sum_count

    return {"epochs": timed, "records": records,
            "counted": {ts.name: sum_count(cfgs[ts.name].counts_path) for ts in sets}}


def monitor_reads(tables) -> None:
    """What the monitor's health line, first epochs page, lag page and counts page read of the
    tables (:class:`ipcount.orchestration.monitor.app.Monitor`, Airflow's run states aside)."""
    kinds = ("scheduled", "backfill")
    tables.epoch_rows([r.epoch for r in tables.unfinished()])
    tables.last_committed()
    tables.chain_positions()
    tables.last_maintenance()
    total = tables.epoch_count(kinds)
    tables.epoch_rows([r.epoch for r in tables.epoch_page(kinds, None, 0, min(50, total))])
    tables.lag_history(50)
    tables.latest_window_end()


# -- the report ----------------------------------------------------------------------------

def table_state(path: str) -> dict:
    """A table's log and files: ``_delta_log`` bytes and entries, its newest checkpoint's
    bytes and transactions, the snapshot's data files and their bytes, its version."""
    import pyarrow as pa
    from deltalake import DeltaTable

    from ipcount.storage.maintenance import _log_sizes  # noqa: PLC2701 - the maintenance log's own figures

    log_bytes, checkpoint_bytes, txns = _log_sizes(path)
    table = DeltaTable(path)
    files = pa.table(table.get_add_actions(flatten=True))
    return {"version": table.version(), "log_bytes": log_bytes,
            "log_entries": len(os.listdir(Path(path) / "_delta_log")),
            "checkpoint_bytes": checkpoint_bytes, "transactions": txns, "files": files.num_rows,
            "bytes": int(sum(files.column("size_bytes").to_pylist()))}


def summarize(result: dict, sets: list[TableSet]) -> dict:
    """Per set: each stage's median over its timed epochs, and its ratio to the youngest
    maintained set's, round by round (the ratio of the round's medians, then their median)."""
    base = next((ts.name for ts in sets if ts.maintained), sets[0].name)
    out = {}
    for ts in sets:
        mine = result["epochs"][ts.name]
        stages = {}
        for stage in (*STAGES, "epoch"):
            def values(name: str, r: int | None = None) -> list[float]:
                return [e["epoch_seconds"] if stage == "epoch" else e["stages"].get(stage, 0.0)
                        for e in result["epochs"][name] if r is None or e["round"] == r]
            ratios = []
            for r in sorted({e["round"] for e in mine}):
                a, b = values(base, r), values(ts.name, r)
                if a and b and statistics.median(a) > 0:
                    ratios.append(statistics.median(b) / statistics.median(a))
            stages[stage] = {"median": round(statistics.median(values(ts.name)), 4),
                             "ratio": round(statistics.median(ratios), 3) if ratios else None}
        out[ts.name] = {"age": ts.age, "maintained": ts.maintained, "stages": stages,
                        "epochs": len(mine), "counted": result["counted"][ts.name]}
    return out
