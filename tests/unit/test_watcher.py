"""The on-data schedule's watcher: when it fires (pure), and its trigger's loop over a
scripted look at the ledger and the log ends."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
from airflow.triggers.base import BaseEventTrigger

from ipcount.jobs.idle import Firing, Verdict
from ipcount.orchestration.watcher import NewRecordsTrigger, watch_settings
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import ConfigError

IDLE, PENDING = Verdict(False, "nothing new"), Verdict(True, "5 new offset(s)")


def test_firing_once_per_pending_work_again_after_the_refire_interval_never_while_idle():
    fire = Firing(refire_seconds=60)
    assert not fire(False, "k0", 0)
    assert fire(True, "k1", 1)            # new work
    assert not fire(True, "k1", 2)        # the same work: the run it started is on it
    assert not fire(True, "k1", 60)
    assert fire(True, "k1", 61)           # still pending a minute later: again
    assert fire(True, "k2", 62)           # the chain moved and more is pending
    assert not fire(False, "k3", 63)      # idle: nothing
    assert fire(True, "k2", 64)           # pending again after idle, even the same key


class ScriptedTrigger(NewRecordsTrigger):
    """The trigger with a look that plays a script (then stays idle): each item a
    (verdict, key) or an exception to raise; it records what happened, in order."""

    def __init__(self, script, **kwargs):
        super().__init__(watch_settings(PipelineConfig()), **kwargs)
        self.retry_seconds = 0.01
        self.script, self.done, self.events = list(script), threading.Event(), []
        self.looks_after_script = 0

    def watch(self, cfg):
        trigger = self
        trigger.events.append("open")

        class Look:
            def look(self):
                if not trigger.script:
                    trigger.looks_after_script += 1
                    if trigger.looks_after_script >= 2:   # the last scripted look was acted on
                        trigger.done.set()
                    return IDLE, "end"
                item = trigger.script.pop(0)
                if isinstance(item, float):   # a slow look
                    time.sleep(item)
                    trigger.events.append("slow look done")
                    return IDLE, "slow"
                if isinstance(item, Exception):
                    raise item
                return item

            def close(self):
                trigger.events.append("close")
        return Look()


def events_of(trigger: ScriptedTrigger) -> list[dict]:
    """The events the trigger fires while it plays its script, then it is cancelled (as the
    triggerer cancels a trigger)."""
    async def collect():
        events = []

        async def consume():
            async for event in trigger.run():
                events.append(event.payload)
        running = asyncio.create_task(consume())
        await asyncio.to_thread(trigger.done.wait, 10)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        return events
    return asyncio.run(collect())


def test_the_trigger_fires_for_new_work_only_and_closes_its_look():
    script = [(IDLE, "a"), (PENDING, "b"), (PENDING, "b"), (PENDING, "b"), (IDLE, "c"), (PENDING, "d")]
    trigger = ScriptedTrigger(script, poll_seconds=0.01)
    assert events_of(trigger) == [{"topic": "ip_count_source", "why": "5 new offset(s)"}] * 2
    assert trigger.events == ["open", "close"] and not trigger.script


def test_the_trigger_fires_the_same_work_again_after_the_refire_interval():
    trigger = ScriptedTrigger([(PENDING, "b")] * 30, poll_seconds=0.01, refire_seconds=0.1)
    fired = events_of(trigger)
    assert 2 <= len(fired) < 15, fired      # again after 0.1 s of 30 looks 0.01 s apart, not at each look


def test_an_idle_log_fires_nothing():
    trigger = ScriptedTrigger([(IDLE, "a")] * 20, poll_seconds=0.01)
    assert events_of(trigger) == []
    assert trigger.events == ["open", "close"]


def test_a_failed_look_fires_nothing_and_the_watch_is_opened_anew():
    trigger = ScriptedTrigger([(IDLE, "a"), OSError("broker down"), (PENDING, "a"), (PENDING, "a")],
                              poll_seconds=0.01)
    assert events_of(trigger) == [{"topic": "ip_count_source", "why": "5 new offset(s)"}]
    assert trigger.events == ["open", "close", "open", "close"]


def test_a_cancelled_trigger_closes_its_watch_only_after_the_look_in_flight():
    trigger = ScriptedTrigger([0.3], poll_seconds=0.01)

    async def cancel_mid_look():
        running = asyncio.create_task(trigger.run().__anext__())
        await asyncio.sleep(0.1)          # the slow look has started in its thread
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    asyncio.run(cancel_mid_look())
    assert trigger.events == ["open", "slow look done", "close"]


def test_the_trigger_serialises_to_json_settings_and_keeps_its_hash_through_the_database():
    from airflow.models.trigger import Trigger
    from airflow.serialization.encoders import encode_trigger

    cfg = PipelineConfig(topic="t", bootstrap_servers="b1:9093,b2:9093")
    trigger = NewRecordsTrigger(watch_settings(cfg), 3)
    classpath, kwargs = trigger.serialize()
    assert classpath == "ipcount.orchestration.watcher.NewRecordsTrigger"
    assert NewRecordsTrigger(**kwargs).serialize() == (classpath, kwargs)
    # The DAG processor keeps a watcher's trigger while the hash of the DAG's trigger equals
    # that of the row it stored (kwargs encrypted and decoded again).
    encoded = encode_trigger(trigger)
    row = Trigger(encoded["classpath"], encoded["kwargs"])
    assert BaseEventTrigger.hash(row.classpath, row.kwargs) == BaseEventTrigger.hash(classpath, kwargs)
    # a poll interval given as 3 or 3.0 (a file, a variable) is the same trigger
    assert NewRecordsTrigger(watch_settings(cfg), 3.0).serialize() == (classpath, kwargs)
    # the trigger rebuilds the pipeline's settings from them; no secret is among them
    assert PipelineConfig.from_mapping(kwargs["settings"]).ledger_path == cfg.ledger_path
    assert not any("password" in k and v and "file" not in k for k, v in kwargs["settings"].items())


@pytest.mark.parametrize("fallback", ["", "  ", "@continuous", "on-data"])
def test_the_fallback_is_a_clock_or_none(fallback):
    with pytest.raises(ConfigError, match="on_data_fallback"):
        PipelineConfig(schedule="on-data", on_data_fallback=fallback)
    assert PipelineConfig(schedule="on-data", on_data_fallback="none").on_data_fallback == "none"
