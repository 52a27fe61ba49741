"""The Spark session an epoch runs in, and the settings spark-submit needs for the same."""
from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import time
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence
from urllib.parse import quote, unquote, urlsplit

from ipcount.rules.config import STATE_DIR, PipelineConfig
from ipcount.rules.errors import ConfigError, MissingJarsError, SparkConnectError
from ipcount.rules.private_files import read_private_file

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

# Resolved once from Maven Central by bin/setup (see jars/spark-extras.xml).
SPARK_JARS_DIR = STATE_DIR / "jars" / "spark"
# The record parse as a Spark function, built by bin/setup from jars/ipcount-parse.
PARSE_JAR = STATE_DIR / "jars" / "ipcount" / "ipcount-parse.jar"
# A spark-submitted driver must run this interpreter: the one with the pinned pyspark and this package (the DAGs'
# operator and the benchmark pass it to spark-submit).
DRIVER_ENV = {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
# Java options of the driver and the executors (see spark_conf).
JVM_OPTIONS = "-Xss4m -XX:-DontCompileHugeMethods"


def spark_home() -> Path:
    """The pinned pyspark's directory: its ``bin/spark-submit``, ``spark-class`` and jars."""
    import pyspark

    return Path(pyspark.__file__).parent


def spark_env() -> dict[str, str]:
    """What a Spark process started from the pinned pyspark needs: its home, and this interpreter for Python on the
    executors."""
    return {"SPARK_HOME": str(spark_home()), "PYSPARK_PYTHON": sys.executable}


def spark_jars(jars_dir: Path = SPARK_JARS_DIR, parse_jar: Path = PARSE_JAR) -> list[str]:
    """The Kafka connector's jars, which pyspark's own jars do not include, and the record parse's."""
    jars = sorted(str(p) for p in jars_dir.glob("*.jar"))
    needed = ("spark-sql-kafka", "kafka-clients")
    missing = [n for n in needed if not any(Path(j).name.startswith(n) for j in jars)]
    if missing:
        raise MissingJarsError(
            f"no {', '.join(missing)} jar in {jars_dir}: this installation is incomplete (in a checkout, "
            "bin/setup fetches them from Maven Central)")
    if not parse_jar.is_file():
        raise MissingJarsError(f"no {parse_jar}: this installation is incomplete (in a checkout, bin/setup "
                               "builds it from jars/ipcount-parse)")
    return [*jars, str(parse_jar)]


# Settings each session sets for itself (a Spark Connect session too, whatever its server's).
SESSION_CONF = {
    "spark.sql.session.timeZone": "UTC",
    # Epochs are small batches on few cores: a handful of shuffle partitions, not 200.
    "spark.sql.shuffle.partitions": "4",
    # The record parse, ipcount.parse(...) (jars/ipcount-parse; the jar is in spark_jars()).
    "spark.sql.catalog.ipcount": "ipcount.parse.ParseCatalog",
}


def spark_conf(cfg: PipelineConfig) -> dict[str, str]:
    """Spark settings shared by the in-process session and spark-submit (the DAG's path)."""
    return {
        **SESSION_CONF,
        "spark.ui.showConsoleProgress": "false",
        # Keep Spark's catalog directory out of the cwd (the pipeline uses no catalog tables).
        "spark.sql.warehouse.dir": str(STATE_DIR / "spark-warehouse"),
        # 4 MB thread stacks: room for Spark's JSON functions, which recurse once per nesting level (a
        # StackOverflowError kills the executor). Generated methods over HotSpot's 8,000-byte JIT limit would run
        # interpreted without -XX:-DontCompileHugeMethods (docs/performance.md). (These replace any extraJavaOptions of
        # spark-defaults.conf: add these to your own.)
        "spark.driver.extraJavaOptions": f"-Dlog4j2.level=warn {JVM_OPTIONS}",
        "spark.executor.extraJavaOptions": JVM_OPTIONS,
    }


def get_spark(cfg: PipelineConfig, app_name: str = "ipcount-epoch", more_jars: Sequence[str] = (),
              more_conf: Mapping[str, str] | None = None) -> SparkSession:
    """A session with the Kafka source and the record parse (and ``more_jars`` and ``more_conf``: the lab's Delta, for
    sessions its peer runs in).

    With ``spark_remote`` set, a Spark Connect session of the server there (which has the jars and settings of
    :func:`spark_conf`: ``ipcount connect-server``). Under spark-submit (the DAG's path) the JVM is already running with
    the master, jars and settings that were submitted, so they are used as they are.
    """
    from pyspark.sql import SparkSession

    if cfg.spark_remote:
        return remote_session(cfg)
    builder = SparkSession.builder.appName(app_name)
    # The Python of the tasks that write and read table files (ipcount.storage.table_files): one with pyarrow and this
    # package, as this one (pyspark's default is any python3).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # not launched by spark-submit
        builder = builder.master(cfg.spark_master).config("spark.jars", ",".join([*spark_jars(), *more_jars]))
        for key, value in {**spark_conf(cfg), **(more_conf or {})}.items():
            builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def connect_url(cfg: PipelineConfig) -> str:
    """``spark_remote`` with the token of ``spark_remote_token_file`` added (never logged)."""
    if not cfg.spark_remote_token_file:
        return cfg.spark_remote
    token = read_private_file(cfg.spark_remote_token_file, "spark_remote_token_file")
    # Quoted as the Spark provider's hook quotes a connection's token: pyspark unquotes it.
    return f"{cfg.spark_remote.rstrip('/')}/;token={quote(token, safe='')}"


def remote_session(cfg: PipelineConfig) -> SparkSession:
    """The pipeline's Spark Connect session of ``cfg.spark_remote`` (:func:`connect_session`)."""
    return connect_session(connect_url(cfg), cfg.spark_remote, cfg.pipeline_id, cfg.kafka_timeout_seconds)


# A new server-side Connect session is a cost of a process's first epoch (docs/performance.md), so a pipeline's
# processes share one. A server forgets a session idle for its timeout (60 minutes by default) and refuses its id from
# then on; the shared id is that of the current half hour, so a session made in it cannot have timed out before. An id
# refused all the same (a shorter timeout; a session someone stopped) gives way to one of the process's own.
SHARED_SESSION_SECONDS = 30 * 60


def shared_session_id(pipeline_id: str, token: str, now: float) -> str:
    """The Spark Connect session id that ``pipeline_id``'s processes share at time ``now`` (seconds since the epoch): a
    UUID made from the pipeline, the half hour and the server's token (so that only a holder of the token can name
    it)."""
    half_hour = int(now // SHARED_SESSION_SECONDS)
    digest = hashlib.sha256(f"{pipeline_id}\0{token}\0{half_hour}".encode()).digest()
    return str(uuid.UUID(bytes=digest[:16], version=4))


def _with_session_id(url: str, session_id: str) -> str:
    """``url`` (``sc://host:port[/][;param=value...]``) with the ``session_id`` parameter added."""
    base, sep, params = url.partition(";")
    return f"{base.rstrip('/')}/;{params + ';' if sep else ''}session_id={session_id}"


def connect_session(url: str, where: str, pipeline_id: str, timeout_seconds: float) -> SparkSession:
    """A session of the Spark Connect server at ``url`` (``where`` names it in messages; the URL may hold a token),
    answering: a server that is not there or refuses the token is a clear error, not minutes of the client's own
    retries. It is the pipeline's shared session (:func:`shared_session_id`), or the process's own if the server refuses
    that id; this process's earlier one for the same URL and pipeline while the server still has it. Never stop it: that
    ends it for every process of the pipeline."""
    from pyspark.sql import SparkSession

    parts = urlsplit(url.replace("sc://", "http://", 1))
    try:
        address = (parts.hostname, parts.port or 15002)
    except ValueError:  # (a port that is no number)
        raise ConfigError(f"{where}: not a Spark Connect address (sc://host:port)") from None
    try:
        socket.create_connection(address, timeout=timeout_seconds).close()
    except OSError as e:
        raise SparkConnectError(f"no Spark Connect server answers at {where} ({e.strerror or e}); start "
                                "one (ipcount connect-server) or leave spark_remote empty") from None
    key = (url, pipeline_id)
    if (earlier := _SESSIONS.get(key)) is not None:
        try:
            earlier.conf.get("spark.sql.session.timeZone")  # (a request: spark.version is kept by the client)
            return earlier
        except Exception as e:  # noqa: BLE001 - pyspark's gRPC errors have no narrower public base
            if not _ended(e):  # (stopped or timed out on the server, or a new server since)
                raise
            _drop(_SESSIONS.pop(key))
    params = dict(p.partition("=")[::2] for p in url.partition(";")[2].split(";") if p)
    shared = shared_session_id(pipeline_id, unquote(params.get("token", "")), time.time())
    spark = SparkSession.builder.remote(_with_session_id(url, shared)).create()
    try:
        _first_request(spark, where)
    except _SessionClosed:
        _drop(spark)
        spark = SparkSession.builder.remote(url).create()
        _first_request(spark, where)
        log.info("on Spark Connect session %s (its own: the server refused the shared %s)", spark.session_id, shared)
    else:
        log.info("on Spark Connect session %s (the pipeline's shared session)", spark.session_id)
    _SESSIONS[key] = configured(spark)
    return spark


# The process's Connect sessions by URL and pipeline (pyspark's getOrCreate() would hand back any session the process
# has, whatever its server or id).
_SESSIONS: dict[tuple[str, str], SparkSession] = {}


def _ended(error: Exception) -> bool:
    """Whether ``error`` says the session is gone on the server (closed, timed out, or the server restarted since)."""
    return "INVALID_HANDLE.SESSION_CLOSED" in str(error) or "INVALID_HANDLE.SESSION_CHANGED" in str(error)


def connect_lost(error: BaseException) -> bool:
    """Whether ``error`` says this process's Spark Connect session went away under it: the server stopped or restarted
    mid-command (its client retries, then finds the session gone or is left with none: ``NO_ACTIVE_SESSION``)."""
    return isinstance(error, Exception) and (_ended(error) or "NO_ACTIVE_SESSION" in str(error))


def _drop(spark: SparkSession) -> None:
    """Let go of a session the server no longer has (no release request: it is closed already)."""
    spark.release_session_on_close = False
    spark.stop()


class _SessionClosed(Exception):
    """The server refuses the session's id: it closed the session (stopped, or timed out)."""


def _first_request(spark: SparkSession, where: str) -> None:
    """The session's first request to its server, where the token and the session id are checked."""
    try:
        spark.version  # noqa: B018
    except Exception as e:  # noqa: BLE001 - pyspark's gRPC errors have no narrower public base
        if _ended(e):
            raise _SessionClosed() from e
        if "UNAUTHENTICATED" not in str(e):
            raise
        raise ConfigError(f"the Spark Connect server at {where} refused this client's token: "
                                f"{' '.join(str(e).split())[:200]} (the token is the server's: "
                                "spark_remote_token_file, or the connection's password)") from None


# A Connect session's own settings besides SESSION_CONF. Adaptive execution re-plans the epoch's query after each
# broadcast, and each re-plan asks Kafka for the range's offsets again (docs/performance.md).
CONNECT_SESSION_CONF = {"spark.sql.adaptive.enabled": "false"}


def configured(spark: SparkSession) -> SparkSession:
    """``spark`` with :data:`SESSION_CONF` and :data:`CONNECT_SESSION_CONF` set (a Spark Connect session's own
    settings)."""
    for key, value in {**SESSION_CONF, **CONNECT_SESSION_CONF}.items():
        spark.conf.set(key, value)
    return spark


def is_remote(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect session (each request a round trip to its server)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


_PROCESS_KEY = os.urandom(16)


def read_group_key(spark: SparkSession) -> bytes:
    """The key of :func:`ipcount.rules.kafka_security.read_group_id` for reads in ``spark``: a Connect session's id (the
    processes sharing a session share the server's consumers), else a key of this process's own (a classic session's
    executors serve this process only)."""
    return spark.session_id.encode() if is_remote(spark) else _PROCESS_KEY


# A Connect session's task slots, asked once: its server's settings are fixed at its start.
_SLOTS: weakref.WeakKeyDictionary[SparkSession, int | None] = weakref.WeakKeyDictionary()


def task_slots(spark: SparkSession) -> int | None:
    """How many tasks the session's Spark runs at once: a classic session's default parallelism, a Connect server's
    ``spark.default.parallelism`` (None if it does not say)."""
    if not is_remote(spark):
        return spark.sparkContext.defaultParallelism
    if spark not in _SLOTS:
        value = spark.conf.get("spark.default.parallelism", None)
        _SLOTS[spark] = int(value) if value else None
    return _SLOTS[spark]


def spark_ddl(columns) -> str:
    """A DataFrame schema in DDL from (name, Spark SQL type, nullable) columns."""
    return ", ".join(f"`{name}` {kind}" for name, kind, _ in columns)
