"""Bad input fails clearly and loses nothing: unreachable broker, missing topic, lost offsets."""
from __future__ import annotations

import subprocess
import sys

import pytest
from kafka import KafkaAdminClient, TopicPartition

from ipcount.jobs import epoch as epoch_mod
from ipcount.rules.errors import DataLossError
from ipcount.storage import broker as broker_io
from ipcount_lab.generator import TrafficGenerator, produce
from tests.conftest import free_port
from tests.tables import ledger, snapshot


def _epoch_cli(cfg, *extra):
    return subprocess.run([sys.executable, "-m", "ipcount.cli", "epoch", *cfg.to_args(), *extra],
                          capture_output=True, text=True, timeout=300)


def test_unreachable_broker_exits_4_naming_the_servers(cfg):
    bad = cfg.replace(bootstrap_servers=f"127.0.0.1:{free_port()}", kafka_timeout_seconds=3)
    proc = _epoch_cli(bad)
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert f"no Kafka broker answered at {bad.bootstrap_servers}" in proc.stderr


def test_missing_topic_exits_4_and_says_how_to_create_it(cfg):
    proc = _epoch_cli(cfg.replace(topic="no_such_topic"))
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "topic 'no_such_topic' does not exist" in proc.stderr
    assert "create-topic" in proc.stderr


def test_a_topic_starting_with_a_dash_reaches_the_broker(cfg):
    """The command line spark-submit gets carries it as --topic=-events, which argparse parses."""
    proc = _epoch_cli(cfg.replace(topic="-events"))
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "topic '-events' does not exist" in proc.stderr


def test_bad_setting_exits_2_before_touching_anything(cfg, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ipcount.cli", "epoch", "--start-position", "middle",
                           "--warehouse", str(tmp_path / "w")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "start_position must be one of earliest, latest, timestamp, group-offsets, specific; found 'middle'" in proc.stderr
    assert not (tmp_path / "w").exists()


def test_offsets_deleted_before_they_were_counted_fail_loudly_and_write_nothing(cfg, spark):
    gen = TrafficGenerator(seed=4)
    produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, 1_795_255_200_000), partition_of=lambda i, r: i % 3)
    epoch_mod.run_epoch(cfg, spark)  # counts [0, 30) of each partition
    produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, 1_795_255_260_000), partition_of=lambda i, r: i % 3)
    admin = KafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers)
    admin.delete_records({TopicPartition(cfg.topic, 1): 42})  # 30..41 of partition 1 never counted
    admin.close()
    before = snapshot(cfg)

    with pytest.raises(DataLossError, match=rf"data loss on {cfg.topic}-1: offsets \[30, 42\) were deleted"):
        epoch_mod.run_epoch(cfg, spark)
    assert snapshot(cfg) == before
    assert {r["status"] for r in ledger(cfg)} == {"committed"}


def test_skip_policy_skips_deleted_offsets_and_records_the_gap(cfg, spark):
    from tests.ground_truth import expected_tables
    from tests.tables import counts

    cfg = cfg.replace(on_data_loss="skip")
    gen = TrafficGenerator(seed=4)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    epoch_mod.run_epoch(cfg, spark)
    produced += produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, 1_795_255_260_000),
                        partition_of=lambda i, r: i % 3)
    admin = KafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers)
    admin.delete_records({TopicPartition(cfg.topic, 1): 42})
    admin.close()

    s = epoch_mod.run_epoch(cfg, spark)
    assert {r.partition: r.from_offset for r in s.plan.ranges} == {0: 30, 1: 42, 2: 30}
    rows = ledger(cfg)
    lost = [(r["epoch"], r["partition"], r["from_offset"], r["until_offset"]) for r in rows if r["status"] == "lost"]
    assert lost == [(2, 1, 30, 42)]
    # per partition, committed and lost ranges chain from 0 to the end without a gap
    for p in range(3):
        spans = sorted((r["from_offset"], r["until_offset"]) for r in rows if r["partition"] == p)
        assert spans[0][0] == 0 and spans[-1][1] == 60
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    epochs = [{r["partition"]: (r["from_offset"], r["until_offset"]) for r in rows
               if r["epoch"] == e and r["status"] == "committed"} for e in (1, 2)]
    assert counts(cfg) == expected_tables(produced, epochs).counts


