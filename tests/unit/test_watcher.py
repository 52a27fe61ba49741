"""The on-data schedule's watcher: when it fires (pure), and its trigger's loop over a
scripted look at the ledger and the log ends."""
from __future__ import annotations

import asyncio
import contextlib

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
    """The trigger with a look that plays a script of verdicts (then stays idle)."""

    def __init__(self, script, **kwargs):
        super().__init__(watch_settings(PipelineConfig()), **kwargs)
        self.script, self.closed = list(script), False

    def watch(self, cfg):
        trigger = self

        class Look:
            def look(self):
                return trigger.script.pop(0) if trigger.script else (IDLE, "end")

            def close(self):
                trigger.closed = True
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
        while trigger.script:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        return events
    return asyncio.run(collect())


def test_the_trigger_fires_for_new_work_only_and_closes_its_look():
    script = [(IDLE, "a"), (PENDING, "b"), (PENDING, "b"), (PENDING, "b"), (IDLE, "c"), (PENDING, "d")]
    trigger = ScriptedTrigger(script, poll_seconds=0.01)
    assert events_of(trigger) == [{"topic": "ip_count_source", "why": "5 new offset(s)"}] * 2
    assert trigger.closed and not trigger.script


def test_the_trigger_fires_the_same_work_again_after_the_refire_interval():
    trigger = ScriptedTrigger([(PENDING, "b")] * 30, poll_seconds=0.01, refire_seconds=0.1)
    fired = events_of(trigger)
    assert 2 <= len(fired) <= 5, fired


def test_an_idle_log_fires_nothing():
    trigger = ScriptedTrigger([(IDLE, "a")] * 20, poll_seconds=0.01)
    assert events_of(trigger) == []
    assert trigger.closed


def test_the_trigger_serialises_to_json_settings_and_hashes_alike_in_every_parse():
    cfg = PipelineConfig(topic="t", bootstrap_servers="b1:9093,b2:9093")
    classpath, kwargs = NewRecordsTrigger(watch_settings(cfg), 3).serialize()
    assert classpath == "ipcount.orchestration.watcher.NewRecordsTrigger"
    again = NewRecordsTrigger(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    rebuilt = PipelineConfig(topic="t", bootstrap_servers="b1:9093,b2:9093")   # another parse
    assert BaseEventTrigger.hash(classpath, kwargs) == \
        BaseEventTrigger.hash(*NewRecordsTrigger(watch_settings(rebuilt), 3).serialize())
    # the trigger rebuilds the pipeline's settings from them; no secret is among them
    assert PipelineConfig.from_mapping(kwargs["settings"]).ledger_path == cfg.ledger_path
    assert not any("password" in k and v and "file" not in k for k, v in kwargs["settings"].items())


@pytest.mark.parametrize("fallback", ["", "  ", "@continuous", "on-data"])
def test_the_fallback_is_a_clock_or_none(fallback):
    with pytest.raises(ConfigError, match="on_data_fallback"):
        PipelineConfig(schedule="on-data", on_data_fallback=fallback)
    assert PipelineConfig(schedule="on-data", on_data_fallback="none").on_data_fallback == "none"
