"""A command chaos runs without kills (the finish, the completed rebuild): exit 0 or an error
that names its log; one that outlives its time is killed."""
from __future__ import annotations

import pytest

from ipcount.rules.config import PipelineConfig
from ipcount_lab.chaos import _Processes, _run_to_end


def test_a_command_run_to_its_end_must_exit_0_and_a_failure_names_its_log(tmp_path):
    procs = _Processes(PipelineConfig(), tmp_path)
    _run_to_end(procs, "asking for help", "--help")
    with pytest.raises(RuntimeError, match=r"chaos: finishing `ipcount epoch` failed \(exit code 2; see "
                                           r".*/0002-epoch\.log\)"):
        _run_to_end(procs, "finishing `ipcount epoch`", "epoch", "--no-such-flag")
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "0002-epoch.log").read_text()


def test_a_command_that_outlives_its_time_is_killed(tmp_path):
    procs = _Processes(PipelineConfig(), tmp_path)
    with pytest.raises(RuntimeError, match=r"not done after 0 s; see .*/0001---help\.log"):
        _run_to_end(procs, "asking for help", "--help", timeout=0.01)
    assert procs.started[0].returncode == -9  # SIGKILLed, not left running
