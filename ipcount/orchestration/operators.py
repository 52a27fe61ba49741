"""The Airflow operator of the tasks that run the pipeline's Spark commands."""
from __future__ import annotations

from pathlib import Path

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk.exceptions import AirflowException

from ipcount.orchestration.kafka_connection import kafka_args, resolved
from ipcount.orchestration.monitor.links import EpochPageLink
from ipcount.rules.config import PipelineConfig
from ipcount.server import auth, client


class EpochSubmitOperator(SparkSubmitOperator):
    """``spark-submit spark_jobs/epoch_job.py <command>``, or the same command in the epoch
    server when ``epoch_server`` names one that answers (a warm session: no JVM start, no
    cold Delta operations). Either way the task fails when the command does, and carries the
    link to its epochs' monitoring page."""

    operator_extra_links = (EpochPageLink(),)

    def __init__(self, *, epoch_server: str = "", epoch_server_token_file: str = "",
                 server_timeout_seconds: float | None = None, kafka_connection: str = "",
                 bootstrap_servers: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.epoch_server = epoch_server
        self.epoch_server_token_file = epoch_server_token_file
        self.server_timeout_seconds = server_timeout_seconds
        self.kafka_connection = kafka_connection
        self.bootstrap_servers = bootstrap_servers

    def execute(self, context):
        if not self.kafka_connection:
            return self._execute(context)
        # The connection's settings follow the DAG's flags (the last flag wins); its secrets
        # are in private files until the command is done.
        cfg = PipelineConfig(bootstrap_servers=self.bootstrap_servers, kafka_connection=self.kafka_connection)
        with resolved(cfg) as kafka:
            self.log.info("Kafka settings from connection %r: %s over %s", self.kafka_connection,
                          kafka.bootstrap_servers, kafka.kafka_security_protocol)
            own = list(self.application_args)
            self.application_args = [*own, *kafka_args(kafka)]
            try:
                return self._execute(context)
            finally:
                self.application_args = own

    def _execute(self, context):
        if self.epoch_server:
            state = client.health(self.epoch_server)
            if state is not None:
                return self._run_in_server(state)
            self.log.warning("no epoch server answers at %s: running the command with spark-submit instead",
                             self.epoch_server)
        return super().execute(context)

    def _run_in_server(self, state: dict) -> None:
        args = [str(a) for a in self.application_args]
        self.log.info("running `%s` in the epoch server at %s (pid %s, %s requests so far%s)", args[0],
                      self.epoch_server, state.get("pid"), state.get("requests"),
                      ", busy: this request waits its turn" if state.get("busy") else "")
        # The server stops the command at this limit (and when this task is killed, since its
        # connection closes); the wait here is bounded by it too.
        token = auth.read_token(Path(self.epoch_server_token_file))  # a server that answers: no token is an error
        result = client.submit(self.epoch_server, args, token, on_log=self.log.info,
                               limit_seconds=self.server_timeout_seconds)
        for line in result.get("stdout", "").splitlines():
            self.log.info("%s", line)
        if result["exit_code"] != 0:
            raise AirflowException(f"`{args[0]}` failed in the epoch server with exit code {result['exit_code']}"
                                   + (f": {result['error']}" if result.get("error") else " (see the log above)"))
