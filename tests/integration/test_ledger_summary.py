"""The ledger's bookkeeping reads its summary and a bounded tail, and gives what every row
gives (delta-rs only: no broker, no JVM)."""
from __future__ import annotations

import shutil

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from ipcount.rules.errors import PlanConflict
from ipcount.rules.finality import chain_commits
from ipcount.rules.ledger import BACKFILL, COLUMNS, COMMITTED, SCHEDULED, EpochPlan, PartitionMetrics, state_of
from ipcount.rules.ledger_summary import committed_chain
from ipcount.rules.offsets import OffsetRange
from ipcount.storage import ledger as ledger_io
from ipcount.storage.delta import arrow_schema, read_rows
from ipcount.storage.ledger import Ledger, committed_positions
from tests.tables import ledger_rows

TOPIC = "t"
LAST = 100  # the chain's open epoch in the first test


def chain_plan(ledger: Ledger, epoch: int, size: int = 10) -> EpochPlan:
    positions = ledger.state(TOPIC).committed
    return EpochPlan(epoch, tuple(OffsetRange(TOPIC, p, positions.get(p, 0), positions.get(p, 0) + size)
                                  for p in range(3)))


def run(ledger: Ledger, plan: EpochPlan, version: int | None, watermark: int | None = None) -> None:
    ledger.record_plan(plan, "run")
    ledger.commit(plan, {r.partition: PartitionMetrics(r.size, r.size) for r in plan.ranges},
                  watermark if watermark is not None else 1_000 * plan.epoch, version, 0.1, "run")


def truth(path: str) -> dict:
    """What every row says (ground truth: the row-by-row rules over a full read)."""
    rows = ledger_rows(path)
    mine = [r for r in rows if r["topic"] == TOPIC]
    newest = max((r["epoch"] for r in mine if r["status"] == COMMITTED and (r["kind"] or SCHEDULED) == SCHEDULED),
                 default=0)
    return {"state": state_of(TOPIC, rows), "chain_commits": chain_commits(mine)[:2],
            "committed": committed_chain(None, TOPIC, mine)[:2] if newest else (0, {})}


def seen(path: str) -> dict:
    ledger = Ledger(path)
    return {"state": ledger.state(TOPIC), "chain_commits": ledger.chain_commits(TOPIC),
            "committed": committed_positions(path, TOPIC)}


@pytest.fixture
def small_files(monkeypatch):
    """Ledger files freeze at a few KiB, so a test's hundred epochs leave frozen ones."""
    monkeypatch.setattr(ledger_io, "LEDGER_FILE_BYTES", 16 * 1024)
    monkeypatch.setattr(ledger_io, "COMPACT_AFTER_FILES", 4)


