"""The on-data schedule's trigger: a DAG run starts when the source topic has records the
ledger's chain has not counted, and none starts while the log is idle.

It runs in Airflow's triggerer as the source Asset's watcher (``AssetWatcher``). Every
``on_data_poll_seconds`` it compares the topic's log ends (read_committed, asked of the broker
as an admin: no consumer group, nothing consumed or committed, so the group's lag stays the
pipeline's) with the ledger's positions, as the epoch DAG's idle check does, and fires an
asset event for each new piece of pending work (:class:`ipcount.jobs.idle.Firing`). Events
that arrive while a run is active start the next one (Airflow merges them); the same work
still pending a minute later fires again, so an event Airflow merged away or a failed run
cannot leave records waiting for the fallback clock.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from ipcount.rules.config import KAFKA_CLIENT_SETTINGS, TABLE_SETTINGS, PipelineConfig

# What the trigger needs to know of the pipeline: where the ledger is, the topic, how to
# reach the broker (a connection's secrets are read in the triggerer, never serialised).
WATCH_SETTINGS = (*TABLE_SETTINGS, "topic", *KAFKA_CLIENT_SETTINGS)
REFIRE_SECONDS = 60.0


def watch_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """The trigger's settings: the same in every process that parses the DAGs (Airflow
    identifies a watcher's trigger by them)."""
    values = cfg.to_dict()
    return {name: values[name] for name in WATCH_SETTINGS}


class NewRecordsTrigger(BaseEventTrigger):
    """Fires when the source topic has records past the ledger's chain (see the module)."""

    def __init__(self, settings: dict[str, Any], poll_seconds: float = 2.0,
                 refire_seconds: float = REFIRE_SECONDS) -> None:
        super().__init__()
        self.settings, self.poll_seconds, self.refire_seconds = dict(settings), poll_seconds, refire_seconds

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
        from ipcount.orchestration.kafka_connection import resolved

        cfg = PipelineConfig.from_mapping(self.settings)
        held = contextlib.ExitStack()   # a connection's secret files, for the trigger's life
        watch = None
        try:
            cfg = await asyncio.to_thread(held.enter_context, resolved(cfg))
            watch = self.watch(cfg)
            firing = Firing(self.refire_seconds)
            self.log.info("watching %s for records past the ledger %s, every %s s", cfg.topic, cfg.ledger_path,
                          self.poll_seconds)
            while True:
                verdict, key = await asyncio.to_thread(watch.look)
                if firing(verdict.run, key, time.monotonic()):
                    self.log.info("new work: %s", verdict.why)
                    yield TriggerEvent({"topic": cfg.topic, "why": verdict.why})
                await asyncio.sleep(self.poll_seconds)
        finally:
            if watch is not None:
                await asyncio.to_thread(watch.close)
            await asyncio.to_thread(held.close)
