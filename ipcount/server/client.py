"""The epoch server's client: is a server there, run a command in it, wait for one to start.
The operator of the DAGs' Spark tasks, the benchmark and the tests use it; it needs
neither Spark nor the server's code.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

from ipcount.rules.errors import EpochServerError


def health(url: str, timeout: float = 3.0) -> dict | None:
    """The server's health, or None when nothing answers at ``url``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def wait_until_ready(url: str, proc, log_path, timeout: float = 300.0) -> dict:
    """Poll a server that ``proc`` (a :class:`subprocess.Popen`) is starting until it
    answers; its health. Raises :class:`EpochServerError` (with the end of its log) if the
    process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while (state := health(url, timeout=1.0)) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited with {proc.returncode}" if proc.poll() is not None else f"did not answer in {timeout:.0f} s"
            tail = Path(log_path).read_text(errors="replace")[-3000:]
            raise EpochServerError(f"the epoch server at {url} {why}; the end of {log_path}:\n{tail}")
        time.sleep(0.5)
    return state


# The server sends a heartbeat this often while a request waits or runs; a connection silent
# for SILENCE_SECONDS means the server hangs.
HEARTBEAT_SECONDS, SILENCE_SECONDS = 5.0, 60.0


def submit(url: str, args: list[str], token: str, on_log: Callable[[str], None] = print,
           limit_seconds: float | None = None) -> dict:
    """Run ``args`` in the server, passing its log lines to ``on_log`` as they come; the
    result ``{"exit_code", "stdout"}``. ``token``: the server's (:mod:`ipcount.server.auth`).
    ``limit_seconds`` bounds the command, its wait for the server's previous one included:
    the server cancels it then, and this gives up shortly after. Raises
    :class:`EpochServerError` when the server cannot be reached, refuses the request, goes
    silent, or the connection breaks before the result."""
    body = {"args": list(args), "limit_seconds": limit_seconds}
    request = urllib.request.Request(url.rstrip("/") + "/run", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {token}"}, method="POST")
    deadline = None if limit_seconds is None else time.monotonic() + limit_seconds + SILENCE_SECONDS
    try:
        with urllib.request.urlopen(request, timeout=SILENCE_SECONDS) as resp:
            for item in _lines(resp):
                if deadline is not None and time.monotonic() > deadline:
                    raise EpochServerError(f"epoch server at {url} did not finish `{args[0]}` within its limit of "
                                           f"{limit_seconds:.0f} s")
                if "log" in item:
                    on_log(item["log"])
                elif "exit_code" in item:
                    return item
    except urllib.error.HTTPError as e:
        raise EpochServerError(f"epoch server at {url} refused the request (HTTP {e.code}): "
                               f"{e.read().decode(errors='replace').strip()}") from None
    except OSError as e:
        raise EpochServerError(f"epoch server at {url}: {e}") from e
    raise EpochServerError(f"epoch server at {url} closed the connection before the command finished "
                           "(it may have died; the next attempt finishes the epoch from the ledger)")


def _lines(resp) -> Iterator[dict]:
    for raw in resp:
        if raw.strip():
            yield json.loads(raw)
