"""Real Kafka on 127.0.0.1 (KRaft, broker + controller in one JVM per node): a single node,
or a three-node cluster whose topics are replicated three times (min.insync.replicas 2).

Its jars come from Maven Central through bin/setup; a node's state (config, data, log, pid)
lives under one directory, ``.local/kafka`` by default. With :class:`SecureListeners` a
single node also serves SASL_SSL, SASL_PLAINTEXT and mutual-TLS SSL next to its PLAINTEXT
port, for trying and testing the pipeline's Kafka security settings.
"""
from __future__ import annotations

import logging
import subprocess
import time
import secrets
from dataclasses import dataclass
from pathlib import Path

from ipcount.rules.config import STATE_DIR
from ipcount_lab.errors import BrokerStartError
from ipcount.rules.kafka_security import JAAS_MODULES, SCRAM_MECHANISMS, jaas_quoted, property_value
from ipcount.rules.private_files import read_private_file, write_private_file
from ipcount_lab.dev_tls import DevTls
from ipcount_lab.service import Processes, listening

log = logging.getLogger(__name__)
KAFKA_JARS_DIR = STATE_DIR / "jars" / "kafka"
NAME = "kafka"  # the node's JVM: its pid file, and its console output as its log (log4j's is broker.log)


@dataclass(frozen=True)
class SecureListeners:
    """Ports of the broker's secured listeners and the one user they know. The SSL listener
    asks for a client certificate (mutual TLS); the SASL ones take PLAIN and both SCRAMs."""
    sasl_ssl_port: int
    sasl_plaintext_port: int
    ssl_port: int
    username: str = "ipcount"

    def ports(self) -> dict[str, int]:
        return {"SASL_SSL": self.sasl_ssl_port, "SASL_PLAINTEXT": self.sasl_plaintext_port, "SSL": self.ssl_port}


