"""The pipeline's errors: one base class that carries the exit code of the command that fails with it, so the CLI maps
every error the same way.

Exit codes: 0 done, 1 failed, 2 bad input (settings, request, flags, no tables where the settings point), 3 data loss, 4
broker unreachable or topic missing, 5 object storage unreachable or refused.

An error is *permanent* when running the same work again cannot end otherwise (bad input, data loss under
``on_data_loss = "fail"``): an Airflow task fails at once instead of being retried. A spark-submitted task sees only its
exit code, so permanence follows the code (:data:`PERMANENT_EXIT_CODES`).
"""
from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DATA_LOSS, EXIT_BROKER, EXIT_STORAGE = 0, 1, 2, 3, 4, 5
PERMANENT_EXIT_CODES = frozenset({EXIT_USAGE, EXIT_DATA_LOSS})


class IpcountError(Exception):
    """Base of the pipeline's errors; the message says what went wrong and what to fix. A subclass names its exit code
    in its class statement (``exit_code=...``)."""

    exit_code = EXIT_FAILED

    def __init_subclass__(cls, exit_code: int | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if exit_code is not None:
            cls.exit_code = exit_code

    @property
    def permanent(self) -> bool:
        """Whether the same work, run again, must fail the same way (see the module's doc)."""
        return self.exit_code in PERMANENT_EXIT_CODES


class ConfigError(IpcountError, ValueError, exit_code=EXIT_USAGE):
    """A setting has a value the pipeline cannot run with; the message says which and why."""


class BadRequestError(IpcountError, ValueError, exit_code=EXIT_USAGE):
    """A backfill (or rebuild) request that cannot be run as given."""


class StartPositionError(IpcountError, ValueError, exit_code=EXIT_USAGE):
    """The configured start position cannot be resolved on this topic."""


class MissingJarsError(IpcountError, exit_code=EXIT_USAGE):
    """Spark's Kafka source jars, or the parse's, are not where the installation puts them (or not in the Spark that
    runs the epoch)."""


class DataLossError(IpcountError, RuntimeError, exit_code=EXIT_DATA_LOSS):
    """Offsets the pipeline still has to count are gone from the broker (or never existed)."""


class BrokerUnavailableError(IpcountError, RuntimeError, exit_code=EXIT_BROKER):
    """The configured bootstrap servers did not answer (or a read stalled)."""


class UnknownTopicError(IpcountError, RuntimeError, exit_code=EXIT_BROKER):
    """The source topic does not exist on the broker."""


class MissingTablesError(IpcountError, exit_code=EXIT_USAGE):
    """A command that reads a table set found none where the settings point."""


class StorageUnavailableError(IpcountError, RuntimeError, exit_code=EXIT_STORAGE):
    """The object storage of the tables did not answer, or refused the request (no or wrong credentials)."""


class PlanConflict(IpcountError, RuntimeError):
    """Another planner recorded offsets (or the epoch id) this plan wanted: plan again."""


class CommitContention(IpcountError, RuntimeError):
    """A commit lost to other writers' commits every time it was tried; nothing of it was written, and running the
    command again is safe."""


class EpochFenced(IpcountError, RuntimeError):
    """Another run settled this epoch (its offsets aged out) while this run was still running it: the sink tables
    refused this run's writes, so it must not commit the epoch either."""


class PublisherFenced(IpcountError, RuntimeError):
    """A newer publisher of the same pipeline took over (same ``transactional.id``): this one stops; what it had not
    committed is aborted, and the newer one goes on from the cursor."""


class MaintenanceFailed(IpcountError, RuntimeError):
    """A maintenance step failed on some table; the others were done and the run was logged."""


class TableSetMismatch(IpcountError, exit_code=EXIT_USAGE):
    """A run's settings, or one of its tables, do not belong to the table set it would write."""


class ConnectionUnavailable(IpcountError, RuntimeError):
    """An Airflow connection the settings name was not found, or the secrets backend that holds it did not answer:
    Airflow tells the two apart to no one, so it is retried."""


class SparkConnectLost(IpcountError, RuntimeError):
    """The Spark Connect server went away under a run (stopped or restarted mid-run): what was written stays, and an
    epoch left unfinished keeps its recorded ranges."""


class SparkConnectError(IpcountError, RuntimeError, exit_code=EXIT_BROKER):
    """The Spark Connect server of ``spark_remote`` (or of a task's connection) did not answer: retried, a server
    restarting being the common case. (One that refuses the token, or an address that is none, is a ConfigError.)"""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its class name if it has none), at most 200 characters: enough to say what
    failed in a log line or a note."""
    return (str(error).splitlines() or [type(error).__name__])[0][:200]
