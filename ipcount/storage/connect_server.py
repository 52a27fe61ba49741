"""The Spark Connect server that epochs run on (``spark_remote``): Spark's own SparkConnectServer, started with
``spark-submit`` from the pinned pyspark, with the Kafka and parse jars and the settings of an epoch's own session
(:func:`ipcount.storage.spark.spark_conf`), so an epoch counts the same on it as in a session of its own.

It takes only clients that send its token, which it reads from its environment (so the token is on no command line).
Whoever holds the token may run anything as the server's user: keep it as private as a key. The server has no TLS of its
own: it listens on 127.0.0.1 by default, and clients on the same host use the name ``localhost``, for which pyspark
sends the token without TLS.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
from typing import Mapping

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import ConfigError
from ipcount.storage.spark import spark_conf, spark_env, spark_home, spark_jars

log = logging.getLogger(__name__)
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
TOKEN_VARIABLE = "SPARK_CONNECT_AUTHENTICATE_TOKEN"


# How soon the server lets go of a query whose client died (a SIGKILLed task): when its response stream reaches its
# deadline, then after the detached timeout, checked every maintenance interval: Spark's defaults (2 min, 5 min, 30 s)
# hold the cores up to 7.5 minutes, these under 2. A client cut off for longer loses its query (the epoch is re-run).
ABANDONED_QUERY_CONF = {"spark.connect.execute.reattachable.senderMaxStreamDuration": "30s",
                        "spark.connect.execute.manager.detachedTimeout": "60s",
                        "spark.connect.execute.manager.maintenanceInterval": "10s"}


def check_bindable(bind: str, port: int) -> None:
    """The server can listen on ``bind:port``: the address is this host's and the port is free (Spark would end in a
    Java stack trace after its JVM started)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(bind.strip("[]"), port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the JVM's: TIME_WAIT is no taker
            probe.bind(address)
    except OSError as e:
        raise ConfigError(f"the Spark Connect server cannot listen on {bind}:{port} ({e.strerror or e}): pick "
                          "another --port, or a --bind address of this host") from None


def server_command(port: int, master: str, cores: int, bind: str = "127.0.0.1") -> list[str]:
    """The ``spark-submit`` command line of a server on ``bind:port`` whose sessions run on ``master`` with ``cores``
    tasks per stage by default (an epoch's read gets that many)."""
    conf = {**spark_conf(PipelineConfig()), **ABANDONED_QUERY_CONF, "spark.connect.grpc.binding.address": bind,
            "spark.connect.grpc.binding.port": str(port), "spark.default.parallelism": str(cores),
            "spark.ui.enabled": "false"}
    return [str(spark_home() / "bin" / "spark-submit"), "--class", SERVER_CLASS, "--name", "ipcount-connect",
            "--master", master, "--jars", ",".join(spark_jars()),
            *(arg for key, value in conf.items() for arg in ("--conf", f"{key}={value}"))]


def server_environment(token: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) plus what the server needs: a Spark process's environment
    (:func:`ipcount.storage.spark.spark_env`) and the token."""
    return {**(os.environ if base is None else base), **spark_env(),
            "SPARK_CONNECT_MODE": "0",  # the server, not a Connect client
            TOKEN_VARIABLE: token}


def serve(command: list[str], env: Mapping[str, str], stop_timeout: float = 60.0) -> int:
    """Run the server in the foreground, a container's main process, until it exits or this process gets SIGTERM or
    SIGINT, which stop it (SIGTERM to its process group, SIGKILL after ``stop_timeout``). The exit code: 0 when stopped
    by a signal, else the server's own."""
    signalled: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _: signalled.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    server = None
    try:
        server = subprocess.Popen(command, env=dict(env), start_new_session=True)
        while server.poll() is None and not signalled:
            try:
                server.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signalled:
        log.info("Spark Connect server stopped on %s", signal.Signals(signalled[0]).name)
        return 0
    code = server.returncode
    log.error("the Spark Connect server exited with code %s", code)
    return 128 - code if code < 0 else code or 1  # killed by signal N: 128 + N, as a shell says
