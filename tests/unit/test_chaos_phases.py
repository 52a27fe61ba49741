"""Where a chaos kill landed, read from the step markers in the victim's log (the crash tests
check that a real epoch writes them)."""
from __future__ import annotations

import pytest

from ipcount_lab.chaos import phase_of

START = "WARNING: Using incubator modules: jdk.incubator.vector\n"
PLANNING = "2026-11-23 03:56:41,665 INFO ipcount.jobs.epoch: ipcount-step planning\n"
PLANNED = "2026-11-23 03:57:14,526 INFO ipcount.jobs.epoch: ipcount-step after_plan epoch=7\n"
SUNK = "2026-11-23 03:57:20,101 INFO ipcount.jobs.epoch: ipcount-step after_sink epoch=7\n"
COMMITTED = "2026-11-23 03:57:33,877 INFO ipcount.jobs.epoch: ipcount-step after_ledger epoch=7\n"
WORDS = ("2026-11-23 03:57:33,877 INFO ipcount.jobs.epoch: epoch 7 committed: p0[105,120) | read 60 "
         "counted 58 late 0 malformed 2 lag 252 | 52.4s\n")


@pytest.mark.parametrize("log, phase", [
    ("", "starting"),
    (START, "starting"),
    (START + PLANNING, "planning"),
    (START + PLANNING + PLANNED, "writing"),
    (START + PLANNING + PLANNED + SUNK, "writing"),
    (START + PLANNING + PLANNED + SUNK + COMMITTED, "committed"),
    # the chain's next epoch: planning again, then writing again
    (PLANNING + PLANNED + COMMITTED + PLANNING, "planning"),
    (PLANNING + PLANNED + COMMITTED + PLANNING + PLANNED.replace("epoch=7", "epoch=8"), "writing"),
    # only markers count: the human wording of the same moments does not
    (START + WORDS + "INFO ipcount.jobs.epoch: planned epoch 8: p0[1,5)\n", "starting"),
])
def test_phase_is_the_last_epoch_milestone_in_the_log(log, phase):
    assert phase_of(log) == phase
