"""Kafka semantics an exactly-once consumer must honour: transactions and partition changes."""
from __future__ import annotations

from collections import Counter

from kafka import KafkaAdminClient, KafkaProducer

from ipcount.jobs import epoch as epoch_mod
from ipcount.storage import broker as broker_io
from ipcount_lab.generator import Produced, TrafficGenerator, produce
from tests.ground_truth import expected_tables
from tests.tables import counts, dead_letters, epoch_ranges

BASE_MS = 1_795_255_200_000


def test_aborted_transactions_are_never_counted_and_open_ones_never_read(cfg, spark):
    """Transactions commit or abort in turn, each spanning all three partitions; one more
    stays open while the epoch plans, so the epoch must stop at the last stable offset."""
    gen = TrafficGenerator(seed=41, events_per_second=20, malformed_share=0.0, late_share=0.0)
    records = list(gen.records(400, BASE_MS))
    producer = KafkaProducer(bootstrap_servers=cfg.bootstrap_servers, transactional_id=f"tx-{cfg.topic}")
    producer.init_transactions()
    committed: list[Produced] = []
    for batch in range(8):
        producer.begin_transaction()
        futures = [(r, producer.send(cfg.topic, key=r.key, value=r.value, partition=i % 3))
                   for i, r in enumerate(records[batch * 40:(batch + 1) * 40])]
        producer.flush()
        if batch % 2 == 0:
            producer.commit_transaction()
            committed += [Produced(f.get().partition, f.get().offset, r.key, r.value) for r, f in futures]
        else:
            producer.abort_transaction()
    producer.begin_transaction()  # left open during the epoch
    for i, r in enumerate(records[320:]):
        producer.send(cfg.topic, key=r.key, value=r.value, partition=i % 3)
    producer.flush()

    first = epoch_mod.run_epoch(cfg, spark)
    assert first.records_read == len(committed) == 160
    ranges = epoch_ranges(cfg)
    expected = expected_tables(committed, ranges)
    assert counts(cfg) == expected.counts and dead_letters(cfg) == set()
    # the epoch ended at the last stable offset: the open transaction's records were not read
    _, lso = broker_io.partition_offsets(cfg)
    assert {p: u for p, (_, u) in ranges[0].items()} == lso

    producer.abort_transaction()
    producer.close()
    second = epoch_mod.run_epoch(cfg, spark)  # spans the aborted transaction: offsets, no records
    assert second.plan.size > 0 and second.records_read == 0
    assert counts(cfg) == expected.counts


def test_partitions_added_between_epochs_are_read_from_their_first_offset(cfg, spark):
    gen = TrafficGenerator(seed=43, events_per_second=20)
    first_batch = produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, BASE_MS), partition_of=lambda i, r: i % 3)
    epoch_mod.run_epoch(cfg, spark)

    admin = KafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers)
    admin.create_partitions({cfg.topic: 5})
    admin.close()
    second_batch = produce(cfg.bootstrap_servers, cfg.topic, gen.records(100, BASE_MS + 5_000),
                           partition_of=lambda i, r: i % 5)
    s = epoch_mod.run_epoch(cfg, spark)
    assert {r.partition: r.from_offset for r in s.plan.ranges} == {0: 30, 1: 30, 2: 30, 3: 0, 4: 0}
    assert s.records_read == len(second_batch)

    everything = first_batch + second_batch
    ends = Counter(p.partition for p in everything)
    assert {p: u for p, (_, u) in epoch_ranges(cfg)[-1].items()} == dict(ends)
    assert counts(cfg) == expected_tables(everything, epoch_ranges(cfg)).counts


def test_event_time_from_the_kafka_record_timestamp(cfg, spark):
    """event_time = kafka: windows and lateness follow the record timestamps, and payloads
    without a time of their own are counted."""
    import json

    from ipcount_lab.generator import Record
    from tests.tables import finality, late_records

    cfg = cfg.replace(event_time="kafka")
    ips = ["203.0.113.9", "198.51.100.7", "2001:db8::1"]
    first = [Record(None, json.dumps({"ip": ips[i % 3]}).encode()) for i in range(60)]
    # record i at BASE + i * 500 ms: 30 s of traffic, 6 windows
    produced = produce(cfg.bootstrap_servers, cfg.topic, first, partition_of=lambda i, r: i % 3,
                       timestamp_of=lambda i, r: BASE_MS + i * 500)
    epoch_mod.run_epoch(cfg, spark)
    # then records stamped 20 s in the past: windows closed for more than the allowed 5 s
    late = [Record(None, f'{ips[i % 3]} - - [01/Jan/2001:00:00:00 +0000] "GET / HTTP/1.1" 200 1'.encode())
            for i in range(9)]
    produced += produce(cfg.bootstrap_servers, cfg.topic, late, partition_of=lambda i, r: i % 3,
                        timestamp_of=lambda i, r: BASE_MS + 10_000 + i * 100)
    s = epoch_mod.run_epoch(cfg, spark)
    assert s.records_late == 9

    expected = expected_tables(produced, epoch_ranges(cfg), event_time="kafka")
    assert counts(cfg) == expected.counts
    assert sum(expected.counts.values()) == 60 and len(late_records(cfg)) == 9
    assert {w for w, _ in expected.counts} == {BASE_MS + k * 5_000 for k in range(6)}
    # watermark = BASE + 29.5 s: windows ending by BASE + 24.5 s are final
    assert {w for (w, _), final in finality(cfg).items() if final} == {BASE_MS + k * 5_000 for k in range(4)}
