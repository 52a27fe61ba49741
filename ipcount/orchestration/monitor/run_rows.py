"""The ledger rows one DAG run wrote, printed as JSON: what the run-note listener
(:mod:`.notes`) reads in a child process of the scheduler. Not in a thread: delta-rs holds
Python's GIL through some calls (its table check on object storage waits out every retry,
minutes), which would stall every thread of the scheduler; a child can be killed, too.
Imports neither Airflow nor Spark, so it starts in well under a second.

    python -m ipcount.orchestration.monitor.run_rows TARGET RUN_ID
"""
from __future__ import annotations

import json
import sys

from ipcount.rules.config import PipelineConfig
from ipcount.storage.delta import read_rows


def main(target: str, run_id: str) -> None:
    cfg = PipelineConfig.load().for_target(target)
    rows = read_rows(cfg.ledger_path, filters=[("run_id", "=", run_id), ("topic", "=", cfg.topic)])
    json.dump(rows, sys.stdout, default=str)   # (times as text: the note does not show them)


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except Exception as e:  # one line for the listener's log
        sys.exit(f"{type(e).__name__}: {' '.join(str(e).split())}")
