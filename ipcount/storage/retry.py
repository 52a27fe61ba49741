"""The retry loop of calls that may lose a race (a Delta commit, a plan) or meet a service not ready yet (a group
coordinator still loading). The table set's claim keeps a loop of its own: it checks again after a successful record."""
from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from ipcount.rules.errors import first_line

log = logging.getLogger(__name__)
T = TypeVar("T")


def retrying(action: Callable[[], T], errors: type[BaseException] | tuple[type[BaseException], ...], what: str,
             attempts: int | None = None, pause: Callable[[int], float] = lambda attempt: 0.2 * attempt,
             deadline: float | None = None, gave_up: Callable[[], Exception] | None = None,
             again: str = "trying again") -> T:
    """``action()``, called again after each of ``errors`` it raises (``pause(n)`` seconds after the n-th, logged with
    ``what`` and ``again``) until it returns. After ``attempts`` calls, or when the next pause would end past
    ``deadline`` (of ``time.monotonic()``), the last error is raised, or ``gave_up()`` instead of it."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return action()
        except errors as e:
            wait = pause(attempt)
            out_of_attempts = attempts is not None and attempt >= attempts
            if out_of_attempts or (deadline is not None and time.monotonic() + wait > deadline):
                if gave_up is None:
                    raise
                raise gave_up() from None
            log.info("%s: %s; %s (attempt %d%s)", what, first_line(e), again, attempt,
                     f" of {attempts}" if attempts else "")
            time.sleep(wait)
