"""The ledger rows one DAG run wrote, printed as JSON with the id of the backfill request it counts: what the run-note
listener (:mod:`.notes`) reads in a child process of the scheduler. Not in a thread: delta-rs holds Python's GIL
through some calls (its table check on object storage waits out every retry, minutes), which would stall every thread
of the scheduler; a child can be killed, too. Imports neither Airflow nor Spark, so it starts in well under a second.

    python -m ipcount.orchestration.monitor.run_rows TARGET RUN_ID [REQUEST_JSON]
"""
from __future__ import annotations

import json
import sys

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import BadRequestError
from ipcount.rules.requests import request_from_fields
from ipcount.storage.delta import read_rows


def main(target: str, run_id: str, request: str = "") -> None:
    cfg = PipelineConfig.load().for_target(target)
    rows = read_rows(cfg.ledger_path, filters=[("run_id", "=", run_id), ("topic", "=", cfg.topic)])
    json.dump({"rows": rows, "request_id": request_id(request, cfg.topic)}, sys.stdout,
              default=str)   # (times as text: the note does not show them)


def request_id(fields: str, topic: str) -> str | None:
    """The id of the backfill request whose fields (JSON) the run was given; None for a run of the chain or a request
    it refused (then it counted nothing)."""
    if not fields:
        return None
    try:
        return request_from_fields(fields, topic).request_id
    except BadRequestError:
        return None


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except Exception as e:  # one line for the listener's log
        sys.exit(f"{type(e).__name__}: {' '.join(str(e).split())}")
