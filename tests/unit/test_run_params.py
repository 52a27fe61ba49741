"""A DAG run's conf: what it may change, and what it may not (pure logic, no Airflow)."""
from __future__ import annotations

import pytest

from ipcount.orchestration.dags import BACKFILL_PARAMS, RUN_PARAMS, check_backfill_request, run_config
from ipcount.rules.config import PER_RUN_SETTINGS, PipelineConfig
from ipcount.rules.errors import BadRequestError, ConfigError


def test_a_run_param_overrides_the_pipeline_config_for_that_run():
    cfg = PipelineConfig(max_records_per_epoch=500)
    assert run_config(cfg, {"max_records_per_epoch": 90, "commit_offsets": False}) == \
        cfg.replace(max_records_per_epoch=90, commit_offsets=False)
    assert run_config(cfg, None) is cfg


def test_the_dags_params_are_exactly_the_per_run_settings():
    assert tuple(RUN_PARAMS) == PER_RUN_SETTINGS


def test_a_misspelt_run_param_is_refused_not_ignored():
    with pytest.raises(ConfigError, match=r"unknown run parameter\(s\) max_record_per_epoch \(did you mean "
                                          r"max_records_per_epoch\?\), zzz; this DAG takes .*start_position"):
        run_config(PipelineConfig(), {"max_record_per_epoch": 90, "zzz": 1})


def test_what_a_table_set_counts_cannot_be_set_per_run():
    with pytest.raises(ConfigError, match="window_seconds cannot be set per run"):
        run_config(PipelineConfig(), {"window_seconds": 60})


def test_a_misspelt_backfill_field_is_refused_before_the_broker_is_asked():
    params = {name: None for name in BACKFILL_PARAMS} | {"offset": "0:0-10"}
    with pytest.raises(BadRequestError, match=r"offset \(did you mean offsets\?\)"):
        check_backfill_request(PipelineConfig(bootstrap_servers="127.0.0.1:1"), params)
