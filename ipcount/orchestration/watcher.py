"""The on-data schedule's trigger: a DAG run starts when the source topic has records the
ledger's chain has not counted, and none starts while the log is idle.

It runs in Airflow's triggerer as the source Asset's watcher (``AssetWatcher``). Every
``on_data_poll_seconds`` it compares the topic's log ends (read_committed, asked of the broker
as an admin: no consumer group, nothing consumed or committed, so the group's lag stays the
pipeline's) with the ledger's positions, as the epoch DAG's idle check does, and fires an
asset event for each new piece of pending work (:class:`ipcount.jobs.idle.Firing`). An event
that arrives while a run is active waits in Airflow's queue for the next run; work still
pending a minute after its event fires again (a failed run, a queued event Airflow did not
turn into a run), so records do not wait for the fallback clock. A look that fails fires
nothing: the watch is opened anew (its Kafka connection read again) a few seconds later.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from ipcount.rules.config import KAFKA_CLIENT_SETTINGS, TABLE_SETTINGS, PipelineConfig

# What the trigger needs to know of the pipeline: where the ledger is, the topic, how to reach the broker (a
# connection's secrets are read in the triggerer, never serialised).
WATCH_SETTINGS = (*TABLE_SETTINGS, "topic", *KAFKA_CLIENT_SETTINGS)
REFIRE_SECONDS = 60.0


def watch_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """The trigger's settings: the same in every process that parses the DAGs (Airflow identifies a watcher's trigger by
    them)."""
    values = cfg.to_dict()
    return {name: values[name] for name in WATCH_SETTINGS}


class NewRecordsTrigger(BaseEventTrigger):
    """Fires when the source topic has records past the ledger's chain (see the module)."""

    def __init__(self, settings: dict[str, Any], poll_seconds: float = 2.0,
                 refire_seconds: float = REFIRE_SECONDS) -> None:
        super().__init__()
        # (floats: Airflow identifies the trigger by a hash of these, and 2 hashes unlike 2.0)
        self.settings = dict(settings)
        self.poll_seconds, self.refire_seconds = float(poll_seconds), float(refire_seconds)
        self.retry_seconds = max(10.0, float(poll_seconds))

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"settings": self.settings, "poll_seconds": self.poll_seconds,
                 "refire_seconds": self.refire_seconds})

    def watch(self, cfg: PipelineConfig):
        """The look at the ledger and the log ends (the tests give one of their own)."""
        from ipcount.jobs.idle import Watch

        return Watch(cfg)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from ipcount.jobs.idle import Firing

        firing = Firing(self.refire_seconds)
        while True:   # a watch that failed is opened anew: the connection may have changed
            held = contextlib.ExitStack()   # a connection's secret files, for the watch's life
            watch, pending = None, None
            try:
                pending = asyncio.ensure_future(asyncio.to_thread(self._open, held))
                watch = await asyncio.shield(pending)
                while True:
                    pending = asyncio.ensure_future(asyncio.to_thread(watch.look))
                    verdict, key = await asyncio.shield(pending)
                    if firing(verdict.run, key, time.monotonic()):
                        self.log.info("new work: %s", verdict.why)
                        yield TriggerEvent({"topic": self.settings["topic"], "why": verdict.why})
                    await asyncio.sleep(self.poll_seconds)
            except Exception as e:  # noqa: BLE001 - a store or broker that fails now may answer later
                self.log.warning("could not look at the ledger and the log ends (%s: %s); trying again in %s s",
                                 type(e).__name__, e, self.retry_seconds)
            finally:
                # A thread's call runs on after a cancel: let it end before closing what it uses.
                if pending is not None and not pending.done():
                    with contextlib.suppress(BaseException):
                        await pending
                if watch is not None:
                    await asyncio.to_thread(watch.close)
                await asyncio.to_thread(held.close)
            await asyncio.sleep(self.retry_seconds)

    def _open(self, held: contextlib.ExitStack):
        """The watch on the pipeline's settings, its Kafka connection (if any) read now."""
        from ipcount.orchestration.kafka_connection import resolved

        cfg = held.enter_context(resolved(PipelineConfig.from_mapping(self.settings)))
        self.log.info("watching %s for records past the ledger %s, every %s s", cfg.topic, cfg.ledger_path,
                      self.poll_seconds)
        return self.watch(cfg)
