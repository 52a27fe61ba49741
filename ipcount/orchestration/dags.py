"""What the Airflow DAG needs from the core package: how to submit the epoch, and what to publish after it. Kept here so
the DAG file stays wiring only."""
from __future__ import annotations

import logging
from datetime import timedelta
from difflib import get_close_matches
from typing import Any, Mapping

from ipcount.jobs.runs import BACKFILL, EPOCH, Run
from ipcount.orchestration.kafka_connection import resolved
from ipcount.orchestration.lineage import source_asset
from ipcount.rules.config import (MEANING, ON_DATA, REPO_ROOT, RUN, SETTINGS, SETTINGS_BY_NAME, SETTINGS_HELP, PipelineConfig,
                                  Setting)
from ipcount.rules.errors import BadRequestError, ConfigError
from ipcount.rules.requests import MAIN_TARGET, REQUEST_FIELDS, BackfillRequest, request_from_fields
from ipcount.storage.ledger import committed_epochs
from ipcount.storage.spark import DRIVER_ENV, spark_conf, spark_jars

log = logging.getLogger(__name__)

EPOCH_APPLICATION = str(REPO_ROOT / "spark_jobs" / "epoch_job.py")
EPOCH_DAG_ID, BACKFILL_DAG_ID, MAINTENANCE_DAG_ID = "ipcount_epoch", "ipcount_backfill", "ipcount_maintenance"


# Settings a DAG run may override from the trigger form or `airflow dags trigger --conf` (scope RUN in
# ipcount.rules.config): name -> (JSON schema, title). The pipeline's topic and tables are not among them: they define
# the pipeline, and an epoch must chain with the ones before it.
JSON_TYPES = {"str": "string", "int": "integer", "bool": "boolean"}


def param_schema(s: Setting) -> dict[str, Any]:
    """The JSON schema of a setting's Param: its type, range and choices, and any more."""
    schema: dict[str, Any] = {"type": JSON_TYPES[s.type]}
    if s.minimum is not None:
        schema.update(minimum=s.minimum, maximum=s.maximum)
    if s.choices:
        schema["enum"] = list(s.choices)
    return {**schema, **s.param}


RUN_PARAMS: dict[str, tuple[dict[str, Any], str]] = {s.name: (param_schema(s), s.title) for s in SETTINGS
                                                     if s.scope == RUN}
# What the tables mean is fixed with them (ipcount.rules.tableset), never a per-run choice.


# The schedule that starts each run as the last one ends (Airflow's continuous timetable; the DAG's max_active_runs=1
# keeps runs one at a time): the lowest latency a schedule gives.
CONTINUOUS = "@continuous"


def epoch_timetable(cfg: PipelineConfig):
    """The epoch DAG's schedule: ``@continuous``; ``on-data``, the source Asset (its watcher fires on new records) or
    ``on_data_fallback``'s clock; else the cron expression (or preset). Clocks run as data intervals - not trigger
    instants - so a backfill run counts its interval's records."""
    from airflow.timetables.interval import CronDataIntervalTimetable

    schedule = cfg.schedule.strip()
    if schedule == CONTINUOUS:
        return CONTINUOUS
    if schedule == ON_DATA:
        from airflow.sdk import AssetOrTimeSchedule

        fallback = cfg.on_data_fallback.strip()
        if fallback.lower() == "none":
            return [source_asset(cfg)]
        return AssetOrTimeSchedule(assets=[source_asset(cfg)],
                                   timetable=CronDataIntervalTimetable(fallback, timezone="UTC"))
    return CronDataIntervalTimetable(schedule, timezone="UTC")


def maintenance_schedule(cfg: PipelineConfig) -> str | None:
    """The maintenance DAG's schedule: ``maintenance_schedule``, or None (only when triggered) for ``none``."""
    schedule = cfg.maintenance_schedule.strip()
    return None if schedule.lower() == "none" else schedule


def dag_params(cfg: PipelineConfig) -> dict[str, Any]:
    """Airflow Params for :data:`RUN_PARAMS`, defaulting to the pipeline's configuration."""
    from airflow.sdk import Param

    return {name: Param(getattr(cfg, name), title=title, description=SETTINGS_HELP.get(name, ""), **schema)
            for name, (schema, title) in RUN_PARAMS.items()}


def run_config(cfg: PipelineConfig, params: dict[str, Any] | None) -> PipelineConfig:
    """The pipeline's configuration with this run's Param values applied."""
    fixed = sorted(set(params or {}) & {*MEANING, "pipeline_id"})
    if fixed:
        raise ConfigError(f"{', '.join(fixed)} cannot be set per run: what a table set counts is fixed when it is "
                          "created (set it in the pipeline's configuration for a new table set)")
    _refuse_unknown(params, RUN_PARAMS)
    overrides = {k: v for k, v in (params or {}).items() if k in RUN_PARAMS}
    return cfg.replace(**overrides) if overrides else cfg


def _refuse_unknown(params: dict[str, Any] | None, known: Mapping[str, Any],
                    error: type[Exception] = ConfigError) -> None:
    """A misspelt key in a run's conf would otherwise be ignored without a word."""
    unknown = sorted(set(params or {}) - set(known))
    if unknown:
        hints = [f"{name} (did you mean {close[0]}?)" if (close := get_close_matches(name, known, 1)) else name
                 for name in unknown]
        raise error(f"unknown run parameter(s) {', '.join(hints)}; this DAG takes {', '.join(known)}")


