"""A listener (registered by the monitoring plugin) that writes each pipeline DAG run's
epoch summary into the run's note, where the Airflow UI shows it on the run's page.

Airflow calls it in the scheduler when a run succeeds or fails; the run's own tasks cannot
set notes (the Task SDK has no call for it). It never overwrites a note someone wrote, and
a failure here is logged, never raised: the run's state is what matters.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from airflow.listeners import hookimpl

from ipcount.orchestration.monitor.links import run_page_path
from ipcount.orchestration.monitor.model import epoch_rows
from ipcount.orchestration.monitor.runs import PIPELINE_DAGS, target_of
from ipcount.rules.config import PipelineConfig
from ipcount.rules.ledger import COMMITTED
from ipcount.rules.requests import MAIN_TARGET
from ipcount.storage.delta import read_rows

log = logging.getLogger(__name__)
NOTE_LIMIT = 1000  # Airflow's dag_run_note.content


def run_note(dag_id: str, run_id: str, rows: Iterable[Mapping[str, Any]], target: str = MAIN_TARGET) -> str:
    """Markdown for the run's note from the ledger rows its epochs wrote (pure)."""
    epochs = sorted(epoch_rows(rows, {}), key=lambda e: e.epoch)
    where = "" if target == MAIN_TARGET else f" into target `{target}`"
    header = f"Epochs of this run{where} ([epoch page]({run_page_path(dag_id, run_id)})):\n"
    lines = []
    for e in epochs:
        spans = " ".join(f"p{p} [{f}, {u})" for p, (f, u) in sorted(e.ranges.items()))  # as the epochs page
        if e.status == COMMITTED:
            lines.append(f"- **epoch {e.epoch}** ({e.kind}) committed: {spans}; read {e.records_read}, counted "
                         f"{e.records_counted}, late {e.records_late}, malformed {e.records_malformed}"
                         + (f"; counts v{e.sink_version}" if e.sink_version is not None else ""))
        else:
            lines.append(f"- **epoch {e.epoch}** unfinished: {spans} - the next run on its lane resumes exactly "
                         "these ranges")
    if not lines:
        return header + "\nNo epoch: nothing new to count (or the run failed before planning one)."
    text, budget = header, NOTE_LIMIT - 40  # room for the "more" line
    for i, line in enumerate(lines):
        if len(text) + len(line) + 1 > budget:
            return text + f"\n- ... and {len(lines) - i} more epoch(s)"
        text += "\n" + line
    return text


def _annotate(dag_run) -> None:
    if dag_run.dag_id not in PIPELINE_DAGS:
        return
    try:
        # The ledger is read before the run's session is touched: in the scheduler that
        # session holds SQLite's write lock from its first flush until its commit.
        text = _note_text(dag_run.dag_id, dag_run.run_id, dag_run.conf or {})
        from sqlalchemy.orm import object_session

        session = object_session(dag_run)
        if session is not None:  # the scheduler's: the note commits with the run's new state
            with session.no_autoflush:
                if not dag_run.note:  # never overwrite what somebody wrote
                    dag_run.note = text
            return
        # `airflow dags test` hands over a detached run: write through a session of our own.
        from airflow.models.dagrun import DagRun
        from airflow.utils.session import create_session

        with create_session() as own:
            run = own.get(DagRun, dag_run.id)
            if run is not None and not run.note:
                run.note = text
    except Exception:
        log.exception("could not write the epoch note of run %s", dag_run.run_id)


def _note_text(dag_id: str, run_id: str, conf: Mapping[str, Any]) -> str:
    target = target_of(dag_id, conf)
    cfg = PipelineConfig.load().for_target(target)
    rows = read_rows(cfg.ledger_path, filters=[("run_id", "=", run_id), ("topic", "=", cfg.topic)])
    return run_note(dag_id, run_id, rows, target)


@hookimpl
def on_dag_run_success(dag_run, msg: str) -> None:
    _annotate(dag_run)


@hookimpl
def on_dag_run_failed(dag_run, msg: str) -> None:
    _annotate(dag_run)
