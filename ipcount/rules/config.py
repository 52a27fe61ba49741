"""Pipeline configuration: one frozen, validated object passed to every component.

Precedence, lowest first: built-in defaults, a TOML/JSON config file, ``IPCOUNT_*`` environment variables, explicit
overrides (CLI flags, DAG params). Nothing deeper in the code reads ``os.environ``; it receives a
:class:`PipelineConfig`.
"""
from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

from ipcount.rules.errors import ConfigError
from ipcount.rules.kafka_properties import parse_properties
from ipcount.rules.requests import MAIN_TARGET, check_target

# Where the jars, the Spark job file and the bin/ tools are: the checkout the package is in (an editable install), or
# IPCOUNT_HOME where the package is installed from a wheel (the product image's /opt/ipcount).
REPO_ROOT = Path(os.environ.get("IPCOUNT_HOME") or Path(__file__).resolve().parents[2])
STATE_DIR = REPO_ROOT / ".local"
ENV_PREFIX = "IPCOUNT_"
START_POSITIONS = ("earliest", "latest", "timestamp", "group-offsets", "specific")
RESET_POLICIES = ("earliest", "latest", "none")
DATA_LOSS_POLICIES = ("fail", "skip")
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
EVENT_TIME_SOURCES = ("payload", "kafka")
IDENTIFIER = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,99}$")


# Bounds of the int settings (seconds, or values that go into a 32-bit Java int).
HOUR, WEEK, MONTH, YEAR = 3_600, 7 * 86_400, 31 * 86_400, 365 * 86_400
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
LAST_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: the last time Python and Spark both hold

# Who may set a setting. PIPELINE: the pipeline's settings. RUN: one run may set it differently (the epoch DAG's
# Params).
PIPELINE, RUN = "pipeline", "run"
# What a setting is for. identity: whose tables (the manifest's owner); location: where a table is; meaning: what the
# rows mean, fixed when a table set is created (its manifest); kafka: the Kafka client's connection; epochs: how epochs
# plan and read; spark: where they run; airflow: the DAGs' schedules, limits and alerts; publishing; maintenance.
USES = ("identity", "location", "meaning", "kafka", "epochs", "spark", "airflow", "publishing", "maintenance")
START_OFFSETS_PATTERN = r"^\s*(\d+\s*:\s*\d+\s*(,\s*\d+\s*:\s*\d+\s*)*)?$"


@dataclass(frozen=True)
class Setting:
    """One setting, declared once as a field of :class:`PipelineConfig`: its CLI flag, its ``IPCOUNT_*`` variable, its
    config-file key, its DAG Param (scope RUN) and its row in docs/configuration.md all come from here
    (tests/unit/test_docs.py checks the table)."""

    name: str
    type: str                        # "str", "int" or "bool": the field's annotation
    default: Any
    help: str                        # the CLI's --help, the Param's description, the docs row
    minimum: int | None = None       # int settings (each states both): the least allowed value
    maximum: int | None = None       # and the greatest
    choices: tuple[str, ...] = ()    # the words allowed
    scope: str = PIPELINE
    title: str = ""                  # scope RUN: the trigger form's label
    param: Mapping[str, Any] = field(default_factory=dict)  # scope RUN: JSON schema besides type, minimum, choices
    use: str = ""                    # what it is for, one of USES: the commands and checks that read it follow

    def __post_init__(self) -> None:
        if self.use not in USES:  # (a setting nobody classified would be left out of some check, silently)
            raise TypeError(f"setting {self.name} must declare its use, one of {', '.join(USES)}; not {self.use!r}")

    @property
    def env(self) -> str:
        return env_name(self.name)


def setting(default: Any, help: str, **details: Any) -> Any:
    """A :class:`PipelineConfig` field and what :class:`Setting` says about it."""
    return field(default=default, metadata={"setting": {"help": help, **details}})


def env_name(name: str) -> str:
    """``window_seconds`` -> ``IPCOUNT_WINDOW_SECONDS``."""
    return ENV_PREFIX + name.upper()


def flag(name: str) -> str:
    """The command-line spelling of a setting: ``window_seconds`` -> ``--window-seconds``."""
    return "--" + name.replace("_", "-")


def negated_flag(name: str) -> str:
    """``--no-commit-offsets``: how a boolean setting is turned off on the command line."""
    return "--no-" + name.replace("_", "-")


def setting_arg(name: str, value: Any) -> str:
    """A setting as one command-line argument: ``--topic=-events``, ``--no-commit-offsets``. One token, so that argparse
    cannot take a value starting with '-' for a flag."""
    if isinstance(value, bool):
        return flag(name) if value else negated_flag(name)
    return f"{flag(name)}={value}"


