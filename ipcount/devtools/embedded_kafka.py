"""A real single-node Kafka broker (KRaft, broker + controller in one JVM) on 127.0.0.1.

Its jars come from Maven Central through bin/setup; its state (config, data, log, pid)
lives under one directory, ``.local/kafka`` by default.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ipcount.rules.config import STATE_DIR
from ipcount.rules.errors import BrokerStartError

log = logging.getLogger(__name__)
KAFKA_JARS_DIR = STATE_DIR / "jars" / "kafka"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for local services)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...);
    None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _is_zombie(pid: int) -> bool:
    """An exited child not yet reaped still answers kill(pid, 0); reap it and say so."""
    stat = proc_stat(pid)
    if stat is None or stat[0] != "Z":
        return False
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return True


@dataclass(frozen=True)
class EmbeddedKafka:
    state_dir: Path = STATE_DIR / "kafka"
    port: int = 9092
    controller_port: int = 9093
    heap: str = "512m"

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "broker.log"

    @property
    def _pid_file(self) -> Path:
        return self.state_dir / "broker.pid"

    def _classpath(self) -> str:
        if not any(KAFKA_JARS_DIR.glob("kafka_2.13-*.jar")):
            raise BrokerStartError(f"no Kafka jars in {KAFKA_JARS_DIR}; run bin/setup to fetch them")
        return str(KAFKA_JARS_DIR / "*")

    def _write_config(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        props = self.state_dir / "server.properties"
        props.write_text("\n".join([
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
            f"listeners=PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
            "inter.broker.listener.name=PLAINTEXT",
            "controller.listener.names=CONTROLLER",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            f"log.dirs={self.state_dir / 'data'}",
            "num.partitions=3",
            # One broker: internal topics cannot have the default replication of 3.
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=3",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "transaction.state.log.num.partitions=3",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            "group.initial.rebalance.delay.ms=0",
            "auto.create.topics.enable=false",
            "",
        ]))
        (self.state_dir / "log4j2.properties").write_text("\n".join([
            "rootLogger.level=INFO",
            "rootLogger.appenderRef.file.ref=FILE",
            "appender.file.type=File",
            "appender.file.name=FILE",
            f"appender.file.fileName={self.log_file}",
            "appender.file.layout.type=PatternLayout",
            "appender.file.layout.pattern=[%d] %p %m (%c)%n",
            "logger.kafka.name=kafka", "logger.kafka.level=INFO",
            "logger.state.name=state.change.logger", "logger.state.level=WARN",
            "",
        ]))
        return props

    def _java(self, *args: str) -> list[str]:
        return ["java", f"-Xmx{self.heap}", f"-Xms{self.heap}", "-XX:+UseG1GC", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.state_dir / 'log4j2.properties'}",
                "-cp", self._classpath(), *args]

    def pid(self) -> int | None:
        """The broker's pid, if its pid file names a live broker of this state directory (a
        stale file after a reboot may name some other process by now)."""
        try:
            pid = int(self._pid_file.read_text())
            os.kill(pid, 0)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        if _is_zombie(pid) or b"kafka.Kafka" not in cmdline or \
                str(self.state_dir / "server.properties").encode() not in cmdline:
            return None
        return pid

    def is_listening(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def start(self, timeout: float = 90.0) -> None:
        """Start the broker (formatting its storage the first time) and wait until it serves."""
        if self.pid() is not None and self.is_listening():
            log.info("Kafka broker already running at %s (pid %s)", self.bootstrap_servers, self.pid())
            return
        if self.is_listening():
            raise BrokerStartError(f"port {self.port} is taken by another process; pick another port")
        props = self._write_config()
        if not (self.state_dir / "data" / "meta.properties").exists():
            cluster_id = subprocess.run(self._java("kafka.tools.StorageTool", "random-uuid"),
                                        check=True, capture_output=True, text=True).stdout.strip()
            log.info("formatting KRaft storage in %s (cluster id %s)", self.state_dir / "data", cluster_id)
            subprocess.run(self._java("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props)),
                           check=True, capture_output=True, text=True)
        log.info("starting Kafka broker at %s (log: %s)", self.bootstrap_servers, self.log_file)
        with open(self.state_dir / "broker.out", "ab") as out:
            proc = subprocess.Popen(self._java("kafka.Kafka", str(props)), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self._pid_file.write_text(str(proc.pid))
        self._wait_ready(proc, timeout)

    def _wait_ready(self, proc: subprocess.Popen, timeout: float) -> None:
        from kafka import KafkaAdminClient
        from kafka.errors import KafkaError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BrokerStartError(f"Kafka broker exited with code {proc.returncode}; see {self.log_file} "
                                       f"and {self.state_dir / 'broker.out'}")
            if self.is_listening():
                try:
                    client = KafkaAdminClient(bootstrap_servers=self.bootstrap_servers, request_timeout_ms=5000)
                    client.describe_cluster()
                    client.close()
                    log.info("Kafka broker ready at %s", self.bootstrap_servers)
                    return
                except KafkaError:
                    pass
            time.sleep(0.5)
        self.stop()
        raise BrokerStartError(f"Kafka broker not ready within {timeout:.0f}s; see {self.log_file}")

    def stop(self, timeout: float = 30.0) -> None:
        pid = self.pid()
        if pid is None:
            log.info("Kafka broker is not running")
            return
        log.info("stopping Kafka broker (pid %d)", pid)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.pid() is not None:
            time.sleep(0.3)
        if self.pid() is not None:
            os.kill(pid, signal.SIGKILL)
        self._pid_file.unlink(missing_ok=True)

    def status(self) -> str:
        pid = self.pid()
        if pid is not None and self.is_listening():
            return f"running at {self.bootstrap_servers} (pid {pid}, state {self.state_dir})"
        return "not running"
