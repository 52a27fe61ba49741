"""A run crosses from Airflow to the Spark job as one JSON argument: it must come back as the
same run, and a bad one must be refused with a message, never half read."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipcount.jobs.runs import BACKFILL, COMMANDS, EPOCH, REBUILD, Run
from ipcount.rules import errors
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import BadRequestError, ConfigError
from ipcount.rules.offsets import OffsetRange
from ipcount.rules.requests import BackfillRequest, request_from_fields

TOPIC = "requests"


@st.composite
def requests(draw) -> BackfillRequest:
    target = draw(st.sampled_from(["main", "audit", "r_2"]))
    if draw(st.booleans()):
        start = draw(st.integers(0, 2 ** 40))
        return BackfillRequest(target, from_ms=start, until_ms=start + draw(st.integers(1, 2 ** 30)))
    ranges, next_from = [], {}
    for partition in draw(st.lists(st.integers(0, 5), min_size=1, max_size=6)):
        start = next_from.get(partition, 0) + draw(st.integers(0, 1000))
        until = start + draw(st.integers(1, 1000))
        next_from[partition] = until
        ranges.append(OffsetRange(TOPIC, partition, start, until))
    return BackfillRequest(target, offsets=tuple(sorted(ranges)))


@st.composite
def runs(draw) -> Run:
    command = draw(st.sampled_from(COMMANDS))
    cfg = PipelineConfig(topic=TOPIC, window_seconds=draw(st.integers(1, 3600)),
                         max_records_per_epoch=draw(st.integers(1, 10 ** 7)), publish=draw(st.booleans()),
                         on_data_loss=draw(st.sampled_from(["fail", "skip"])))
    return Run(command, cfg, run_id=draw(st.none() | st.text(min_size=1, max_size=40)),
               epochs=draw(st.integers(1, 50)), commit_offsets=draw(st.booleans()), publish=draw(st.booleans()),
               request=draw(requests()) if command == BACKFILL else None,
               into="rebuilt" if command == REBUILD else "", source=draw(st.sampled_from(["main", "audit"])))


@settings(max_examples=200, deadline=None)
@given(runs())
def test_a_run_comes_back_from_its_json_as_the_same_run(run):
    assert Run.from_json(run.to_json()) == run


def test_a_time_range_may_start_at_epoch_millisecond_0():
    """0 is a time, not an absent field (found by the round trip above)."""
    assert request_from_fields({"from_time": 0, "until_time": 5}, TOPIC) == BackfillRequest(from_ms=0, until_ms=5)
    assert request_from_fields({"offsets": "", "from_time": 0, "until_time": 5}, TOPIC).from_ms == 0


def test_a_bad_run_is_refused_with_what_is_wrong():
    good = json.loads(Run(EPOCH, PipelineConfig(topic=TOPIC)).to_json())
    for change, error, message in [
            ({"command": "vacuum"}, BadRequestError, "one of epoch, backfill, rebuild, not 'vacuum'"),
            ({"epochs": 0}, BadRequestError, "epochs must be a whole number of at least 1"),
            ({"epochs": True}, BadRequestError, "epochs must be a whole number"),
            ({"extra": 1}, BadRequestError, r"unknown field\(s\) extra"),
            ({"settings": {"window_seconds": 0}}, ConfigError, "window_seconds"),
            ({"settings": {"topik": "x"}}, ConfigError, "unknown setting"),
            ({"settings": []}, ConfigError, "settings are a JSON object"),
            ({"settings": None}, ConfigError, "a run has them"),
            ({"commit_offsets": "false"}, BadRequestError, "commit_offsets must be a boolean, not 'false'"),
            ({"run_id": 5}, BadRequestError, "run_id must be a string"),
            ({"into": None}, BadRequestError, "into must be a string"),
            ({"request": {"offsets": "0:0-5"}}, BadRequestError, "only a backfill run has one"),
            ({"command": "backfill"}, BadRequestError, "a backfill run needs its request"),
            ({"command": "backfill", "request": {"offsets": "0:5-1"}}, BadRequestError, "must be greater than")]:
        with pytest.raises(error, match=message):
            Run.from_json(json.dumps({**good, **change}))
    without_settings = {k: v for k, v in good.items() if k != "settings"}
    with pytest.raises(ConfigError, match="a run has them"):
        Run.from_json(json.dumps(without_settings))
    for text in ("", "[1]", "{"):
        with pytest.raises(BadRequestError, match="JSON"):
            Run.from_json(text)


def test_an_error_is_permanent_exactly_when_its_exit_code_says_so():
    """A spark-submitted task sees only the exit code, the Connect task the error itself:
    both must decide alike. Permanent: bad input and data loss; everything else is retried."""
    classes = [cls for cls in errors.IpcountError.__subclasses__() if cls.__module__ == errors.__name__]
    permanent = {cls.__name__ for cls in classes if cls("x").permanent}
    assert permanent == {"ConfigError", "BadRequestError", "StartPositionError", "MissingJarsError",
                         "DataLossError", "MissingTablesError", "TableSetMismatch"}
    assert all(cls("x").permanent == (cls.exit_code in errors.PERMANENT_EXIT_CODES) for cls in classes)


def test_an_unknown_crash_point_is_a_bad_setting_before_anything_runs(monkeypatch, tmp_path, caplog):
    """IPCOUNT_CRASH_AT (the tests' hook) with a typo: exit 2 naming the variable, not a traceback, and
    nothing made (the check comes before the tables, the broker or a JVM)."""
    from ipcount import cli

    monkeypatch.setenv("IPCOUNT_CRASH_AT", "after_plam")
    warehouse = tmp_path / "tables"
    assert cli.main(["epoch", "--warehouse", str(warehouse)]) == errors.EXIT_USAGE
    assert "IPCOUNT_CRASH_AT (a test hook) must be one of after_plan," in caplog.text
    assert not warehouse.exists()
