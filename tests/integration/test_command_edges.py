"""Every command at its edges, as a user meets them: each class of bad input (wrong type, out
of range, empty, a path that is missing, a file or a directory, object storage without
credentials or unreachable, a malformed or unreachable broker, a missing topic, missing
tables, conflicting flags, an unknown variable) against every subcommand of ``bin/ipcount``
and ``bin/run`` that takes it. Each must exit with the code its help documents, say why in
one error line with no traceback, and leave every table byte for byte as it was (and create
none).

One row per (command, edge): a subprocess each, as the user runs it, against the suite's
broker and a table set with a committed epoch.
"""
from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from ipcount.jobs.epoch import run_epoch
from ipcount.rules.config import COMMAND_SETTINGS, PipelineConfig
from ipcount.rules.errors import EXIT_BROKER, EXIT_FAILED, EXIT_STORAGE, EXIT_USAGE
from ipcount.storage.broker import create_topic
from ipcount_lab.generator import TrafficGenerator, produce
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Stack:
    cfg: PipelineConfig       # a topic with records and a table set with a committed epoch
    empty: PipelineConfig     # a topic with no records, its table set made by an epoch that read nothing
    root: Path                # everything the commands could write under
    closed_port: int          # nothing listens there
    read_only: Path | None    # a read-only file system (None: this user may not mount one)
    taken_port: int           # a port something listens on


@pytest.fixture(scope="module")
def stack(broker, spark, tmp_path_factory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("edges")
    (root / "a_file").write_text("not a directory\n")
    (root / "a_dir").mkdir()
    (root / "a.toml").write_text('topic = 123\n')
    (root / "password").write_text("secret\n")
    (root / "password").chmod(0o644)
    (root / "token").write_text("a-token-of-the-server\n")
    (root / "token").chmod(0o600)
    base = PipelineConfig(bootstrap_servers=broker.bootstrap_servers, spark_master="local[2]",
                          kafka_timeout_seconds=3)
    cfg = base.replace(topic="edges", group_id="edges", pipeline_id="edges", warehouse=str(root / "warehouse"))
    empty = base.replace(topic="edges_empty", group_id="edges_empty", pipeline_id="edges_empty",
                         warehouse=str(root / "empty"))
    for c in (cfg, empty):
        create_topic(c, 2)
    produce(cfg.bootstrap_servers, cfg.topic, TrafficGenerator(seed=60).records(80, 1_795_255_200_000),
            partition_of=lambda i, r: i % 2)
    assert run_epoch(cfg, spark) is not None
    run_epoch(empty, spark)  # commits the start positions, no offset
    read_only = root / "read_only"
    read_only.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)],
                             capture_output=True).returncode == 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield Stack(cfg, empty, root, free_port(), read_only if mounted else None, taken.getsockname()[1])
    if mounted:
        subprocess.run(["umount", str(read_only)], check=True)


def read_only_warehouse(s: Stack) -> str:
    if s.read_only is None:
        pytest.skip("this user cannot mount a read-only file system")
    return str(s.read_only / "warehouse")


def files_of(root: Path) -> dict[str, str]:
    """Every file under ``root`` (its path, and a digest of its bytes) and every directory."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


def clean_env(**changes: str | None) -> dict[str, str]:
    """This environment without pipeline settings or AWS variables, with ``changes``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IPCOUNT_", "AWS_"))}
    env.update({k: v for k, v in changes.items() if v is not None})
    return env


@dataclass(frozen=True)
class Edge:
    argv: Callable[[Stack], list[str]]   # after bin/ipcount (or the whole command, for bin/run)
    code: int
    says: Callable[[Stack], str] | str
    env: Callable[[Stack], dict[str, str]] = lambda s: clean_env()
    program: str = "ipcount"

    def message(self, s: Stack) -> str:
        return self.says(s) if callable(self.says) else self.says


def settings(cfg: PipelineConfig, command: str, **changes: str) -> list[str]:
    """``cfg`` as the flags ``command`` takes, then ``changes`` as they are typed (a later
    flag wins): a bad value reaches the command, not this test's own checks."""
    return [*cfg.to_args(COMMAND_SETTINGS.get(command)), *(f"--{k.replace('_', '-')}={v}" for k, v in changes.items())]


