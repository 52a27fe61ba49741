"""A proxy in front of an S3-compatible store that loses answers: it passes a commit's PUT
on, the store stores it, and the client never hears so (the connection closes instead of
the answer). What a client then does - tries again and is told the object exists, or gives
up - is the "commit whose answer was lost" every writer of the tables has to survive.

Only PUTs of Delta commit files (``_delta_log/<version>.json``) lose answers, every
``every``-th of them (none while ``every`` is 0: a shared ``multiprocessing.Value`` lets the
process that started the proxy turn losing on and off); everything else is passed on as it is. The store behind it must not
check signatures (``EmbeddedS3(authorization=False)``): the proxy's own connection to it
carries another Host header than the one the client signed.
"""
from __future__ import annotations

import http.client
import multiprocessing
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ipcount_lab.service import free_port

COMMIT_FILE = re.compile(r"/_delta_log/\d{20}\.json(\?|$)")


def pass_on(handler: BaseHTTPRequestHandler, upstream_port: int, drop: tuple[str, ...] = ()
            ) -> tuple[int, list[tuple[str, str]], bytes]:
    """Send the request ``handler`` holds to 127.0.0.1:``upstream_port`` (without the
    headers named in ``drop``): the upstream's status, headers and body."""
    length = int(handler.headers.get("Content-Length") or 0)
    body = handler.rfile.read(length) if length else None
    headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "connection", *drop)}
    upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
    try:
        upstream.request(handler.command, handler.path, body=body, headers=headers)
        answer = upstream.getresponse()
        return answer.status, answer.getheaders(), answer.read()
    finally:
        upstream.close()


def reply(handler: BaseHTTPRequestHandler, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
    """Answer the client of ``handler`` with what :func:`pass_on` got."""
    handler.send_response(status)
    for k, v in headers:
        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
            handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: LossyProxy

    def log_message(self, *args) -> None:
        pass

    def forward(self) -> None:
        status, headers, data = pass_on(self, self.server.upstream_port)
        if self.command == "PUT" and COMMIT_FILE.search(self.path) and self.server.lose_this_answer(status):
            self.close_connection = True  # stored upstream; the client hears nothing
            return
        reply(self, status, headers, data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward


class LossyProxy(ThreadingHTTPServer):
    """Serves on 127.0.0.1:``port`` until the process ends. Run it in a process of its own
    (:func:`serve`): delta-rs calls hold the calling interpreter while they wait for it.
    ``every``: an int or a shared ``multiprocessing.Value``; ``lost``: a shared counter of the
    answers lost (``multiprocessing.Value``), or None."""

    daemon_threads = True

    def __init__(self, upstream_port: int, port: int, every=3, lost=None) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.upstream_port, self.every, self.lost = upstream_port, every, lost
        self._stored = 0
        self._lock = threading.Lock()

    def handle_error(self, request, client_address) -> None:
        """A client killed mid-request (chaos kills them) is no error of the proxy's."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def lose_this_answer(self, status: int) -> bool:
        """Whether the answer to this stored commit is lost (every ``every``-th stored one)."""
        every = self.every if isinstance(self.every, int) else self.every.value
        if status >= 300 or every <= 0:
            return False
        with self._lock:
            self._stored += 1
            if self._stored % every:
                return False
            if self.lost is not None:
                with self.lost.get_lock():
                    self.lost.value += 1
            return True


def serve(upstream_port: int, port: int, every=3, lost=None) -> None:
    """The target of the proxy's process."""
    LossyProxy(upstream_port, port, every, lost).serve_forever()


def start_proxy(upstream_port: int, every=3, lost=None, timeout: float = 60.0) -> tuple[multiprocessing.Process, int]:
    """The proxy (:func:`serve`) in a spawned process on a free port, listening: the process
    and its port. The caller kills the process when done."""
    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(target=serve, args=(upstream_port, port, every, lost),
                                                        daemon=True)
    proc.start()
    deadline = time.monotonic() + timeout   # (the spawned interpreter imports first)
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return proc, port
        except OSError:
            if not proc.is_alive() or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the lossy proxy did not listen on 127.0.0.1:{port} within {timeout:.0f} s "
                                   f"(exit code {proc.exitcode})") from None
            time.sleep(0.2)
