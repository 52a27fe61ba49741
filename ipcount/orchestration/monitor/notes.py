"""A listener (registered by the monitoring plugin) that writes each pipeline DAG run's epochs into the run's note,
shown on the run's page (the run's tasks cannot set notes, and a failed run's may never get to). Airflow calls it in
the scheduler's loop, so the hook only queues the run for one background thread, which reads the run's ledger rows in
a child process (:mod:`.run_rows`, killed after :data:`READ_TIMEOUT_SECONDS`: a slow store must not stall every DAG)
and writes the note through a session of its own. A note someone wrote is never overwritten; a failure is logged,
never raised: the run's state is what matters.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from airflow.listeners import hookimpl

from ipcount.orchestration.dags import BACKFILL_DAG_ID
from ipcount.orchestration.monitor.links import run_page_path
from ipcount.orchestration.monitor.model import EpochRow, epoch_rows
from ipcount.orchestration.monitor.runs import PIPELINE_DAGS, target_of
from ipcount.rules.ledger import BACKFILL, COMMITTED
from ipcount.rules.requests import MAIN_TARGET, REQUEST_FIELDS

log = logging.getLogger(__name__)
NOTE_LIMIT = 1000         # Airflow's dag_run_note.content
PENDING_LIMIT = 100       # runs waiting for their note; beyond that (a ledger down for long) runs get none
READ_TIMEOUT_SECONDS = 60  # then the child reading a run's ledger rows is killed, and the run gets no note
EXIT_WAIT_SECONDS = 60    # how long a process that ends (e.g. `airflow dags test`) waits for its notes


def run_note(dag_id: str, run_id: str, rows: Iterable[Mapping[str, Any]], target: str = MAIN_TARGET,
             request_id: str | None = None) -> str:
    """Markdown for the run's note from the ledger rows that carry its run id (pure). A commit writes the committing
    run's id, so these include epochs the run finished for another run (``planned_by`` differs; None: a run without a
    run id, or a ledger from before the column) or for another backfill request than ``request_id`` (None for the
    chain's runs): those are listed apart, after the run's own."""
    rows = list(rows)
    planners = {r["epoch"]: r.get("planned_by", run_id) for r in rows}
    own, others = [], []
    for e in sorted(epoch_rows(rows, {}), key=lambda e: e.epoch):
        planner = planners[e.epoch]
        for_other_request = e.kind == BACKFILL and request_id is not None and e.request_id != request_id
        if planner == run_id and not for_other_request:
            own.append(_epoch_line(e))
            continue
        whose = f"{e.kind} for request `{e.request_id}`" if e.kind == BACKFILL else e.kind
        if planner != run_id:
            whose += f", planned by run `{planner}`" if planner else ", planned by a run without a run id"
        others.append(_epoch_line(e, whose))
    where = "" if target == MAIN_TARGET else f" into target `{target}`"
    header = f"Epochs of this run{where} ([epoch page]({run_page_path(dag_id, run_id)})):\n"
    if not own and not others:
        return header + "\nNo epoch: nothing new to count (or the run failed before planning one)."
    lines = own or ["None of its own."]
    if others:
        lines += ["\nEpochs it finished for another run or request:\n", *others]
    text, budget = header, NOTE_LIMIT - 40  # room for the "more" line
    for i, line in enumerate(lines):
        if len(text) + len(line) + 1 > budget:
            return text + f"\n- ... and {sum(x.startswith('- ') for x in lines[i:])} more epoch(s)"
        text += "\n" + line
    return text


def _epoch_line(e: EpochRow, whose: str | None = None) -> str:
    """``whose``: for an epoch not the run's own, whose it is."""
    spans = " ".join(f"p{p} [{f}, {u})" for p, (f, u) in sorted(e.ranges.items()))  # as the epochs page
    if e.status == COMMITTED:
        return (f"- **epoch {e.epoch}** ({whose or e.kind}) committed: {spans}; read {e.records_read}, counted "
                f"{e.records_counted}, late {e.records_late}, malformed {e.records_malformed}"
                + (f"; counts v{e.sink_version}" if e.sink_version is not None else ""))
    return (f"- **epoch {e.epoch}**{f' ({whose})' if whose else ''} unfinished: {spans} - the next run on its lane "
            "resumes exactly these ranges")


@dataclass(frozen=True)
class _Run:
    id: int
    dag_id: str
    run_id: str
    target: str
    request: str  # the backfill request the run counts, as JSON of its fields ("": a run of the chain)

    @classmethod
    def of(cls, dag_run) -> _Run:
        """The run, with the request its epoch task hands the CLI: the backfill DAG's form, or the data interval of an
        `airflow backfill create` run of the epoch DAG."""
        conf = dag_run.conf or {}
        if dag_run.dag_id == BACKFILL_DAG_ID:
            fields = {k: conf.get(k) for k in REQUEST_FIELDS}
        elif getattr(dag_run.run_type, "value", dag_run.run_type) == "backfill":
            fields = {"from_time": dag_run.data_interval_start.isoformat(),
                      "until_time": dag_run.data_interval_end.isoformat()}
        else:
            fields = None
        return cls(dag_run.id, dag_run.dag_id, dag_run.run_id, target_of(dag_run.dag_id, conf),
                   json.dumps(fields) if fields else "")


_pending: queue.Queue[_Run] = queue.Queue(PENDING_LIMIT)
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


def _annotate(dag_run) -> None:
    global _worker
    if dag_run.dag_id not in PIPELINE_DAGS:
        return
    try:
        _pending.put_nowait(_Run.of(dag_run))
    except queue.Full:
        log.warning("%d runs wait for their epoch note (is the ledger's store slow?): run %s gets none",
                    PENDING_LIMIT, dag_run.run_id)
        return
    with _worker_lock:
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_write_notes, name="ipcount-run-notes", daemon=True)
            _worker.start()