def at(warehouse_of: Callable[[Stack], str], command: str, *extra: str, **changes) -> Callable[[Stack], list[str]]:
    """``command`` run with the stack's settings and the warehouse ``warehouse_of`` names."""
    return lambda s: [command, *settings(s.cfg, command, warehouse=warehouse_of(s), **changes), *extra]


def own(command: str, *extra: str, **changes) -> Callable[[Stack], list[str]]:
    """``command`` run with the stack's own settings (``changes`` applied)."""
    return lambda s: [command, *settings(s.cfg, command, **changes), *extra]


def file_warehouse(s: Stack) -> str:
    return str(s.root / "a_file")


def missing_warehouse(s: Stack) -> str:
    return str(s.root / "missing" / "warehouse")


READERS = {"verify": (), "latency": (), "publish": ("--publish",), "maintain": ()}
BACKFILL = ("--offsets", "0:0-5")
FILE = "is a file, not a directory, so no table can be at"
NO_TABLES = "no table set for {} to read"
NO_BROKER = "no Kafka broker answered at"
NO_TOPIC = "topic 'no_such_topic' does not exist on the broker"
NO_CREDENTIALS = "no credentials for the object storage of s3://edges/warehouse/"
NO_STORE = "did not answer or refused the request: check AWS_ENDPOINT_URL"


def no_credentials_env(s: Stack) -> dict[str, str]:
    """No credentials anywhere the AWS SDK looks, and an endpoint where nothing listens (so
    that no request can reach a real bucket of that name)."""
    return clean_env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{s.closed_port}", AWS_REGION="us-east-1",
                     AWS_ALLOW_HTTP="true", AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null",
                     AWS_EC2_METADATA_DISABLED="true")


def s3_env(s: Stack) -> dict[str, str]:
    return clean_env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{s.closed_port}", AWS_ACCESS_KEY_ID="key",
                     AWS_SECRET_ACCESS_KEY="secret", AWS_REGION="us-east-1", AWS_ALLOW_HTTP="true")


