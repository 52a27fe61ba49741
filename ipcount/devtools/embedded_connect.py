"""A Spark Connect server on 127.0.0.1, from the pinned pyspark (its ``spark-connect`` jar
and ``spark-submit``), with the Kafka and Delta jars and the settings of an epoch's own
session (:func:`ipcount.storage.spark.spark_conf`): what ``spark_remote`` points epochs at.

It listens on 127.0.0.1 only and takes only clients that send its token (a private file,
made on the first start unless written there before, as docker-compose.yml does from .env;
the server reads it from its environment, so it is on no command line). Whoever holds the
token may run anything as the server's user: keep the file as private as a key. The server
has no TLS of its own; clients on this machine use the host name ``localhost``, for which
pyspark sends the token without TLS.
"""
from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from ipcount.devtools.embedded_spark import cluster_env, spark_home
from ipcount.devtools.service import Processes, listening
from ipcount.rules.config import STATE_DIR, PipelineConfig
from ipcount.rules.errors import ServiceStartError
from ipcount.rules.private_files import read_private_file, write_private_file
from ipcount.storage.spark import spark_conf, spark_jars

log = logging.getLogger(__name__)
NAME = "connect-server"  # its process (pid file and log under the state directory)
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


class ConnectStartError(ServiceStartError):
    """The Spark Connect server did not start (the message says why, with its log's tail)."""


@dataclass(frozen=True)
class EmbeddedSparkConnect:
    state_dir: Path = STATE_DIR / "spark-connect"
    port: int = 15002
    master: str = "local[*]"
    cores: int = os.cpu_count() or 2   # spark.default.parallelism: how many tasks an epoch's read gets

    @property
    def processes(self) -> Processes:
        return Processes(self.state_dir)

    @property
    def url(self) -> str:
        """What ``spark_remote`` is set to (the token goes in ``spark_remote_token_file``)."""
        return f"sc://localhost:{self.port}"

    @property
    def token_file(self) -> Path:
        return self.state_dir / "token"

    @property
    def log_file(self) -> Path:
        return self.processes.log_file(NAME)

    def settings(self) -> dict[str, str]:
        """The pipeline settings that make epochs use this server."""
        return {"spark_remote": self.url, "spark_remote_token_file": str(self.token_file)}

    def token(self) -> str:
        """The server's token: the token file's, made once (mode 0600) if there is none."""
        if not self.token_file.exists():
            self.state_dir.mkdir(parents=True, exist_ok=True)
            write_private_file(self.token_file, secrets.token_urlsafe(32) + "\n")
        return read_private_file(self.token_file, "the Spark Connect server's token file")

    def pid(self) -> int | None:
        return self.processes.pid(NAME)

    def is_listening(self) -> bool:
        return listening(self.port)

    def start(self, timeout: float = 180.0) -> None:
        """Start the server and wait until it takes connections."""
        if self.pid() is not None and self.is_listening():
            log.info("Spark Connect server already running at %s", self.url)
            return
        self.stop()  # this state directory's server on another port, if any: one at a time
        if self.is_listening():
            raise ConnectStartError(f"port {self.port} is taken by another process; pick another port")
        conf = {**spark_conf(PipelineConfig()), "spark.connect.grpc.binding.address": "127.0.0.1",
                "spark.connect.grpc.binding.port": str(self.port), "spark.default.parallelism": str(self.cores),
                "spark.ui.enabled": "false"}
        argv = [str(spark_home() / "bin" / "spark-submit"), "--class", SERVER_CLASS, "--name", "ipcount-connect",
                "--master", self.master, "--jars", ",".join(spark_jars()),
                *(arg for key, value in conf.items() for arg in ("--conf", f"{key}={value}"))]
        env = {**os.environ, **cluster_env(), "SPARK_CONNECT_MODE": "0",  # (the server, not a client)
               "SPARK_CONNECT_AUTHENTICATE_TOKEN": self.token()}
        log.info("starting a Spark Connect server at %s (master %s, log %s)", self.url, self.master, self.log_file)
        proc = self.processes.launch(NAME, argv, env)
        self.processes.wait_ready(self.is_listening, timeout, ConnectStartError, f"the Spark Connect server at "
                                  f"{self.url}", NAME, proc)
        log.info("Spark Connect server ready at %s (token in %s)", self.url, self.token_file)

    def serve(self) -> int:
        """Run in the foreground, a container's main process, until SIGTERM or SIGINT
        (:meth:`Processes.serve`); the exit code."""
        return self.processes.serve(NAME, self.start, self.stop)

    def stop(self, timeout: float = 30.0) -> None:
        self.processes.stop(timeout)

    def kill(self) -> None:
        """SIGKILL the server (for failure tests): its sessions and running queries die with it."""
        self.processes.kill(NAME)

    def status(self) -> str:
        pid = self.pid()
        if pid is not None and self.is_listening():
            return f"Spark Connect server running at {self.url} (pid {pid}; token in {self.token_file})"
        return "Spark Connect server not running"
