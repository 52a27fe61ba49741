"""Does the scheduled chain have anything to do? Answered without a JVM.

An epoch pays for a JVM and a Spark session before it can find out that nothing new arrived: most of what a quiet
topic's scheduled run costs. This check reads the ledger with delta-rs and the log ends with kafka-python, and the DAG
skips the Spark job when it says idle. It says "idle" only when the job would certainly commit nothing: any doubt means
"run", and the job decides with its full checks. The consumer group is never read.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping

from ipcount.rules.config import PipelineConfig
from ipcount.rules.coverage import Coverage
from ipcount.rules.ledger import LedgerState
from ipcount.rules.offsets import OffsetRange
from ipcount.storage.ledger import Ledger, LedgerView


@dataclass(frozen=True)
class Verdict:
    run: bool
    why: str


def verdict(positions: Mapping[int, int], unfinished: list[int], earliest: Mapping[int, int],
            latest: Mapping[int, int], owned: Coverage | None = None) -> Verdict:
    """Whether the next scheduled epoch must run, and why (pure). ``owned``: the offsets the ledger's rows own
    (:attr:`ipcount.rules.ledger.LedgerState.coverage`); the planner passes over those a backfill counted ahead of the
    chain, and so does this."""
    if unfinished:
        return Verdict(True, f"epoch {unfinished[0]} is unfinished: finishing it with its recorded ranges")
    if not positions:
        return Verdict(True, "the ledger has no committed scheduled epoch yet")
    if set(positions) - set(latest):
        return Verdict(True, f"partitions changed: the ledger has {sorted(positions)}, the topic {sorted(latest)}")

    def unowned(partition: int, start: int, end: int) -> int:
        if owned is None or start >= end:
            return max(0, end - start)
        return sum(g.size for g in owned.gaps(OffsetRange(owned.topic, partition, start, end)))
    aged = [p for p in sorted(positions) if unowned(p, positions[p], earliest[p])]
    if aged:
        return Verdict(True, "offsets aged out on partition(s) " + ", ".join(
            f"{p} ([{positions[p]}, {earliest[p]}))" for p in aged))
    # A partition the chain has not read yet starts at its log start (the ledger has entries).
    at = {p: max(positions.get(p, earliest[p]), earliest[p]) for p in latest}
    new = {p: n for p in sorted(at) if (n := unowned(p, at[p], latest[p]))}
    if new:
        return Verdict(True, f"{sum(new.values())} new offset(s): " + " ".join(f"p{p}+{n}" for p, n in new.items()))
    return Verdict(False, "nothing new: the chain is at the log end " +
                   " ".join(f"p{p}={o}" for p, o in sorted(at.items())))


def check(cfg: PipelineConfig) -> Verdict:
    """The verdict for ``cfg``'s scheduled chain, from the ledger and the broker. A failure to look is a reason to run:
    the job then reports it properly."""
    try:
        from ipcount.storage import broker

        state = Ledger(cfg.ledger_path).state(cfg.topic)
        positions, unfinished = state.committed, _unfinished(state)
        if unfinished or not positions:
            return verdict(positions, unfinished, {}, {})
        earliest, latest = broker.partition_offsets(cfg)
    except Exception as e:  # noqa: BLE001 - the Spark job gives the authoritative error
        return Verdict(True, f"could not check without Spark ({type(e).__name__}: {e}); running the epoch")
    return verdict(positions, unfinished, earliest, latest, state.coverage)


def _unfinished(state: LedgerState) -> list[int]:
    """The scheduled chain's planned (not yet committed) epochs, lowest first."""
    return [p.epoch for p in state.pending_chain]


class Watch:
    """:func:`check` for a watcher that looks every few seconds (the on-data schedule's trigger): the ledger kept open
    and read again only when its version moves, one admin client kept (both opened again after a failure). Like
    :func:`check`, it asks the broker for log ends only: no consumer, no group, nothing consumed or committed. Until the
    chain has an epoch, records in the topic are work (the first epoch starts from start_position)."""

    # A table object follows its own log: one made anew now and then sees a table that was deleted and created again at
    # the same place.
    REOPEN_SECONDS = 60.0

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self._table: Any = None
        self._opened_at = 0.0
        self._view: tuple[int, LedgerView] | None = None   # (ledger version, its view)
        self._client: contextlib.ExitStack | None = None
        self._admin: Any = None
        self._closed = False

    def look(self) -> tuple[Verdict, Hashable]:
        """The verdict, and which work is pending: the chain's positions. New records past the same positions are the
        same work for the next run, and so is an epoch planned from them (the run that planned it is on it, or a retry
        finishes it). Raises when the ledger or the broker cannot be read: a failed look is no reason for a run."""
        try:
            state = self._ledger().state(self.cfg.topic)
            positions, unfinished = state.committed, _unfinished(state)
            key = tuple(sorted(positions.items()))
            if unfinished:
                return verdict(positions, unfinished, {}, {}), key
            earliest, latest = self._offsets()
        except Exception:
            self._table = None
            self._drop_client()
            raise
        if not positions and all(latest[p] <= earliest[p] for p in latest):
            return Verdict(False, "no epoch yet, and no record in the topic"), key
        return verdict(positions, unfinished, earliest, latest, state.coverage), key

    def _ledger(self) -> LedgerView:
        from ipcount.storage.delta import open_table

        if self._table is None or time.monotonic() - self._opened_at >= self.REOPEN_SECONDS:
            self._table, self._opened_at, self._view = open_table(self.cfg.ledger_path), time.monotonic(), None
            if self._table is None:
                return LedgerView(None, [])
        else:
            self._table.update_incremental()
        version = self._table.version()
        if self._view is None or self._view[0] != version:
            self._view = (version, Ledger(self.cfg.ledger_path).view(self._table))
        return self._view[1]

    def _offsets(self) -> tuple[dict[int, int], dict[int, int]]:
        from ipcount.storage import broker

        if self._closed:
            raise RuntimeError("the watch is closed")
        if self._client is None:
            stack = contextlib.ExitStack()
            self._admin = stack.enter_context(broker.admin_client(self.cfg))
            self._client = stack
        return broker.offsets_with(self._admin, self.cfg.topic)

    def _drop_client(self) -> None:
        if self._client is not None:
            client, self._client, self._admin = self._client, None, None
            client.close()

    def close(self) -> None:
        self._closed = True
        self._drop_client()


@dataclass
class Firing:
    """When a watcher fires (pure): once for each new piece of pending work, and again for the same work every
    ``refire_seconds`` while it stays pending (an event Airflow lost or merged, a run that failed). Never while idle."""

    refire_seconds: float
    fired: tuple[Hashable, float] | None = field(default=None, init=False)   # (key, when)

    def __call__(self, run: bool, key: Hashable, now: float) -> bool:
        if not run:
            self.fired = None
            return False
        if self.fired is None or self.fired[0] != key or now - self.fired[1] >= self.refire_seconds:
            self.fired = (key, now)
            return True
        return False
