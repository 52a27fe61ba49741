"""Backfills, rebuilds and verification against the real broker, Spark and Delta.

Ground truth is replayed in plain Python lane by lane (the scheduled chain, and each
backfill request, chain their own watermarks), over the ranges the ledger committed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from ipcount.jobs.backfill import run_backfill
from ipcount.jobs.epoch import run_epoch
from ipcount.jobs.rebuild import rebuild
from ipcount.jobs.verify import verify
from ipcount.rules.config import COMMAND_SETTINGS, REPO_ROOT
from ipcount.rules.errors import BadRequestError, DataLossError, TableSetMismatch
from ipcount.rules.offsets import OffsetRange
from ipcount.rules.requests import BackfillRequest, parse_offsets
from ipcount.storage import broker as broker_io
from ipcount_lab.generator import TrafficGenerator, produce
from tests.conftest import run_until_idle
from tests.ground_truth import Expected, expected_tables
from tests.tables import counts, counts_merges, dead_letters, finality, lanes, late_records
from tests.tables import ledger as ledger_rows
from tests.tables import owned_offsets, snapshot

BASE_MS = 1_795_255_200_000  # 2026-11-21T10:00:00Z


def produce_dataset(cfg, n, seed, base_ms=BASE_MS, kafka_ts=None):
    gen = TrafficGenerator(seed=seed, events_per_second=50, late_share=0.04, malformed_share=0.03)
    return produce(cfg.bootstrap_servers, cfg.topic, gen.records(n, base_ms), partition_of=lambda i, r: i % 3,
                   timestamp_of=kafka_ts)


def lane_truth(produced, cfg) -> Expected:
    """The tables the documented rules give for the ledger's lanes, summed."""
    total = Expected()
    for epochs in lanes(cfg).values():
        e = expected_tables(produced, epochs)
        total.counts += e.counts
        total.dead |= e.dead
        total.late |= e.late
    return total


def assert_tables_match(cfg, produced):
    want = lane_truth(produced, cfg)
    assert counts(cfg) == want.counts
    assert dead_letters(cfg) == want.dead
    assert late_records(cfg) == want.late
    return want


def ends_of(produced) -> dict[int, int]:
    return dict(Counter(p.partition for p in produced))


