"""The epoch server: one long-lived Spark driver that runs the DAGs' Spark commands
(the client side is :mod:`ipcount.server.client`).

A spark-submit per epoch pays for a fresh JVM every time: Spark's start, then the first
Delta and Kafka operations of a cold JVM (class loading, JIT), which the benchmark measured
at most of a small epoch's cost. ``ipcount serve`` (or ``spark-submit spark_jobs/epoch_job.py
serve``) starts the session once, warms it up on a scratch table set, and then runs
``epoch``, ``backfill`` and ``rebuild`` requests through the very CLI code spark-submit runs,
one at a time.

Exactly-once never depends on it: a request is the same command with the same flags, so a
server that dies mid-epoch leaves a planned epoch that the next attempt (through the server
or spark-submit) finishes with its recorded ranges, as after any crash.

Protocol (HTTP on 127.0.0.1 by default, no authentication: keep it on a private network):

* ``GET /health`` -> ``{"status": "ok", "busy": bool, "requests": n, "pid": ..., ...}``
* ``POST /run`` with ``{"args": ["epoch", "--topic", ...]}`` -> newline-delimited JSON: a
  ``{"log": line}`` per log record as the command runs, then ``{"exit_code": n, "stdout": text}``.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import EXIT_USAGE, EpochServerError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

SERVED_COMMANDS = ("epoch", "backfill", "rebuild")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Runs one command line (``["epoch", "--topic", ...]``) and returns its exit code: the CLI's
# ``main``, handed in by the CLI's ``serve`` command (the server does not import the CLI).
CommandRunner = Callable[[Sequence[str]], int]

class _StreamLog(logging.Handler):
    """Sends the request thread's log records to the client as they happen."""

    def __init__(self, emit_line: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self.thread = threading.get_ident()
        self.emit_line = emit_line

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.emit_line(self.format(record))


class EpochServer:
    """Runs served commands in this process's Spark session, one at a time."""

    def __init__(self, run_command: CommandRunner, spark: SparkSession | None = None) -> None:
        self.run_command = run_command
        self.spark = spark
        self.lock = threading.Lock()  # epochs run one after another, like max_active_runs=1
        self.requests = 0
        self.started = time.time()
        self.warm_up_seconds: float | None = None

    def health(self) -> dict:
        return {"status": "ok", "busy": self.lock.locked(), "requests": self.requests, "pid": os.getpid(),
                "up_seconds": round(time.time() - self.started, 1), "warm_up_seconds": self.warm_up_seconds,
                "spark_master": self.spark.sparkContext.master}

    def run(self, args: list[str], emit: Callable[[str], None]) -> dict:
        """``ipcount <args>`` in this session: its log lines go to ``emit`` as they come; the
        exit code and standard output are returned."""
        if not args or args[0] not in SERVED_COMMANDS:
            return {"exit_code": EXIT_USAGE, "stdout": "",
                    "error": f"the epoch server runs {', '.join(SERVED_COMMANDS)}; got {args[:1] or 'nothing'}"}
        with self.lock:
            self.requests += 1
            handler = _StreamLog(emit)
            root = logging.getLogger()
            root.addHandler(handler)
            out, err = io.StringIO(), io.StringIO()
            try:
                # One request at a time (the lock), so redirecting the process's streams is safe.
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    code = self.run_command(args)
            except SystemExit as e:  # argparse: bad flags (its message is on stderr)
                code = e.code if isinstance(e.code, int) else EXIT_USAGE
            except Exception:  # noqa: BLE001 - report it; the next request may still succeed
                emit(traceback.format_exc())
                code = 1
            finally:
                root.removeHandler(handler)
            for line in err.getvalue().splitlines():
                emit(line)
            return {"exit_code": code, "stdout": out.getvalue()}

    def session_alive(self) -> bool:
        try:
            return self.spark.range(1).count() == 1
        except Exception:  # noqa: BLE001 - a dead JVM raises anything py4j has
            return False


def warm_up(cfg: PipelineConfig, spark: SparkSession) -> float:
    """Run one small epoch on a scratch table set (deleted after): the first Delta and Kafka
    operations of a JVM are the slow ones, and this way no DAG run pays for them. Seconds."""
    from ipcount.jobs.epoch import run_epoch

    started = time.monotonic()
    # Under the warehouse, not /tmp: on a cluster the executors write the scratch tables, and
    # the warehouse is the storage they share with the driver.
    scratch = Path(cfg.warehouse) / "_epoch_server_warm_up" / uuid.uuid4().hex
    try:
        # Reads at most 60 of the earliest offsets into tables nobody else uses.
        scratch_cfg = cfg.replace(warehouse=str(scratch), counts_table="", ledger_table="", dead_letter_table="",
                                  late_table="", start_position="earliest", max_records_per_epoch=60,
                                  commit_offsets=False)
        run_epoch(scratch_cfg, spark, run_id="epoch-server-warm-up")
    except Exception as e:  # noqa: BLE001 - a warm-up that fails only leaves the session cold
        log.warning("warm-up epoch on %s did not finish (%s); the first request pays the cold start", cfg.topic, e)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(OSError):  # another server may be warming up beside this one
            scratch.parent.rmdir()
    return time.monotonic() - started


def serve(cfg: PipelineConfig, run_command: CommandRunner, host: str, port: int, warm: bool = True,
          ready: Callable[[str], None] | None = None) -> int:
    """Listen, start the session, warm it up, then serve until interrupted (or the JVM
    dies), running each request's command line with ``run_command``."""
    from ipcount.storage.spark import get_spark

    server = EpochServer(run_command)
    # Bound first, so that a taken port fails at once; until serve_forever runs, callers'
    # health checks time out and they spark-submit instead.
    try:
        httpd = ThreadingHTTPServer((host, port), _handler_for(server))
    except OSError as e:  # the port is taken, or the address is not this machine's
        raise EpochServerError(f"epoch server cannot listen on {host}:{port}: {e}") from e
    url = f"http://{host}:{httpd.server_address[1]}"
    try:
        log.info("epoch server: starting the Spark session (master %s)", cfg.spark_master)
        server.spark = get_spark(cfg, app_name=f"{cfg.pipeline_id}-epoch-server")
        if warm:
            log.info("epoch server: warming up with a scratch epoch on %s", cfg.topic)
            server.warm_up_seconds = round(warm_up(cfg, server.spark), 3)
            log.info("epoch server: warm in %.1f s", server.warm_up_seconds)
        log.info("epoch server: listening on %s (the DAGs use it with epoch_server=%s)", url, url)
        if ready is not None:
            ready(url)
        jvm_gone = threading.Event()
        threading.Thread(target=_watch_jvm, args=(server, httpd, jvm_gone), daemon=True).start()
        httpd.serve_forever()
    finally:
        httpd.server_close()
    return 1 if jvm_gone.is_set() else 0


def _watch_jvm(server: EpochServer, httpd: ThreadingHTTPServer, gone: threading.Event, every: float = 5.0) -> None:
    """Stop serving when the driver's JVM is gone: under spark-submit the JVM is this
    process's parent, and without this a killed spark-submit would leave a server that
    answers health checks but can run nothing."""
    while True:
        time.sleep(every)
        if server.lock.locked():
            continue  # a command is running; it reports a dead JVM itself
        try:
            server.spark.sparkContext._jvm.java.lang.System.currentTimeMillis()
        except Exception as e:  # noqa: BLE001 - py4j raises whatever the broken socket gives
            log.error("epoch server: the Spark driver's JVM is gone (%s); shutting down", type(e).__name__)
            gone.set()
            httpd.shutdown()
            return


def _handler_for(server: EpochServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the run response streams until the connection closes

        def log_message(self, fmt: str, *args) -> None:
            log.debug("%s %s", self.address_string(), fmt % args)

        def _json(self, status: int, body: dict) -> None:
            data = (json.dumps(body) + "\n").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/health":
                return self._json(404, {"error": f"no such endpoint {self.path}; GET /health, POST /run"})
            self._json(200, server.health())

        def do_POST(self) -> None:
            if self.path != "/run":
                return self._json(404, {"error": f"no such endpoint {self.path}; GET /health, POST /run"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                args = body["args"]
                if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                    raise ValueError("args must be a list of strings")
            except (ValueError, KeyError, TypeError) as e:
                return self._json(400, {"error": f'expected {{"args": ["epoch", ...]}}: {e}'})
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.end_headers()
            client = {"gone": False}

            def send(item: dict) -> None:
                if client["gone"]:
                    return
                try:
                    self.wfile.write((json.dumps(item) + "\n").encode())
                    self.wfile.flush()
                except OSError:  # the client went away; the command still runs to its end
                    client["gone"] = True

            result = server.run(args, lambda line: send({"log": line}))
            send(result)
            if result["exit_code"] != 0 and not server.session_alive():
                log.error("epoch server: the Spark session is gone; shutting down")
                threading.Thread(target=self.server.shutdown, daemon=True).start()

    return Handler
