"""Epochs against the real broker, Spark and Delta, checked against plain-Python ground truth."""
from __future__ import annotations

from collections import Counter

from deltalake import DeltaTable

from ipcount.jobs import epoch as epoch_mod
from ipcount.jobs import group_commit
from ipcount.rules import offsets as offsets_rules
from ipcount.storage import broker as broker_io
from ipcount.storage.sink import Sink
from ipcount_lab.generator import TrafficGenerator, produce
from tests.conftest import run_until_idle
from tests.ground_truth import expected_tables
from tests.tables import counts, counts_merges, dead_letters, epoch_ranges, finality, late_records, snapshot
from tests.tables import ledger as ledger_rows

BASE_MS = 1_795_255_200_000  # 2026-11-21T10:00:00Z


def produce_dataset(cfg, n=1500, seed=11):
    gen = TrafficGenerator(seed=seed, events_per_second=50, late_share=0.04, malformed_share=0.03)
    return produce(cfg.bootstrap_servers, cfg.topic, gen.records(n, BASE_MS), partition_of=lambda i, r: i % 3)


def assert_contiguous(ranges_per_epoch, ends, cap):
    """Per partition the committed ranges start at 0, chain with no gap or overlap, and end
    at the partition's end; no epoch spans more than the cap."""
    position = {p: 0 for p in ends}
    for ranges in ranges_per_epoch:
        assert sum(u - f for f, u in ranges.values()) <= cap
        for p, (f, u) in ranges.items():
            assert f == position[p], (p, f, position[p])
            assert u >= f
            position[p] = u
    assert position == ends


def test_epochs_count_exactly_what_was_produced(cfg, spark):
    cfg = cfg.replace(max_records_per_epoch=400)
    produced = produce_dataset(cfg)
    summaries = run_until_idle(cfg, spark)

    ends = Counter(p.partition for p in produced)
    ranges = epoch_ranges(cfg)
    assert len(ranges) == len(summaries) >= 4  # 1500 records at 400 per epoch
    assert [s.epoch for s in summaries] == list(range(1, len(summaries) + 1))
    assert_contiguous(ranges, dict(ends), 400)

    expected = expected_tables(produced, ranges)
    assert counts(cfg) == expected.counts
    assert dead_letters(cfg) == expected.dead
    assert late_records(cfg) == expected.late
    # the data set exercises every path, and everything read is accounted for exactly once
    assert expected.late and expected.dead and len(expected.counts) > 100
    assert sum(expected.counts.values()) + len(expected.late) + len(expected.dead) == len(produced)
    assert sum(s.records_read for s in summaries) == len(produced)
    assert sum(s.records_late for s in summaries) == len(expected.late)
    assert sum(s.records_malformed for s in summaries) == len(expected.dead)
    # a window is final once the last watermark passed its end plus the allowed lateness
    want_final = {key: key[0] + 5_000 + 5_000 <= expected.watermark_ms for key in expected.counts}
    assert finality(cfg) == want_final
    # a new counts table is partitioned by the window's day and finality; every row carries its
    # day and hour
    table = DeltaTable(cfg.counts_path)
    assert table.metadata().partition_columns == ["window_day", "is_final"]
    rows = table.to_pyarrow_table(columns=["window_start", "window_day", "window_hour"]).to_pylist()
    assert rows and all((r["window_start"].strftime("%Y-%m-%d"), r["window_start"].strftime("%Y-%m-%dT%H"))
                        == (r["window_day"], r["window_hour"]) for r in rows)
    assert 0 < sum(want_final.values()) < len(want_final)
    # the first two counts commits finalize in a full pass; from the third on, back to back
    # with the chain's last two, a read bounded by the last watermark is enough
    merges = counts_merges(cfg)
    assert len(merges) == len(summaries) and [m["full_pass"] for m in merges[:2]] == [True, True]
    assert not any(m["full_pass"] for m in merges[2:])
    # `ipcount latency` reads the same epochs back: every record, from its produce time on
    from ipcount.jobs.latency import measure

    waited = measure(cfg)
    assert (waited.epochs, waited.records) == (len(summaries), len(produced))
    assert 0 < waited.p50_seconds <= waited.p95_seconds <= waited.max_seconds


