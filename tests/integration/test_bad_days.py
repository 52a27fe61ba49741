"""Exactly once on a pipeline's bad days: retention passing an unfinished epoch or a backfill
chunk, months of log cleanup, a settling run racing the epoch's own runner, a plan commit
whose answer was lost. Each interleaving is forced step by step through the real code, and
the tables are compared with a ground truth counted in plain Python."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
from kafka import TopicPartition

from ipcount.jobs.backfill import run_backfill
from ipcount.jobs.epoch import EpochRunner, aged_out, next_chain_epoch, run_epoch
from ipcount.rules import errors
from ipcount.rules.errors import DataLossError
from ipcount.rules.requests import BackfillRequest, parse_offsets
from ipcount.storage import broker as broker_io
from ipcount.storage.delta import arrow_schema, rs_append_once
from ipcount.storage.ledger import Ledger
from ipcount.storage.sink import COUNTS_COLUMNS, Sink
from ipcount_lab.generator import Record, TrafficGenerator, produce
from tests.conftest import run_until_idle
from tests.ground_truth import expected_tables
from tests.integration.test_backfill import lane_truth
from tests.tables import counts, dead_letters, epoch_ranges, late_records, ledger

BASE_MS = 1_795_255_200_000  # 2026-11-21T10:00:00Z


class Died(Exception):
    """The run stopped at a step boundary (as a killed one would, without killing the tests)."""


def die_at(point: str):
    def hook(at: str) -> None:
        if at == point:
            raise Died(at)
    return hook


def produce_batch(cfg, seed: int, start_ms: int, n: int = 90):
    gen = TrafficGenerator(seed=seed, events_per_second=200, late_share=0.0, malformed_share=0.05)
    return produce(cfg.bootstrap_servers, cfg.topic, gen.records(n, start_ms), partition_of=lambda i, r: i % 3)


def delete_before(cfg, offsets: dict[int, int]) -> None:
    """Retention passes: the log of each partition now starts at the given offset."""
    with broker_io.admin_client(cfg) as admin:
        admin.delete_records({TopicPartition(cfg.topic, p): o for p, o in offsets.items()})


def commit_elsewhere(cfg, n: int) -> None:
    """``n`` commits to the counts table by other writers (another pipeline's fences)."""
    empty = arrow_schema(COUNTS_COLUMNS).empty_table()
    for i in range(n):
        rs_append_once(cfg.counts_path, empty, f"other/epoch-{i}", i, "other")


def clean_up_log(path: str) -> None:
    """What delta-rs's log cleanup leaves once the log retention has passed: a checkpoint,
    and no commit file before it."""
    from deltalake import DeltaTable

    table = DeltaTable(path)
    table.create_checkpoint()
    for commit in (Path(path) / "_delta_log").glob("*.json"):
        if int(commit.name.split(".")[0]) < table.version():
            commit.unlink()


def statuses(cfg) -> list[tuple]:
    return sorted((r["epoch"], r["status"], r["partition"], r["from_offset"], r["until_offset"]) for r in ledger(cfg))


def test_a_resumed_epoch_records_its_counts_version_after_log_cleanup(cfg, spark):
    """Which counts version holds an epoch comes from the table's own transactions: a
    window of commit history misses it once more commits follow or the log is cleaned."""
    produce_batch(cfg, 11, BASE_MS)
    with pytest.raises(Died):
        run_epoch(cfg, spark, crash=die_at("after_sink"))
    from deltalake import DeltaTable

    written = DeltaTable(cfg.counts_path).version()
    commit_elsewhere(cfg, 60)
    clean_up_log(cfg.counts_path)
    s = run_epoch(cfg, spark)
    assert s.resumed and s.epoch == 1 and s.sink_version == written
    assert {r["sink_version"] for r in ledger(cfg)} == {written}


@pytest.mark.parametrize("log_cleaned", [False, True])
def test_settling_an_epoch_whose_counts_are_in_keeps_them_once_with_their_watermark(cfg, spark, log_cleaned):
    cfg = cfg.replace(on_data_loss="skip")
    produced = produce_batch(cfg, 12, BASE_MS)
    run_epoch(cfg, spark)                                        # epoch 1: [0, 30) of each partition
    produced += produce_batch(cfg, 13, BASE_MS + 60_000)
    with pytest.raises(Died):                                    # epoch 2: counts in, ledger not
        run_epoch(cfg, spark, crash=die_at("after_sink"))
    if log_cleaned:
        commit_elsewhere(cfg, 60)
        clean_up_log(cfg.counts_path)
    delete_before(cfg, {1: 42})                                  # retention passes epoch 2's head
    assert run_epoch(cfg, spark) is None                         # settles epoch 2; nothing new
    assert [(e, s) for e, s, *_ in statuses(cfg)] == [(1, "committed")] * 3 + [(2, "committed")] * 3
    # Records in windows that epoch 2's watermark closed are late from now on.
    produced += produce_batch(cfg, 14, BASE_MS + 30_000)
    assert run_epoch(cfg, spark).epoch == 3
    want = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == want.counts
    assert late_records(cfg) == want.late and want.late
    assert dead_letters(cfg) == want.dead


def test_an_epoch_of_dead_letters_only_keeps_them_when_settled(cfg, spark):
    cfg = cfg.replace(on_data_loss="skip")
    produced = produce_batch(cfg, 15, BASE_MS)
    run_epoch(cfg, spark)
    produced += produce(cfg.bootstrap_servers, cfg.topic, [Record(None, b"not an event %d" % i) for i in range(30)],
                        partition_of=lambda i, r: i % 3)
    with pytest.raises(Died):
        run_epoch(cfg, spark, crash=die_at("after_sink"))        # its dead letters are in
    delete_before(cfg, {1: 35})
    assert run_epoch(cfg, spark) is None
    want = expected_tables(produced, epoch_ranges(cfg))          # every epoch committed, none lost
    assert dead_letters(cfg) == want.dead and len(want.dead) > 30
    assert counts(cfg) == want.counts


def test_a_runner_that_lost_to_the_fence_does_not_commit_the_epoch(cfg, spark):
    """A settling run fences epoch 2 and finds nothing of it written; the epoch's own runner,
    still busy, writes and commits between that decision and the release. Its writes are
    refused by the fence, and so must its ledger commit be: otherwise epoch 2 is committed
    with no counts, and what Kafka still holds of its ranges is never counted."""
    produced = produce_batch(cfg, 16, BASE_MS)
    run_epoch(cfg, spark)
    produced += produce_batch(cfg, 17, BASE_MS + 60_000)
    earliest, latest = broker_io.partition_offsets(cfg)
    plan, _ = next_chain_epoch(EpochRunner.open(cfg, spark), earliest, latest)   # epoch 2 planned
    decided, runner_done = threading.Event(), threading.Event()
    settler_failed: list[BaseException] = []

    class WaitsForTheRunner(Sink):  # the settler's sink: the runner goes on between decision and release
        def remove_epoch_rows(self, epoch: int) -> None:
            decided.set()
            runner_done.wait(300)
            super().remove_epoch_rows(epoch)

    def settle() -> None:
        try:
            skip = cfg.replace(on_data_loss="skip")
            settler = EpochRunner(skip, spark, Ledger(skip.ledger_path), WaitsForTheRunner(skip))
            now_earliest, now_latest = broker_io.partition_offsets(skip)
            settler.settle_aged_out(plan, aged_out(plan, now_earliest, now_latest))
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            settler_failed.append(e)
            decided.set()

    settler_thread = threading.Thread(target=settle)

    class SettledMeanwhile(Sink):  # the runner's sink: its records are read when retention passes
        def write(self, *args, **kwargs):
            delete_before(cfg, {1: 42})
            settler_thread.start()
            assert decided.wait(300)
            return super().write(*args, **kwargs)

    runner = EpochRunner(cfg, spark, Ledger(cfg.ledger_path), SettledMeanwhile(cfg))
    try:
        runner.execute(plan, earliest, latest, resumed=True)
        outcome: BaseException | None = None
    except Exception as e:  # noqa: BLE001 - checked below
        outcome = e
    finally:
        runner_done.set()
        settler_thread.join(300)
    assert not settler_failed, settler_failed
    run_until_idle(cfg.replace(on_data_loss="skip"), spark)        # the released rest is counted
    rows = statuses(cfg)
    assert [r for r in rows if r[0] == 2] == [(2, "lost", 1, 30, 42)]
    want = expected_tables(produced, _committed_ranges(cfg))
    assert counts(cfg) == want.counts
    assert dead_letters(cfg) == want.dead
    assert isinstance(outcome, errors.EpochFenced), outcome


def _committed_ranges(cfg) -> list[dict[int, tuple[int, int]]]:
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for r in ledger(cfg):
        if r["status"] == "committed":
            out.setdefault(r["epoch"], {})[r["partition"]] = (r["from_offset"], r["until_offset"])
    return [out[e] for e in sorted(out)]


def test_an_aged_out_backfill_chunk_is_settled_under_skip_and_loud_under_fail(cfg, spark):
    produced = produce_batch(cfg, 18, BASE_MS)
    first = BackfillRequest(offsets=parse_offsets("0:0-30,1:0-30,2:0-30", cfg.topic))
    with pytest.raises(Died):
        run_backfill(cfg, spark, first, crash=die_at("after_plan"))   # its chunk stays planned
    delete_before(cfg, {1: 12})
    produced += produce_batch(cfg, 19, BASE_MS + 60_000)
    later = BackfillRequest(offsets=parse_offsets("0:30-60,1:30-60,2:30-60", cfg.topic))
    with pytest.raises(DataLossError, match=rf"{cfg.topic}-1: offsets \[0, 12\) of unfinished backfill epoch 1 "
                                            r".* were deleted .*--on-data-loss skip"):
        run_backfill(cfg, spark, later)
    report = run_backfill(cfg.replace(on_data_loss="skip"), spark, later)
    assert report.records_counted > 0
    rows = statuses(cfg)
    assert [r[1:] for r in rows if r[1] != "committed"] == [("lost", 1, 0, 12)]
    covered = {p: sorted((f, u) for _, s, q, f, u in rows if q == p) for p in range(3)}
    assert covered == {0: [(0, 30), (30, 60)], 1: [(0, 12), (12, 30), (30, 60)], 2: [(0, 30), (30, 60)]}
    want = lane_truth(produced, cfg)
    assert counts(cfg) == want.counts
    assert dead_letters(cfg) == want.dead


def test_a_backfill_reads_the_log_start_again_before_each_chunk(cfg, spark):
    cfg = cfg.replace(max_records_per_epoch=45, on_data_loss="skip")
    produced = produce_batch(cfg, 20, BASE_MS)
    chunks = []

    def retention_after_first_chunk(point: str) -> None:
        if point == "after_ledger" and not chunks:
            chunks.append(point)
            delete_before(cfg, {0: 25, 1: 25, 2: 25})
    report = run_backfill(cfg, spark, BackfillRequest(offsets=parse_offsets("0:0-30,1:0-30,2:0-30", cfg.topic)),
                          crash=retention_after_first_chunk)
    assert len(report.epochs) >= 2
    rows = statuses(cfg)
    assert {r[1] for r in rows} <= {"committed", "lost"}
    owned = {p: sorted((f, u) for _, _, q, f, u in rows if q == p) for p in range(3)}
    for p, spans in owned.items():                     # every offset once: counted, or lost where deleted
        assert spans[0][0] == 0 and spans[-1][1] == 30
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(u <= 25 for _, s, _, _, u in rows if s == "lost") and any(s == "lost" for _, s, *_ in rows)
    want = lane_truth(produced, cfg)
    assert counts(cfg) == want.counts
    assert dead_letters(cfg) == want.dead


def test_a_backfill_adopts_its_plan_when_the_commit_landed_but_its_answer_was_lost(cfg, spark, monkeypatch):
    """An object store that accepted the plan's PUT but lost its answer (a retried PUT
    answered 412) looks like a lost race: the plan is there, and is the backfill's own."""
    import deltalake
    from deltalake.exceptions import CommitFailedError

    produced = produce_batch(cfg, 21, BASE_MS)
    real_write = deltalake.write_deltalake
    answers_lost = []

    def answer_lost(table, data, *args, **kwargs):
        real_write(table, data, *args, **kwargs)
        ledger_write = isinstance(table, deltalake.DeltaTable) and "ledger" in table.table_uri
        if ledger_write and not answers_lost:
            answers_lost.append(table.table_uri)
            raise CommitFailedError("Transaction failed: version already exists (the answer to a retried PUT)")
    monkeypatch.setattr(deltalake, "write_deltalake", answer_lost)
    report = run_backfill(cfg.replace(max_records_per_epoch=45), spark,
                          BackfillRequest(offsets=parse_offsets("0:0-30,1:0-30,2:0-30", cfg.topic)))
    assert answers_lost
    rows = statuses(cfg)
    assert {r[1] for r in rows} == {"committed"}
    assert sorted(e.epoch for e in report.epochs) == sorted({r[0] for r in rows})
    want = lane_truth(produced, cfg)
    assert counts(cfg) == want.counts and sum(want.counts.values()) > 0


def test_a_backfill_lets_an_unfinished_chain_epoch_commit_first(cfg, spark):
    """Each counts commit sends a racing one back to read again, and the chain's MERGE after
    another writer's commit reads the whole table: a backfill that commits chunk after chunk
    could make the chain lose every try. Its chunk's run finishes the chain's due epoch first,
    racing the chain's own runner when it comes back: one of them commits it, once."""
    from tests.tables import counts_merges

    produced = produce_batch(cfg, 22, BASE_MS)
    run_epoch(cfg, spark)                                          # epoch 1: [0, 30)
    produced += produce_batch(cfg, 23, BASE_MS + 60_000)
    earliest, latest = broker_io.partition_offsets(cfg)
    chain, _ = next_chain_epoch(EpochRunner.open(cfg, spark), earliest, latest)   # epoch 2: [30, 60), due
    produced += produce_batch(cfg, 24, BASE_MS + 120_000)
    reports, failed = [], []

    def backfill() -> None:
        try:
            reports.append(run_backfill(cfg, spark, BackfillRequest(
                offsets=parse_offsets("0:60-90,1:60-90,2:60-90", cfg.topic))))
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            failed.append(e)
    ahead = threading.Thread(target=backfill)
    ahead.start()
    threading.Event().wait(4)                                      # the backfill has read its chunk by now
    back = run_epoch(cfg, spark)                                   # the chain's runner comes back: it finishes
    assert back is None or back.epoch == chain.epoch               # its epoch, or finds it finished
    ahead.join(300)
    assert not failed, failed
    order = [m["epoch"] for m in counts_merges(cfg)]
    assert order == ["epoch=1", "epoch=2", f"epoch={reports[0].epochs[0].epoch}"]
    want = lane_truth(produced, cfg)
    assert counts(cfg) == want.counts


def test_a_chain_that_gave_up_its_first_epoch_goes_on_from_its_lost_rows(cfg, spark):
    """Found by chaos: with no committed chain row, the chain resolved its start position
    again after giving up its first epoch, and the offsets deleted past that epoch's end
    were owned by no row (neither counted nor lost)."""
    cfg = cfg.replace(on_data_loss="skip")
    produced = produce_batch(cfg, 25, BASE_MS)
    earliest, latest = broker_io.partition_offsets(cfg)
    next_chain_epoch(EpochRunner.open(cfg, spark), earliest, latest)   # epoch 1: [0, 30), its runner died
    produced += produce_batch(cfg, 26, BASE_MS + 60_000)
    delete_before(cfg, {1: 42})                                          # past epoch 1's end on partition 1
    run_until_idle(cfg, spark)
    rows = statuses(cfg)
    for p in range(3):                                  # every offset owned once, from 0 to the end
        spans = sorted((f, u) for _, _, q, f, u in rows if q == p)
        assert spans[0][0] == 0 and spans[-1][1] == 60, (p, spans)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (p, spans)
    assert [r[1:] for r in rows if r[1] == "lost"] == [("lost", 1, 0, 30), ("lost", 1, 30, 42)]
    want = expected_tables(produced, _committed_ranges(cfg))
    assert counts(cfg) == want.counts
    assert dead_letters(cfg) == want.dead


def test_records_deleted_while_an_epoch_reads_them_fail_as_data_loss(cfg, spark, monkeypatch):
    # Retention passes between the epoch's check of the log start and its Spark read: the read
    # fails, and the epoch must say so as data loss naming the offsets, not as a Java traceback.
    from ipcount.jobs import epoch as epoch_job

    produce_batch(cfg, 23, BASE_MS)
    read = epoch_job._read_and_tally

    def retention_mid_read(spark_, cfg_, plan):
        delete_before(cfg, {1: 12})
        return read(spark_, cfg_, plan)
    monkeypatch.setattr(epoch_job, "_read_and_tally", retention_mid_read)
    with pytest.raises(DataLossError, match=rf"data loss on {cfg.topic}-1: offsets \[0, 12\) were deleted"):
        run_epoch(cfg, spark)
    assert {r["status"] for r in ledger(cfg)} == {"planned"}   # unfinished: the next run settles it