# The manual backfill DAG's trigger form: what to count and where.
BACKFILL_PARAMS: dict[str, tuple[dict[str, Any], str, str]] = {
    "target": ({"type": "string", "pattern": r"^[a-z][a-z0-9_]{0,62}$"}, "Target",
               "'main' (the pipeline's counts table) or the name of a replay table set (lower-case letters, "
               "digits, '_'), kept with its own ledger under <warehouse>/replays/<name>/"),
    "offsets": ({"type": ["null", "string"],
                 "pattern": r"^\s*(\d+\s*:\s*\d+\s*-\s*\d+\s*(,\s*\d+\s*:\s*\d+\s*-\s*\d+\s*)*)?$"},
                "Offset ranges", "per-partition half-open ranges 'partition:from-until,...', e.g. '0:0-500,2:100-200'; "
                "leave empty to give a time range instead"),
    "from_time": ({"type": ["null", "string"], "format": "date-time"}, "From (time)",
                  "start of a time range (inclusive), resolved per partition to the first offset whose record "
                  "timestamp is at or after it"),
    "until_time": ({"type": ["null", "string"], "format": "date-time"}, "Until (time)",
                   "end of the time range (exclusive); must not be in the future"),
    "max_records_per_epoch": (param_schema(SETTINGS_BY_NAME["max_records_per_epoch"]), "Max records per epoch",
                              "the range is counted in epochs of at most this many offsets, each committed on its own"),
}


def backfill_params(cfg: PipelineConfig) -> dict[str, Any]:
    from airflow.sdk import Param

    defaults = {"target": MAIN_TARGET, "offsets": None, "from_time": None, "until_time": None,
                "max_records_per_epoch": cfg.max_records_per_epoch}
    return {name: Param(defaults[name], title=title, description=text, **schema)
            for name, (schema, title, text) in BACKFILL_PARAMS.items()}


def check_backfill_request(cfg: PipelineConfig, params: dict[str, Any]) -> dict[str, Any]:
    """The trigger form's request, checked (also against the broker) before Spark starts."""
    from ipcount.jobs.backfill import resolve  # (imports pyspark: not at DAG parse time)

    _refuse_unknown(params, BACKFILL_PARAMS, BadRequestError)
    request = request_from_fields({k: params.get(k) for k in REQUEST_FIELDS}, cfg.topic)
    with resolved(cfg) as kafka:
        ranges = resolve(kafka, request).ranges
    log.info("backfill request %s: %s -> %d offset range(s), %d offsets", request.request_id, request.describe(),
             len(ranges), sum(r.size for r in ranges))
    return {"request_id": request.request_id, "target": request.target, "request": request.describe(),
            "ranges": [str(r) for r in ranges]}


def task_defaults(cfg: PipelineConfig, retries: int) -> dict[str, Any]:
    """The DAGs' ``default_args``: retries, and a limit on every task, so a task that hangs
    fails (and is retried) instead of holding the DAG's one active run."""
    return {"retries": retries, "retry_delay": timedelta(seconds=15),
            "execution_timeout": timedelta(seconds=cfg.command_timeout_seconds)}


def dagrun_timeout(cfg: PipelineConfig) -> timedelta:
    return timedelta(seconds=cfg.dagrun_timeout_seconds)


def spark_submit_kwargs(cfg: PipelineConfig, task_id: str) -> dict[str, Any]:
    """The spark-submit settings of an epoch task (its run, the one argument, is added when the task runs). The master
    comes from the ``spark_default`` connection."""
    return {"application": EPOCH_APPLICATION, "conn_id": "spark_default", "name": f"{cfg.pipeline_id}-{task_id}",
            "jars": ",".join(spark_jars()), "conf": spark_conf(cfg), "env_vars": dict(DRIVER_ENV)}


# The runs of the DAGs' Spark tasks, built when each runs from the pipeline's settings and the task's context
# (ipcount.orchestration.operators.epoch_operator).

def epoch_run(cfg: PipelineConfig, context: Mapping[str, Any]) -> Run:
    """The epoch DAG's ``run_epoch``: one epoch with the run's Params; the group offset commit
    and publishing are tasks of their own."""
    return Run(EPOCH, run_config(cfg, context["params"]), run_id=context["run_id"], commit_offsets=False,
               publish=False)


def interval_run(cfg: PipelineConfig, context: Mapping[str, Any]) -> Run:
    """A run of ``airflow backfill create`` (``backfill_interval``): the records whose Kafka
    timestamps fall in the run's data interval - only what the ledger does not own yet."""
    start, end = (round(context[name].timestamp() * 1000) for name in ("data_interval_start", "data_interval_end"))
    return Run(BACKFILL, run_config(cfg, context["params"]), run_id=context["run_id"],
               request=BackfillRequest(from_ms=start, until_ms=end))


def request_run(cfg: PipelineConfig, context: Mapping[str, Any]) -> Run:
    """The backfill DAG's ``run_backfill``: the request of its form (checked by ``check_request``)."""
    params = context["params"]
    request = request_from_fields({k: params.get(k) for k in REQUEST_FIELDS}, cfg.topic)
    return Run(BACKFILL, cfg.replace(max_records_per_epoch=params["max_records_per_epoch"]),
               run_id=context["run_id"], request=request)


def epoch_summary(cfg: PipelineConfig, run_id: str, target: str = MAIN_TARGET) -> dict[str, Any]:
    """The epoch(s) this DAG run committed, as logged, returned to XCom and put in the counts Asset event's extra."""
    cfg = cfg.for_target(target)
    epochs = committed_epochs(cfg.ledger_path, run_id=run_id)
    for e in epochs:
        log.info("%s", e.line())
    return {
        "run_id": run_id,
        "topic": cfg.topic,
        "target": target,
        "counts_table": cfg.counts_path,
        "epochs": [e.to_dict() for e in epochs],
        "records_counted": sum(e.records_counted for e in epochs),
    }
