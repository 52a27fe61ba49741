"""The pipeline's errors: one base class that carries the exit code of the command that
fails with it, so the CLI (and the epoch server, which runs the CLI) maps every error the
same way, and a caller that must react to one condition catches that one class.

Exit codes: 0 done, 1 failed, 2 bad input (settings, request, flags), 3 data loss,
4 broker unreachable or topic missing.
"""
from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DATA_LOSS, EXIT_BROKER = 0, 1, 2, 3, 4


class IpcountError(Exception):
    """Base of the pipeline's errors; the message says what went wrong and what to fix."""

    exit_code = EXIT_FAILED


class ConfigError(IpcountError, ValueError):
    """A setting has a value the pipeline cannot run with; the message says which and why."""

    exit_code = EXIT_USAGE


class BadRequestError(IpcountError, ValueError):
    """A backfill (or rebuild) request that cannot be run as given."""

    exit_code = EXIT_USAGE


class StartPositionError(IpcountError, ValueError):
    """The configured start position cannot be resolved on this topic."""

    exit_code = EXIT_USAGE


class MissingJarsError(IpcountError):
    """Spark's Kafka source or Delta jars are not where bin/setup puts them."""

    exit_code = EXIT_USAGE


class DataLossError(IpcountError, RuntimeError):
    """Offsets the pipeline still has to count are gone from the broker (or never existed)."""

    exit_code = EXIT_DATA_LOSS


class BrokerUnavailableError(IpcountError, RuntimeError):
    """The configured bootstrap servers did not answer (or a read stalled)."""

    exit_code = EXIT_BROKER


class UnknownTopicError(IpcountError, RuntimeError):
    """The source topic does not exist on the broker."""

    exit_code = EXIT_BROKER


class BrokerStartError(IpcountError, RuntimeError):
    """The embedded broker did not start."""

    exit_code = EXIT_BROKER


class PlanConflict(IpcountError, RuntimeError):
    """Another planner recorded offsets (or the epoch id) this plan wanted: plan again."""


class LedgerStateError(IpcountError, RuntimeError):
    """The ledger holds a state no planner leaves behind (e.g. two unfinished scheduled epochs)."""


class EpochServerError(IpcountError, RuntimeError):
    """The epoch server could not be reached, refused the request, or broke off while running it."""

    exit_code = EXIT_USAGE
