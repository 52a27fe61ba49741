"""The Airflow operators of the pipeline's tasks: those that run its Spark commands, and
``@lineage_task``, Airflow's ``@task`` naming its Assets to OpenLineage."""
from __future__ import annotations

import threading
import uuid
from typing import Callable

from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.providers.standard.decorators.python import _PythonDecoratedOperator
from airflow.providers.standard.operators.python import PythonOperator

from ipcount.orchestration.dags import command_args, spark_submit_kwargs
from ipcount.orchestration.kafka_connection import kafka_args, resolved
from ipcount.orchestration.lineage import LineageMixin
from ipcount.orchestration.monitor.links import EpochPageLink
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import ConfigError
from ipcount.storage.spark import connect_session


class EpochSubmitOperator(LineageMixin, SparkSubmitOperator):
    """``spark-submit spark_jobs/epoch_job.py <command>``: the task fails when the command
    does, and carries the link to its epochs' monitoring page."""

    operator_extra_links = (EpochPageLink(),)

    def __init__(self, *, kafka_connection: str = "", bootstrap_servers: str = "", lineage_outputs: list | None = None,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.kafka_connection = kafka_connection
        self.bootstrap_servers = bootstrap_servers
        self.lineage_outputs = lineage_outputs

    def execute(self, context):
        if not self.kafka_connection:
            return super().execute(context)
        # The connection's settings follow the DAG's flags (the last flag wins); its secrets
        # are in private files until the command is done.
        cfg = PipelineConfig(bootstrap_servers=self.bootstrap_servers, kafka_connection=self.kafka_connection)
        with resolved(cfg) as kafka:
            self.log.info("Kafka settings from connection %r: %s over %s", self.kafka_connection,
                          kafka.bootstrap_servers, kafka.kafka_security_protocol)
            own = list(self.application_args)
            self.application_args = [*own, *kafka_args(kafka)]
            try:
                return super().execute(context)
            finally:
                self.application_args = own


class EpochConnectOperator(LineageMixin, PythonOperator):
    """``ipcount <command>`` in this task's own process, on the pipeline's session
    (:func:`ipcount.storage.spark.connect_session`) of the Spark Connect server of the
    ``spark_connect`` connection ``conn_id`` (its URL from the Spark provider's hook):
    planning and every Delta commit happen here, the Kafka read and the aggregation on the
    server. The session stays open for the pipeline's next tasks (the provider's
    PySparkOperator would stop it, and with it the session another task is using). A task
    that dies takes its epoch with it: nothing of it runs on elsewhere. ``python_callable``
    runs the command (:func:`ipcount.cli.run_in_session`, handed over by the DAG file: the
    CLI sits above this layer); ``command_args`` are templated."""

    operator_extra_links = (EpochPageLink(),)
    template_fields = ("conn_id", *PythonOperator.template_fields, "command_args")

    def __init__(self, *, conn_id: str, pipeline_id: str, command_args: list[str], kafka_connection: str = "",
                 bootstrap_servers: str = "", timeout_seconds: int = 30, lineage_outputs: list | None = None,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.lineage_outputs = lineage_outputs
        self.conn_id = conn_id
        self.pipeline_id = pipeline_id
        self.command_args = command_args
        self.kafka_connection = kafka_connection
        self.bootstrap_servers = bootstrap_servers
        self.timeout_seconds = timeout_seconds
        self._running: tuple | None = None   # (session, tag) while the command runs

    def execute_callable(self):
        hook = SparkConnectHook(self.conn_id)
        conn = hook.get_connection(self.conn_id)
        if conn.conn_type != SparkConnectHook.conn_type:
            raise ConfigError(f"spark_connect_connection {self.conn_id!r} is a connection of type {conn.conn_type!r}, "
                              f"not {SparkConnectHook.conn_type!r}")
        # The URL holds the connection's token, user and use_ssl. Settings in its extra would
        # change the session every process of the pipeline shares, mid-epoch for some.
        if settings := sorted(set(conn.extra_dejson) - {SparkConnectHook.PARAM_USE_SSL}):
            raise ConfigError(f"spark_connect_connection {self.conn_id!r} has {', '.join(settings)} in its extra, which "
                              f"may hold only {SparkConnectHook.PARAM_USE_SSL}: set Spark settings on the server")
        spark = connect_session(hook.get_connection_url(), f"connection {self.conn_id!r} ({conn.host}:{conn.port})",
                                self.pipeline_id, self.timeout_seconds)
        self.op_kwargs = {**self.op_kwargs, "spark": spark}
        # Tags are the client's, per thread (the epoch's queries run on this one), and match
        # within the session, which other tasks share: so one of this task's own.
        tag = f"ipcount-task-{uuid.uuid4().hex}"
        spark.addTag(tag)
        self._running = (spark, tag)
        try:
            return super().execute_callable()
        finally:
            self._running = None
            spark.removeTag(tag)

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

    def execute(self, context):
        if not self.kafka_connection:
            self.op_args = [self.command_args]
            return super().execute(context)
        cfg = PipelineConfig(bootstrap_servers=self.bootstrap_servers, kafka_connection=self.kafka_connection)
        with resolved(cfg) as kafka:  # (its secrets in private files until the command is done)
            self.log.info("Kafka settings from connection %r: %s over %s", self.kafka_connection,
                          kafka.bootstrap_servers, kafka.kafka_security_protocol)
            self.op_args = [[*self.command_args, *kafka_args(kafka)]]
            return super().execute(context)


class LineageTaskOperator(LineageMixin, _PythonDecoratedOperator):
    """The operator ``@task`` builds (the standard provider's, whose class name is private),
    naming its datasets to OpenLineage (``lineage_outputs``: see :class:`LineageMixin`)."""

    def __init__(self, *, lineage_outputs: list | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lineage_outputs = lineage_outputs


def lineage_task(python_callable: Callable | None = None, **kwargs):
    """``@task`` (or ``@task(...)``) whose Assets reach OpenLineage's events."""
    from airflow.sdk.bases.decorator import task_decorator_factory

    return task_decorator_factory(python_callable=python_callable, decorated_operator_class=LineageTaskOperator,
                                  **kwargs)


def epoch_operator(cfg: PipelineConfig, task_id: str, command: str, task_args: tuple[str, ...] = (),
                   run_params: bool = True, run_in_session: Callable | None = None, **task_kwargs):
    """The task running ``ipcount <command>``: in the task's own process on the Spark Connect
    server of ``spark_connect_connection`` when that is set (``run_in_session`` runs it:
    :func:`ipcount.cli.run_in_session`), else spark-submit (:func:`spark_submit_kwargs`).
    Chosen by configuration, never by probing. ``task_kwargs`` (inlets, outlets,
    ``lineage_outputs``) go to the operator."""
    if not cfg.spark_connect_connection:
        return EpochSubmitOperator(task_id=task_id, **spark_submit_kwargs(cfg, command, task_args, run_params),
                                   **task_kwargs)
    if run_in_session is None:
        raise ConfigError("spark_connect_connection is set, but the DAG file gave no command runner")
    args = command_args(cfg, command, task_args, run_params)   # (no Spark jars needed on this host)
    return EpochConnectOperator(task_id=task_id, python_callable=run_in_session, conn_id=cfg.spark_connect_connection,
                                pipeline_id=cfg.pipeline_id, command_args=args, kafka_connection=cfg.kafka_connection,
                                bootstrap_servers=cfg.bootstrap_servers, timeout_seconds=cfg.kafka_timeout_seconds,
                                **task_kwargs)