def test_bookkeeping_reads_no_file_of_folded_epochs(tmp_path, small_files, monkeypatch):
    path = str(tmp_path / "ledger")
    ledger = Ledger(path)
    ledger.ensure()
    # an old backfill island ahead of the chain, an epoch that lost its head, a backfill chunk
    # planned and never run (killed, not resumed: open for good), then the chain
    island = EpochPlan(1, (OffsetRange(TOPIC, 0, 5_000, 5_100),), kind=BACKFILL, request_id="r1")
    run(ledger, island, None, watermark=77)
    lost = EpochPlan(2, (OffsetRange(TOPIC, 1, 7, 10),), lost=(OffsetRange(TOPIC, 1, 0, 7),))
    run(ledger, lost, 1)
    ledger.record_plan(EpochPlan(3, (OffsetRange(TOPIC, 2, 9_000, 9_100),), kind=BACKFILL, request_id="r0"), "bf")
    for epoch in range(4, LAST):
        run(ledger, chain_plan(ledger, epoch), epoch if epoch % 7 else None)
    ledger.record_plan(chain_plan(ledger, LAST), "run")  # open when the ledger is read
    want = truth(path)
    assert seen(path) == want

    # Copy the ledger and delete every data file the summary made needless: what the
    # bookkeeping still reads is in the rest.
    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)
    summary = Ledger(copy).view().summary
    assert summary is not None and summary.in_tail(LAST) and summary.through >= LAST - 20
    newest = -DeltaTable(copy).transaction_version(ledger_io.SUMMARY_TXN)  # the summary row's from_offset
    actions = pa.table(DeltaTable(copy).get_add_actions(flatten=True)).to_pylist()
    needless = [a["path"] for a in actions
                if a["max.epoch"] <= summary.through and not a["min.from_offset"] <= newest <= a["max.from_offset"]
                and not any(a["min.epoch"] <= e <= a["max.epoch"] for e in summary.open)]
    assert len(needless) >= 2 and len(actions) - len(needless) <= 6, actions
    monkeypatch.setattr(ledger_io, "COMPACT_AFTER_FILES", 10**9)  # compaction reads small files: not here
    for name in needless:
        (tmp_path / "copy" / name).unlink()
    assert seen(copy) == want
    # a plan over the folded island is refused; the chain's next plan is recorded
    with pytest.raises(PlanConflict):
        Ledger(copy).record_plan(EpochPlan(LAST + 1, (OffsetRange(TOPIC, 0, 5_050, 5_060),), kind=BACKFILL,
                                           request_id="r2"), "run")
    Ledger(copy).commit(chain_plan_of(copy, LAST), None, 1_000 * LAST, 200, 0.1, "run")
    run(Ledger(copy), chain_plan(Ledger(copy), LAST + 1), 201)
    # epochs 4 to LAST + 1 took 10 offsets a partition each; epoch 2 partition 1's first 10
    chain = {0: 10 * (LAST - 2), 1: 10 * (LAST - 1), 2: 10 * (LAST - 2)}
    assert Ledger(copy).state(TOPIC).committed == chain
    assert committed_positions(copy, TOPIC) == (LAST + 1, chain)


def chain_plan_of(path: str, epoch: int) -> EpochPlan:
    (pending,) = Ledger(path).state(TOPIC).pending_chain
    assert pending.epoch == epoch
    return pending


def test_an_epoch_recorded_below_the_summary_stays_visible(tmp_path):
    """A rebuild records the source's epoch ids in its own order: an id below the summary's."""
    path = str(tmp_path / "ledger")
    ledger = Ledger(path)
    ledger.ensure()
    for epoch in (*range(1, 11), *range(12, 40)):
        run(ledger, chain_plan(ledger, epoch), epoch)
    assert ledger.view().summary.through > 11
    late = chain_plan(ledger, 11)
    ledger.record_plan(late, "run")
    assert [p.epoch for p in ledger.state(TOPIC).pending_chain] == [11]
    assert seen(path) == truth(path)
    ledger.commit(late, None, 11_000, 11, 0.1, "run")
    assert seen(path) == truth(path) and not ledger.state(TOPIC).pending_chain


def test_an_older_ledger_gets_the_column_and_its_first_plan_folds_it(tmp_path):
    path = str(tmp_path / "ledger")
    older = arrow_schema([c for c in COLUMNS if c[0] != "summary"])
    ledger = Ledger(path)
    ledger.ensure()
    for epoch in range(1, 6):
        run(ledger, chain_plan(ledger, epoch), epoch)
    rows = [{k: v for k, v in r.items() if k != "summary"} for r in ledger_rows(path)]
    old = str(tmp_path / "older")
    write_deltalake(old, pa.Table.from_pylist(rows, schema=older))
    want = truth(old)
    assert DeltaTable(old).transaction_version(ledger_io.SUMMARY_TXN) is None
    Ledger(old).ensure()
    assert "summary" in DeltaTable(old).schema().to_arrow().names
    assert seen(old) == want
    run(Ledger(old), chain_plan(Ledger(old), 6), 6)
    table = DeltaTable(old)
    versions = [h["version"] for h in table.history() if h.get("operation") == "WRITE"]
    assert table.transaction_version(ledger_io.SUMMARY_TXN) == max(versions)
    assert seen(old) == truth(old)
    summaries = read_rows(old, ("epoch", "from_offset"), filters=[("status", "=", "summary")])
    assert summaries == [{"epoch": 6, "from_offset": -max(versions)}]
