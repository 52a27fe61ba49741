"""The no-JVM idle check: it may only say "idle" when an epoch would certainly commit nothing."""
from ipcount.jobs.idle import verdict
from ipcount.rules.coverage import Coverage
from ipcount.rules.ledger_summary import committed_chain
from ipcount.rules.offsets import OffsetRange


def row(epoch, partition, until, status="committed", kind="scheduled"):
    return {"epoch": epoch, "topic": "t", "partition": partition, "until_offset": until, "status": status,
            "kind": kind}


def test_the_idle_check_follows_the_scheduled_chain_only():
    rows = [row(1, 0, 10), row(1, 1, 7), row(2, 0, 25), row(2, 1, 9),
            row(3, 0, 900, kind="backfill"),            # a backfill ahead of the chain is not its position
            row(4, 1, 50, status="planned", kind="backfill"),
            row(5, 0, 40, status="planned"), {**row(6, 1, 60), "kind": None}]  # null kind: scheduled
    newest, positions, unfinished = committed_chain(None, "t", rows)
    assert positions == {0: 25, 1: 60} and newest == 6
    assert unfinished == [5]


def test_idle_only_at_the_log_end_with_nothing_aged_out():
    v = verdict({0: 25, 1: 9}, [], earliest={0: 0, 1: 9}, latest={0: 25, 1: 9})
    assert not v.run and "p0=25 p1=9" in v.why


def test_every_doubt_means_run():
    at_end = {0: 25, 1: 9}
    cases = {
        "unfinished": verdict(at_end, [7], {0: 0, 1: 0}, at_end),
        "no ledger": verdict({}, [], {0: 0}, {0: 0}),
        "new partition": verdict(at_end, [], {0: 0, 1: 0, 2: 0}, {**at_end, 2: 3}),
        "vanished partition": verdict(at_end, [], {0: 0}, {0: 25}),
        "aged out": verdict(at_end, [], {0: 30, 1: 0}, {0: 30, 1: 9}),
        "new records": verdict(at_end, [], {0: 0, 1: 0}, {0: 26, 1: 12}),
    }
    assert all(v.run for v in cases.values()), {k: v for k, v in cases.items() if not v.run}
    assert "epoch 7" in cases["unfinished"].why
    assert "[25, 30)" in cases["aged out"].why
    assert "4 new offset(s): p0+1 p1+3" in cases["new records"].why
    assert "3 new offset(s): p2+3" in cases["new partition"].why


def test_an_empty_new_partition_is_no_work_as_the_planner_plans_nothing_there():
    said = verdict({0: 25, 1: 9}, [], {0: 0, 1: 0, 2: 4}, {0: 25, 1: 9, 2: 4})
    assert not said.run and "p2=4" in said.why


def test_offsets_a_backfill_counted_ahead_of_the_chain_are_no_work():
    # Found by the model test of the ledger: the planner passes over offsets a backfill owns,
    # so an idle check that counted them as new would start a run to plan nothing.
    owned = Coverage.of("t", [OffsetRange("t", 0, 10, 20), OffsetRange("t", 1, 0, 5)])
    assert not verdict({0: 10, 1: 0}, [], {0: 0, 1: 0}, {0: 20, 1: 5}, owned).run
    assert verdict({0: 10, 1: 0}, [], {0: 0, 1: 0}, {0: 21, 1: 5}, owned).why == "1 new offset(s): p0+1"
    # ... and so are offsets it counted before they aged out: nothing is lost there.
    assert not verdict({0: 10, 1: 0}, [], {0: 20, 1: 0}, {0: 20, 1: 5}, owned).run
