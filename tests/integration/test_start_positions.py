"""Every start position of an empty ledger, against the real broker; the ledger wins after."""
from __future__ import annotations

import logging
import time
from collections import Counter

import pytest

from ipcount.jobs import epoch as epoch_mod
from ipcount.rules.errors import StartPositionError
from ipcount.storage import broker as broker_io
from ipcount_lab.generator import TrafficGenerator, produce
from tests.ground_truth import expected_tables
from tests.tables import counts, epoch_ranges

# Kafka timestamps an hour ago (on the hour): the broker deletes records older than its
# retention (7 days) by their timestamps, possibly in the middle of a test.
BASE_MS = (int(time.time()) // 3600 - 1) * 3_600_000


def _produce(cfg, n=90, seed=51):
    """n records round-robin over 3 partitions; record i has Kafka timestamp BASE_MS + i s."""
    gen = TrafficGenerator(seed=seed, events_per_second=20)
    return produce(cfg.bootstrap_servers, cfg.topic, gen.records(n, BASE_MS), partition_of=lambda i, r: i % 3,
                   timestamp_of=lambda i, r: BASE_MS + i * 1000)


def _first_from(cfg):
    return {p: f for p, (f, _) in epoch_ranges(cfg)[0].items()}


def test_timestamp_start_is_the_first_offset_at_or_after_the_time(cfg, spark):
    produced = _produce(cfg)
    cfg = cfg.replace(start_position="timestamp", start_timestamp_ms=BASE_MS + 45_500)
    s = epoch_mod.run_epoch(cfg, spark)
    want = {p: min(r.offset for r in produced if r.partition == p and r.timestamp_ms >= BASE_MS + 45_500)
            for p in range(3)}
    assert _first_from(cfg) == want == {0: 16, 1: 15, 2: 15}
    kept = [r for r in produced if r.timestamp_ms >= BASE_MS + 45_500]
    assert s.records_read == len(kept) == 44
    assert counts(cfg) == expected_tables(kept, epoch_ranges(cfg)).counts


def test_timestamp_after_the_last_record_starts_at_the_end(cfg, spark):
    produced = _produce(cfg, n=30)
    s = epoch_mod.run_epoch(cfg.replace(start_position="timestamp", start_timestamp_ms=BASE_MS + 10**9), spark)
    assert s.records_read == 0 and _first_from(cfg) == dict(Counter(r.partition for r in produced))


def test_specific_offsets_and_unnamed_partitions_start_at_earliest(cfg, spark):
    _produce(cfg)
    cfg = cfg.replace(start_position="specific", start_offsets="0:7,2:29")
    s = epoch_mod.run_epoch(cfg, spark)
    assert _first_from(cfg) == {0: 7, 1: 0, 2: 29}
    assert s.records_read == (30 - 7) + 30 + (30 - 29)


def test_specific_offsets_outside_the_log_are_refused(cfg, spark):
    _produce(cfg, n=30)
    with pytest.raises(StartPositionError, match=r"-1:99 is outside the partition's offsets \[0, 10\]"):
        epoch_mod.run_epoch(cfg.replace(start_position="specific", start_offsets="1:99"), spark)


@pytest.mark.parametrize("reset, partition_2", [("earliest", 0), ("latest", 30)])
def test_group_offsets_with_reset_for_partitions_without_any(cfg, spark, reset, partition_2):
    _produce(cfg)
    broker_io.commit_group_offsets(cfg, {0: 5, 1: 12}, epoch=0)
    epoch_mod.run_epoch(cfg.replace(start_position="group-offsets", group_offsets_reset=reset), spark)
    assert _first_from(cfg) == {0: 5, 1: 12, 2: partition_2}


def test_group_offsets_reset_none_fails_naming_the_partitions(cfg, spark):
    _produce(cfg, n=30)
    broker_io.commit_group_offsets(cfg, {0: 5}, epoch=0)
    with pytest.raises(StartPositionError, match=r"no committed offset for .* partition\(s\) \[1, 2\]"):
        epoch_mod.run_epoch(cfg.replace(start_position="group-offsets", group_offsets_reset="none"), spark)


def test_once_the_ledger_has_entries_it_wins_over_any_start_position(cfg, spark, caplog):
    _produce(cfg, n=30)
    epoch_mod.run_epoch(cfg, spark)
    _produce(cfg, n=30, seed=52)
    broker_io.commit_group_offsets(cfg, {0: 0, 1: 0, 2: 0}, epoch=0)
    caplog.set_level(logging.INFO, logger="ipcount.jobs.epoch")
    s = epoch_mod.run_epoch(cfg.replace(start_position="group-offsets"), spark)
    assert {r.partition: r.from_offset for r in s.plan.ranges} == {0: 10, 1: 10, 2: 10}
    assert "ledger has entries: starting from its positions (start_position 'group-offsets' not used)" in caplog.text