def _write_notes() -> None:
    while True:
        run = _pending.get()
        try:
            _write_note(run)
        except Exception:
            log.exception("could not write the epoch note of run %s", run.run_id)
        finally:
            _pending.task_done()


def _note(run: _Run) -> str | None:
    """The run's note, or None (logged) if its ledger rows were not read."""
    try:
        read = subprocess.run([sys.executable, "-m", "ipcount.orchestration.monitor.run_rows", run.target, run.run_id,
                               run.request], capture_output=True, text=True, timeout=READ_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        log.warning("no epoch note for run %s: its ledger rows were not read within %d s", run.run_id,
                    READ_TIMEOUT_SECONDS)
        return None
    if read.returncode != 0:
        log.warning("no epoch note for run %s: reading its ledger rows failed: %s", run.run_id,
                    (read.stderr.strip().splitlines() or ["(no message)"])[-1])
        return None
    found = json.loads(read.stdout)
    return run_note(run.dag_id, run.run_id, found["rows"], run.target, found["request_id"])


def _write_note(run: _Run) -> None:
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    text = _note(run)
    if text is None:
        return
    with create_session() as session:
        row = session.get(DagRun, run.id)
        if row is not None and not row.note:  # never overwrite what somebody wrote
            row.note = text


def wait_idle(timeout: float) -> bool:
    """Whether every run queued got its note written (or its failure logged) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while _pending.unfinished_tasks:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@atexit.register
def _finish() -> None:
    if not wait_idle(EXIT_WAIT_SECONDS):
        log.warning("exiting with %d epoch note(s) unwritten", _pending.unfinished_tasks)


def _forget_after_fork() -> None:
    """A forked child (Airflow forks its task and file processors) has no worker thread: it must neither wait for the
    parent's queued runs at exit nor share the queue's lock."""
    global _pending, _worker, _worker_lock
    _pending, _worker, _worker_lock = queue.Queue(PENDING_LIMIT), None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


@hookimpl
def on_dag_run_success(dag_run, msg: str) -> None:
    _annotate(dag_run)


@hookimpl
def on_dag_run_failed(dag_run, msg: str) -> None:
    _annotate(dag_run)