EDGES: dict[str, Edge] = {
    # -- wrong type
    "epoch window_seconds not a number": Edge(own("epoch", window_seconds="five"), EXIT_USAGE,
                                              "window_seconds must be an integer; found 'five'"),
    "config window_seconds a float": Edge(lambda s: ["config", "--window-seconds", "5.0"], EXIT_USAGE,
                                          "window_seconds must be an integer; found '5.0'"),
    "watch --epochs not a number": Edge(own("watch", "--epochs", "x"), EXIT_USAGE,
                                        "argument --epochs: not a whole number: 'x'"),
    "config file topic a number": Edge(lambda s: ["config", "--config", str(s.root / "a.toml")], EXIT_USAGE,
                                       "topic must be a string; found 123 (int)"),
    # -- out of range
    "epoch window_seconds too large": Edge(own("epoch", window_seconds="100000000000000000000"), EXIT_USAGE,
                                           "window_seconds must be an integer from 1 to 604800"),
    "backfill max_records_per_epoch 0": Edge(own("backfill", *BACKFILL, max_records_per_epoch="0"), EXIT_USAGE,
                                             "max_records_per_epoch must be an integer from 1 to"),
    "verify bootstrap port 0": Edge(own("verify", bootstrap_servers="127.0.0.1:0"), EXIT_USAGE,
                                    "port 0 is not between 1 and 65535"),
    "create-topic bootstrap port 70000": Edge(own("create-topic", bootstrap_servers="h:70000"), EXIT_USAGE,
                                              "port 70000 is not between 1 and 65535"),
    "connect-server --port 70000": Edge(lambda s: ["connect-server", "--port", "70000", "--token-file", "t"],
                                        EXIT_USAGE, "argument --port: must be a port from 1 to 65535, not 70000"),
    "watch --timeout nan": Edge(own("watch", "--timeout", "nan"), EXIT_USAGE,
                                "argument --timeout: must be a number of seconds above 0, not nan"),
    "watch --epochs -1": Edge(own("watch", "--epochs", "-1"), EXIT_USAGE, "argument --epochs: must be at least 1"),
    "latency --epochs 0": Edge(own("latency", "--epochs", "0"), EXIT_USAGE, "argument --epochs: must be at least 1"),
    "verify --max-differences -1": Edge(own("verify", "--max-differences", "-1"), EXIT_USAGE,
                                        "argument --max-differences: must be 0 or more, not -1"),
    "create-topic --partitions 0": Edge(own("create-topic", "--partitions", "0"), EXIT_USAGE,
                                        "argument --partitions: must be at least 1"),
    # -- empty
    "backfill --target empty": Edge(own("backfill", *BACKFILL, "--target", ""), EXIT_USAGE,
                                    "argument --target: must not be empty"),
    "verify --target empty": Edge(own("verify", "--target", ""), EXIT_USAGE, "argument --target: must not be empty"),
    "epoch topic empty": Edge(own("epoch", topic=""), EXIT_USAGE, "topic must be a legal Kafka topic name"),
    "config --config empty": Edge(lambda s: ["config", "--config", ""], EXIT_USAGE, "--config is empty"),
    "config IPCOUNT_CONFIG empty": Edge(lambda s: ["config"], EXIT_USAGE, "IPCOUNT_CONFIG is set but empty",
                                        env=lambda s: clean_env(IPCOUNT_CONFIG="")),
    "scram-user --username empty": Edge(own("scram-user", "--username", "", "--password-file", "p"), EXIT_USAGE,
                                        "argument --username: must not be empty"),
    "connect-server port taken": Edge(lambda s: ["connect-server", "--port", str(s.taken_port), "--token-file",
                                                 str(s.root / "token")], EXIT_USAGE,
                                      lambda s: f"cannot listen on 127.0.0.1:{s.taken_port} (Address already in use)"),
    "connect-server bind address not this host's": Edge(
        lambda s: ["connect-server", "--bind", "192.0.2.123", "--port", str(s.closed_port), "--token-file",
                   str(s.root / "token")], EXIT_USAGE, "cannot listen on 192.0.2.123"),
    "connect-server token file open to others": Edge(
        lambda s: ["connect-server", "--port", str(s.closed_port), "--token-file", str(s.root / "password")],
        EXIT_USAGE, "is open to others (mode 644)"),
    "scram-user broker unreachable": Edge(
        lambda s: ["scram-user", *settings(s.cfg, "scram-user", bootstrap_servers=f"127.0.0.1:{s.closed_port}",
                                           kafka_timeout_seconds=2),
                   "--username", "u", "--password-file", str(s.root / "token")], EXIT_BROKER, NO_BROKER),
    "connect-server --bind empty": Edge(lambda s: ["connect-server", "--bind", "", "--token-file", "t"], EXIT_USAGE,
                                        "argument --bind: must not be empty"),
    "rebuild --into empty": Edge(own("rebuild", "--into", ""), EXIT_USAGE,
                                 "target must be 'main' or a plain identifier"),
    # -- paths: missing, a file, a directory, a line break
    "config file missing": Edge(lambda s: ["config", "--config", str(s.root / "nope.toml")], EXIT_USAGE,
                                "does not exist"),
    "config file a directory": Edge(lambda s: ["config", "--config", str(s.root / "a_dir")], EXIT_USAGE,
                                    "is a directory; expected a .toml or .json file"),
    "epoch warehouse with a line break": Edge(lambda s: ["epoch", *settings(s.cfg, "epoch"),
                                                         f"--warehouse={s.root}/w\nx"], EXIT_USAGE,
                                              "warehouse holds a control character"),
    **{f"{c} warehouse a file": Edge(at(file_warehouse, c, *READERS[c]), EXIT_USAGE, FILE) for c in READERS},
    "watch warehouse a file": Edge(at(file_warehouse, "watch", "--epochs", "1"), EXIT_USAGE, FILE),
    "epoch warehouse a file": Edge(at(file_warehouse, "epoch"), EXIT_USAGE, FILE),
    "backfill warehouse a file": Edge(at(file_warehouse, "backfill", *BACKFILL), EXIT_USAGE, FILE),
    "epoch warehouse under a file": Edge(lambda s: ["epoch", *settings(s.cfg, "epoch",
                                                                       warehouse=f"{file_warehouse(s)}/w")],
                                         EXIT_USAGE, FILE),
    **{f"{c} warehouse read-only": Edge(at(read_only_warehouse, c, *extra), EXIT_USAGE,
                                        "is not writable by this user (a read-only file system")
       for c, extra in (("epoch", ()), ("backfill", BACKFILL))},
    "epoch password file open to others": Edge(own("epoch", kafka_security_protocol="SASL_PLAINTEXT",
                                                   kafka_sasl_mechanism="PLAIN", kafka_sasl_username="u",
                                                   kafka_sasl_password_file="../password"), EXIT_USAGE,
                                               "is open to others (mode 644); make it private"),
    "epoch consumer property unknown": Edge(own("epoch", kafka_consumer_properties="fetch.max.byte=5"), EXIT_USAGE,
                                            "'fetch.max.byte' is no property of Kafka's consumer"),
    "consumer-groups consumer property the pipeline sets": Edge(
        own("consumer-groups", "--", "--list", kafka_consumer_properties="bootstrap.servers=h:1"), EXIT_USAGE,
        "bootstrap.servers is set by the pipeline from bootstrap_servers"),
    "epoch --kafka-connection outside Airflow": Edge(own("epoch", kafka_connection="ipcount_kafka"), EXIT_USAGE,
                                                     "is read by the Airflow tasks and the monitor only"),
    # -- missing tables
    **{f"{c} no tables": Edge(at(missing_warehouse, c, *READERS[c]), EXIT_USAGE, NO_TABLES.format(c))
       for c in READERS},
    "publish no counts table": Edge(lambda s: ["publish", *settings(s.cfg, "publish",
                                                                    counts_table=str(s.root / "no_counts")),
                                               "--publish"], EXIT_USAGE,
                                    lambda s: f"no table set for publish to read: {s.root / 'no_counts'} does not exist"),
    "verify unknown replay target": Edge(own("verify", "--target", "nosuch"), EXIT_USAGE,
                                         "no replay table set 'nosuch' under"),
    "rebuild from an unknown source": Edge(own("rebuild", "--into", "r1", "--source", "nosuch"), EXIT_USAGE,
                                           "target 'nosuch' has no ledger"),
    # -- object storage without credentials, or unreachable
    **{f"{c} s3 without credentials": Edge(at(lambda s: "s3://edges/warehouse", c, *extra), EXIT_STORAGE,
                                           NO_CREDENTIALS, env=no_credentials_env)
       for c, extra in (("verify", ()), ("maintain", ()), ("epoch", ()), ("backfill", BACKFILL))},
    "latency s3 unreachable": Edge(at(lambda s: "s3://edges/warehouse", "latency"), EXIT_STORAGE, NO_STORE,
                                   env=s3_env),
    # -- malformed or unreachable broker, missing topic
    "epoch bootstrap not host:port": Edge(own("epoch", bootstrap_servers="localhost"), EXIT_USAGE,
                                          "bootstrap_servers entry 'localhost' is not host:port"),
    **{f"{c} broker unreachable": Edge(
        lambda s, c=c: [c, *settings(s.cfg, c, bootstrap_servers=f"127.0.0.1:{s.closed_port}", kafka_timeout_seconds=2),
                        *READERS.get(c, BACKFILL if c == "backfill" else ())],
        EXIT_BROKER, NO_BROKER) for c in ("epoch", "backfill", "verify", "latency", "create-topic", "consumer-groups")},
    "rebuild broker unreachable": Edge(lambda s: ["rebuild", *settings(s.cfg, "rebuild", kafka_timeout_seconds=2,
                                                                       bootstrap_servers=f"127.0.0.1:{s.closed_port}"),
                                                  "--into", "r1"], EXIT_BROKER, NO_BROKER),
    "rebuild topic missing": Edge(own("rebuild", "--into", "r1", topic="no_such_topic"), EXIT_BROKER, NO_TOPIC),
    **{f"{c} topic missing": Edge(lambda s, c=c: [c, *settings(s.cfg, c, topic="no_such_topic"),
                                                  *(BACKFILL if c == "backfill" else ())], EXIT_BROKER, NO_TOPIC)
       for c in ("epoch", "backfill", "verify", "latency")},
    # -- conflicting or empty requests
    "backfill --offsets with --until-time": Edge(own("backfill", *BACKFILL, "--until-time", "2026-01-01T00:00:00Z"),
                                                 EXIT_USAGE, "--until-time goes with --from-time, not with --offsets"),
    "backfill --offsets and --from-time": Edge(own("backfill", *BACKFILL, "--from-time", "1"), EXIT_USAGE,
                                               "not allowed with argument"),
    "verify reversed range": Edge(own("verify", "--from-time", "2026-01-02T00:00:00Z", "--until-time",
                                      "2026-01-01T00:00:00Z"), EXIT_USAGE, "the time range is empty"),
    "verify of no committed offsets": Edge(lambda s: ["verify", *settings(s.empty, "verify")], EXIT_FAILED,
                                           "NOTHING TO VERIFY: the ledger has no committed offsets of topic edges_empty"),
    "verify of a range with no window": Edge(own("verify", "--from-time", "2000-01-01T00:00:00Z", "--until-time",
                                                 "2000-01-02T00:00:00Z"), EXIT_FAILED,
                                             "NOTHING TO VERIFY: no counted window starts in the time range"),
    "publish with publish off": Edge(own("publish"), EXIT_USAGE, "publish is off for this pipeline"),
    # -- variables
    "epoch unknown IPCOUNT_ variable": Edge(own("epoch"), EXIT_USAGE,
                                            "IPCOUNT_WINDOW_SECOND is no setting of the pipeline (did you mean "
                                            "IPCOUNT_WINDOW_SECONDS?)",
                                            env=lambda s: clean_env(IPCOUNT_WINDOW_SECOND="10")),
    # -- bin/run (each refused before it sets anything up)
    **{f"bin/run {' '.join(args)}": Edge(lambda s, args=args: list(args), EXIT_USAGE, says, program="run")
       for args, says in ((("--port",), "--port needs a value"), (("--epochs",), "--epochs needs a value"),
                          (("--port", "70000"), "--port must be a port number from 1 to 65535, got '70000'"),
                          (("--rate", "0"), "--rate must be a number from 0.001 to 1000000"),
                          (("--kafka-port", "65535"), "the broker(s) also take the next 1 port(s), past 65535"),
                          (("--epochs", "-1"), "--epochs must be a positive integer, got '-1'"),
                          (("--kafka-nodes", "2"), "--kafka-nodes must be 1 or 3"),
                          (("--airflow-db", "mysql"), "--airflow-db must be sqlite or postgres"),
                          (("--frobnicate",), "unknown option '--frobnicate'"))},
    "bin/run setting out of range": Edge(lambda s: ["--port", str(s.closed_port)], EXIT_USAGE,
                                         "window_seconds must be an integer from 1 to 604800; found 0", program="run",
                                         env=lambda s: clean_env(IPCOUNT_WINDOW_SECONDS="0")),
    "bin/run warehouse a file": Edge(lambda s: ["--port", str(s.closed_port)], EXIT_USAGE, FILE, program="run",
                                     env=lambda s: clean_env(IPCOUNT_WAREHOUSE=file_warehouse(s))),
}


