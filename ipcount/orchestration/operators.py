"""The Airflow operators of the pipeline's tasks: those that run its Spark work (a typed
:class:`~ipcount.jobs.runs.Run`, built when the task runs), ``@lineage_task``, Airflow's
``@task`` naming its Assets to OpenLineage, and how an error ends a task: a permanent one
(:mod:`ipcount.rules.errors`) fails it at once, a transient one is left to its retries."""
from __future__ import annotations

import dataclasses
import threading
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.providers.standard.decorators.python import _PythonDecoratedOperator
from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from ipcount.jobs.runs import Run, execute, quiet_clients
from ipcount.orchestration.dags import spark_submit_kwargs
from ipcount.orchestration.kafka_connection import resolved
from ipcount.orchestration.lineage import LineageMixin
from ipcount.orchestration.monitor.links import EpochPageLink
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import PERMANENT_EXIT_CODES, ConfigError, IpcountError
from ipcount.storage.spark import connect_session

# Builds a task's run from the pipeline's settings and the task's context (its Params, run id and data interval):
# ipcount.orchestration.dags.epoch_run and the like.
RunOf = Callable[[PipelineConfig, Mapping[str, Any]], Run]


@contextmanager
def failing_fast() -> Iterator[None]:
    """Within (or, as ``@failing_fast()``, in a ``@task``'s function), a permanent pipeline error fails the task at once
    (the same work would fail the same way on every retry); a transient one is raised as it is, for the retries."""
    try:
        yield
    except IpcountError as e:
        if not e.permanent:
            raise
        raise AirflowFailException(f"{type(e).__name__}: {e} (not retried: running it again cannot end otherwise)") \
            from e


class _RunsEpochs(LineageMixin):
    """What both epoch operators share: the run, built when the task runs, with the Kafka settings of the pipeline's
    ``kafka_connection`` (its secrets in private files until the run is done)."""

    operator_extra_links = (EpochPageLink(),)

    @contextmanager
    def task_run(self, context: Mapping[str, Any]) -> Iterator[Run]:
        run = self.run_of(self.pipeline, context)
        with resolved(run.config) as cfg:
            if run.config.kafka_connection:
                self.log.info("Kafka settings from connection %r: %s over %s", run.config.kafka_connection,
                              cfg.bootstrap_servers, cfg.kafka_security_protocol)
            yield dataclasses.replace(run, config=cfg)


