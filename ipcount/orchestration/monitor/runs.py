"""Airflow's own view of the pipeline's DAG runs, read from its metadata database. Only for code running inside
Airflow's api-server or scheduler (the plugin and the listener)."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from ipcount.orchestration.dags import BACKFILL_DAG_ID, EPOCH_DAG_ID
from ipcount.rules.requests import MAIN_TARGET

PIPELINE_DAGS = (EPOCH_DAG_ID, BACKFILL_DAG_ID)


def _value(state: Any) -> str | None:
    return None if state is None else str(getattr(state, "value", state))


def run_states(run_ids: Iterable[str]) -> dict[str, tuple[str, str]]:
    """run_id -> (dag_id, state) for the pipeline DAGs' runs among ``run_ids``."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    ids = sorted({r for r in run_ids if r})
    if not ids:
        return {}
    with create_session() as session:
        rows = session.execute(select(DagRun.run_id, DagRun.dag_id, DagRun.state)
                               .where(DagRun.dag_id.in_(PIPELINE_DAGS), DagRun.run_id.in_(ids))).all()
    return {run_id: (dag_id, _value(state)) for run_id, dag_id, state in rows}


def failed_since_success(dag_id: str = EPOCH_DAG_ID, look_back: int = 50) -> list[str]:
    """Run ids of the DAG's runs that failed after its last successful run, newest first."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(select(DagRun.run_id, DagRun.state).where(DagRun.dag_id == dag_id)
                               .order_by(DagRun.run_after.desc(), DagRun.id.desc()).limit(look_back)).all()
    failed = []
    for run_id, state in rows:
        state = _value(state)
        if state == "success":
            break
        if state == "failed":
            failed.append(run_id)
    return failed


def run_target(dag_id: str, run_id: str) -> str | None:
    """The target the run counted into (:func:`target_of`); None if Airflow has no such run of the pipeline's DAGs."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    if dag_id not in PIPELINE_DAGS:
        return None
    with create_session() as session:
        row = session.execute(select(DagRun.conf).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)).first()
    return None if row is None else target_of(dag_id, row[0] or {})


def target_of(dag_id: str, conf: Mapping[str, Any]) -> str:
    """A pipeline DAG run's target: ``main``, unless a backfill run's conf names a replay table set."""
    return str(conf.get("target") or MAIN_TARGET) if dag_id == BACKFILL_DAG_ID else MAIN_TARGET
