"""The table set's manifest: all four tables named, older manifests upgraded, rebuild
targets and tables that hold another set's epochs refused."""
from __future__ import annotations

import pytest

from ipcount.rules import tableset
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import TableSetMismatch

CFG = PipelineConfig(warehouse="/w")
IDS = {tableset.LEDGER_ID: "L", tableset.COUNTS_ID: "C", tableset.DEAD_LETTER_ID: "D", tableset.LATE_ID: "T"}
NEW_SET = "new counts, ledger, dead-letter and late-record locations"


def test_the_manifest_names_all_four_tables_and_a_rebuild_its_source():
    wanted = tableset.manifest(CFG, IDS)
    assert {k: wanted[tableset.key(k)] for k in IDS} == IDS
    assert tableset.key(tableset.REBUILD_OF) not in wanted
    assert tableset.manifest(CFG, IDS, rebuild_of="S")[tableset.key(tableset.REBUILD_OF)] == "S"
    assert set(tableset.locations(CFG)) == set(IDS)
    assert tableset.locations(CFG)[tableset.DEAD_LETTER_ID] == CFG.dead_letter_path


def test_a_manifest_recorded_before_the_side_tables_joined_gains_their_ids():
    wanted = tableset.manifest(CFG, IDS)
    side = {tableset.key(tableset.DEAD_LETTER_ID), tableset.key(tableset.LATE_ID)}
    older = {k: v for k, v in wanted.items() if k not in side}
    assert tableset.missing(older) == side
    assert tableset.differences(older, wanted) == []
    tableset.check("counts", older, wanted)
    assert tableset.missing(wanted) == set() and tableset.missing({}) == set()


def test_another_side_table_is_refused_with_advice_naming_all_four():
    old_ids = {**IDS, tableset.LATE_ID: "T-old"}
    recorded = tableset.manifest(CFG, old_ids)
    with pytest.raises(TableSetMismatch, match=r"late_table_id: recorded T-old, now T.*not created together") as e:
        tableset.check("late", recorded, tableset.manifest(CFG, IDS))
    assert NEW_SET in str(e.value)
    with pytest.raises(TableSetMismatch, match=NEW_SET):  # the advice for changed settings too
        tableset.check("counts", recorded, tableset.manifest(CFG.replace(window_seconds=60), old_ids))


def test_a_rebuild_resumes_only_its_own_target():
    own = tableset.manifest(CFG, IDS, rebuild_of="S")
    tableset.check("ledger", own, tableset.manifest(CFG, IDS, rebuild_of="S"))
    tableset.check("ledger", own, tableset.manifest(CFG, IDS))  # swapped in, the main pipeline runs on it
    for recorded, was in ((tableset.manifest(CFG, IDS), r"\(none\)"), (tableset.manifest(CFG, IDS, "X"), "X")):
        with pytest.raises(TableSetMismatch, match=rf"rebuild_of: recorded {was}, now S.*rebuild into a new name"):
            tableset.check("ledger", recorded, tableset.manifest(CFG, IDS, rebuild_of="S"))


def test_tables_without_a_manifest_that_hold_epochs():
    tableset.check_unclaimed([], "/w/ledger", ledger_is_new=True, rebuild=True)  # a fresh set
    # a set of a version without manifests (its ledger holds epochs) gets one
    tableset.check_unclaimed(["/w/ledger", "/w/dead_letters"], "/w/ledger", ledger_is_new=False, rebuild=False)
    vanishing = rf"another table set are in /w/dead_letters, but the ledger /n/ledger is new.*{NEW_SET}"
    with pytest.raises(TableSetMismatch, match=vanishing):
        tableset.check_unclaimed(["/w/dead_letters"], "/n/ledger", ledger_is_new=True, rebuild=False)
    with pytest.raises(TableSetMismatch, match=r"rebuild's target holds epoch commits in /r/ledger.*new name"):
        tableset.check_unclaimed(["/r/ledger"], "/r/ledger", ledger_is_new=False, rebuild=True)