class EpochSubmitOperator(_RunsEpochs, SparkSubmitOperator):
    """``spark-submit spark_jobs/epoch_job.py RUN_JSON``: the task fails when the run does,
    at once when its exit code says the error is permanent."""

    def __init__(self, *, pipeline: PipelineConfig, run_of: RunOf, lineage_outputs: list | None = None,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.pipeline, self.run_of, self.lineage_outputs = pipeline, run_of, lineage_outputs

    def execute(self, context):
        with failing_fast(), self.task_run(context) as run:
            self.application_args = [run.to_json()]
            try:
                return super().execute(context)
            except AirflowException as e:
                code = getattr(getattr(self._hook, "_submit_sp", None), "returncode", None)
                if code in PERMANENT_EXIT_CODES:
                    raise AirflowFailException(f"`ipcount {run.command}` exited with code {code} (bad settings or "
                                               "request, or data loss; see the log above): not retried") from e
                raise


class EpochConnectOperator(_RunsEpochs, BaseOperator):
    """The run in this task's own process, on the pipeline's session
    (:func:`ipcount.storage.spark.connect_session`) of the Spark Connect server of the
    ``spark_connect`` connection ``conn_id`` (its URL from the Spark provider's hook):
    planning and every Delta commit happen here, the Kafka read and the aggregation on the
    server. The session stays open for the pipeline's next tasks (the provider's
    PySparkOperator would stop it, and with it the session another task is using). A task
    that dies takes its epoch with it: nothing of it runs on elsewhere."""

    template_fields = ("conn_id",)

    def __init__(self, *, pipeline: PipelineConfig, run_of: RunOf, conn_id: str, lineage_outputs: list | None = None,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.pipeline, self.run_of, self.conn_id, self.lineage_outputs = pipeline, run_of, conn_id, lineage_outputs
        self._running: tuple | None = None   # (session, tag) while the run runs

    def session(self):
        """The pipeline's session on the connection's server (refusing a connection that
        is no Spark Connect server's, or would change the session others share)."""
        hook = SparkConnectHook(self.conn_id)
        conn = hook.get_connection(self.conn_id)
        if conn.conn_type != SparkConnectHook.conn_type:
            raise ConfigError(f"spark_connect_connection {self.conn_id!r} is a connection of type {conn.conn_type!r}, "
                              f"not {SparkConnectHook.conn_type!r}")
        # The URL holds the connection's token, user and use_ssl. Settings in its extra would change the session every
        # process of the pipeline shares, mid-epoch for some.
        if settings := sorted(set(conn.extra_dejson) - {SparkConnectHook.PARAM_USE_SSL}):
            raise ConfigError(f"spark_connect_connection {self.conn_id!r} has {', '.join(settings)} in its extra, which "
                              f"may hold only {SparkConnectHook.PARAM_USE_SSL}: set Spark settings on the server")
        return connect_session(hook.get_connection_url(), f"connection {self.conn_id!r} ({conn.host}:{conn.port})",
                               self.pipeline.pipeline_id, self.pipeline.kafka_timeout_seconds)

    def execute(self, context) -> None:
        quiet_clients()
        with failing_fast(), self.task_run(context) as run:
            spark = self.session()
            # Tags are the client's, per thread (the run's queries run on this one), and match within the session, which
            # other tasks share: so one of this task's own.
            tag = f"ipcount-task-{uuid.uuid4().hex}"
            spark.addTag(tag)
            self._running = (spark, tag)
            try:
                self.execute_run(run, spark)
            finally:
                self._running = None
                spark.removeTag(tag)

    def execute_run(self, run: Run, spark) -> None:
        execute(run, spark)

    def on_kill(self) -> None:
        """On SIGTERM (a cleared run, a run marked failed elsewhere; Airflow's SIGKILL follows
        5 s later) the server stops this task's query now, rather than once it notices the
        client is gone (:data:`ipcount.storage.connect_server.ABANDONED_QUERY_CONF`). The
        epoch then fails as a crashed one does; its commits are this process's, so nothing of
        it runs on. The request gets 3 s: a server that does not answer must not hold up the
        task's end."""
        if (running := self._running) is None:
            return
        spark, tag = running

        def interrupt() -> None:
            try:
                stopped = spark.interruptTag(tag)
                self.log.info("on kill: asked the Spark Connect server to stop this task's queries (%d)", len(stopped))
            except Exception as e:  # noqa: BLE001 - pyspark's gRPC errors have no narrower public base
                self.log.warning("on kill: could not stop this task's queries on the server: %s", e)

        asking = threading.Thread(target=interrupt, name="ipcount-interrupt", daemon=True)
        asking.start()
        asking.join(3)


class LineageTaskOperator(LineageMixin, _PythonDecoratedOperator):
    """The operator ``@task`` builds (the standard provider's, whose class name is private), naming its datasets to
    OpenLineage (``lineage_outputs``: see :class:`LineageMixin`)."""

    def __init__(self, *, lineage_outputs: list | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lineage_outputs = lineage_outputs


def lineage_task(python_callable: Callable | None = None, **kwargs):
    """``@task`` (or ``@task(...)``) whose Assets reach OpenLineage's events."""
    from airflow.sdk.bases.decorator import task_decorator_factory

    return task_decorator_factory(python_callable=python_callable, decorated_operator_class=LineageTaskOperator,
                                  **kwargs)


def epoch_operator(cfg: PipelineConfig, task_id: str, run_of: RunOf, **task_kwargs) -> BaseOperator:
    """The task executing ``run_of``'s run: in the task's own process on the Spark Connect server of
    ``spark_connect_connection`` when that is set, else spark-submit (:func:`spark_submit_kwargs`). Chosen by
    configuration, never by probing. ``task_kwargs`` (inlets, outlets, ``lineage_outputs``) go to the operator."""
    if not cfg.spark_connect_connection:
        return EpochSubmitOperator(task_id=task_id, pipeline=cfg, run_of=run_of, **spark_submit_kwargs(cfg, task_id),
                                   **task_kwargs)
    return EpochConnectOperator(task_id=task_id, pipeline=cfg, run_of=run_of, conn_id=cfg.spark_connect_connection,
                                **task_kwargs)