def test_backfill_history_after_starting_at_latest_then_rebuild_and_verify(cfg, spark):
    cfg = cfg.replace(start_position="latest", max_records_per_epoch=250)
    history = produce_dataset(cfg, 600, seed=21)
    first = run_epoch(cfg, spark)                      # pins "latest" in the ledger: an empty epoch
    assert first.records_read == 0 and first.plan.size == 0
    live = produce_dataset(cfg, 300, seed=22, base_ms=BASE_MS + 60_000)
    produced = history + live
    run_until_idle(cfg, spark)
    assert sum(counts(cfg).values()) < 300             # history is not counted yet

    pinned = ends_of(history)
    spec = ",".join(f"{p}:0-{u}" for p, u in sorted(pinned.items()))
    report = run_backfill(cfg, spark, BackfillRequest(offsets=parse_offsets(spec, cfg.topic)))
    assert len(report.epochs) == 3                      # 600 offsets at 250 per epoch
    assert report.skipped == ()
    assert sum(e.records_read for e in report.epochs) == 600
    want = assert_tables_match(cfg, produced)
    assert sum(want.counts.values()) + len(want.late) + len(want.dead) == len(produced)
    ends = ends_of(produced)
    for p, spans in owned_offsets(cfg).items():  # (owned_offsets asserts that no two rows overlap)
        assert spans[0][0] == 0 and spans[-1][1] == ends[p]
        assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:])), spans  # no gap either

    # Asking again counts nothing and says so; a wider request counts only the new part.
    before = snapshot(cfg)
    again = run_backfill(cfg, spark, BackfillRequest(offsets=parse_offsets(spec, cfg.topic)))
    assert again.epochs == [] and again.skipped == again.requested
    assert snapshot(cfg) == before
    more = produce_dataset(cfg, 90, seed=23, base_ms=BASE_MS + 120_000)
    produced += more
    wider = ",".join(f"{p}:0-{u}" for p, u in sorted(ends_of(produced).items()))
    partial = run_backfill(cfg, spark, BackfillRequest(offsets=parse_offsets(wider, cfg.topic)))
    assert sum(e.records_read for e in partial.epochs) == 90
    assert {(r.partition, r.from_offset, r.until_offset) for r in partial.skipped} == {
        (p, 0, u) for p, u in ends.items()}
    assert_tables_match(cfg, produced)
    assert run_epoch(cfg, spark) is None               # the chain skips what the backfill took

    # Verify: the live table matches a recount from Kafka.
    check = verify(cfg)
    assert check.ok, [d.line() for d in check.differences[:5]]
    assert check.records == len(produced) and check.windows == len(counts(cfg))

    # Rebuild: replaying the whole ledger gives the same tables, row for row.
    result = rebuild(cfg, spark, into="rebuilt")
    assert len(result.replayed) == sum(len(epochs) for epochs in lanes(cfg).values()) > 5
    rebuilt = cfg.for_target("rebuilt")
    # (a rebuild happens later: the lag it saw, and its own table versions, differ)
    ignore = frozenset({"lag_after", "sink_version"})
    assert snapshot(rebuilt, ignore) == snapshot(cfg, ignore)
    again_rebuilt = rebuild(cfg, spark, into="rebuilt")           # resumable: nothing left to do
    assert again_rebuilt.replayed == [] and again_rebuilt.already == result.replayed

    # A table altered behind the ledger's back: verify names each planted difference.
    first_ip = min(ip for _, ip in counts(rebuilt))
    spark.sql(f"UPDATE delta.`{rebuilt.counts_path}` SET count = count + 2 WHERE ip = '{first_ip}'")
    victim = (spark.read.format("delta").load(rebuilt.counts_path).where(f"ip != '{first_ip}'")
              .orderBy("window_start", "ip").first())
    spark.sql(f"DELETE FROM delta.`{rebuilt.counts_path}` WHERE window_start = '{victim.window_start}' "
              f"AND ip = '{victim.ip}'")
    bad = verify(cfg, "rebuilt")
    assert not bad.ok
    by_key = {(d.window_start_ms, d.ip): (d.expected, d.actual) for d in bad.differences}
    live_counts = counts(cfg)
    altered = {k for k in live_counts if k[1] == first_ip}
    deleted = (int(victim.window_start.timestamp() * 1000), victim.ip)
    assert set(by_key) == altered | {deleted} and deleted not in altered
    for k in altered:
        assert by_key[k] == (live_counts[k], live_counts[k] + 2)
    assert by_key[deleted] == (live_counts[deleted], 0)
    assert verify(cfg).ok                               # the live table is untouched
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cli = subprocess.run([sys.executable, "-m", "ipcount.cli", "verify", "--target", "rebuilt", *cfg.to_args(COMMAND_SETTINGS["verify"])],
                         env=env, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 1, cli.stderr[-2000:]
    assert f"ip {victim.ip}: Kafka has {live_counts[deleted]}, table has 0" in cli.stdout
    assert f"MISMATCH: {len(by_key)} difference(s)" in cli.stdout


def test_backfill_by_time_into_a_replay_table(cfg, spark):
    hour = 3_600_000
    # Yesterday, as Kafka record timestamps: relative to now, since the broker deletes records
    # older than its retention (7 days) by their timestamps, possibly in the middle of the test.
    t0 = (int(time.time() * 1000) // hour - 24) * hour
    # [t0, t0+150s), then an hour later; event times a little before their Kafka timestamps
    first = produce_dataset(cfg, 150, seed=31, base_ms=t0, kafka_ts=lambda i, r: t0 + i * 1000)
    second = produce_dataset(cfg, 150, seed=32, base_ms=t0 + hour, kafka_ts=lambda i, r: t0 + hour + i * 1000)
    request = BackfillRequest(target="audit", from_ms=t0, until_ms=t0 + hour)
    report = run_backfill(cfg.replace(max_records_per_epoch=60), spark, request)
    assert sum(e.records_read for e in report.epochs) == 150
    audit = cfg.for_target("audit")
    want = expected_tables(first + second, lanes(audit)[request.request_id])
    assert counts(audit) == want.counts and dead_letters(audit) == want.dead
    assert sum(want.counts.values()) + len(want.late) + len(want.dead) == 150
    # requested exactly the first batch's offsets; the main tables were not touched
    assert {(r.partition, r.from_offset, r.until_offset) for r in report.requested} == {
        (p, 0, n) for p, n in ends_of(first).items()}
    assert not Path(cfg.ledger_path).exists()
    assert verify(cfg, "audit").ok


@pytest.mark.parametrize("storage", ["local", "object_store"])
def test_concurrent_backfill_and_scheduled_epochs_never_double_count(storage, request, spark, tmp_path):
    """A backfill process and the scheduled chain race over the same offsets, with the
    tables in a local directory and on S3 (s3proxy)."""
    cfg = request.getfixturevalue("cfg" if storage == "local" else "s3_cfg")
    cfg = cfg.replace(max_records_per_epoch=150)
    produced = produce_dataset(cfg, 1050, seed=41)
    spec = ",".join(f"{p}:0-{u}" for p, u in sorted(ends_of(produced).items()))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    log_path = tmp_path / "backfill.log"  # a file, not a pipe: a full pipe would stall the process
    with open(log_path, "w") as log:
        backfill = subprocess.Popen([sys.executable, "-m", "ipcount.cli", "backfill", "--offsets", spec,
                                     *cfg.to_args()], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        # The chain starts once the backfill has planned: a chain of small epochs in a warm
        # session would otherwise take every offset before the backfill's JVM is up.
        deadline = time.monotonic() + 600
        while backfill.poll() is None and not any(r["kind"] == "backfill" for r in ledger_rows(cfg)):
            assert time.monotonic() < deadline, "the backfill planned nothing"
            time.sleep(0.2)
        chain = []
        while backfill.poll() is None or not chain or chain[-1] is not None:
            assert time.monotonic() < deadline, "race did not finish"
            chain.append(run_epoch(cfg, spark))
    finally:
        if backfill.poll() is None:
            backfill.kill()
    out = log_path.read_text()
    assert backfill.returncode == 0, out[-3000:]
    kinds = lanes(cfg)
    assert "scheduled" in kinds and len(kinds) == 2, list(kinds)     # both lanes really committed epochs
    owned = owned_offsets(cfg)                                        # asserts no overlap
    ends = ends_of(produced)
    assert {p: sum(b - a for a, b in spans) for p, spans in owned.items()} == ends
    assert_tables_match(cfg, produced)
    print("scheduled epochs", len(kinds["scheduled"]), "backfill epochs",
          sum(len(v) for k, v in kinds.items() if k != "scheduled"), "conflicts retried:",
          out.count("planning again"))


def test_bad_requests_fail_before_any_write(cfg, spark, broker):
    produce_dataset(cfg, 30, seed=51)
    ends = broker_io.partition_offsets(cfg)[1]
    cases = [
        (BackfillRequest(offsets=(OffsetRange(cfg.topic, 7, 0, 5),)), BadRequestError, "has no partition 7"),
        (BackfillRequest(offsets=(OffsetRange(cfg.topic, 0, 0, ends[0] + 5),)), BadRequestError,
         "beyond the end of the log"),
        (BackfillRequest(from_ms=int(time.time() * 1000) - 1000, until_ms=int(time.time() * 1000) + 3_600_000),
         BadRequestError, "ends in the future"),
    ]
    for request, error, message in cases:
        with pytest.raises(error, match=message):
            run_backfill(cfg, spark, request)
    with pytest.raises(broker_io.UnknownTopicError, match="does not exist"):
        run_backfill(cfg.replace(topic="no_such_topic_x"), spark, BackfillRequest(offsets=parse_offsets("0:0-1", "x")))
    # offsets deleted by retention
    with broker_io.admin_client(cfg) as admin:
        from kafka import TopicPartition
        admin.delete_records({TopicPartition(cfg.topic, 0): 4})
    with pytest.raises(BadRequestError, match=r"offsets \[0, 4\) of .*-0 were already deleted"):
        run_backfill(cfg, spark, BackfillRequest(offsets=parse_offsets("0:0-6", cfg.topic)))
    with pytest.raises(BadRequestError, match="fresh replay target"):
        rebuild(cfg, spark, into="main")
    with pytest.raises(BadRequestError, match="has no ledger"):
        rebuild(cfg, spark, into="fresh")
    assert not Path(cfg.warehouse).exists()             # nothing was written anywhere

    # The CLI says what to fix, with exit code 2, before starting Spark.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for args, message in [(["--offsets", "0:9-3"], "until (3) must be greater than from (9)"),
                          (["--offsets", "0:0-3", "--target", "../../etc"], "plain identifier"),
                          (["--from-time", "2026-11-20T10:00:00Z", "--until-time", "2026-11-20T09:00:00Z"],
                           "must be after from"),
                          (["--from-time", "noon"], "needs --until-time"),
                          (["--offsets", "0:0-1", "--until-time", "2026-11-20T09:00:00Z"], "goes with --from-time")]:
        done = subprocess.run([sys.executable, "-m", "ipcount.cli", "backfill", *args, *cfg.to_args()], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (args, done.stderr[-2000:])
        assert message in done.stderr, (args, done.stderr[-2000:])
    assert not Path(cfg.warehouse).exists()


def test_rebuild_refuses_when_kafka_no_longer_has_the_offsets(cfg, spark):
    produce_dataset(cfg, 30, seed=61)
    run_until_idle(cfg, spark)
    with broker_io.admin_client(cfg) as admin:
        from kafka import TopicPartition
        admin.delete_records({TopicPartition(cfg.topic, 1): 3})
    with pytest.raises(DataLossError, match=r"cannot rebuild epoch 1: .*-1\[0,10\) is no longer in Kafka"):
        rebuild(cfg, spark, into="again")
    assert not Path(cfg.for_target("again").ledger_path).exists()


def test_rebuild_writes_only_into_a_fresh_target_or_its_own_earlier_rebuild(cfg, spark):
    """A target holding other epochs (a backfill's, another source's rebuild) is refused:
    its epoch ids would pass for replayed ones and be skipped, and verify would not see it."""
    class Stopped(Exception):
        pass

    sinks = []

    def stop_after_second_sink(point: str) -> None:
        sinks.append(point)
        if sinks.count("after_sink") == 2:
            raise Stopped(point)

    cfg = cfg.replace(max_records_per_epoch=40)
    produce_dataset(cfg, 120, seed=91)
    run_until_idle(cfg, spark)
    # a backfill into "audit" of offsets within epoch 1's ranges: its epoch 1 looks replayed
    run_backfill(cfg, spark, BackfillRequest(target="audit", offsets=parse_offsets("0:0-5", cfg.topic)))
    audit = cfg.for_target("audit")
    before = snapshot(audit)
    with pytest.raises(TableSetMismatch, match=r"rebuild_of: recorded \(none\).*rebuild into a new name"):
        rebuild(cfg, spark, into="audit")
    assert snapshot(audit) == before                    # nothing was written

    with pytest.raises(Stopped):                         # a rebuild stopped in its second epoch
        rebuild(cfg, spark, into="rebuilt", crash=stop_after_second_sink)
    with pytest.raises(TableSetMismatch, match=r"rebuild_of: recorded [\w-]+, now [\w-]+"):
        rebuild(cfg, spark, into="rebuilt", source="audit")
    resumed = rebuild(cfg, spark, into="rebuilt")        # its own rebuild goes on
    assert len(resumed.already) == 1 and len(resumed.replayed) == len(lanes(cfg)["scheduled"]) - 1
    ignore = frozenset({"lag_after", "sink_version"})
    assert snapshot(cfg.for_target("rebuilt"), ignore) == snapshot(cfg, ignore)


def test_a_rebuild_resumed_twice_while_the_source_grew_finishes_every_planned_epoch(cfg, spark):
    """A rebuild replays epochs in the order of their counts commits, and an epoch that wrote
    no counts goes first. One that the source gained between two stopped rebuilds is planned
    out of epoch order, so the target holds two planned scheduled epochs; the next rebuild
    used to see only the lower one as unfinished and fail to record the other again
    (PlanConflict: its epoch id exists; found by the long chaos run)."""
    from ipcount.storage.ledger import Ledger

    class Stopped(Exception):
        pass

    def stop_after_first_plan(point: str) -> None:
        if point == "after_plan":
            raise Stopped(point)

    cfg = cfg.replace(max_records_per_epoch=40)
    produce_dataset(cfg, 120, seed=95)
    run_until_idle(cfg, spark)
    with pytest.raises(Stopped):                 # the target's first epoch planned, not committed
        rebuild(cfg, spark, into="rebuilt", crash=stop_after_first_plan)
    # The source gains an epoch of malformed records only: no counts, so it replays first.
    produce(cfg.bootstrap_servers, cfg.topic, TrafficGenerator(seed=96, malformed_share=1.0).records(6, BASE_MS),
            partition_of=lambda i, r: i % 3)
    run_until_idle(cfg, spark)
    (first, version), *_ = Ledger(cfg.ledger_path).epochs(cfg.topic)
    assert version is None and first.epoch == max(p.epoch for p, _ in Ledger(cfg.ledger_path).epochs(cfg.topic))
    with pytest.raises(Stopped):                 # ... and is planned in the target too
        rebuild(cfg, spark, into="rebuilt", crash=stop_after_first_plan)
    planned = {r["epoch"] for r in ledger_rows(cfg.for_target("rebuilt")) if r["status"] == "planned"}
    assert planned == {1, first.epoch}

    resumed = rebuild(cfg, spark, into="rebuilt")
    assert sorted(resumed.replayed) == sorted({r["epoch"] for r in ledger_rows(cfg)})
    ignore = frozenset({"lag_after", "sink_version"})
    assert snapshot(cfg.for_target("rebuilt"), ignore) == snapshot(cfg, ignore)
    assert verify(cfg, "rebuilt").ok


def test_the_ledger_refuses_overlapping_plans_even_recorded_at_the_same_moment(cfg, spark):
    import threading

    from ipcount.rules.errors import PlanConflict
    from ipcount.rules.ledger import BACKFILL, EpochPlan
    from ipcount.storage.ledger import Ledger

    t = cfg.topic
    ledger = Ledger(cfg.ledger_path)
    ledger.ensure()
    ledger.record_plan(EpochPlan(1, (OffsetRange(t, 0, 0, 10),)), None)
    with pytest.raises(PlanConflict):       # overlaps a recorded range
        ledger.record_plan(EpochPlan(2, (OffsetRange(t, 0, 5, 15),), kind=BACKFILL, request_id="r"), None)
    with pytest.raises(PlanConflict):       # takes a recorded epoch id
        ledger.record_plan(EpochPlan(1, (OffsetRange(t, 1, 0, 10),)), None)
    ledger.record_plan(EpochPlan(2, (OffsetRange(t, 0, 10, 20),), kind=BACKFILL, request_id="r"), None)

    # Two planners that read the same ledger record overlapping plans at once: never both.
    for i in range(6):
        start = 100 * (i + 1)
        plans = (EpochPlan(10 + 2 * i, (OffsetRange(t, 0, start, start + 50),)),
                 EpochPlan(11 + 2 * i, (OffsetRange(t, 0, start + 25, start + 75),), kind=BACKFILL, request_id="r"))
        barrier, results = threading.Barrier(2), [None, None]

        def record(k):
            barrier.wait()
            try:
                ledger.record_plan(plans[k], None)
                results[k] = "recorded"
            except PlanConflict:
                results[k] = "refused"
        threads = [threading.Thread(target=record, args=(k,)) for k in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
        assert sorted(results) == ["recorded", "refused"], results
    owned_offsets(cfg)                       # (asserts that no two ledger rows overlap)
    assert len({r["epoch"] for r in ledger_rows(cfg)}) == 2 + 6


def test_a_backfill_ahead_of_a_lagging_chain_marks_nothing_final_the_chain_still_counts(cfg, spark):
    """Windows are final against the live chain's watermark: a backfill's own watermark used
    to mark windows final that the chain then still counted records into."""
    def batch(seed, start_ms):
        gen = TrafficGenerator(seed=seed, events_per_second=5, late_share=0, malformed_share=0)
        return produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, start_ms), partition_of=lambda i, r: i % 3)
    first = batch(91, BASE_MS)
    run_until_idle(cfg, spark)                       # the chain's watermark: about BASE + 18 s
    second = batch(92, BASE_MS + 600_000)            # ten minutes later, 18 s of events
    third = batch(92, BASE_MS + 600_000)             # the same again: the same windows and IPs
    spec = ",".join(f"{p}:{min(r.offset for r in second if r.partition == p)}-"
                    f"{max(r.offset for r in second if r.partition == p) + 1}" for p in range(3))
    run_backfill(cfg, spark, BackfillRequest(offsets=parse_offsets(spec, cfg.topic)))
    after_backfill = counts(cfg)
    final_then = {k for k, final in finality(cfg).items() if final}
    # the chain's watermark (about BASE + 18 s) has passed none of the backfilled windows
    assert final_then and all(k[0] < BASE_MS + 600_000 for k in final_then)

    run_until_idle(cfg, spark)                       # the chain counts the third batch
    now = counts(cfg)
    assert all(now[k] == after_backfill[k] for k in final_then), "a final window's count changed"
    assert any(now[k] != after_backfill[k] for k in after_backfill)  # the chain did add to them
    # and the chain finalized them as its own watermark passed them
    want = lane_truth(first + second + third, cfg)
    assert now == want.counts
    chain_watermark = max(r["watermark_after_ms"] for r in ledger_rows(cfg)
                          if r.get("kind") in (None, "scheduled") and r["watermark_after_ms"] is not None)
    assert finality(cfg) == {k: k[0] + 10_000 <= chain_watermark for k in now}


def test_a_backfill_committing_behind_the_chain_is_finalized_in_a_full_pass(cfg, spark):
    """A backfill planned at the chain's watermark W1 commits after the chain moved on to W2,
    leaving rows not final below W2. Each chain epoch finalizes with a read bounded by the
    last watermark only while the chain alone writes the counts table; the backfill's commit
    makes the next one a full pass, or those rows would never become final."""
    class Stopped(Exception):
        pass

    def stop_after_plan(point: str) -> None:
        if point == "after_plan":
            raise Stopped(point)

    def batch(seed, start_ms):
        gen = TrafficGenerator(seed=seed, events_per_second=5, late_share=0, malformed_share=0)
        return produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, start_ms), partition_of=lambda i, r: i % 3)
    first = batch(71, BASE_MS)
    run_until_idle(cfg, spark)                                   # W1: about BASE + 18 s
    second = batch(72, BASE_MS + 600_000)
    spec = ",".join(f"{p}:{min(r.offset for r in second if r.partition == p)}-"
                    f"{max(r.offset for r in second if r.partition == p) + 1}" for p in range(3))
    request = BackfillRequest(offsets=parse_offsets(spec, cfg.topic))
    with pytest.raises(Stopped):                                 # planned at W1, then stopped
        run_backfill(cfg, spark, request, crash=stop_after_plan)
    third = batch(73, BASE_MS + 1_200_000)
    run_until_idle(cfg.replace(max_records_per_epoch=30), spark)  # W2: about BASE + 1218 s
    assert not counts_merges(cfg)[-1]["full_pass"]               # the chain alone: bounded reads

    run_backfill(cfg, spark, request)                            # finishes its chunk against W1
    backfilled = counts_merges(cfg)[-1]["version"]
    assert not any(final for (w, _), final in finality(cfg).items() if BASE_MS + 600_000 <= w < BASE_MS + 700_000)

    fourth = batch(74, BASE_MS + 1_800_000)
    run_until_idle(cfg, spark)
    now = counts(cfg)
    assert now == lane_truth(first + second + third + fourth, cfg).counts
    chain_watermark = max(r["watermark_after_ms"] for r in ledger_rows(cfg)
                          if r.get("kind") in (None, "scheduled") and r["watermark_after_ms"] is not None)
    assert finality(cfg) == {k: k[0] + 10_000 <= chain_watermark for k in now}
    after = [m for m in counts_merges(cfg) if m["version"] > backfilled]
    assert after and after[0]["full_pass"]