def test_one_task_and_spread_reads_and_changed_kafka_options_count_the_same(cfg, spark, monkeypatch):
    """Small epochs read, parse and tally in one task, larger ones in a task per partition and
    a shuffle; and a read whose Kafka options changed gets other consumers from Spark's pool,
    which refuses other options for a group id it has seen. Both ways, in one session, the
    tables hold exactly what was produced."""
    monkeypatch.setattr(offsets_rules, "ONE_TASK_RECORDS", 350)
    one_task = []
    decide = epoch_mod.reads_in_one_task
    monkeypatch.setattr(epoch_mod, "reads_in_one_task",
                        lambda records: one_task.append(decide(records)) or one_task[-1])
    cfg = cfg.replace(max_records_per_epoch=400)
    produced = produce_dataset(cfg)  # 1,500 records: epochs of 400, 400, 400 and 300
    summaries = [epoch_mod.run_epoch(cfg, spark)]
    port = cfg.bootstrap_servers.rsplit(":", 1)[1]
    summaries += run_until_idle(cfg.replace(bootstrap_servers=f"localhost:{port}"), spark)

    assert one_task == [False, False, False, True]
    ranges = epoch_ranges(cfg)
    assert [s.epoch for s in summaries] == [1, 2, 3, 4] and len(ranges) == 4
    expected = expected_tables(produced, ranges)
    assert counts(cfg) == expected.counts and len(expected.counts) > 100
    assert dead_letters(cfg) == expected.dead and expected.dead
    assert late_records(cfg) == expected.late and expected.late
    assert sum(s.records_read for s in summaries) == len(produced)


def test_group_offsets_follow_the_ledger_and_are_never_read_back(cfg, spark):
    produced = produce_dataset(cfg, n=300)
    epoch_mod.run_epoch(cfg, spark)
    assert group_commit.commit_group_offsets_from_ledger(cfg)
    ends = dict(Counter(p.partition for p in produced))
    assert broker_io.group_offsets(cfg) == ends

    # A group rewound to 0 by someone else does not make the pipeline re-read anything.
    broker_io.commit_group_offsets(cfg, {0: 0, 1: 0, 2: 0}, epoch=0)
    assert epoch_mod.run_epoch(cfg, spark) is None
    more = produce_dataset(cfg, n=30, seed=12)
    s = epoch_mod.run_epoch(cfg, spark)
    assert s.records_read == len(more)
    assert {r.partition: r.from_offset for r in s.plan.ranges} == ends


def test_an_epoch_loads_each_of_its_tables_from_the_log_once(cfg, spark, table_loads):
    """Each use after the first only reads the commits made since (``one_epoch_of_tables``):
    an epoch used to load its four tables seventeen times."""
    cfg = cfg.replace(max_records_per_epoch=150)
    produced = produce_dataset(cfg, n=300)
    for _ in range(2):  # the first epoch creates the tables, the second finds them
        table_loads.clear()
        summary = epoch_mod.run_epoch(cfg, spark)
        assert sorted(table_loads) == sorted([cfg.ledger_path, cfg.counts_path, cfg.dead_letter_path,
                                             cfg.late_path])
    assert summary.epoch == 2
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead


def test_offset_commit_off_leaves_the_group_untouched(cfg, spark):
    cfg = cfg.replace(commit_offsets=False)
    produce_dataset(cfg, n=60)
    epoch_mod.run_epoch(cfg, spark)
    assert not group_commit.commit_group_offsets_from_ledger(cfg)
    assert broker_io.group_offsets(cfg) == {}


def test_replaying_a_committed_epoch_changes_nothing(cfg, spark):
    """The sink's writes and the ledger commit, repeated for a committed epoch, are no-ops."""
    from ipcount.jobs.epoch import _read_and_tally
    from ipcount.storage.ledger import Ledger

    produce_dataset(cfg, n=200)
    first = epoch_mod.run_epoch(cfg, spark)
    produce_dataset(cfg, n=200, seed=12)
    second = epoch_mod.run_epoch(cfg, spark)
    before = snapshot(cfg)
    for s in (first, second):
        tally = _read_and_tally(spark, cfg, s.plan)
        assert sum(m.records_read for m in tally.metrics().values()) == s.records_read
        late = tally.late_records(s.plan.epoch, cfg.window_ms, s.plan.watermark_ms)
        assert Sink(cfg).write(s.plan, tally.counts(cfg.window_ms), tally.dead_letters(s.plan.epoch), late,
                               watermark_after_ms=s.watermark_ms) == s.sink_version
        Ledger(cfg.ledger_path).commit(s.plan, {}, None, None, 0.0, "replay")
    assert snapshot(cfg) == before
    assert epoch_mod.run_epoch(cfg, spark) is None


