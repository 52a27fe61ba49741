"""The lab's own errors: a service of the embedded stack that did not start. Each carries
its exit code as the product's errors do (:class:`ipcount.rules.errors.IpcountError`)."""
from __future__ import annotations

from ipcount.rules.errors import EXIT_BROKER, IpcountError


class BrokerStartError(IpcountError, RuntimeError, exit_code=EXIT_BROKER):
    """The embedded broker did not start."""


class DatabaseStartError(IpcountError, RuntimeError):
    """The embedded PostgreSQL server is not installed or did not start (the message says why)."""


class ServiceStartError(IpcountError, RuntimeError):
    """An embedded server (Spark Connect, s3proxy) did not start: its port is taken, or it
    exited or was not ready in time (the message says which, with its log's tail)."""
