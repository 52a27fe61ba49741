"""One exception base carries each error's exit code, and the CLI answers with it."""
from __future__ import annotations

from ipcount.cli import main
from ipcount.rules import errors
from ipcount_lab.cli import main as lab


def test_each_error_carries_the_exit_code_the_docs_promise():
    codes = {cls.__name__: cls.exit_code for cls in errors.IpcountError.__subclasses__()
             if cls.__module__ == errors.__name__}
    assert codes == {"ConfigError": 2, "BadRequestError": 2, "StartPositionError": 2, "MissingJarsError": 2,
                     "DataLossError": 3, "BrokerUnavailableError": 4, "UnknownTopicError": 4,
                     "PlanConflict": 1, "CommitContention": 1, "EpochFenced": 1,
                     "MaintenanceFailed": 1, "PublisherFenced": 1, "TableSetMismatch": 2,
                     "SparkConnectError": 4, "SparkConnectLost": 1, "ConnectionUnavailable": 1,
                     "MissingTablesError": 2, "StorageUnavailableError": 5}
    assert issubclass(errors.ConfigError, ValueError) and issubclass(errors.DataLossError, RuntimeError)
    # The lab's own (a service of the embedded stack that did not start), under the same base.
    from ipcount_lab import errors as lab_errors

    assert {cls.__name__: cls.exit_code for cls in (lab_errors.BrokerStartError, lab_errors.DatabaseStartError,
                                                    lab_errors.ServiceStartError)} == \
        {"BrokerStartError": 4, "DatabaseStartError": 1, "ServiceStartError": 1}


def test_the_cli_exits_with_the_errors_code_and_says_why(caplog):
    # The request is checked before anything reaches the broker (nothing listens on port 1).
    code = main(["backfill", "--offsets", "0:5-1", "--bootstrap-servers", "127.0.0.1:1"])
    assert code == errors.EXIT_USAGE
    assert "offsets entry '0:5-1': until (1) must be greater than from (5)" in caplog.text


def test_a_server_that_cannot_start_is_a_message_not_a_traceback(tmp_path, caplog):
    # A taken port is found before any JVM starts.
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = lab(["spark-connect", "start", "--port", str(port), "--state-dir", str(tmp_path)])
    assert code == errors.EXIT_FAILED
    assert f"port {port} is taken by another process" in caplog.text and "Traceback" not in caplog.text


def test_overlapping_bootstrap_watches_put_kafka_pythons_printing_back():
    """Two threads' admin clients may watch their bootstraps at once (the monitor's pages):
    kafka-python's lines are kept while any watches, and printed again after the last."""
    import logging

    from ipcount.storage.broker import _BootstrapFailures

    kafka = logging.getLogger("kafka")
    assert kafka.propagate
    first, second = _BootstrapFailures.watching(), _BootstrapFailures.watching()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not kafka.propagate
    second.__exit__(None, None, None)
    assert kafka.propagate
