"""Where a chaos kill landed, read from the victim's log (the lines the epoch, backfill and
server commands really write)."""
from __future__ import annotations

import pytest

from ipcount.devtools.chaos import phase_of

START = "WARNING: Using incubator modules: jdk.incubator.vector\n"
PLANNING = "2026-11-23 03:56:41,665 INFO ipcount.jobs.epoch: ledger has entries: starting from its positions\n"
PLANNED = "2026-11-23 03:57:14,526 INFO ipcount.jobs.epoch: planned epoch 7: p0[105,120) p1[102,117)\n"
COMMITTED = ("2026-11-23 03:57:33,877 INFO ipcount.jobs.epoch: epoch 7 committed: p0[105,120) | read 60 "
             "counted 58 late 0 malformed 2 lag 252 | 52.4s\n")
GROUP = "2026-11-23 03:57:33,936 INFO ipcount.jobs.group_commit: committed epoch 7 positions to consumer group\n"


@pytest.mark.parametrize("log, phase", [
    ("", "starting"),
    (START, "starting"),
    (START + PLANNING, "planning"),
    (START + PLANNING + PLANNED, "writing"),
    (START + PLANNING + PLANNED + COMMITTED + GROUP, "committed"),
    # the chain's next epoch: planning again, then writing again
    (PLANNING + PLANNED + COMMITTED + GROUP + PLANNING, "planning"),
    (PLANNING + PLANNED + COMMITTED + PLANNING + PLANNED.replace("epoch 7", "epoch 8"), "writing"),
    ("INFO ipcount.jobs.epoch: resuming unfinished epoch 11 with its recorded ranges p0[166,182)\n", "writing"),
    ("INFO ipcount.jobs.backfill: backfill bf-119be4b4050d: p0[53,58) into target main -> p0[53,58)\n", "planning"),
    ("INFO ipcount.jobs.backfill: finishing unfinished backfill epoch 9 (p0[1,5)) with its recorded ranges\n",
     "writing"),
    # a group commit alone is no ledger commit
    (START + GROUP, "starting"),
])
def test_phase_is_the_last_epoch_milestone_in_the_log(log, phase):
    assert phase_of(log) == phase
