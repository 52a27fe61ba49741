"""storage/retry.retrying: how often an action is tried, what is retried and what ends it."""
from __future__ import annotations

import pytest

from ipcount.rules.errors import CommitContention, PlanConflict
from ipcount.storage import retry


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    pauses = []
    monkeypatch.setattr(retry.time, "sleep", pauses.append)
    return pauses


def failing(times: int, error: type[Exception] = PlanConflict):
    calls = []

    def action():
        calls.append(1)
        if len(calls) <= times:
            raise error(f"lost race {len(calls)}")
        return len(calls)
    return action, calls


def test_an_action_is_tried_again_after_each_listed_error_until_it_returns(no_sleep):
    action, calls = failing(3)
    assert retry.retrying(action, PlanConflict, "planning", attempts=5) == 4
    assert len(calls) == 4 and no_sleep == [0.2, 0.4, pytest.approx(0.6)]


@pytest.mark.parametrize("attempts", [0, 1])
def test_no_more_tries_than_attempts_and_never_endless(attempts):
    action, calls = failing(100)
    with pytest.raises(PlanConflict, match="lost race 1"):
        retry.retrying(action, PlanConflict, "planning", attempts=attempts)
    assert len(calls) == 1


def test_giving_up_raises_what_gave_up_makes_and_other_errors_pass_at_once():
    action, calls = failing(100)
    with pytest.raises(CommitContention, match="gave up"):
        retry.retrying(action, PlanConflict, "planning", attempts=3, gave_up=lambda: CommitContention("gave up"))
    assert len(calls) == 3
    action, calls = failing(100, error=ValueError)
    with pytest.raises(ValueError):
        retry.retrying(action, PlanConflict, "planning", attempts=3)
    assert len(calls) == 1


def test_a_deadline_ends_the_tries_before_a_pause_would_pass_it(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(retry.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(retry.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    action, calls = failing(100)
    with pytest.raises(PlanConflict):
        retry.retrying(action, PlanConflict, "waiting", pause=lambda n: 1.0, deadline=102.5)
    assert len(calls) == 3 and now[0] == 102.0