def test_first_epoch_at_latest_skips_history_and_then_chains(cfg, spark):
    cfg = cfg.replace(start_position="latest")
    old = produce_dataset(cfg, n=90)
    first = epoch_mod.run_epoch(cfg, spark)
    assert first.records_read == 0
    assert {r.partition: (r.from_offset, r.until_offset) for r in first.plan.ranges} == \
        {p: (n, n) for p, n in Counter(x.partition for x in old).items()}
    new = produce_dataset(cfg, n=60, seed=3)
    second = epoch_mod.run_epoch(cfg, spark)
    assert second.records_read == len(new)
    expected = expected_tables(new, [{r.partition: (r.from_offset, r.until_offset) for r in second.plan.ranges}])
    assert counts(cfg) == expected.counts


def test_failed_group_commit_only_warns_and_the_next_commit_catches_up(cfg, spark, caplog):
    from tests.conftest import free_port

    produced = produce_dataset(cfg, n=120)
    epoch_mod.run_epoch(cfg, spark)
    unreachable = cfg.replace(bootstrap_servers=f"127.0.0.1:{free_port()}", kafka_timeout_seconds=2)
    assert group_commit.commit_group_offsets_from_ledger(unreachable) is False
    assert "could not commit offsets to consumer group" in caplog.text
    assert broker_io.group_offsets(cfg) == {}
    assert group_commit.commit_group_offsets_from_ledger(cfg)  # the next epoch's commit
    assert broker_io.group_offsets(cfg) == dict(Counter(p.partition for p in produced))


def test_kafka_consumer_groups_describe_shows_ledger_positions_and_true_lag(cfg, spark):
    """Kafka's own CLI sees what lag tools see: the ledger's positions and the real backlog."""
    import subprocess

    from ipcount.rules.config import REPO_ROOT
    from ipcount.storage.ledger import committed_positions

    cfg = cfg.replace(max_records_per_epoch=60)
    produced = produce_dataset(cfg, n=150)
    epoch_mod.run_epoch(cfg, spark)
    group_commit.commit_group_offsets_from_ledger(cfg)
    out = subprocess.run([str(REPO_ROOT / "bin" / "kafka-consumer-groups"), "--bootstrap-server",
                          cfg.bootstrap_servers, "--describe", "--group", cfg.group_id],
                         capture_output=True, text=True, timeout=120).stdout
    rows = {int(cols[2]): (int(cols[3]), int(cols[4]), int(cols[5]))
            for cols in (line.split() for line in out.splitlines()) if cols and cols[0] == cfg.group_id}
    _, positions = committed_positions(cfg.ledger_path, cfg.topic)
    ends = Counter(p.partition for p in produced)
    assert rows == {p: (positions[p], ends[p], ends[p] - positions[p]) for p in range(3)}
    assert sum(lag for _, _, lag in rows.values()) == 150 - 60
    # the ledger records the same lag, and the seconds of each stage
    from ipcount.storage.ledger import committed_epochs

    last = committed_epochs(cfg.ledger_path)[-1]
    assert last.lag_after == {p: lag for p, (_, _, lag) in rows.items()}
    assert set(last.stage_seconds) == {"plan", "read", "aggregate", "side_tables", "merge"}
    assert all(v >= 0 for v in last.stage_seconds.values())
    assert f"lag {150 - 60} |" in last.line()


def test_tables_from_an_older_schema_and_from_spark_gain_the_new_columns(cfg, spark):
    """Tables of earlier versions were created and written by delta-spark: delta-rs takes
    them over, adding the columns they lack."""
    from delta.tables import DeltaTable
    from deltalake import DeltaTable as RsDeltaTable
    from pyspark.sql.types import StructType

    from ipcount.rules.ledger import COLUMNS
    from ipcount.storage.ledger import ledger_schema

    # (columns added since the first release)
    added = ("lag_after", "stage_seconds", "kind", "request_id", "chain_watermark_ms", "planned_by", "summary")
    old_ledger = ", ".join(f"`{name}` {kind}" for name, kind, _ in COLUMNS if name not in added)
    (DeltaTable.createIfNotExists(spark).location(cfg.ledger_path).addColumns(StructType.fromDDL(old_ledger))
     .property("delta.autoOptimize.autoCompact", "true").execute())
    (DeltaTable.createIfNotExists(spark).location(cfg.counts_path).addColumns(StructType.fromDDL(
        "window_start timestamp, window_end timestamp, ip string, count bigint, first_epoch bigint, "
        "last_epoch bigint, is_final boolean")).execute())
    first = produce_dataset(cfg, n=30)
    assert epoch_mod.run_epoch(cfg, spark).records_read == 30
    assert spark.read.format("delta").load(cfg.ledger_path).schema.fieldNames() == ledger_schema().names
    second = produce_dataset(cfg, n=20, seed=2)
    assert epoch_mod.run_epoch(cfg, spark).records_read == 20
    assert [r["status"] for r in ledger_rows(cfg)].count("committed") >= 2
    assert counts(cfg) == expected_tables(first + second, epoch_ranges(cfg)).counts
    # the counts table keeps its layout, unpartitioned, and gains the partition columns
    counts_table = RsDeltaTable(cfg.counts_path)
    assert counts_table.metadata().partition_columns == []
    assert {"window_hour", "window_day"} <= set(counts_table.schema().to_arrow().names)


