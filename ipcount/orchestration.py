"""What the Airflow DAG needs from the core package: how to submit the epoch, and what to
publish after it. Kept here so the DAG file stays wiring only."""
from __future__ import annotations

import logging
import sys
from typing import Any

from ipcount.config import (DATA_LOSS_POLICIES, EVENT_TIME_SOURCES, REPO_ROOT, RESET_POLICIES, SETTINGS_HELP,
                            START_POSITIONS, PipelineConfig)
from ipcount.ledger_view import committed_epochs
from ipcount.session import spark_conf, spark_jars

log = logging.getLogger(__name__)

EPOCH_APPLICATION = str(REPO_ROOT / "spark_jobs" / "epoch_job.py")


# Settings a DAG run may override from the trigger form or `airflow dags trigger --conf`:
# name -> (JSON schema, title). The pipeline's topic and tables are not among them: they
# define the pipeline, and an epoch must chain with the ones before it.
RUN_PARAMS: dict[str, tuple[dict[str, Any], str]] = {
    "max_records_per_epoch": ({"type": "integer", "minimum": 1}, "Max records in this epoch"),
    "start_position": ({"type": "string", "enum": list(START_POSITIONS)},
                       "Start position (only while the ledger is empty)"),
    "start_timestamp_ms": ({"type": "integer", "minimum": -1}, "Start timestamp, epoch ms (start_position timestamp)"),
    "start_offsets": ({"type": "string", "pattern": r"^\s*(\d+\s*:\s*\d+\s*(,\s*\d+\s*:\s*\d+\s*)*)?$"},
                      "Start offsets 'partition:offset,...' (start_position specific)"),
    "group_offsets_reset": ({"type": "string", "enum": list(RESET_POLICIES)},
                            "Reset for partitions without group offsets (start_position group-offsets)"),
    "on_data_loss": ({"type": "string", "enum": list(DATA_LOSS_POLICIES)}, "On offsets deleted before counted"),
    "commit_offsets": ({"type": "boolean"}, "Commit offsets to the consumer group"),
    "event_time": ({"type": "string", "enum": list(EVENT_TIME_SOURCES)}, "Event time source"),
    "window_seconds": ({"type": "integer", "minimum": 1}, "Window size (s)"),
    "allowed_lateness_seconds": ({"type": "integer", "minimum": 0}, "Allowed lateness (s)"),
    "max_value_bytes": ({"type": "integer", "minimum": 1}, "Max record value size (bytes)"),
}


def dag_params(cfg: PipelineConfig) -> dict[str, Any]:
    """Airflow Params for :data:`RUN_PARAMS`, defaulting to the pipeline's configuration."""
    from airflow.sdk import Param

    return {name: Param(getattr(cfg, name), title=title, description=SETTINGS_HELP.get(name, ""), **schema)
            for name, (schema, title) in RUN_PARAMS.items()}


def run_config(cfg: PipelineConfig, params: dict[str, Any] | None) -> PipelineConfig:
    """The pipeline's configuration with this run's Param values applied."""
    overrides = {k: v for k, v in (params or {}).items() if k in RUN_PARAMS}
    return cfg.replace(**overrides) if overrides else cfg


def _param_args() -> list[str]:
    """CLI flags rendered from the run's Params (they follow, and so override, the base flags)."""
    args: list[str] = []
    for name, (schema, _) in RUN_PARAMS.items():
        flag = "--" + name.replace("_", "-")
        if schema["type"] == "boolean":
            args.append(f"{{{{ '{flag}' if params.{name} else '--no-{flag[2:]}' }}}}")
        else:
            args.append(f"{flag}={{{{ params.{name} }}}}")
    return args


def spark_submit_kwargs(cfg: PipelineConfig) -> dict[str, Any]:
    """Arguments of SparkSubmitOperator for one epoch. The master comes from the
    ``spark_default`` connection; ``{{ run_id }}`` is rendered by Airflow."""
    return {
        "application": EPOCH_APPLICATION,
        "conn_id": "spark_default",
        "name": f"{cfg.pipeline_id}-epoch",
        "jars": ",".join(spark_jars()),
        "conf": spark_conf(cfg),
        # The DAG commits offsets to the consumer group in a task of its own.
        "application_args": [*cfg.to_args(), *_param_args(), "--run-id", "{{ run_id }}",
                             "--skip-offset-commit"],
        # The driver must run the interpreter that has the pinned pyspark and this package.
        "env_vars": {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable},
    }


def epoch_summary(cfg: PipelineConfig, run_id: str) -> dict[str, Any]:
    """The epoch(s) this DAG run committed, as logged, returned to XCom and put in the
    counts Asset event's extra."""
    epochs = committed_epochs(cfg.ledger_path, run_id=run_id)
    for e in epochs:
        log.info("%s", e.line())
    return {
        "run_id": run_id,
        "topic": cfg.topic,
        "counts_table": cfg.counts_path,
        "epochs": [e.to_dict() for e in epochs],
        "records_counted": sum(e.records_counted for e in epochs),
    }
