"""Processes on a pipeline's Spark Connect session, for the tests of its sharing: each reports
the session's id and a mark a process may leave in the session's settings."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from ipcount.storage.spark import SHARED_SESSION_SECONDS

MARK = "ipcount.test.mark"

_PROCESS = f"""
import json, sys
from ipcount.rules.config import PipelineConfig
from ipcount.storage.spark import remote_session
spark = remote_session(PipelineConfig(**json.loads(sys.argv[1])))
mark = spark.conf.get("{MARK}", None)
if sys.argv[2]:
    spark.conf.set("{MARK}", sys.argv[2])
if sys.argv[3] == "closed-under-it":  # as another process's stop would: this one's client is not told
    spark.client.release_session()
    spark = remote_session(PipelineConfig(**json.loads(sys.argv[1])))
rows = spark.range(7).count()
print(json.dumps({{"session_id": spark.session_id, "mark": mark, "rows": rows}}))
if sys.argv[3] == "stop":
    spark.stop()
"""


def session_process(cfg, set_mark: str = "", then: str = "") -> dict:
    """A process on ``cfg``'s Connect session (:func:`ipcount.storage.spark.remote_session`):
    its id, the mark it found (None if none), after it set ``set_mark``. ``then="stop"``: it
    then stops the session; ``"closed-under-it"``: the server closes it before the process
    asks for its session again and counts (the id reported is the second session's)."""
    settings = {k: getattr(cfg, k) for k in ("spark_remote", "spark_remote_token_file", "pipeline_id")}
    proc = subprocess.run([sys.executable, "-c", _PROCESS, json.dumps(settings), set_mark, then],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["rows"] == 7
    return report


def clear_of_half_hour_edge(seconds: float) -> None:
    """Wait, if need be, until the shared session's half hour has ``seconds`` left: the
    processes of a test must all ask for the same id."""
    left = SHARED_SESSION_SECONDS - time.time() % SHARED_SESSION_SECONDS
    if left < seconds:
        time.sleep(left + 1)