def test_one_record_from_a_bad_clock_does_not_stop_the_counting(cfg, spark):
    """A year-2099 record used to move the watermark to 2099: every later record was late."""
    from ipcount_lab.generator import Record

    gen = TrafficGenerator(seed=61, events_per_second=50, late_share=0, malformed_share=0)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(300, BASE_MS), partition_of=lambda i, r: i % 3)
    run_until_idle(cfg, spark)
    (bad,) = produce(cfg.bootstrap_servers, cfg.topic, [Record(b"k", b'{"ip": "1.2.3.4", "ts": 4102444700000}')],
                     partition_of=lambda i, r: 0)
    produced += [bad]
    produced += produce(cfg.bootstrap_servers, cfg.topic, gen.records(300, BASE_MS + 60_000),
                        partition_of=lambda i, r: i % 3)
    later = run_until_idle(cfg, spark)

    assert sum(s.records_counted for s in later) == 300
    assert sum(s.records_late for s in later) == 0
    assert (0, bad.offset, "event_time_ahead") in dead_letters(cfg)
    assert max(s.watermark_ms for s in later) < BASE_MS + 120_000
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead


def test_a_runner_that_loses_the_race_to_plan_finishes_the_winners_epoch(cfg, spark):
    """Two chain runners plan from the same ledger state: the loser's plan conflicts, and it
    used to plan the epoch after the winner's, leaving two unfinished scheduled epochs."""
    cfg = cfg.replace(max_records_per_epoch=100)
    produced = produce_dataset(cfg, n=300, seed=62)
    runner = epoch_mod.EpochRunner.open(cfg, spark)
    earliest, latest = broker_io.partition_offsets(cfg)
    seen_by_both = runner.state()
    winner, resumed = epoch_mod.next_chain_epoch(runner, earliest, latest, seen_by_both)
    assert (winner.epoch, resumed) == (1, False)
    loser, resumed = epoch_mod.next_chain_epoch(runner, earliest, latest, seen_by_both)
    assert (loser, resumed) == (winner, True)
    assert runner.state().unfinished == [1]
    run_until_idle(cfg, spark)
    ranges = epoch_ranges(cfg)
    assert_contiguous(ranges, dict(Counter(p.partition for p in produced)), 100)
    assert counts(cfg) == expected_tables(produced, ranges).counts


def test_the_on_data_watch_follows_the_ledger_and_log_ends_without_a_consumer_group(cfg, spark):
    from ipcount.jobs.idle import Watch

    watch = Watch(cfg)
    try:
        empty, key = watch.look()
        assert not empty.run and empty.why == "no epoch yet, and no record in the topic" and key == ()
        produce_dataset(cfg, n=300)
        first, key = watch.look()
        assert first.run and "no committed scheduled epoch" in first.why and key == ()
        run_until_idle(cfg, spark)
        with broker_io.admin_client(cfg) as admin:
            groups = sorted(map(str, admin.list_groups()))
        idle, key = watch.look()
        ends = {r["partition"]: r["until_offset"] for r in ledger_rows(cfg)}
        assert not idle.run and key == tuple(sorted(ends.items())), (idle, key)
        produce_dataset(cfg, n=30, seed=12)
        pending, same = watch.look()
        assert pending.run and pending.why.startswith("30 new offset(s)") and same == key, pending
        with broker_io.admin_client(cfg) as admin:
            assert sorted(map(str, admin.list_groups())) == groups   # it looked as an admin only
    finally:
        watch.close()
