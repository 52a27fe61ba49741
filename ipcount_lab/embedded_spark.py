"""A real Spark standalone cluster on 127.0.0.1: one master and N workers, started from the
pinned pyspark's own ``spark-class`` (the wheel has no ``sbin/start-*`` scripts). For the
cluster tests, and for trying the pipeline against a cluster: point ``spark_master`` at
:attr:`EmbeddedSparkCluster.master_url`.

The master's web UI serves its state as JSON (``/json``), which tells when every worker has
registered.
"""
from __future__ import annotations

import json
import logging
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ipcount.rules.config import STATE_DIR
from ipcount.storage.spark import spark_env, spark_home
from ipcount_lab.service import Processes

log = logging.getLogger(__name__)


class ClusterStartError(RuntimeError):
    """The cluster did not come up (the message says why, with a log's tail)."""


def cluster_env() -> dict[str, str]:
    """What every process of the cluster, and a driver that uses it, needs: this machine's
    loopback address, and this interpreter for Python on the executors."""
    return {**spark_env(), "SPARK_LOCAL_IP": "127.0.0.1"}


@dataclass(frozen=True)
class EmbeddedSparkCluster:
    state_dir: Path = STATE_DIR / "spark-cluster"
    port: int = 7077
    webui_port: int = 8082   # not 8080: Airflow's API server's default
    workers: int = 2
    worker_cores: int = 1
    worker_memory: str = "1g"

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    @property
    def webui_url(self) -> str:
        return f"http://127.0.0.1:{self.webui_port}"

    @property
    def processes(self) -> Processes:
        return Processes(self.state_dir)

    def _start(self, name: str, *args: str) -> None:
        env = {**os.environ, **cluster_env(), "SPARK_WORKER_DIR": str(self.state_dir / "work")}
        self.processes.launch(name, [str(spark_home() / "bin" / "spark-class"), *args], env)

    def alive_workers(self) -> int:
        """Workers registered with the master and alive (0 if the master does not answer)."""
        try:
            with urllib.request.urlopen(self.webui_url + "/json", timeout=2) as answer:
                state = json.load(answer)
        except (OSError, ValueError):
            return 0
        return sum(w.get("state") == "ALIVE" for w in state.get("workers", []))

    def start(self, timeout: float = 120.0) -> None:
        """Start the master and the workers and wait until every worker has registered."""
        if self.processes.pids() and self.alive_workers() >= self.workers:
            log.info("Spark cluster already running at %s", self.master_url)
            return
        log.info("starting a Spark standalone cluster at %s: %d worker(s) of %d core(s), %s", self.master_url,
                 self.workers, self.worker_cores, self.worker_memory)
        self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", str(self.webui_port))
        for i in range(self.workers):
            self._start(f"worker-{i}", "org.apache.spark.deploy.worker.Worker", self.master_url,
                        "--host", "127.0.0.1", "--cores", str(self.worker_cores), "--memory", self.worker_memory,
                        "--webui-port", "0")
        self.processes.wait_ready(lambda: self.alive_workers() >= self.workers, timeout, ClusterStartError,
                                  f"the Spark master at {self.master_url} with {self.workers} registered worker(s)",
                                  "master")
        log.info("Spark cluster ready: %s (UI %s)", self.master_url, self.webui_url)

    def stop(self, timeout: float = 20.0) -> None:
        self.processes.stop(timeout)
