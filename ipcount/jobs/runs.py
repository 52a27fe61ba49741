"""A run of the pipeline's Spark work, typed: up to N epochs of the chain, a backfill, or a rebuild, with its settings.
The command line, the Airflow tasks and spark-submit's application (the run as JSON) all execute a :class:`Run`, so a
task's settings cross no argv and its errors keep their type."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable

from ipcount.jobs.crash import Crash, crash_from_env
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import BadRequestError, ConfigError, SparkConnectLost
from ipcount.rules.requests import MAIN_TARGET, BackfillRequest, json_object, request_from_fields

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


EPOCH, BACKFILL, REBUILD = "epoch", "backfill", "rebuild"
COMMANDS = (EPOCH, BACKFILL, REBUILD)


@dataclass(frozen=True)
class Run:
    """What to run. ``epoch``: up to ``epochs`` epochs, stopping at the first with nothing new, each followed by the
    group offset commit (``commit_offsets``) and publishing (``publish``) when the settings turn them on (the DAG runs
    both in tasks of their own); ``backfill``: ``request``; ``rebuild``: ``source``'s ledger into the replay target
    ``into``. ``run_id`` is recorded in the ledger (an Airflow run's id)."""

    command: str
    config: PipelineConfig = field(default_factory=PipelineConfig)
    run_id: str | None = None
    epochs: int = 1
    commit_offsets: bool = True
    publish: bool = True
    request: BackfillRequest | None = None
    into: str = ""
    source: str = MAIN_TARGET

    def __post_init__(self) -> None:
        if self.command not in COMMANDS:
            raise BadRequestError(f"a run's command is one of {', '.join(COMMANDS)}, not {self.command!r}")
        if not isinstance(self.config, PipelineConfig):
            raise BadRequestError("a run's config must be a PipelineConfig")
        if type(self.epochs) is not int or self.epochs < 1:
            raise BadRequestError(f"a run's epochs must be a whole number of at least 1, not {self.epochs!r}")
        for name, kinds in (("run_id", (str, type(None))), ("commit_offsets", bool), ("publish", bool),
                            ("into", str), ("source", str)):
            if not isinstance(getattr(self, name), kinds):
                raise BadRequestError(f"a run's {name} must be a {'string' if kinds is not bool else 'boolean'}, "
                                      f"not {getattr(self, name)!r}")
        if (self.request is not None) != (self.command == BACKFILL):
            raise BadRequestError("a backfill run needs its request, and only a backfill run has one")
        # (a rebuild's into and source are checked with the tables, by jobs.rebuild.check_request)

    def to_json(self) -> str:
        out: dict[str, Any] = {k: v for k, v in asdict(self).items() if k not in ("config", "request")}
        out["settings"] = self.config.to_dict()
        out["request"] = None if self.request is None else request_fields(self.request)
        return json.dumps(out, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Run:
        """The run :meth:`to_json` wrote; every part checked as the CLI checks its own."""
        given = json_object(text, "the run", sorted({f.name for f in fields(cls)} - {"config"} | {"settings"}))
        if not isinstance(settings := given.pop("settings", None), dict):
            raise ConfigError("a run's settings are a JSON object, and a run has them")
        cfg = PipelineConfig.from_mapping(settings)
        request = given.pop("request", None)
        return cls(config=cfg, request=None if request is None else request_from_fields(request, cfg.topic), **given)


def request_fields(request: BackfillRequest) -> dict[str, Any]:
    """``request`` as the fields :func:`request_from_fields` reads."""
    offsets = ",".join(f"{r.partition}:{r.from_offset}-{r.until_offset}" for r in request.offsets) or None
    return {"target": request.target, "offsets": offsets, "from_time": request.from_ms,
            "until_time": request.until_ms}


# Called with each epoch's summary once its offsets are committed (after its line is printed), or with the backfill's or
# the rebuild's report.
Report = Callable[[Any], None]


def quiet_clients() -> None:
    """kafka-python's and py4j's INFO lines off, and delta-rs's WARN line per AWS credentials provider it tries: the
    error a run ends with says what failed and what to set."""
    for noisy in ("kafka", "py4j"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("RUST_LOG", "error")


def execute(run: Run, spark: SparkSession | None = None, report: Report = lambda result: None) -> list:
    """Run ``run`` on ``spark`` (default: the session its settings name, started here), printing a line per epoch (or
    the backfill's or rebuild's), and return its summaries or its report. Every check that needs no Spark happens before
    a JVM starts. ``IPCOUNT_CRASH_AT`` names a step to be killed at (a test hook)."""
    crash = crash_from_env()
    try:
        return {EPOCH: _epochs, BACKFILL: _backfill, REBUILD: _rebuild}[run.command](run, spark, report, crash)
    except Exception as e:
        from ipcount.rules.kafka_properties import refused_property
        from ipcount.storage.spark import connect_lost

        if refused := refused_property(str(e), run.config.kafka_consumer_properties):
            raise ConfigError(f"{refused}. Nothing written is lost: the epoch keeps its recorded ranges, and the "
                              "next run finishes it") from None
        if connect_lost(e):
            raise SparkConnectLost(f"ipcount {run.command}: the Spark Connect server went away under it "
                                   f"({' '.join(str(e).split())[:160]}). Nothing written is lost: an epoch it left "
                                   "unfinished keeps its recorded ranges, and the next run finishes it") from None
        raise


def _session(run: Run, spark: SparkSession | None) -> SparkSession:
    from ipcount.storage.spark import get_spark

    return spark if spark is not None else get_spark(run.config)


def _epochs(run: Run, spark: SparkSession | None, report: Report, crash: Crash) -> list:
    from ipcount.jobs.epoch import check_before_touch, run_epoch
    from ipcount.jobs.group_commit import commit_group_offsets_from_ledger
    from ipcount.jobs.publish import publish_step
    from ipcount.rules.ledger import EpochSummary

    cfg = run.config
    check_before_touch(cfg)  # before the JVM starts (run_epoch checks again before any table)
    spark = _session(run, spark)
    summaries = []
    # Several epochs in one session (catching up after downtime) pay the JVM and Spark start once; each is still a whole
    # epoch, exactly as if run on its own.
    for _ in range(run.epochs):
        started = time.monotonic()
        summary = run_epoch(cfg, spark, run_id=run.run_id, crash=crash)
        summary = summary or EpochSummary(None, seconds=time.monotonic() - started)
        print(summary.line(), flush=True)  # (before the offset commit, which may fail: only warns)
        if run.commit_offsets:
            crash("before_kafka_commit")
            started = time.monotonic()
            commit_group_offsets_from_ledger(cfg)
            summary = summary.with_stages(kafka_commit=time.monotonic() - started)
        report(summary)
        summaries.append(summary)
        if cfg.publish and run.publish:  # after the summary: a failed publish undoes no epoch
            publish_step(cfg, crash)
        if summary.plan is None:
            break
    return summaries


def _backfill(run: Run, spark: SparkSession | None, report: Report, crash: Crash) -> list:
    from ipcount.jobs.backfill import resolve, run_backfill
    from ipcount.jobs.epoch import check_locations

    check_locations(run.config.for_target(run.request.target))
    resolved = resolve(run.config, run.request)  # checked, with the broker, before Spark starts
    done = run_backfill(run.config, _session(run, spark), run.request, run_id=run.run_id, crash=crash,
                        resolved=resolved)
    print(done.line(), flush=True)
    report(done)
    return [done]


def _rebuild(run: Run, spark: SparkSession | None, report: Report, crash: Crash) -> list:
    from ipcount.jobs.rebuild import check_request, rebuild
    from ipcount.storage.broker import partition_offsets

    check_request(run.config, run.into, run.source)  # the request, the tables' locations and the broker,
    partition_offsets(run.config)                    # before the JVM starts (rebuild checks the offsets again)
    done = rebuild(run.config, _session(run, spark), run.into, run.source, run_id=run.run_id, crash=crash)
    print(done.line(), flush=True)
    report(done)
    return [done]