@dataclass(frozen=True)
class EmbeddedKafka:
    state_dir: Path = STATE_DIR / "kafka"
    port: int = 9092
    controller_port: int = 9093
    heap: str = "512m"
    secure: SecureListeners | None = None
    # Membership of a cluster (see EmbeddedKafkaCluster); the defaults are a cluster of one.
    node_id: int = 1
    quorum_voters: str = ""
    replication: int = 1

    @property
    def tls(self) -> DevTls:
        """The dev CA and certificates of the secured listeners."""
        return DevTls(self.state_dir / "secure")

    @property
    def password_file(self) -> Path:
        """The secured listeners' user's password (mode 0600; made on the first start unless
        written before it)."""
        return self.state_dir / "secure" / "password"

    def client_settings(self, protocol: str, mechanism: str = "SCRAM-SHA-512") -> dict[str, object]:
        """The pipeline settings (``kafka_*``, ``bootstrap_servers``) that reach this broker
        over ``protocol``: PLAINTEXT or one of the secured listeners."""
        if protocol == "PLAINTEXT":
            return {"bootstrap_servers": self.bootstrap_servers, "kafka_security_protocol": "PLAINTEXT"}
        if self.secure is None:
            raise ValueError("this broker has no secured listeners")
        settings: dict[str, object] = {"bootstrap_servers": f"127.0.0.1:{self.secure.ports()[protocol]}",
                                       "kafka_security_protocol": protocol}
        if protocol.startswith("SASL_"):
            settings.update(kafka_sasl_mechanism=mechanism, kafka_sasl_username=self.secure.username,
                            kafka_sasl_password_file=str(self.password_file))
        if protocol.endswith("SSL"):
            settings["kafka_ssl_cafile"] = str(self.tls.ca_pem)
        if protocol == "SSL":
            settings["kafka_ssl_client_pem"] = str(self.tls.client_pem)
        return settings

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "broker.log"

    @property
    def processes(self) -> Processes:
        return Processes(self.state_dir)

    def _classpath(self) -> str:
        if not any(KAFKA_JARS_DIR.glob("kafka_2.13-*.jar")):
            raise BrokerStartError(f"no Kafka jars in {KAFKA_JARS_DIR}; run bin/setup to fetch them")
        return str(KAFKA_JARS_DIR / "*")

    def _listener_lines(self) -> list[str]:
        """Listeners: PLAINTEXT (clients, between broker and itself), CONTROLLER, and the
        secured ones if asked for."""
        served = {"PLAINTEXT": self.port, **(self.secure.ports() if self.secure else {})}
        advertised = ",".join(f"{name}://127.0.0.1:{port}" for name, port in served.items())
        lines = [f"listeners={advertised},CONTROLLER://127.0.0.1:{self.controller_port}",
                 f"advertised.listeners={advertised}",
                 "listener.security.protocol.map=CONTROLLER:PLAINTEXT," + ",".join(f"{n}:{n}" for n in served)]
        if self.secure is None:
            return lines
        self.tls.ensure()
        password = self._password()
        lines += [f"sasl.enabled.mechanisms=PLAIN,{','.join(SCRAM_MECHANISMS)}",
                  "ssl.keystore.type=PEM", f"ssl.keystore.location={self.tls.broker_pem}",
                  "ssl.truststore.type=PEM", f"ssl.truststore.location={self.tls.ca_pem}",
                  "listener.name.ssl.ssl.client.auth=required"]
        for listener in ("sasl_ssl", "sasl_plaintext"):
            # PLAIN users live in the JAAS line; SCRAM users in the cluster metadata (see _add_scram_user).
            plain = f'{JAAS_MODULES["PLAIN"]} required user_{self.secure.username}={jaas_quoted(password)};'
            lines.append(f"listener.name.{listener}.plain.sasl.jaas.config={property_value(plain)}")
            lines += [f"listener.name.{listener}.{m.lower()}.sasl.jaas.config={JAAS_MODULES[m]} required;"
                      for m in SCRAM_MECHANISMS]
        return lines

    def _password(self) -> str:
        if not self.password_file.exists():
            write_private_file(self.password_file, secrets.token_urlsafe(18) + "\n", exclusive=True)
        return read_private_file(self.password_file, "the embedded broker's password file")

    def _write_config(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        props = self.state_dir / "server.properties"
        # Replicated topics and internal topics need a quorum of replicas for acks=all writes.
        min_isr = 2 if self.replication >= 3 else 1
        write_private_file(props, "\n".join([  # it may hold the PLAIN user's password
            "process.roles=broker,controller",
            f"node.id={self.node_id}",
            f"controller.quorum.voters={self.quorum_voters or f'{self.node_id}@127.0.0.1:{self.controller_port}'}",
            *self._listener_lines(),
            "inter.broker.listener.name=PLAINTEXT",
            "controller.listener.names=CONTROLLER",
            f"log.dirs={self.state_dir / 'data'}",
            "num.partitions=3",
            # Topics created without a replication factor (the pipeline's) get the node count.
            f"default.replication.factor={self.replication}",
            f"min.insync.replicas={min_isr}",
            f"offsets.topic.replication.factor={self.replication}",
            "offsets.topic.num.partitions=3",
            f"transaction.state.log.replication.factor={self.replication}",
            f"transaction.state.log.min.isr={min_isr}",
            "transaction.state.log.num.partitions=3",
            f"share.coordinator.state.topic.replication.factor={self.replication}",
            f"share.coordinator.state.topic.min.isr={min_isr}",
            "group.initial.rebalance.delay.ms=0",
            "auto.create.topics.enable=false",
            # A killed node's partitions move to another leader after this long without heartbeats.
            "broker.session.timeout.ms=6000",
            "broker.heartbeat.interval.ms=1000",
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
        """The broker's pid, while the process its pid file names runs."""
        return self.processes.pid(NAME)

    def is_listening(self) -> bool:
        return listening(self.port)

    def start(self, timeout: float = 90.0) -> None:
        """Start the broker (formatting its storage the first time) and wait until it serves."""
        if self.is_running():
            log.info("Kafka broker already running at %s (pid %s)", self.bootstrap_servers, self.pid())
            return
        self.wait_ready(self.launch(), timeout)

    def is_running(self) -> bool:
        return self.pid() is not None and self.is_listening()

    def new_cluster_id(self) -> str:
        # The last line: before the node's first config is written, log4j complains above it.
        return subprocess.run(self._java("kafka.tools.StorageTool", "random-uuid"), check=True, capture_output=True,
                              text=True).stdout.split()[-1]

    def launch(self, cluster_id: str | None = None) -> subprocess.Popen:
        """Start the broker's JVM without waiting for it (a cluster's nodes only become ready
        together, once a quorum of their controllers runs). All nodes of a cluster are
        formatted with one cluster id."""
        if self.is_listening():
            raise BrokerStartError(f"port {self.port} is taken by another process; pick another port")
        props = self._write_config()
        if not (self.state_dir / "data" / "meta.properties").exists():
            cluster_id = cluster_id or self.new_cluster_id()
            log.info("formatting KRaft storage in %s (cluster id %s)", self.state_dir / "data", cluster_id)
            subprocess.run(self._java("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props)),
                           check=True, capture_output=True, text=True)
        log.info("starting Kafka broker %d at %s (log: %s)", self.node_id, self.bootstrap_servers, self.log_file)
        return self.processes.launch(NAME, self._java("kafka.Kafka", str(props)))

    def wait_ready(self, proc: subprocess.Popen, timeout: float, brokers: int = 1) -> None:
        from kafka import KafkaAdminClient
        from kafka.errors import KafkaError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BrokerStartError(f"Kafka broker exited with code {proc.returncode}; see {self.log_file} "
                                       f"and {self.processes.log_file(NAME)}")
            if self.is_listening():
                try:
                    client = KafkaAdminClient(bootstrap_servers=self.bootstrap_servers, request_timeout_ms=5000)
                    try:
                        seen = len(client.describe_cluster()["brokers"])
                    finally:
                        client.close()
                    if seen < brokers:  # a cluster's node: ready once it sees every broker
                        time.sleep(0.5)
                        continue
                    log.info("Kafka broker ready at %s", self.bootstrap_servers)
                    if self.secure is not None:
                        self._add_scram_user()
                        self._wait_secure_ready(deadline)
                    return
                except KafkaError:
                    pass
            time.sleep(0.5)
        self.stop()
        raise BrokerStartError(f"Kafka broker not ready within {timeout:.0f}s; see {self.log_file}")

    def _add_scram_user(self) -> None:
        """Give the user SCRAM credentials (over PLAINTEXT, so the password is on no command
        line); an upsert, so it holds on every start."""
        from ipcount.rules.config import PipelineConfig
        from ipcount.storage.broker import upsert_scram_user

        try:
            upsert_scram_user(PipelineConfig(bootstrap_servers=self.bootstrap_servers), self.secure.username,
                              self._password())
        except Exception:
            self.stop()
            raise

    def _wait_secure_ready(self, deadline: float) -> None:
        """Wait until a SCRAM login over TLS works: new credentials reach the listeners through
        the metadata log, a moment after they were accepted."""
        from ipcount.rules.config import PipelineConfig
        from ipcount.rules.errors import BrokerUnavailableError
        from ipcount.storage.broker import admin_client

        cfg = PipelineConfig(**self.client_settings("SASL_SSL"), kafka_timeout_seconds=5)
        while True:
            try:
                with admin_client(cfg):
                    pass
                log.info("secured listeners ready: %s", ", ".join(f"{n} 127.0.0.1:{p}"
                                                                 for n, p in self.secure.ports().items()))
                return
            except BrokerUnavailableError as e:
                if time.monotonic() > deadline:
                    self.stop()
                    raise BrokerStartError(f"no SCRAM login on the SASL_SSL listener: {e}; see {self.log_file}") \
                        from None
                time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the broker, as a crashed machine would stop it (for failure tests), and wait
        until its ports are closed."""
        pid = self.pid()
        if pid is not None:
            log.info("killing Kafka broker %d (pid %d)", self.node_id, pid)
            self.processes.kill(NAME)

    def stop(self, timeout: float = 30.0) -> None:
        self.wait_stopped(self.terminate(), timeout)

    def terminate(self) -> dict[str, int]:
        """Ask the broker to shut down (SIGTERM) without waiting; what was signalled."""
        running = self.processes.terminate()
        if running:
            log.info("stopping Kafka broker %d (pid %d)", self.node_id, running[NAME])
        else:
            log.info("Kafka broker is not running")
        return running

    def wait_stopped(self, running: dict[str, int], timeout: float = 30.0) -> None:
        """Wait for a terminated broker to exit (every thread: its ports closed); SIGKILL it
        after ``timeout``."""
        self.processes.wait_stopped(running, timeout)

    def status(self) -> str:
        pid = self.pid()
        if pid is not None and self.is_listening():
            return f"running at {self.bootstrap_servers} (pid {pid}, state {self.state_dir})"
        return "not running"


@dataclass(frozen=True)
class EmbeddedKafkaCluster:
    """Three (or ``len(ports)``) KRaft nodes, each broker and controller, on 127.0.0.1: what
    users run, so a node can die (a partition's leader, the group's coordinator, the active
    controller) while the others serve. Topics get replication factor 3 and
    min.insync.replicas 2 by default, so acks=all writes survive one node's loss."""
    state_dir: Path = STATE_DIR / "kafka-cluster"
    ports: tuple[int, ...] = (9092, 9094, 9096)
    controller_ports: tuple[int, ...] = (9093, 9095, 9097)
    heap: str = "384m"

    @classmethod
    def from_port(cls, port: int, state_dir: Path, nodes: int = 3) -> "EmbeddedKafkaCluster":
        """Node i (from 0) serves clients on port + 2i and its controller on port + 2i + 1."""
        return cls(state_dir=state_dir, ports=tuple(port + 2 * i for i in range(nodes)),
                   controller_ports=tuple(port + 2 * i + 1 for i in range(nodes)))

    @property
    def nodes(self) -> list[EmbeddedKafka]:
        voters = ",".join(f"{i}@127.0.0.1:{c}" for i, c in enumerate(self.controller_ports, start=1))
        return [EmbeddedKafka(state_dir=self.state_dir / f"node-{i}", port=port, controller_port=controller,
                              heap=self.heap, node_id=i, quorum_voters=voters, replication=min(3, len(self.ports)))
                for i, (port, controller) in enumerate(zip(self.ports, self.controller_ports), start=1)]

    def node(self, node_id: int) -> EmbeddedKafka:
        return self.nodes[node_id - 1]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(node.bootstrap_servers for node in self.nodes)

    def start(self, timeout: float = 120.0) -> None:
        """Start the nodes that are not running (all of them, or one killed earlier) and wait
        until every node sees all brokers."""
        nodes = self.nodes
        down = [node for node in nodes if not node.is_running()]
        if not down:
            log.info("Kafka cluster already running at %s", self.bootstrap_servers)
            return
        id_file = self.state_dir / "cluster.id"
        if not id_file.exists():
            self.state_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(nodes[0].new_cluster_id())
        deadline = time.monotonic() + timeout
        try:
            procs = [(node, node.launch(id_file.read_text().strip())) for node in down]
            for node, proc in procs:
                node.wait_ready(proc, max(deadline - time.monotonic(), 1.0), brokers=len(nodes))
        except BaseException:
            self._stop(down)  # only what this call started: the nodes that ran before keep running
            raise
        log.info("Kafka cluster ready at %s (%d nodes)", self.bootstrap_servers, len(nodes))

    def stop(self) -> None:
        self._stop(self.nodes)

    @staticmethod
    def _stop(nodes: list[EmbeddedKafka]) -> None:
        # All at once: a node shutting down alone waits for a controller quorum that the
        # nodes stopped before it no longer make up.
        signalled = [(node, node.terminate()) for node in nodes]
        for node, running in signalled:
            node.wait_stopped(running)

    def status(self) -> str:
        return "\n".join(f"node {node.node_id}: {node.status()}" for node in self.nodes)

    def running_nodes(self) -> int:
        return sum(node.is_running() for node in self.nodes)
