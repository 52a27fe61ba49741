"""The README's first command, as a newcomer runs it: `bin/run` brings up the embedded stack,
whose epoch runs new records start (its default schedule, on-data), shows a healthy pipeline
in the monitor (the docs' screenshot is this test's), and stops everything it started on
SIGTERM, mid-epoch or not. The next epoch finishes what the stop cut short; then the tables
equal a plain-Python recount of the ranges the ledger names."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from ipcount.rules.config import REPO_ROOT, PipelineConfig
from ipcount_lab.embedded_kafka import EmbeddedKafka
from ipcount_lab.generator import Produced
from ipcount_lab.service import free_port_pair, listening
from tests.airflow_services import access_token
from tests.browser import ARTIFACTS, browser_page, log_in
from tests.conftest import free_port, run_until_idle
from tests.ground_truth import expected_tables
from tests.tables import counts, dead_letters, epoch_ranges, late_records

pytestmark = pytest.mark.airflow


def _ports() -> tuple[int, int, int]:
    """Free ports for the broker (its controller on the next one), Airflow and Spark Connect."""
    return free_port_pair(), free_port(), free_port()


def _get(url: str, token: str, method: str = "GET", body: dict | None = None) -> bytes:
    request = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def _processes_under(state: Path) -> list[str]:
    """Processes whose command line or environment names ``state``: every process bin/run
    starts inherits its exports (here the config file's path, under ``state``)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and (any(str(state) in part for part in proc.cmdline())
                                            or any(str(state) in value for value in proc.environ().values())):
                found.append(f"{proc.pid} {' '.join(proc.cmdline())[:200]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _records(cfg: PipelineConfig) -> list[Produced]:
    """Every record of the source topic, read_committed."""
    consumer = KafkaConsumer(bootstrap_servers=cfg.bootstrap_servers, isolation_level="read_committed",
                             enable_auto_commit=False)
    try:
        partitions = [TopicPartition(cfg.topic, p) for p in sorted(consumer.partitions_for_topic(cfg.topic))]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        ends = consumer.end_offsets(partitions)
        out: list[Produced] = []
        while any(consumer.position(tp) < ends[tp] for tp in partitions):
            for batch in consumer.poll(timeout_ms=1000).values():
                out.extend(Produced(r.partition, r.offset, r.key, r.value, r.timestamp) for r in batch)
        return out
    finally:
        consumer.close()


def _wait_healthy(url: str, token: str, run: subprocess.Popen, log: Path, epochs: int,
                  timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    health: dict = {}
    while time.monotonic() < deadline:
        assert run.poll() is None, f"bin/run ended early ({run.returncode}):\n{log.read_text()[-4000:]}"
        try:
            health = json.loads(_get(f"{url}/ipcount/api/health", token))
        except OSError:
            health = {}
        if health.get("state") == "ok" and (health.get("last_epoch") or 0) >= epochs:
            return health
        time.sleep(2)
    raise AssertionError(f"no healthy pipeline with {epochs} epochs in {timeout} s: {health}\n"
                         f"{log.read_text()[-4000:]}")


def test_bin_run_counts_new_records_as_they_come_and_shows_a_healthy_pipeline(tmp_path, spark):
    state, log = tmp_path / "state", tmp_path / "bin-run.log"
    kafka_port, api_port, connect_port = _ports()
    # Settings from a file, both paths relative to where bin/run is typed: the file's
    # warehouse wins over the state dir's default one; the schedule is bin/run's default.
    (tmp_path / "pipeline.toml").write_text(f'warehouse = "{tmp_path / "tables"}"\n')
    # The broker bin/run starts, on the same state, once bin/run has stopped it.
    kafka = EmbeddedKafka(state_dir=state / "kafka", port=kafka_port, controller_port=kafka_port + 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IPCOUNT_", "AIRFLOW"))}
    env.update({"IPCOUNT_CONFIG": "pipeline.toml", "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port())})
    command = [str(REPO_ROOT / "bin" / "run"), "--state-dir", "state", "--port", str(api_port),
               "--kafka-port", str(kafka_port), "--connect-port", str(connect_port), "--rate", "100"]
    url = f"http://127.0.0.1:{api_port}"
    try:
        with open(log, "wb") as out:
            run = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, cwd=tmp_path, start_new_session=True)
        try:
            for _ in range(300):
                if "epochs as they commit" in log.read_text() or run.poll() is not None:
                    break
                time.sleep(1)
            text = log.read_text()
            assert "starting Kafka" in text and "schedule: on-data" in text, text[-4000:]
            assert f"Tables:      {tmp_path / 'tables'}" in text and f"Logs:        {state / 'logs'}/" in text
            token = access_token(url, state / "airflow")
            health = _wait_healthy(url, token, run, log, epochs=5)
            assert not health["failed_runs"] and not health["problems"], health

            with browser_page() as page:
                log_in(page, url, state / "airflow")
                page.goto(f"{url}/plugin/ipcount")
                frame = page.frame_locator("iframe[title='ipcount pipeline']")
                frame.locator("tr.epoch").first.wait_for(timeout=60_000)
                assert frame.locator("tr.epoch[data-status=committed]").count() >= 5
                assert "OK" in frame.locator("#health").inner_text()
                page.screenshot(path=str(ARTIFACTS / "bin-run-epochs.png"), full_page=True)
                frame.locator("nav a", has_text="Lag").click()
                frame.locator("#lag-time-chart polyline.series").first.wait_for(state="attached", timeout=30_000)
                page.screenshot(path=str(ARTIFACTS / "bin-run-lag.png"), full_page=True)

            # What a scraper reads: the last committed epoch, and a healthy state
            metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for f in text_string_to_metric_families(_get(f"{url}/ipcount/metrics", token).decode())
                       for s in f.samples}
            assert metrics[("ipcount_health", (("pipeline", "ipcount"), ("state", "ok")))] == 1
            assert metrics[("ipcount_last_committed_epoch", (("pipeline", "ipcount"),))] >= health["last_epoch"]
            # New records started runs (not only the fallback clock's run at the start)
            runs = json.loads(_get(f"{url}/api/v2/dags/ipcount_epoch/dagRuns?limit=100", token))["dag_runs"]
            assert sum(r["run_type"] == "asset_triggered" for r in runs) >= 3, [r["run_id"] for r in runs]
        finally:
            if run.poll() is None:
                os.kill(run.pid, signal.SIGTERM)     # as a supervisor stops it
            returncode = run.wait(timeout=120)
        text = log.read_text()
        assert "[run] stopped" in text, text[-4000:]
        # Everything it started is gone: the broker's, Airflow's and Spark Connect's ports are free.
        for port in (kafka_port, api_port, connect_port):
            assert not listening(port), f"port {port} still served after bin/run stopped ({returncode})"
        left = _processes_under(tmp_path)
        assert not left, f"processes of bin/run's stack outlived it: {left}"

        kafka.start()
        cfg = PipelineConfig(bootstrap_servers=f"127.0.0.1:{kafka_port}", warehouse=str(tmp_path / "tables"),
                             spark_master="local[2]")
        # An epoch the stop cut short is finished with its recorded ranges, then the rest of the log.
        run_until_idle(cfg, spark)
        ranges = epoch_ranges(cfg)
        assert len(ranges) >= 5
        expected = expected_tables(_records(cfg), ranges)
        assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead
        assert late_records(cfg) == expected.late
    finally:
        kafka.stop()


def test_bin_run_refuses_a_port_another_service_answers_on_before_starting_anything(tmp_path):
    import socket

    kafka_port, _, connect_port = _ports()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.Popen([str(REPO_ROOT / "bin" / "run"), "--port", str(port), "--state-dir", "state",
                                "--kafka-port", str(kafka_port), "--connect-port", str(connect_port)],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:     # it went on: SIGTERM stops what it started
            run.terminate()
            out, err = run.communicate(timeout=120)
    assert run.returncode == 2, out + err
    assert f"port {port} is taken" in err and "pick another with --port" in err
    assert not (tmp_path / "state").exists()     # nothing was started or made
