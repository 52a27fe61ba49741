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

Protocol (HTTP, on 127.0.0.1 unless told otherwise):

* ``GET /health`` -> ``{"status": "ok", "busy": bool, "requests": n, "pid": ..., ...}``
* ``POST /run`` with ``{"args": ["epoch", "--topic", ...], "limit_seconds": n}``, header
  ``Authorization: Bearer <token>`` (:mod:`ipcount.server.auth`) and ``Content-Type:
  application/json`` -> newline-delimited JSON: a ``{"log": line}`` per log record as the
  command runs, a ``{"heartbeat": t}`` every few seconds, then ``{"exit_code": n, "stdout": text}``.
  Refused before anything runs: no or a wrong token (401), a browser's request (it carries
  an ``Origin``: 403), another content type (415), a body over 256 KiB (413); and, with
  exit code 2, a command line that is not one a DAG task sends for a pipeline this server
  serves (:mod:`ipcount.server.vetting`: the server's tables, brokers and pipeline id are
  its own, a request sets only per-run flags).

No command runs for ever: one that is still running (or still waiting for the one before
it) ``limit_seconds`` after it arrived (default: the ``command_timeout_seconds`` setting's)
is cancelled, and so is one whose client goes away (a killed or timed-out Airflow task):
its Spark jobs are cancelled, or it never starts. Its epoch stays planned, and the next
attempt finishes it from the ledger.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import EXIT_FAILED, EXIT_USAGE, BadRequestError, EpochServerError
from ipcount.server import auth
from ipcount.server.client import HEARTBEAT_SECONDS
from ipcount.server.vetting import MAX_BODY_BYTES, Parse, PipelineOf, command_line

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

CLIENT_GONE = "the client that asked for it went away"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEFAULT_LIMIT_SECONDS = PipelineConfig().command_timeout_seconds  # for a request that names none
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


class Request:
    """One command's place in the server: its Spark job group, its time limit (from its
    arrival, the wait for the command before it included) and why it was cancelled."""

    def __init__(self, limit_seconds: float | None = None) -> None:
        self.job_group = f"ipcount-{uuid.uuid4().hex[:12]}"
        self.limit_seconds = limit_seconds or DEFAULT_LIMIT_SECONDS
        self.deadline = time.monotonic() + self.limit_seconds
        self.cancelled: str | None = None

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def expired(self) -> bool:
        return self.remaining() == 0.0

    def refusal(self, when: str) -> dict:
        why = self.cancelled or f"its time limit of {self.limit_seconds:.0f} s passed"
        return {"exit_code": EXIT_FAILED, "stdout": "", "error": f"not run: {why} {when}"}


class EpochServer:
    """Runs served commands in this process's Spark session, one at a time."""

    def __init__(self, run_command: CommandRunner, parse: Parse, pipelines: PipelineOf, token: str,
                 spark: SparkSession | None = None, max_limit_seconds: float = DEFAULT_LIMIT_SECONDS) -> None:
        self.run_command, self.parse, self.pipelines, self.token = run_command, parse, pipelines, token
        self.spark = spark
        self.max_limit_seconds = max_limit_seconds  # no request's limit goes beyond this
        self.lock = threading.Lock()  # epochs run one after another, like max_active_runs=1
        self.requests = 0
        self.started = time.time()
        self.warm_up_seconds: float | None = None
        self.running: Request | None = None

    def health(self) -> dict:
        return {"status": "ok", "busy": self.lock.locked(), "requests": self.requests, "pid": os.getpid(),
                "up_seconds": round(time.time() - self.started, 1), "warm_up_seconds": self.warm_up_seconds,
                "spark_master": self.spark.sparkContext.master}

    def run(self, args: list[str], emit: Callable[[str], None], request: Request | None = None) -> dict:
        """``ipcount <args>`` in this session: its log lines go to ``emit`` as they come; the
        exit code and standard output are returned. ``request`` carries the command's time
        limit and is how it is cancelled (:meth:`cancel`)."""
        request = request or Request()
        try:
            args = command_line(args, self.parse, self.pipelines)
        except BadRequestError as e:
            log.warning("epoch server: refused a request: %s", e)
            return {"exit_code": EXIT_USAGE, "stdout": "", "error": f"refused: {e}"}
        # Wait for the command before it, but not past this one's limit, nor for a client gone.
        while not self.lock.acquire(timeout=0.5):
            if request.cancelled or request.expired():
                return request.refusal("while it waited for the command before it")
        try:
            if request.cancelled or request.expired():
                return request.refusal("before it started")
            self.requests += 1
            self.running = request
            return self._run_locked(args, emit, request)
        finally:
            self.running = None
            self.lock.release()

    def _run_locked(self, args: list[str], emit: Callable[[str], None], request: Request) -> dict:
        handler = _StreamLog(emit)
        root = logging.getLogger()
        root.addHandler(handler)
        out, err = io.StringIO(), io.StringIO()
        # The command's Spark jobs are one job group: cancel() stops them (an interrupt, so a
        # task stuck in a read stops too) and the command fails with Spark's error.
        self.spark.sparkContext.setJobGroup(request.job_group, f"ipcount {' '.join(args[:1])}", True)
        timer = threading.Timer(request.remaining(), self.cancel, (request, "its time limit passed"))
        timer.daemon = True
        timer.start()
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
            timer.cancel()
            root.removeHandler(handler)
        for line in err.getvalue().splitlines():
            emit(line)
        result = {"exit_code": code, "stdout": out.getvalue()}
        if request.cancelled and code != 0:
            result["error"] = f"cancelled: {request.cancelled}"
        return result

    def cancel(self, request: Request, why: str, every: float = 0.5) -> None:
        """Stop ``request``: if it waits, it never starts; if it runs, its Spark jobs are
        cancelled - again and again until it ends, since Spark cancels only the jobs running
        at the call, and the command may be between two."""
        if request.cancelled:
            return
        request.cancelled = why
        if self.running is not request:
            return
        log.warning("epoch server: cancelling the running command: %s", why)

        def keep_cancelling() -> None:
            while self.running is request:
                with contextlib.suppress(Exception):  # a JVM going down is the watchdog's business
                    self.spark.sparkContext.cancelJobGroup(request.job_group)
                time.sleep(every)
        threading.Thread(target=keep_cancelling, daemon=True).start()

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
    # A local directory whatever the warehouse: only the driver writes tables (delta-rs).
    scratch = Path(tempfile.gettempdir()) / "ipcount_epoch_server_warm_up" / uuid.uuid4().hex
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


def serve(cfg: PipelineConfig, run_command: CommandRunner, parse: Parse, host: str, port: int, warm: bool = True,
          ready: Callable[[str], None] | None = None, pipelines_dir: str | None = None) -> int:
    """Listen, start the session, warm it up, then serve until interrupted (or the JVM
    dies), running each request's command line (vetted with ``parse``, for ``cfg``'s
    pipeline or one in ``pipelines_dir``) with ``run_command``."""
    from ipcount.server.vetting import Pipelines
    from ipcount.storage.spark import get_spark

    token_path = cfg.epoch_server_token_path
    server = EpochServer(run_command, parse, Pipelines(cfg, pipelines_dir), auth.ensure_token(token_path),
                         max_limit_seconds=cfg.command_timeout_seconds)
    log.info("epoch server: requests must carry the token in %s", token_path)
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
        try:  # also while a command runs: one waiting on a dead JVM may never return
            server.spark.sparkContext._jvm.java.lang.System.currentTimeMillis()
        except Exception as e:  # noqa: BLE001 - py4j raises whatever the broken socket gives
            log.error("epoch server: the Spark driver's JVM is gone (%s); shutting down", type(e).__name__)
            gone.set()
            httpd.shutdown()
            return


def _handler_for(server: EpochServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the run response streams until the connection closes
        timeout = 60  # seconds a socket read or write may stall (a body announced and never sent)

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

        def _refusal(self, size: int) -> tuple[int, str] | None:
            """Why a POST of ``size`` bytes is refused before its body is looked at, if it is."""
            if not 0 <= size <= MAX_BODY_BYTES:
                return 413, f"the body must have a Content-Length of at most {MAX_BODY_BYTES} bytes"
            if self.headers.get("Origin") is not None:  # browsers send it; the DAGs' tasks do not
                return 403, "requests from web pages are refused"
            if self.headers.get_content_type() != "application/json":
                return 415, "the body must be JSON (Content-Type: application/json)"
            if not auth.authorized(self.headers.get("Authorization"), server.token):
                return 401, "no or a wrong token: send Authorization: Bearer <the token in epoch_server_token_file>"
            return None

        def do_POST(self) -> None:
            if self.path != "/run":
                return self._json(404, {"error": f"no such endpoint {self.path}; GET /health, POST /run"})
            try:
                size = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                size = -1
            refused = self._refusal(size)
            if refused is not None:
                status, why = refused
                log.warning("epoch server: refused a request from %s: %s", self.address_string(), why)
                if status != 413:  # read (not used): closing on an unread body resets the connection
                    self.rfile.read(size)
                return self._json(status, {"error": why})
            try:
                body = json.loads(self.rfile.read(size) or b"{}")
                args, limit = body["args"], body.get("limit_seconds")
                if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                    raise ValueError("args must be a list of strings")
                if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                          or limit <= 0):
                    raise ValueError(f"limit_seconds must be a positive number of seconds; got {limit!r}")
            except (ValueError, KeyError, TypeError) as e:
                return self._json(400, {"error": f'expected {{"args": ["epoch", ...], "limit_seconds": n}}: {e}'})
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.end_headers()
            request = Request(min(limit or server.max_limit_seconds, server.max_limit_seconds))
            writing = threading.Lock()  # the heartbeat thread and the command both write

            def send(item: dict) -> None:
                if request.cancelled == CLIENT_GONE:
                    return
                try:
                    with writing:
                        self.wfile.write((json.dumps(item) + "\n").encode())
                        self.wfile.flush()
                except OSError:  # the task that asked is gone (killed, timed out): stop its work
                    server.cancel(request, CLIENT_GONE)

            done = threading.Event()

            def heartbeat() -> None:  # how a client that vanished is noticed while no log flows
                while not done.wait(HEARTBEAT_SECONDS):
                    send({"heartbeat": round(time.time(), 3)})
            threading.Thread(target=heartbeat, daemon=True).start()
            try:
                result = server.run(args, lambda line: send({"log": line}), request)
            finally:
                done.set()
            send(result)
            if result["exit_code"] != 0 and not server.session_alive():
                log.error("epoch server: the Spark session is gone; shutting down")
                threading.Thread(target=self.server.shutdown, daemon=True).start()

    return Handler
