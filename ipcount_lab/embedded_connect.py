"""The product's Spark Connect server (:mod:`ipcount.storage.connect_server`) on 127.0.0.1,
in the background, for the lab: bin/run, the tests, chaos and the benchmark point epochs at
it with ``spark_remote``. Its token is a private file, made on the first start unless
written there before.
"""
from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from ipcount.rules.config import STATE_DIR
from ipcount_lab.errors import ServiceStartError
from ipcount.rules.private_files import read_private_file, write_private_file
from ipcount.storage.connect_server import server_command, server_environment
from ipcount_lab.embedded_spark import cluster_env
from ipcount_lab.service import Processes, listening

log = logging.getLogger(__name__)
NAME = "connect-server"  # its process (pid file and log under the state directory)


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
        argv = server_command(self.port, self.master, self.cores)
        env = server_environment(self.token(), {**os.environ, **cluster_env()})
        log.info("starting a Spark Connect server at %s (master %s, log %s)", self.url, self.master, self.log_file)
        proc = self.processes.launch(NAME, argv, env)
        self.processes.wait_ready(self.is_listening, timeout, ConnectStartError, f"the Spark Connect server at "
                                  f"{self.url}", NAME, proc)
        log.info("Spark Connect server ready at %s (token in %s)", self.url, self.token_file)

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