def test_a_planned_epoch_whose_offsets_aged_out_is_settled_under_skip(cfg, spark):
    """Its data was deleted before it was resumed: it raised data loss for good, even under
    skip, and no command resolved it."""
    from tests.ground_truth import expected_tables
    from tests.tables import counts

    gen = TrafficGenerator(seed=5)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    epoch_mod.run_epoch(cfg, spark)                  # epoch 1: [0, 30) of each partition
    produced += produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, 1_795_255_260_000),
                        partition_of=lambda i, r: i % 3)
    runner = epoch_mod.EpochRunner.open(cfg, spark)  # epoch 2 planned, then its runner died
    earliest, latest = broker_io.partition_offsets(cfg)
    stuck, _ = epoch_mod.next_chain_epoch(runner, earliest, latest)
    admin = KafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers)
    admin.delete_records({TopicPartition(cfg.topic, 1): 42})  # 30..41 of partition 1 gone
    admin.close()

    with pytest.raises(DataLossError, match=rf"{cfg.topic}-1: offsets \[30, 42\) were deleted"):
        epoch_mod.run_epoch(cfg, spark)              # fail (the default) stays loud
    s = epoch_mod.run_epoch(cfg.replace(on_data_loss="skip"), spark)
    # epoch 3 is the rest of epoch 2, planned in the commit that gave epoch 2 up, then run
    assert stuck.epoch == 2 and s.epoch == 3 and s.resumed
    assert {r.partition: r.from_offset for r in s.plan.ranges} == {0: 30, 1: 42, 2: 30}
    rows = ledger(cfg)
    assert sorted((r["epoch"], r["status"], r["partition"], r["from_offset"], r["until_offset"]) for r in rows
                  if r["epoch"] == 2) == [(2, "lost", 1, 30, 42)]
    epochs = [{r["partition"]: (r["from_offset"], r["until_offset"]) for r in rows
               if r["epoch"] == e and r["status"] == "committed"} for e in (1, 3)]
    assert counts(cfg) == expected_tables(produced, epochs).counts


def _recreate_topic(cfg, partitions):
    import time

    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers)
    admin.delete_topics([cfg.topic])
    for _ in range(60):  # deletion completes asynchronously
        try:
            admin.create_topics({cfg.topic: {"num_partitions": partitions, "replication_factor": 1}})
            break
        except TopicAlreadyExistsError:
            time.sleep(0.5)
    admin.close()


@pytest.mark.parametrize("partitions, message", [
    (2, r"partition\(s\) {topic}-2 are in the ledger but no longer exist on the broker"),
    (3, r"data loss on {topic}-0: the ledger has counted up to offset 30 but the partition now ends at 3"),
])
def test_recreated_topic_fails_loudly_and_writes_nothing(cfg, spark, partitions, message):
    gen = TrafficGenerator(seed=6)
    produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, 1_795_255_200_000), partition_of=lambda i, r: i % 3)
    epoch_mod.run_epoch(cfg, spark)
    _recreate_topic(cfg, partitions)
    produce(cfg.bootstrap_servers, cfg.topic, gen.records(3 * partitions, 1_795_255_260_000),
            partition_of=lambda i, r: i % partitions)
    before = snapshot(cfg)
    for policy in ("fail", "skip"):  # skipping is for deleted offsets, never for a recreated topic
        with pytest.raises(DataLossError, match=message.format(topic=cfg.topic)):
            epoch_mod.run_epoch(cfg.replace(on_data_loss=policy), spark)
    assert snapshot(cfg) == before


def test_every_kind_of_bad_record_lands_in_the_dead_letter_table(cfg, spark):
    from ipcount_lab.generator import MALFORMED_SAMPLES, Record
    from tests.tables import counts, dead_letters

    cfg = cfg.replace(max_value_bytes=200)
    bad = [(reason, Record(b"k" if value is None else None, value)) for reason, value in MALFORMED_SAMPLES]
    bad.append(("too_large", Record(None, b'{"ip": "10.0.0.1", "ts": "2026-11-21T10:00:00Z", "pad": "'
                                    + b"x" * 300 + b'"}')))
    good = Record(None, b'{"ip": "10.0.0.1", "ts": "2026-11-21T10:00:01Z"}')
    records = [r for _, r in bad] + [good]
    produced = produce(cfg.bootstrap_servers, cfg.topic, records, partition_of=lambda i, r: i % 3)
    s = epoch_mod.run_epoch(cfg, spark)
    assert s.records_malformed == len(bad) == 9 and s.records_counted == 1
    assert dead_letters(cfg) == {(p.partition, p.offset, reason) for p, (reason, _) in zip(produced, bad)}
    assert sum(counts(cfg).values()) == 1
    # The raw bytes are kept as they arrived, with their size and hash - but of a value over
    # the size cap, only the first max_value_bytes (at most 1 KiB): the cap caps storage too.
    import hashlib

    from deltalake import DeltaTable

    rows = {(r["partition"], r["offset"]): r for r in DeltaTable(cfg.dead_letter_path).to_pyarrow_table().to_pylist()}
    for p, (reason, r) in zip(produced, bad):
        row = rows[(p.partition, p.offset)]
        assert row["value"] == (r.value[:200] if reason == "too_large" else r.value), reason
        assert (row["value_bytes"], row["value_sha256"]) == ((None, None) if r.value is None else
                                                             (len(r.value), hashlib.sha256(r.value).hexdigest()))
    assert len(rows[(produced[-2].partition, produced[-2].offset)]["value"]) == 200 < len(bad[-1][1].value)
