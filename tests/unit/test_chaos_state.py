"""A paused chaos run's state: round trip, per-round randomness, clear errors."""
from __future__ import annotations

import pytest

from ipcount.rules.errors import ConfigError
from ipcount_lab.chaos_state import RunState, round_rng


def state(**extra) -> RunState:
    return RunState(**{"name": "chaos_7_abc123", "seed": 7, "kills_wanted": 4, "scenarios": ["race", "dag"],
                       "order": ["dag", "race"], "batch": 40, "clock_ms": 1_795_255_200_000,
                       "max_records_per_epoch": 80, **extra})


def test_the_state_round_trips_and_says_when_the_run_is_done(tmp_path):
    s = state(backfills=["0:1-5"], kills=3, rounds=2, by_scenario={"dag": 1, "race": 1},
              by_phase={"writing": 2, "starting": 1}, sittings=[{"started": "t0", "stopped": "t1", "kills": 3}])
    s.save(tmp_path / "state.json")
    assert RunState.load(tmp_path / "state.json") == s and not s.enough(pausing=True)
    s.kills = 4
    assert s.enough(pausing=True) and s.enough(pausing=False)
    s.by_scenario = {"dag": 2}  # four kills in two rounds: a pause may come now, the finish waits for race's turn
    assert s.enough(pausing=True) and not s.enough(pausing=False)
    assert not (tmp_path / "state.json.tmp").exists()


def test_how_far_retention_rounds_deleted_survives_a_pause(tmp_path):
    s = state()
    s.mark_deleted(1, 40)
    s.mark_deleted(1, 25)  # a later round that deleted less leaves the log start where it was
    s.mark_deleted(0, 7)
    s.save(tmp_path / "state.json")
    assert RunState.load(tmp_path / "state.json").deleted_marks() == {0: 7, 1: 40}


def test_each_round_draws_the_same_choices_however_the_run_was_paused():
    assert [round_rng(7, 3).random() for _ in range(2)] == [round_rng(7, 3).random() for _ in range(2)]
    assert round_rng(7, 3).random() != round_rng(7, 4).random() != round_rng(8, 3).random()


def test_a_missing_or_foreign_state_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no chaos run to resume"):
        RunState.load(tmp_path / "state.json")
    (tmp_path / "state.json").write_text('{"format": 1, "name": "x"}')
    with pytest.raises(ConfigError, match="does not fit this version"):
        RunState.load(tmp_path / "state.json")
    (tmp_path / "state.json").write_text("{")
    with pytest.raises(ConfigError, match="is not JSON"):
        RunState.load(tmp_path / "state.json")


def test_retention_waits_for_the_rebuild_and_the_rebuild_stops_once_records_are_deleted():
    s = state(kills_wanted=8, scenarios=["chain", "retention", "rebuild"], order=["retention", "rebuild", "chain"])
    played = []
    while len(played) < 9:
        scenario = s.next_scenario()
        played.append(scenario)
        if scenario == "retention":
            s.mark_deleted(0, 5)
        s.by_scenario[scenario] = s.by_scenario.get(scenario, 0) + 1
        s.rounds, s.kills = s.rounds + 1, s.kills + 1
    # Retention's turns (rounds 0 and 3) go to the next scenario until every other one has had
    # a round and four of the eight kills are made; then it takes the next round (not waiting
    # for its turn: a short run reaches its finish sooner); once records are deleted,
    # rebuild's go on.
    assert played == ["rebuild", "rebuild", "chain", "rebuild", "retention", "chain", "retention", "chain", "chain"]
    assert s.enough(pausing=False)


def test_without_a_rebuild_retention_takes_its_turns_from_the_start():
    s = state(scenarios=["chain", "retention"], order=["retention", "chain"])
    assert s.next_scenario() == "retention"
    s.mark_deleted(0, 5)
    s.rounds = 1
    assert s.next_scenario() == "chain"


def test_once_the_rebuild_is_completed_it_has_no_more_rounds():
    # Completed before a retention round that then deleted nothing: the recount checks the
    # epochs kept at completion, so more rebuild rounds would replay epochs it does not expect.
    s = state(scenarios=["rebuild", "chain"], order=["rebuild", "chain"], rebuilt=[1, 2])
    for s.rounds in range(3):
        assert s.next_scenario() == "chain"
    with pytest.raises(ConfigError, match="no scenario of rebuild can take a round"):
        state(scenarios=["rebuild"], order=["rebuild"], rebuilt=[1]).next_scenario()


def test_a_paused_run_with_a_scenario_this_version_no_longer_has_is_refused_on_resume(tmp_path):
    # E.g. `server`, the epoch server's scenario, in a run paused before it was removed: the
    # refusal comes before anything touches the run's broker, topic or tables.
    from ipcount.rules.config import PipelineConfig
    from ipcount_lab.chaos import run_chaos

    state(scenarios=["race", "server"], order=["server", "race"]).save(tmp_path / "state.json")
    with pytest.raises(ConfigError, match=r"takes turns with server, a scenario this version no longer has: "
                                          r"finish it with the commit that started it"):
        run_chaos(PipelineConfig(bootstrap_servers="127.0.0.1:1"), resume=tmp_path)
