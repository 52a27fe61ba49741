"""Epochs on a Spark Connect server (``spark_remote``): the epoch runs in the calling process
with a remote session, planning and every Delta commit there, the Kafka read and the
aggregation on the server. A process gets either a classic or a Connect session, never both
(pyspark's Connect mode is process-wide), so the epochs here run as CLI processes, as a DAG
task would run them, and the tests' own Spark session is not used."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

from ipcount.rules.errors import EXIT_BROKER, EXIT_FAILED, EXIT_USAGE
from ipcount.rules.private_files import write_private_file
from ipcount_lab.generator import TrafficGenerator, produce
from ipcount_lab.service import listening
from tests.conftest import connect_connection, free_port
from tests.connect_sessions import clear_of_half_hour_edge, killed_task_query, session_process
from tests.ground_truth import expected_tables
from tests.tables import counts, dead_letters, epoch_ranges, late_records, ledger

BASE_MS = 1_795_255_200_000  # 2026-11-21T10:00:00Z


def ipcount(cfg, *args, env=None):
    return subprocess.run([sys.executable, "-m", "ipcount.cli", *args, *cfg.to_args()], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def test_epochs_on_a_connect_server_count_exactly_and_survive_a_crash(cfg, connect):
    cfg = cfg.replace(max_records_per_epoch=400, **connect.settings())
    gen = TrafficGenerator(seed=71, events_per_second=80, late_share=0.05, malformed_share=0.03)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(1000, BASE_MS), partition_of=lambda i, r: i % 3)
    crashed = ipcount(cfg, "epoch", env={"IPCOUNT_CRASH_AT": "after_sink"})
    assert crashed.returncode == -9, crashed.stderr[-3000:]      # its counts written, its ledger commit not
    assert {r["status"] for r in ledger(cfg)} == {"planned"}
    done = ipcount(cfg, "epoch", "--epochs", "10")
    assert done.returncode == 0, done.stderr[-3000:]
    assert {r["status"] for r in ledger(cfg)} == {"committed"} and len(epoch_ranges(cfg)) == 3
    want = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == want.counts and sum(want.counts.values()) > 900
    assert dead_letters(cfg) == want.dead and late_records(cfg) == want.late


def test_a_server_gone_mid_epoch_is_one_line_and_the_next_run_finishes_the_epoch(cfg, connect):
    """Review finding 5 of issue 59: a Connect server that died (and came back) under an
    epoch's read ended the command with pyspark's raw NO_ACTIVE_SESSION traceback."""
    cfg = cfg.replace(**connect.settings())
    gen = TrafficGenerator(seed=73, events_per_second=80, late_share=0.0, malformed_share=0.0)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(600, BASE_MS), partition_of=lambda i, r: i % 3)
    epoch = subprocess.Popen([sys.executable, "-m", "ipcount.cli", "epoch", *cfg.to_args()], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    log = []
    try:
        for line in epoch.stderr:  # stopped at its first step past the plan: the read comes next
            log.append(line)
            if "ipcount-step after_plan" in line:
                os.kill(epoch.pid, signal.SIGSTOP)
                break
        assert epoch.poll() is None, "".join(log)[-3000:]
        connect.kill()
        connect.start()
    finally:
        os.kill(epoch.pid, signal.SIGCONT)
    out, err = epoch.communicate(timeout=900)
    err = "".join(log) + err
    assert epoch.returncode == EXIT_FAILED, err[-3000:]
    assert "the Spark Connect server went away under it" in err and "the next run finishes it" in err, err[-3000:]
    assert "Traceback" not in err
    assert {r["status"] for r in ledger(cfg)} == {"planned"}
    done = ipcount(cfg, "epoch", "--epochs", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    want = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == want.counts and sum(want.counts.values()) == 600


def test_a_server_that_is_not_there_or_refuses_the_token_is_a_clear_error(cfg, connect, tmp_path):
    gone = ipcount(cfg.replace(spark_remote=f"sc://localhost:{free_port()}"), "epoch")
    assert gone.returncode == EXIT_BROKER and "no Spark Connect server answers at sc://localhost:" in gone.stderr
    wrong = write_private_file(tmp_path / "wrong-token", "not-the-token\n")
    refused = ipcount(cfg.replace(spark_remote=connect.url, spark_remote_token_file=str(wrong)), "epoch")
    assert refused.returncode == EXIT_USAGE, refused.stderr[-2000:]
    assert f"the Spark Connect server at {connect.url} refused this client's token" in refused.stderr
    assert "not-the-token" not in refused.stderr + refused.stdout
    assert "Traceback" not in refused.stderr


def test_the_compose_spark_connect_service_runs_an_epoch_and_stops_on_sigterm(cfg, tmp_path):
    """docker-compose.yml's spark-connect service, its command run here (its port, state
    directory and master moved onto this machine) with the token it gets from .env: an epoch
    with that token counts there, and a SIGTERM, as docker stops a container, stops the server."""
    import yaml

    from ipcount.rules.config import REPO_ROOT

    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    port, state, token = free_port(), tmp_path / "spark-connect", f"compose{uuid.uuid4().hex}"
    command = compose["services"]["spark-connect"]["command"][-1].replace("$$", "$")
    for here, there in (("--port 15002", f"--port {port}"), ("/tmp/spark-connect", str(state)),
                        ("--master spark://spark-master:7077", "--master 'local[2]'")):
        assert here in command, here                   # else it would run on the compose port or paths
        command = command.replace(here, there)
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])  # `python`: this venv's
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(["bash", "-c", command], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "CONNECT_TOKEN": token, "PATH": path}, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not listening(port):
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        assert (state / "token").read_text() == token    # the file the command wrote, kept
        gen = TrafficGenerator(seed=73, events_per_second=50, late_share=0.05, malformed_share=0.03)
        produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(300, BASE_MS), partition_of=lambda i, r: i % 3)
        client_token = write_private_file(tmp_path / "client-token", token + "\n")
        done = ipcount(cfg.replace(spark_remote=f"sc://localhost:{port}", spark_remote_token_file=str(client_token)),
                       "epoch")
        assert done.returncode == 0, done.stderr[-3000:]
        assert {r["status"] for r in ledger(cfg)} == {"committed"} and len(epoch_ranges(cfg)) == 1
        want = expected_tables(produced, epoch_ranges(cfg))
        assert counts(cfg) == want.counts and sum(want.counts.values()) > 250
        server.send_signal(signal.SIGTERM)                # as docker stops a container
        assert server.wait(timeout=90) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        assert not listening(port)
    finally:
        if server.poll() is None:                         # the test failed first: the command stops its JVM
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=90)
            except subprocess.TimeoutExpired:
                server.kill()


def test_a_pipelines_processes_share_one_session_and_a_stopped_one_gives_way(cfg, connect):
    """Each process of a pipeline joins the server's session of the pipeline (what one sets,
    the next sees); another pipeline has its own; once someone stops the shared session (the
    server then refuses its id), a process runs on a session of its own, also one that held
    the session when it was closed."""
    cfg = cfg.replace(**connect.settings())
    clear_of_half_hour_edge(120)
    first = session_process(cfg, set_mark="first")
    second = session_process(cfg, set_mark="second")
    assert first["mark"] is None and second == {**first, "mark": "first"}
    other = session_process(cfg.replace(pipeline_id=f"{cfg.pipeline_id}-other"))
    assert other["session_id"] != first["session_id"] and other["mark"] is None
    closed = session_process(cfg.replace(pipeline_id=f"{cfg.pipeline_id}-closed"), then="closed-under-it")
    assert closed["session_id"] not in (first["session_id"], other["session_id"])  # (one of its own, working)
    stopper = session_process(cfg, then="stop")
    assert stopper == {**first, "mark": "second"}
    after = [session_process(cfg, set_mark="after") for _ in range(2)]
    assert len({first["session_id"], after[0]["session_id"], after[1]["session_id"]}) == 3
    assert after[0]["mark"] is None and after[1]["mark"] is None


def test_a_killed_dag_tasks_query_stops_on_the_server(cfg, connect):
    """A DAG task killed mid-query: killed as Airflow kills it (SIGTERM, so the operator's
    on_kill, then SIGKILL), the server stops its query at once; SIGKILLed (no on_kill), the
    server still lets go of the query within two minutes (ABANDONED_QUERY_CONF), not 7.5.
    Watched on the server through the task's session (another client on its id)."""
    env = {**os.environ, **connect_connection(connect)}
    killed = killed_task_query("ipcount_connect", f"{cfg.pipeline_id}-terminated", "airflow", env)
    assert killed["before"].count("OPERATION_STATE_RUNNING") == 1, killed
    assert "OPERATION_STATE_RUNNING" not in killed["after"] and "OPERATION_STATE_CANCELLED" in killed["after"], killed
    assert killed["seconds"] < 4, killed                     # before Airflow's SIGKILL
    dead = killed_task_query("ipcount_connect", f"{cfg.pipeline_id}-sigkilled", "sigkill", env)
    assert dead["before"].count("OPERATION_STATE_RUNNING") == 1, dead
    assert "OPERATION_STATE_RUNNING" not in dead["after"] and "OPERATION_STATE_CANCELLED" in dead["after"], dead
    assert dead["seconds"] < 120, dead                       # 30 s stream, 60 s timeout, 10 s checks