@dataclass(frozen=True)
class PipelineConfig:
    """Everything an epoch needs to know. Validated when built.

    Table locations default to ``<warehouse>/<table>``; set them one by one to place a table elsewhere.
    """

    pipeline_id: str = setting(
        "ipcount", "name of the pipeline; the Delta txnAppId prefix of its writes", use="identity")
    bootstrap_servers: str = setting("127.0.0.1:9092", "Kafka bootstrap servers, host:port[,host:port]", use="kafka")
    topic: str = setting("ip_count_source", "source topic", use="meaning")
    warehouse: str = setting(
        str(STATE_DIR / "warehouse"),
        "directory or object-storage URI (s3://bucket/prefix) holding the Delta tables (counts, ledger, "
        "dead_letters, late_records)", use="location")
    counts_table: str = setting("", "location of the counts table (default <warehouse>/counts)", use="location")
    ledger_table: str = setting("", "location of the offset ledger (default <warehouse>/ledger)", use="location")
    dead_letter_table: str = setting(
        "", "location of the dead-letter table (default <warehouse>/dead_letters)", use="location")
    late_table: str = setting(
        "", "location of the late-records table (default <warehouse>/late_records)", use="location")
    maintenance_table: str = setting(
        "", "location of the maintenance log, a row per table and maintenance run (default <warehouse>/maintenance)",
        use="location")
    window_seconds: int = setting(5, "tumbling event-time window size", minimum=1, maximum=WEEK, use="meaning")
    allowed_lateness_seconds: int = setting(
        5,
        "a window accepts records until the watermark passes its end plus this",
        minimum=0, maximum=WEEK, use="meaning")
    event_time: str = setting(
        "payload",
        "where event time comes from: payload (the record's JSON ts or NGINX [time]) or kafka (the Kafka record "
        "timestamp; the payload's time is then neither required nor checked)",
        choices=EVENT_TIME_SOURCES, use="meaning")
    max_records_per_epoch: int = setting(
        500_000,
        "cap on the offsets one epoch (or one backfill chunk) reads, split across partitions by backlog (no "
        "partition with a backlog is starved)",
        minimum=1, maximum=1_000_000_000, scope=RUN, title="Max records in this epoch", use="epochs")
    max_driver_tally_rows: int = setting(
        250_000,
        "an epoch's tally (a row per window and client counted, and per bad or late record) of at "
        "most this many rows is merged by the epoch's own process; a larger one is written by Spark's executors "
        "into the tables, and only the files' metadata reaches the process that commits (0: always the executors)",
        minimum=0, maximum=INT32_MAX, use="epochs")
    start_position: str = setting(
        "earliest",
        "where a pipeline with an empty ledger starts: earliest, latest, timestamp, group-offsets or specific; "
        "ignored (and logged) once the ledger has entries",
        choices=START_POSITIONS, scope=RUN, title="Start position (only while the ledger is empty)", use="epochs")
    start_timestamp_ms: int = setting(
        -1,
        "for start_position timestamp: per partition, the first offset whose record timestamp is at or after "
        "this epoch-ms time (the end if none)",
        scope=RUN, title="Start timestamp, epoch ms (start_position timestamp)", minimum=-1, maximum=LAST_MS,
        use="epochs")
    start_offsets: str = setting(
        "",
        "for start_position specific: 'partition:offset,...'; partitions not named start at earliest; offsets "
        "outside the log are refused",
        scope=RUN, title="Start offsets 'partition:offset,...' (start_position specific)",
        param={"pattern": START_OFFSETS_PATTERN}, use="epochs")
    group_offsets_reset: str = setting(
        "earliest",
        "for start_position group-offsets: partitions where the group has no committed offset start at earliest "
        "or latest, or the epoch fails (none)",
        choices=RESET_POLICIES, scope=RUN,
        title="Reset for partitions without group offsets (start_position group-offsets)", use="epochs")
    on_data_loss: str = setting(
        "fail",
        "offsets deleted before they were counted: fail the epoch (naming partition and offsets), or skip them "
        "and record the gap in the ledger as status 'lost'",
        choices=DATA_LOSS_POLICIES, scope=RUN, title="On offsets deleted before counted", use="epochs")
    group_id: str = setting(
        "ipcount", "Kafka consumer group that receives the committed offsets (monitoring only)", use="epochs")
    commit_offsets: bool = setting(
        True,
        "commit the ledger's positions to the consumer group after each epoch",
        scope=RUN, title="Commit offsets to the consumer group", use="epochs")
    max_value_bytes: int = setting(65_536, "larger record values go to the dead-letter table as too_large",
                                   minimum=1, maximum=INT32_MAX, use="meaning")
    max_event_time_ahead_seconds: int = setting(
        3_600,
        "records whose event time is further than this past their Kafka timestamp (or the time their epoch was "
        "planned) go to the dead-letter table as event_time_ahead, so that one bad clock cannot move the "
        "watermark into the future (Kafka 4's message.timestamp.after.max.ms defaults to an hour too)",
        minimum=0, maximum=10 * YEAR, use="meaning")
    spark_master: str = setting(
        "local[*]",
        "master of the in-process Spark session (bin/ipcount epoch); the DAGs' spark-submit uses Airflow's "
        "spark_default connection", use="spark")
    spark_remote: str = setting(
        "",
        "Spark Connect URL of a Spark Connect server (sc://host:port; `ipcount connect-server` runs one): "
        "set, the epoch runs in this process with a remote "
        "session (planning and every Delta commit here, the read and aggregation on the server) and "
        "spark_master is not used", use="spark")
    spark_remote_token_file: str = setting(
        "",
        "file holding the Spark Connect server's token (mode 0600), sent with every request (use the host name "
        "localhost for a server on this machine: pyspark asks for TLS whenever a token goes elsewhere)", use="spark")
    spark_connect_connection: str = setting(
        "",
        "id of an Airflow connection of type spark_connect (host, port, password: the server's token, extra "
        "use_ssl): set, the DAGs' Spark tasks run their command in the task's own process on that Spark Connect "
        "server (not spark-submit)", use="spark")
    kafka_timeout_seconds: int = setting(30, "timeout of broker requests", minimum=1, maximum=HOUR, use="kafka")
    schedule: str = setting(
        "* * * * *",
        "the epoch DAG's schedule, read when Airflow parses the DAG: a cron expression or preset, as data "
        "intervals [previous tick, tick) (a run made by airflow backfill create counts the records whose Kafka "
        "timestamps fall in its interval), @continuous: each run starts as the last one ends, or on-data: a run "
        "starts within on_data_poll_seconds of new records, none while the log is idle (an asset watcher in "
        "Airflow's triggerer compares the log ends with the ledger; on_data_fallback runs it on a clock too)",
        use="airflow")
    on_data_fallback: str = setting(
        "@hourly",
        "with schedule on-data, the clock that also starts runs (a cron expression or preset, as data intervals: "
        "it bounds the delay after a lost event or a stopped triggerer, and gives airflow backfill create its "
        "intervals), or none: new data alone starts runs", use="airflow")
    on_data_poll_seconds: int = setting(
        2, "with schedule on-data, how often the watcher compares the log ends with the ledger",
        minimum=1, maximum=HOUR, use="airflow")
    alert_lag_records: int = setting(
        0,
        "after each epoch DAG run, its check_freshness task fails (so the failure alerts configured in Airflow "
        "fire) when more than this many offsets wait past the chain; 0: off",
        minimum=0, maximum=INT64_MAX, use="airflow")
    alert_stale_seconds: int = setting(
        0,
        "after each epoch DAG run, check_freshness fails when records wait and the chain's last commit is older "
        "than this; 0: off",
        minimum=0, maximum=MONTH, use="airflow")
    alert_run_seconds: int = setting(
        0,
        "a Deadline Alert on each epoch DAG run: when the run is not done this long after it was queued, its "
        "callback (ipcount.orchestration.alerts.run_overdue) logs an error; 0: off",
        minimum=0, maximum=MONTH, use="airflow")
    metrics_token_file: str = setting(
        "",
        "file (mode 0600) holding a token of at least 32 characters that a scraper sends as Authorization: "
        "Bearer to read the monitor's /ipcount/metrics (Airflow logins may read it too); empty: Airflow logins only",
        use="airflow")
    command_timeout_seconds: int = setting(
        3_600,
        "the longest one Spark command of a DAG run (epoch, backfill, rebuild) may take: the tasks' "
        "execution_timeout (a task past it fails and is retried; its epoch stays planned and the retry finishes "
        "it)",
        minimum=1, maximum=MONTH, use="airflow")
    dagrun_timeout_seconds: int = setting(
        7_200,
        "a DAG run still running after this fails (Airflow's dagrun_timeout), so one stuck run cannot hold the "
        "DAG's one active run for good",
        minimum=1, maximum=MONTH, use="airflow")
    kafka_security_protocol: str = setting(
        "PLAINTEXT",
        "how the pipeline talks to Kafka: PLAINTEXT, SSL (TLS), SASL_PLAINTEXT or SASL_SSL (SASL login over TLS)",
        choices=SECURITY_PROTOCOLS, use="kafka")
    kafka_sasl_mechanism: str = setting("", "for SASL_*: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", use="kafka")
    kafka_sasl_username: str = setting("", "for SASL_*: the user name", use="kafka")
    kafka_sasl_password_file: str = setting(
        "",
        "for SASL_*: a file holding the password (mode 0600; the password is never a setting, so it is in no "
        "command line, environment, ledger or log)", use="kafka")
    kafka_ssl_cafile: str = setting(
        "", "for SSL and SASL_SSL: PEM file of the CA(s) to trust (default: the system's)", use="kafka")
    kafka_ssl_client_pem: str = setting(
        "",
        "for SSL and SASL_SSL with client certificates: one PEM file holding the unencrypted private key and the "
        "certificate chain (mode 0600)", use="kafka")
    kafka_ssl_check_hostname: bool = setting(
        True,
        "for SSL and SASL_SSL: check that the broker's certificate names the host connected to (turn off only "
        "for a test broker)", use="kafka")
    kafka_consumer_properties: str = setting(
        "",
        "more properties of the Java Kafka consumer that reads each epoch (Spark's Kafka source takes them as its "
        "kafka.* options) and of Kafka's Java tools (consumer-groups): 'name=value;name=value' in Kafka's own "
        "names, e.g. 'fetch.max.bytes=104857600;client.rack=eu-1a'; a name the consumer does not have, or one the "
        "pipeline sets from its own settings (bootstrap, security, group, deserializers, offsets), is refused",
        use="epochs")
    kafka_connection: str = setting(
        "",
        "id of an Airflow connection of type kafka whose extra (librdkafka names: bootstrap.servers, "
        "security.protocol, sasl.mechanism, sasl.username, sasl.password, ssl.ca.location, "
        "ssl.certificate.location, ssl.key.location, ssl.endpoint.identification.algorithm) gives the Kafka "
        "settings to the DAGs' tasks and the monitor; they write its password to a private file for the task's "
        "run", use="kafka")
    publish: bool = setting(
        False,
        "after each epoch, publish the counts rows it changed to publish_topic, exactly once (one Kafka "
        "transaction per counts-table version, with the publisher's cursor); turns on the counts table's change "
        "data feed", use="publishing")
    publish_topic: str = setting(
        "ip_count_sink",
        "the Kafka topic the counts are published to, made if missing; an existing one must have "
        "cleanup.policy=compact only (keyed by window and IP; read it with isolation.level=read_committed)",
        use="publishing")
    maintenance_schedule: str = setting(
        "@hourly",
        "the maintenance DAG's schedule (a cron expression or preset), or none: it then runs only when triggered; "
        "each run compacts, checkpoints and vacuums every table of the set (every epoch adds a file to the counts "
        "table, which the next run packs)", use="maintenance")
    vacuum_retention_hours: int = setting(
        168,
        "maintenance deletes a data file once no table version has referenced it for this long (Delta's VACUUM "
        "retention; a reader of an older version needs its files)",
        minimum=1, maximum=10 * YEAR // 3600, use="maintenance")
    log_retention_hours: int = setting(
        1,
        "every table's commits older than this are deleted from its _delta_log, below its last checkpoint (Delta's "
        "delta.logRetentionDuration): time travel and streaming readers of a table reach back this far, and every "
        "commit lists the log, so a longer one costs each epoch; versions not yet published are kept",
        minimum=1, maximum=10 * YEAR // 3600, use="maintenance")

    def __post_init__(self) -> None:
        self._check_types()
        self._absolute_locations()
        self._check_names()
        self._check_numbers_and_choices()
        self._check_start_position()
        if not self.schedule.strip():
            raise ConfigError("schedule is empty; expected a cron expression such as '* * * * *', a "
                              "preset such as '@hourly', @continuous or on-data")
        if self.schedule.strip() not in ("@continuous", ON_DATA) and not is_cron(self.schedule):
            raise ConfigError(f"schedule {self.schedule!r} is not a cron expression Airflow takes (five fields "
                              "such as '*/5 * * * *', or a preset such as '@hourly'), nor @continuous or on-data")
        if self.on_data_fallback.strip().lower() != "none" and not is_cron(self.on_data_fallback):
            raise ConfigError(f"on_data_fallback {self.on_data_fallback!r}: expected a cron expression or preset "
                              "such as '@hourly' (the clock beside the data), or none")
        if self.spark_remote:
            _check_spark_remote(self.spark_remote)
        if self.spark_remote_token_file and not self.spark_remote:
            raise ConfigError("spark_remote_token_file is set but spark_remote is not: the token is for a Spark "
                              "Connect server")
        if not self.warehouse:
            raise ConfigError("warehouse is empty; expected a directory or an s3:// URI for the Delta tables")
        if not self.maintenance_schedule.strip():
            raise ConfigError("maintenance_schedule is empty; expected a cron expression or preset such as "
                              "'@hourly', or 'none' to run maintenance only when triggered")
        if self.maintenance_schedule.strip().lower() != "none" and not is_cron(self.maintenance_schedule):
            raise ConfigError(f"maintenance_schedule {self.maintenance_schedule!r} is not a cron expression "
                              "Airflow takes (five fields such as '0 * * * *', or a preset such as '@hourly'), "
                              "nor 'none'")
        for name in LOCATION_SETTINGS:
            scheme = location_scheme(getattr(self, name))
            if scheme not in ("", *OBJECT_STORAGE_SCHEMES):
                raise ConfigError(f"{name} {getattr(self, name)!r}: tables live in a directory or under "
                                  f"{', '.join(s + '://' for s in OBJECT_STORAGE_SCHEMES)}; not {scheme}://")
        self._check_kafka_security()
        parse_properties(self.kafka_consumer_properties)

    @property
    def uses_sasl(self) -> bool:
        """Whether the pipeline logs in to Kafka (SASL_PLAINTEXT or SASL_SSL)."""
        return self.kafka_security_protocol.startswith("SASL_")

    @property
    def uses_tls(self) -> bool:
        """Whether the pipeline talks to Kafka over TLS (SSL or SASL_SSL)."""
        return self.kafka_security_protocol.endswith("SSL")

    def _check_kafka_security(self) -> None:
        """Settings that fit together (the files are read when used)."""
        if self.uses_sasl:
            if self.kafka_sasl_mechanism not in SASL_MECHANISMS:
                raise ConfigError(f"kafka_security_protocol {self.kafka_security_protocol} needs kafka_sasl_mechanism, "
                                  f"one of {', '.join(SASL_MECHANISMS)}; found {self.kafka_sasl_mechanism!r}")
            if not self.kafka_sasl_username or not self.kafka_sasl_password_file:
                raise ConfigError(f"kafka_security_protocol {self.kafka_security_protocol} needs kafka_sasl_username "
                                  "and kafka_sasl_password_file (a file holding the password, mode 0600)")
        else:
            given = [n for n in ("kafka_sasl_mechanism", "kafka_sasl_username", "kafka_sasl_password_file")
                     if getattr(self, n)]
            if given:
                raise ConfigError(f"{', '.join(given)} set, but kafka_security_protocol is "
                                  f"{self.kafka_security_protocol}: SASL settings need SASL_SSL or SASL_PLAINTEXT")
        if not self.uses_tls:
            given = [n for n in ("kafka_ssl_cafile", "kafka_ssl_client_pem") if getattr(self, n)]
            if given:
                raise ConfigError(f"{', '.join(given)} set, but kafka_security_protocol is "
                                  f"{self.kafka_security_protocol}: TLS settings need SSL or SASL_SSL")

    def _check_names(self) -> None:
        for name in ("pipeline_id", "group_id"):
            value = getattr(self, name)
            if not IDENTIFIER.match(value):
                raise ConfigError(
                    f"{name} must start with a letter and hold only letters, digits, '_', '.', '-' "
                    f"(at most 100 characters); found {value!r}")
        for name in ("topic", "publish_topic"):
            if not re.match(r"^[A-Za-z0-9._-]{1,249}$", getattr(self, name)):
                raise ConfigError(f"{name} must be a legal Kafka topic name; found {getattr(self, name)!r}")
        if self.publish and self.publish_topic == self.topic:
            raise ConfigError(f"publish_topic must not be the source topic {self.topic!r}")
        if not self.bootstrap_servers.strip():
            raise ConfigError("bootstrap_servers is empty; expected host:port[,host:port...]")
        for hostport in self.bootstrap_servers.split(","):
            parse_host_port(hostport, "bootstrap_servers entry")

    def _absolute_locations(self) -> None:
        """A local table location as an absolute path (``~`` expanded): one given relative to where a command was typed
        must name the same tables for the DAG's tasks, the Spark executors and the next command, wherever they run."""
        for name in LOCATION_SETTINGS:
            value = getattr(self, name)
            if value != value.strip():
                raise ConfigError(f"{name} {value!r} starts or ends with blanks")
            if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:/(?!/)", value):
                raise ConfigError(f"{name} {value!r} looks like a URI with one slash after its scheme; expected "
                                  "scheme://bucket/prefix, or a directory")
            if value and not location_scheme(value) and not os.path.isabs(value):
                object.__setattr__(self, name, os.path.abspath(os.path.expanduser(value)))

    def _check_types(self) -> None:
        """Each value of its declared type, however the object was made (``_convert`` turns a
        flag's or a variable's text into it); no text holds a control character."""
        for s in SETTINGS:
            value = getattr(self, s.name)
            if s.type == "str":
                if not isinstance(value, str):
                    raise ConfigError(f"{s.name} must be a string; found {value!r} ({type(value).__name__})")
                if re.search(r"[\x00-\x1f\x7f]", value):
                    raise ConfigError(f"{s.name} holds a control character (a line break or tab?); found {value!r}")
            elif s.type == "bool" and not isinstance(value, bool):
                raise ConfigError(f"{s.name} must be true or false; found {value!r}")

    def _check_numbers_and_choices(self) -> None:
        for s in SETTINGS:
            if s.type != "int":
                continue
            value = getattr(self, s.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{s.name} must be an integer; found {value!r}")
            if not s.minimum <= value <= s.maximum:
                raise ConfigError(f"{s.name} must be an integer from {s.minimum} to {s.maximum}; found {value!r}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}; found {getattr(self, name)!r}")

    def _check_start_position(self) -> None:
        if self.start_position == "timestamp" and self.start_timestamp_ms < 0:
            raise ConfigError("start_position 'timestamp' needs start_timestamp_ms (epoch milliseconds, >= 0); "
                              f"found {self.start_timestamp_ms}")
        specific = self.specific_start_offsets  # validates the format
        if self.start_position == "specific" and not specific:
            raise ConfigError("start_position 'specific' needs start_offsets, e.g. '0:100,2:250' "
                              "(partitions not named start at earliest)")

    # -- construction -------------------------------------------------------------------

    @classmethod
    def load(cls, config_file: str | os.PathLike[str] | None = None,
             environ: Mapping[str, str] | None = None, **overrides: Any) -> PipelineConfig:
        """Defaults < ``config_file`` (or ``$IPCOUNT_CONFIG``) < ``IPCOUNT_*`` env < overrides."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        if config_file is None:
            config_file = environ.get(f"{ENV_PREFIX}CONFIG")
            if config_file is not None and not config_file.strip():
                raise ConfigError(f"{ENV_PREFIX}CONFIG is set but empty: name a config file, or unset it")
        elif not str(config_file).strip():
            raise ConfigError("--config is empty: name a config file, or leave the flag out")
        if config_file is not None:
            values.update(read_config_file(config_file))
        values.update(_from_env(environ))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_mapping(values)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PipelineConfig:
        """Build from plain values (strings are converted to each field's type)."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        converted = {name: _convert(name, known[name].type, value) for name, value in values.items()}
        return cls(**converted)

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with some settings changed, validated again."""
        return PipelineConfig.from_mapping({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_env(self) -> dict[str, str]:
        """The settings as the ``IPCOUNT_*`` variables the DAGs read (``load`` reads them back)."""
        return {env_name(name): str(value) for name, value in self.to_dict().items()}

    def to_args(self, names: Iterable[str] | None = None) -> list[str]:
        """The settings (or only ``names``) as the command line's flags: all of them for ``ipcount epoch``, ``backfill``
        and ``rebuild``, a command's own group for the others (:data:`COMMAND_SETTINGS`)."""
        wanted = None if names is None else set(names)
        return [setting_arg(name, value) for name, value in self.to_dict().items()
                if wanted is None or name in wanted]

    @property
    def specific_start_offsets(self) -> dict[int, int]:
        """``start_offsets`` parsed: "0:100, 2:250" -> {0: 100, 2: 250}."""
        out: dict[int, int] = {}
        for item in filter(None, (x.strip() for x in self.start_offsets.split(","))):
            m = re.match(r"^(\d+)\s*:\s*(\d+)$", item)
            if not m:
                raise ConfigError(f"start_offsets entry {item!r} is not partition:offset "
                                  f"(e.g. '0:100,2:250'); found {self.start_offsets!r}")
            if int(m.group(1)) in out:
                raise ConfigError(f"start_offsets names partition {m.group(1)} twice: {self.start_offsets!r}")
            out[int(m.group(1))] = int(m.group(2))
        return out

    # Table locations: an explicit setting wins, else <warehouse>/<table>.
    def _table(self, explicit: str, name: str) -> str:
        return explicit or join_location(self.warehouse, name)

    @property
    def counts_path(self) -> str:
        return self._table(self.counts_table, "counts")

    @property
    def ledger_path(self) -> str:
        return self._table(self.ledger_table, "ledger")

    @property
    def dead_letter_path(self) -> str:
        return self._table(self.dead_letter_table, "dead_letters")

    @property
    def late_path(self) -> str:
        return self._table(self.late_table, "late_records")

    @property
    def maintenance_path(self) -> str:
        return self._table(self.maintenance_table, "maintenance")

    def for_target(self, target: str) -> PipelineConfig:
        """The configuration writing to ``target``: ``main`` is this pipeline's own tables;
        any other (checked) name is a replay table set with its own ledger under
        ``<warehouse>/replays/<target>/``."""
        if check_target(target) == MAIN_TARGET:
            return self
        base = join_location(self.warehouse, "replays", target)
        return self.replace(**{setting: join_location(base, name) for setting, name in (
            ("counts_table", "counts"), ("ledger_table", "ledger"), ("dead_letter_table", "dead_letters"),
            ("late_table", "late_records"), ("maintenance_table", "maintenance"))})

    @property
    def window_ms(self) -> int:
        return self.window_seconds * 1000

    @property
    def allowed_lateness_ms(self) -> int:
        return self.allowed_lateness_seconds * 1000

    @property
    def max_event_time_ahead_ms(self) -> int:
        return self.max_event_time_ahead_seconds * 1000


# Every setting, in declaration order, and the views of it the code reads.
SETTINGS = tuple(Setting(f.name, str(f.type), f.default, **f.metadata["setting"]) for f in fields(PipelineConfig))


def used_for(use: str) -> tuple[str, ...]:
    """The settings declared with ``use``, in declaration order."""
    return tuple(s.name for s in SETTINGS if s.use == use)


LOCATION_SETTINGS = used_for("location")  # the settings that place tables
MEANING = used_for("meaning")             # what the rows mean: recorded in a table set's manifest
SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}
SETTINGS_HELP = {s.name: s.help for s in SETTINGS}
CHOICES = {s.name: s.choices for s in SETTINGS if s.choices}
PER_RUN_SETTINGS = tuple(s.name for s in SETTINGS if s.scope == RUN)

# The settings of the commands that do not take them all (the rest, and every command's
# --config file and IPCOUNT_* variables, carry every setting): each group is what its
# command reads, so a flag it would ignore is refused instead.
KAFKA_CLIENT_SETTINGS = used_for("kafka")
TABLE_SETTINGS = (*used_for("identity"), *LOCATION_SETTINGS)
COUNTING_SETTINGS = tuple(name for name in MEANING if name != "topic")
COMMAND_SETTINGS = {
    "watch": TABLE_SETTINGS,
    "latency": (*TABLE_SETTINGS, "topic", *KAFKA_CLIENT_SETTINGS),
    "verify": (*TABLE_SETTINGS, "topic", *KAFKA_CLIENT_SETTINGS, *COUNTING_SETTINGS),
    "publish": (*TABLE_SETTINGS, "topic", *KAFKA_CLIENT_SETTINGS, "publish", "publish_topic"),
    "maintain": (*TABLE_SETTINGS, "topic", *KAFKA_CLIENT_SETTINGS, "publish", "publish_topic", "window_seconds",
                 "allowed_lateness_seconds", "vacuum_retention_hours", "log_retention_hours"),
    "create-topic": ("pipeline_id", "topic", *KAFKA_CLIENT_SETTINGS),
    "scram-user": ("pipeline_id", *KAFKA_CLIENT_SETTINGS),
    "consumer-groups": ("pipeline_id", *KAFKA_CLIENT_SETTINGS, "kafka_consumer_properties"),
    "generate": ("pipeline_id", "topic", *KAFKA_CLIENT_SETTINGS),
    # Spark's server with the epochs' own Spark settings, which are no pipeline settings: it reads no file or IPCOUNT_*
    # variable, so none meant for the pipeline can stop it.
    "connect-server": (),
}


# The schedule whose runs are started by new records (an asset watcher), not a clock.
ON_DATA = "on-data"


def cron_expression(schedule: str) -> str:
    """``schedule`` as croniter reads it: croniter knows every preset of Airflow's but @quarterly."""
    schedule = schedule.strip()
    return "0 0 1 */3 *" if schedule == "@quarterly" else schedule


def is_cron(expression: str) -> bool:
    """Whether Airflow's cron timetables take ``expression``: a preset, or what croniter parses (Airflow's own check).
    """
    from croniter import croniter

    return croniter.is_valid(cron_expression(expression))


_HOST_PORT = re.compile(r"^(?:\[(?P<ipv6>[^\]\s]+)\]|(?P<host>[A-Za-z0-9._-]+)):(?P<port>\d{1,5})$")


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    """``host:port`` (a host name, an IPv4 address, or an IPv6 address in brackets:
    ``[::1]:9092``) as (host without brackets, port); a :class:`ConfigError` naming ``what``
    otherwise."""
    m = _HOST_PORT.match(text.strip())
    if not m:
        raise ConfigError(f"{what} {text!r} is not host:port (a host name or IPv4 address, or an IPv6 address in "
                          "brackets such as [::1]:9092)")
    if m["ipv6"]:
        try:
            ipaddress.IPv6Address(m["ipv6"])
        except ValueError:
            raise ConfigError(f"{what} {text!r}: {m['ipv6']!r} in brackets is not an IPv6 address") from None
    port = int(m["port"])
    if not 1 <= port <= 65535:
        raise ConfigError(f"{what} {text!r}: port {port} is not between 1 and 65535")
    return m["ipv6"] or m["host"], port


def _check_spark_remote(url: str) -> None:
    """``sc://host[:port][/]``. (No ;parameters: a token there would be in every command line; it has its file.)"""
    netloc = url[len("sc://"):].removesuffix("/") if url.startswith("sc://") else ""
    if not netloc or ";" in netloc or "/" in netloc:
        raise ConfigError(f"spark_remote must be a Spark Connect URL such as sc://localhost:15002, with no "
                          f";parameters (the token goes in spark_remote_token_file), or empty for a Spark "
                          f"session in this process; found {url!r}")
    has_port = re.search(r":\d*$", netloc) and not netloc.endswith("]")
    parse_host_port(netloc if has_port else f"{netloc}:15002", "spark_remote's address")


# Where delta-rs can keep tables besides a local directory (its credentials and endpoint come from the standard AWS_*
# environment variables).
OBJECT_STORAGE_SCHEMES = ("s3", "s3a")


def location_scheme(location: str) -> str:
    """``s3`` of ``s3://bucket/x``; "" for a local path."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", location)
    return m.group(1).lower() if m else ""


def join_location(base: str, *parts: str) -> str:
    """``base``/``parts``, for a directory or a URI alike (a URI's ``//`` is kept)."""
    if location_scheme(base):
        return "/".join([base.rstrip("/"), *parts])
    return str(Path(base).joinpath(*parts))


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``.toml`` or ``.json`` file of settings (top-level keys, or an ``[ipcount]`` table:
    not both)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} is {'a directory' if p.is_dir() else 'not a regular file'}; "
                          "expected a .toml or .json file of settings")
    kind = "JSON" if p.suffix == ".json" else "TOML"
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start} cannot be read)") from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (ValueError, RecursionError) as e:  # TOMLDecodeError is a ValueError
        raise ConfigError(f"config file {str(p)!r} is not valid {kind}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a {kind} {'object' if kind == 'JSON' else 'table'} "
                          f"of settings; found {type(data).__name__}")
    settings = data.get("ipcount", data)
    if "ipcount" in data and len(data) > 1:  # the top-level ones would be ignored without a word
        section = '"ipcount"' if kind == "JSON" else "[ipcount]"
        raise ConfigError(f"config file {str(p)!r} has top-level key(s) {', '.join(sorted(set(data) - {'ipcount'}))} "
                          f"besides its {section} {'object' if kind == 'JSON' else 'table'}; put all the settings "
                          f"in one place: all under {section} or all at top level")
    if not isinstance(settings, dict):
        example = '{"ipcount": {"topic": "..."}}' if kind == "JSON" else '[ipcount] then topic = "..."'
        raise ConfigError(f"config file {str(p)!r}: 'ipcount' must be a {kind} {'object' if kind == 'JSON' else 'table'} "
                          f"of settings (e.g. {example}); found {type(settings).__name__}")
    return dict(settings)