@pytest.mark.parametrize("name", list(EDGES))
def test_each_edge_exits_with_its_code_says_why_once_and_changes_nothing(stack, name):
    edge = EDGES[name]
    before = files_of(stack.root)
    argv = edge.argv(stack)
    command = ([str(ROOT / "bin" / "run"), *argv] if edge.program == "run"
               else [sys.executable, "-m", "ipcount.cli", *argv])
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=edge.env(stack),
                          cwd=stack.root / "a_dir")
    said = proc.stderr + proc.stdout
    assert proc.returncode == edge.code, said[-3000:]
    assert edge.message(stack) in said, said[-3000:]
    assert "Traceback" not in said and "Exception in thread" not in said, said[-3000:]
    # One error line (argparse's comes after its usage); a verify that finds nothing to
    # compare says so in its verdict on stdout, with none.
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line or "error:" in line or "ERROR:" in line]
    assert len(errors) == (0 if edge.code == EXIT_FAILED else 1), proc.stderr[-3000:]
    assert files_of(stack.root) == before, "a table or file changed"


def test_the_edges_reach_every_command():
    """The table has a row for every subcommand, and for bin/run."""
    from ipcount.cli import COMMANDS

    named = {name.split(" ")[0] for name in EDGES}
    assert set(COMMANDS) <= named | {"bin/run"}, set(COMMANDS) - named
    assert "bin/run" in named
