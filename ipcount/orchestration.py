"""What the Airflow DAG needs from the core package: how to submit the epoch, and what to
publish after it. Kept here so the DAG file stays wiring only."""
from __future__ import annotations

import logging
import sys
from typing import Any

from ipcount.config import REPO_ROOT, PipelineConfig
from ipcount.ledger_view import committed_epochs
from ipcount.session import spark_conf, spark_jars

log = logging.getLogger(__name__)

EPOCH_APPLICATION = str(REPO_ROOT / "spark_jobs" / "epoch_job.py")


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
        "application_args": [*cfg.to_args(), "--run-id", "{{ run_id }}", "--skip-offset-commit"],
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