# IPCOUNT_* variables that are not settings: the config file, the install's home, the test and lab hooks, and the
# secrets bin/compose-env writes to .env for docker-compose (a shell may have sourced it).
OTHER_VARIABLES = frozenset(ENV_PREFIX + name for name in (
    "CONFIG", "HOME", "CRASH_AT", "MODEL_EXAMPLES", "MODEL_STEPS", "MODEL_REPORT", "TEST_DAG_DENY", "TEST_ARTIFACTS",
    "AIRFLOW_ADMIN_PASSWORD", "AIRFLOW_JWT_SECRET", "CONNECT_TOKEN", "KAFKA_EXTERNAL_PASSWORD",
    "POSTGRES_PASSWORD", "S3_SECRET"))


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings of the ``IPCOUNT_*`` variables; one that is no setting (a typo such as ``IPCOUNT_WINDOW_SECOND``) is
    refused, as an unknown key of a config file is."""
    names = {f.name for f in fields(PipelineConfig)}
    out = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key in OTHER_VARIABLES:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in names or key != env_name(name):
            close = difflib.get_close_matches(key, [env_name(n) for n in names], n=1)
            raise ConfigError(f"environment variable {key} is no setting of the pipeline"
                              + (f" (did you mean {close[0]}?)" if close else "")
                              + "; the settings' variables are listed in docs/configuration.md")
        out[name] = value
    return out


def _convert(name: str, type_name: Any, value: Any) -> Any:
    """``value`` as the setting's type: its own type, or a string spelling it (flags and
    variables are strings); anything else (a TOML list, a number for a name) is refused."""
    type_name = str(type_name)
    if type_name == "bool":
        if isinstance(value, bool):
            return value
        text = value.strip().lower() if isinstance(value, str) else None
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name} must be true or false; found {value!r}")
    if type_name == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d[\d_]*\s*", value):
            return int(value.replace("_", ""))
        raise ConfigError(f"{name} must be an integer; found {value!r}")
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string; found {value!r} ({type(value).__name__}): quote it in a "
                          "config file")
    return value


