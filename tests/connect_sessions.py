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


# A DAG task on Spark Connect (EpochConnectOperator) whose command is one endless query,
# with the SIGTERM handler Airflow's task runner installs.
_TASK = """
import signal, sys
from ipcount.jobs.runs import EPOCH, Run
from ipcount.orchestration.operators import EpochConnectOperator
from ipcount.rules.config import PipelineConfig

class EndlessQuery(EpochConnectOperator):
    def execute_run(self, run, spark):
        print("querying", spark.session_id, flush=True)
        spark.range(10 ** 13).where("id % 9 = 4").count()   # hours on two cores

task = EndlessQuery(task_id="run_epoch", pipeline=PipelineConfig(pipeline_id=sys.argv[2]), conn_id=sys.argv[1],
                    run_of=lambda cfg, context: Run(EPOCH, cfg))
signal.signal(signal.SIGTERM, lambda *_: task.on_kill())
task.execute({})
"""

# Starts _TASK, kills it as Airflow does (SIGTERM, SIGKILL 5 s later) or SIGKILLs it, and
# watches the task's session on the server until none of its operations is running.
_WATCH = """
import json, signal, subprocess, sys, time
from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
from pyspark.sql import SparkSession
from pyspark.sql.connect.proto import base_pb2
from ipcount.storage.spark import _with_session_id

STATE = base_pb2.GetStatusResponse.OperationStatus.OperationState
conn_id, pipeline_id, how, task_script = sys.argv[1:5]
task = subprocess.Popen([sys.executable, "-c", task_script, conn_id, pipeline_id], stdout=subprocess.PIPE, text=True)
try:
    for line in task.stdout:                              # (the task's log lines come first)
        if line.startswith("querying "):
            session_id = line.split()[1]
            break
    else:
        raise SystemExit(f"the task ended with {task.wait()} before its query")
    spark = SparkSession.builder.remote(_with_session_id(SparkConnectHook(conn_id).get_connection_url(),
                                                         session_id)).create()

    def states(ids=None):                                 # (pyspark's own call for it is private)
        statuses = spark.client._get_operation_statuses(ids).operation_statuses
        return {s.operation_id: STATE.Name(s.state) for s in statuses}

    time.sleep(3)
    before = states()
    ids = list(before)
    killed = time.monotonic()
    if how == "airflow":
        task.send_signal(signal.SIGTERM)
        try:
            task.wait(5)
        except subprocess.TimeoutExpired:
            task.kill()
    else:
        task.kill()
    task.wait()
    while "OPERATION_STATE_RUNNING" in (after := states(ids)).values() and time.monotonic() - killed < 300:
        time.sleep(0.5)
    print(json.dumps({"before": list(before.values()), "after": list(after.values()),
                      "seconds": time.monotonic() - killed}))
finally:
    task.kill()                                           # (else it would hold the test's pipes open)
"""


def killed_task_query(conn_id: str, pipeline_id: str, how: str, env: dict[str, str]) -> dict:
    """Run a DAG task's endless query on Connect, kill the task (``how``: ``"airflow"``,
    SIGTERM then SIGKILL 5 s later, or ``"sigkill"``), and report the states of its
    session's operations before and after, and the seconds from the kill until none ran
    (at most 300)."""
    proc = subprocess.run([sys.executable, "-c", _WATCH, conn_id, pipeline_id, how, _TASK], capture_output=True,
                          text=True, timeout=420, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
