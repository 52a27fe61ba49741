"""Crash points: where a command can be made to kill itself (``IPCOUNT_CRASH_AT``), so the tests and the chaos command
can prove a re-run after a crash at any step boundary ends where a crash-free run does. No Spark here: `ipcount publish`
runs without a JVM."""
from __future__ import annotations

import logging
import os
import signal
from typing import Callable

from ipcount.rules.errors import ConfigError

log = logging.getLogger(__name__)

# An epoch's step boundaries (tests SIGKILL the process there).
CRASH_POINTS = ("after_plan", "after_sink", "after_ledger", "before_kafka_commit")
# Between the files Spark's executors wrote for an epoch's counts and the commit that makes them part of the table (an
# epoch whose tally Spark writes: ipcount.storage.table_files).
FILE_CRASH_POINTS = ("after_counts_files",)
# Each epoch step logs a marker, worded for machines: chaos reads the last one in a killed process's log to tell where
# its epoch had got to. Reading the ledger to plan is a step too (no crash point: nothing is written yet).
STEP_MARKER = "ipcount-step"
PLANNING = "planning"
# Where a publish can be killed: its records and cursor sent, uncommitted; committed.
PUBLISH_CRASH_POINTS = ("publish_before_commit", "publish_after_commit")
Crash = Callable[[str], None]


def step_line(point: str, epoch: int | None = None) -> str:
    """The marker a step logs: ``ipcount-step after_plan epoch=7``."""
    return f"{STEP_MARKER} {point}" + (f" epoch={epoch}" if epoch is not None else "")


def no_crash(point: str) -> None:
    """The crash hook of a normal run: nothing happens at any step boundary."""


def crash_from_env() -> Crash:
    """The crash hook ``IPCOUNT_CRASH_AT`` names (none when it is unset or empty)."""
    return crash_hook(os.environ.get("IPCOUNT_CRASH_AT") or None)


def crash_hook(crash_at: str | None) -> Crash:
    """A hook that kills this process with SIGKILL at the named step boundary."""
    points = (*CRASH_POINTS, *FILE_CRASH_POINTS, *PUBLISH_CRASH_POINTS)
    if crash_at is not None and crash_at not in points:
        raise ConfigError(f"IPCOUNT_CRASH_AT (a test hook) must be one of {', '.join(points)}; found {crash_at!r}")

    def hook(point: str) -> None:
        if point == crash_at:
            log.warning("crash injected at %s: SIGKILL", point)
            os.kill(os.getpid(), signal.SIGKILL)
    return hook
