"""The lab's command line: ``bin/lab <command> --help``. The embedded stack on one machine,
traffic, and the trials; none of it is part of the product (``bin/ipcount``).

    generate       produce access-log traffic to the source topic
    chaos          kill epochs, backfills, DAG runs, the broker and a Spark Connect server at random
                   on a topic of its own, then recount: duplicates and losses must be 0
    model          the model test of the ledger as a long run (random operations and faults, every
                   invariant after every step), with its figures
    kafka          start / stop / status of the embedded broker (--secure: SASL and TLS too;
                   --nodes 3: a three-node cluster)
    s3             start / stop / status / serve of an embedded S3-compatible server (s3proxy)
    spark-cluster  start / stop / status of a local Spark standalone master and workers
    spark-connect  start / stop / status of a local Spark Connect server for remote epochs
    postgres       start / stop / status of an embedded PostgreSQL server for Airflow's metadata
    airflow        run an airflow command in the embedded stack's environment

The benchmark has a command of its own: ``bin/benchmark --help``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from ipcount.cli import Command, add_config_flags, main as run_command, positive_int
from ipcount.rules.config import COMMAND_SETTINGS, STATE_DIR, PipelineConfig, env_name
from ipcount.rules.errors import EXIT_FAILED, EXIT_OK, BadRequestError, ConfigError
from ipcount_lab.chaos_state import SCENARIOS

log = logging.getLogger("ipcount_lab")


def positive_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.001 <= value <= 1_000_000:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be between 0.001 and 1000000 records per second, not {text}")
    return value


def _generate_arguments(sub) -> None:
    p = sub.add_parser("generate", help="produce access-log traffic to the source topic",
                       description="Produce generated access-log records (JSON and NGINX lines, some "
                                   "out of order, a few late, ~1%% malformed) to the source topic.")
    add_config_flags(p, COMMAND_SETTINGS["generate"])
    p.add_argument("--rate", type=positive_rate, default=200.0, help="records per second (default 200)")
    p.add_argument("--count", type=positive_int, default=None, help="stop after this many records (default: forever)")
    p.add_argument("--seed", type=int, default=7, help="random seed (default 7)")


def _generate(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.storage.broker import client_options
    from ipcount_lab.generator import TrafficGenerator, stream

    gen = TrafficGenerator(seed=args.seed, events_per_second=args.rate)
    log.info("generating %s records at %.0f/s to %s on %s", args.count or "unbounded", args.rate, cfg.topic,
             cfg.bootstrap_servers)
    sent = stream(cfg.bootstrap_servers, cfg.topic, gen, args.count, client_options(cfg))
    log.info("generator sent %d records", sent)
    return EXIT_OK


def _chaos_arguments(sub) -> None:
    p = sub.add_parser("chaos", help="try exactly-once against random SIGKILLs; report duplicates and losses",
                       description="On a topic and warehouse of its own (the pipeline's tables are never "
                                   "touched), produce a known data set (out of order, late, malformed, "
                                   "committed and aborted transactions), run epochs, racing hand-run "
                                   "epochs, backfills and the DAGs (airflow dags test, "
                                   "in an Airflow home of its own) as separate processes, SIGKILL one of "
                                   "them at a random moment each round or SIGKILL and restart the embedded "
                                   "broker under the chain, delete records under the chain and a backfill "
                                   "as retention would (retention: on_data_loss skip or fail), rebuild the "
                                   "run's tables into a replay target under the chain (rebuild), lose the "
                                   "answers to commits the store took (answers: the run's tables on an S3 "
                                   "store of its own behind a lossy proxy), kill a Spark Connect server under the "
                                   "chain (connect), add a partition half way, then "
                                   "finish without kills and recount in plain Python: each deleted record "
                                   "counted before it aged out or recorded lost, every other one counted "
                                   "once, in the run's tables and the replay target; with publish on, no "
                                   "version published twice and no final row changed by a live epoch. Exit "
                                   "code 0 when duplicates, losses and changed final rows are all 0, else 1.")
    p.add_argument("--kills", type=positive_int, default=None,
                   help="kills to survive (default 20; resumed: the paused run's, or this many in all)")
    p.add_argument("--records", type=positive_int, default=None,
                   help="about this many records, produced in batches of records/(kills+1): one batch before "
                        "the first round and one before each round (default 3000)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default 1)")
    p.add_argument("--max-minutes", type=positive_int, default=60,
                   help="stop killing after this, in this sitting (default 60)")
    p.add_argument("--scenarios", default=None,
                   help=f"which to take turns with, comma-separated (default all: {','.join(SCENARIOS)}; "
                        "broker only when the embedded broker serves bootstrap_servers)")
    p.add_argument("--broker-state-dir", default=str(STATE_DIR / "kafka"),
                   help="the embedded broker the broker scenario restarts (default .local/kafka, bin/run's)")
    p.add_argument("--workdir", default=None, help="for its tables and logs (default <warehouse>/../chaos; "
                                                   ".local/chaos when the warehouse is on S3)")
    p.add_argument("--pause", action="store_true",
                   help="at --kills or --max-minutes, stop without finishing: the run (topic, tables, state) "
                        "is kept to go on with --resume, the verdict comes at its finish")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="go on with a paused run (the directory its report names), on the same broker; its "
                        "records, seed and scenarios are the run's own")
    p.add_argument("--json", action="store_true", help="print the report as JSON too")
    add_config_flags(p)


def _chaos(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount_lab.chaos import embedded_broker, report_json, restartable, run_chaos

    kafka = embedded_broker(args.broker_state_dir, cfg.bootstrap_servers)
    if args.resume:
        fixed = [flag for flag, value in (("--records", args.records), ("--seed", args.seed),
                                          ("--scenarios", args.scenarios), ("--workdir", args.workdir))
                 if value is not None]
        if fixed:
            raise BadRequestError(f"{', '.join(fixed)}: a resumed run keeps its own; leave them out")
        scenarios = ()  # the run's own
    elif args.scenarios is None:
        scenarios = SCENARIOS
        if not restartable(kafka, cfg.bootstrap_servers):
            log.warning("chaos: no broker restarts: no embedded broker from %s serves %s", args.broker_state_dir,
                        cfg.bootstrap_servers)
            scenarios = tuple(s for s in scenarios if s != "broker")
    else:
        scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    report = run_chaos(cfg, kills=args.kills, records=args.records or 3000,
                       seed=1 if args.seed is None else args.seed, workdir=args.workdir,
                       max_seconds=args.max_minutes * 60, scenarios=scenarios, broker_to_restart=kafka,
                       pause=args.pause, resume=args.resume)
    print(report.line())
    for problem in report.problems:
        print(f"  {problem}")
    if args.json:
        print(report_json(report))
    return EXIT_OK if report.ok or report.paused else EXIT_FAILED


def _kafka_arguments(sub) -> None:
    p = sub.add_parser("kafka", help="manage the embedded Kafka broker or three-node cluster",
                       description="Start, stop or inspect the embedded KRaft broker (or, with --nodes 3, a "
                                   "three-node cluster: node i on --port + 2i, topics replicated 3 times with "
                                   "min.insync.replicas 2). Then `bin/ipcount create-topic` makes the source "
                                   "topic on it.")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--port", type=positive_int, default=9092, help="broker port on 127.0.0.1 (default 9092)")
    p.add_argument("--nodes", type=int, choices=(1, 3), default=1,
                   help="1: a single broker (default); 3: a cluster, which start prints the bootstrap servers of")
    p.add_argument("--state-dir", help="broker config, data and log (default .local/kafka, or "
                                       ".local/kafka-cluster with --nodes 3)")
    p.add_argument("--secure", action="store_true",
                   help="start: also serve SASL_SSL, SASL_PLAINTEXT and mutual-TLS SSL on the next three "
                        "ports (a dev CA and a user's password under STATE_DIR/secure), and print the "
                        "settings that reach each (single broker only)")


def _kafka(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount_lab.embedded_kafka import EmbeddedKafka, EmbeddedKafkaCluster, SecureListeners

    if args.nodes > 1:
        if args.secure:
            raise ConfigError("--secure is for a single broker (--nodes 1)")
        kafka = EmbeddedKafkaCluster.from_port(args.port, Path(args.state_dir or STATE_DIR / "kafka-cluster"),
                                               args.nodes)
    else:
        secure = SecureListeners(args.port + 2, args.port + 3, args.port + 4) if args.secure else None
        kafka = EmbeddedKafka(state_dir=Path(args.state_dir or STATE_DIR / "kafka"), port=args.port,
                              controller_port=args.port + 1, secure=secure)
    if args.action == "start":
        kafka.start()
        if args.nodes > 1:
            print(f'export IPCOUNT_BOOTSTRAP_SERVERS="{kafka.bootstrap_servers}"')
        for protocol in (kafka.secure.ports() if args.nodes == 1 and kafka.secure else {}):
            settings = kafka.client_settings(protocol)
            print(f"# {protocol}\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
    elif args.action == "stop":
        kafka.stop()
    else:
        print(kafka.status())
        running = kafka.running_nodes() if args.nodes > 1 else int(kafka.pid() is not None)
        return EXIT_OK if running == args.nodes else EXIT_FAILED
    return EXIT_OK


def _s3_arguments(sub) -> None:
    p = sub.add_parser("s3", help="manage an embedded S3-compatible server (s3proxy)",
                       description="Start, stop or inspect s3proxy (its filesystem backend: objects in "
                                   "STATE_DIR/data, conditional writes honoured). `start` prints the AWS "
                                   "variables that point the pipeline at it; then set warehouse to an s3:// URI "
                                   "in its bucket (docs/scaling-out.md).")
    p.add_argument("action", choices=("start", "stop", "status", "serve"),
                   help="serve: start and stay in the foreground until SIGTERM (a container's main process)")
    p.add_argument("--port", type=int, default=9000, help="port (default 9000)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--state-dir", default=str(STATE_DIR / "s3"), help="its config, secret, objects and log")
    p.add_argument("--bucket", default="ipcount", help="the bucket it serves (default ipcount)")


def _s3(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount_lab.embedded_s3 import EmbeddedS3

    store = EmbeddedS3(state_dir=Path(args.state_dir), port=args.port, bucket=args.bucket, host=args.host)
    if args.action == "serve":
        return store.serve()
    if args.action == "start":
        store.start()
        import shlex

        # Shell lines; the secret stays in its owner-only file, which they read.
        env = {k: shlex.quote(v) for k, v in store.environment().items()}
        env["AWS_SECRET_ACCESS_KEY"] = f'"$(cat {shlex.quote(str(store.state_dir / "secret"))})"'
        env["IPCOUNT_WAREHOUSE"] = shlex.quote(store.uri("warehouse"))
        print("\n".join(f"export {k}={v}" for k, v in env.items()))
    elif args.action == "stop":
        store.stop()
    else:
        serving = store.pid() is not None and store.is_serving()
        print(f"s3proxy {'serving' if serving else 'not running'} at {store.endpoint} (bucket {store.bucket})")
        return EXIT_OK if serving else EXIT_FAILED
    return EXIT_OK


def _spark_cluster_arguments(sub) -> None:
    p = sub.add_parser("spark-cluster", help="manage a local Spark standalone cluster",
                       description="Start, stop or inspect a Spark standalone master and workers on "
                                   "127.0.0.1, from the pinned pyspark. Point the pipeline at it with "
                                   "spark_master (IPCOUNT_SPARK_MASTER), which `start` prints.")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--port", type=int, default=7077, help="the master's port (default 7077)")
    p.add_argument("--webui-port", type=int, default=8082, help="the master's web UI (default 8082; 8080 is "
                                                                   "Airflow's)")
    p.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    p.add_argument("--worker-cores", type=int, default=1, help="cores per worker (default 1)")
    p.add_argument("--worker-memory", default="1g", help="memory per worker (default 1g)")
    p.add_argument("--state-dir", default=str(STATE_DIR / "spark-cluster"), help="logs and work directories")


def _spark_cluster(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount_lab.embedded_spark import EmbeddedSparkCluster

    if args.workers < 1 or args.worker_cores < 1:
        raise ConfigError("--workers and --worker-cores must be at least 1")
    cluster = EmbeddedSparkCluster(state_dir=Path(args.state_dir), port=args.port, webui_port=args.webui_port,
                                   workers=args.workers, worker_cores=args.worker_cores,
                                   worker_memory=args.worker_memory)
    if args.action == "start":
        cluster.start()
        print(f'export IPCOUNT_SPARK_MASTER="{cluster.master_url}"  # UI: {cluster.webui_url}')
    elif args.action == "stop":
        cluster.stop()
    else:
        alive = cluster.alive_workers()
        print(f"Spark master {cluster.master_url}: {alive} worker(s) alive (UI {cluster.webui_url})")
        return EXIT_OK if alive else EXIT_FAILED
    return EXIT_OK


def _spark_connect_arguments(sub) -> None:
    p = sub.add_parser("spark-connect", help="manage a local Spark Connect server that epochs can run on",
                       description="Start, stop or inspect a Spark Connect server on 127.0.0.1 from the pinned "
                                   "pyspark, with the Kafka source's and the parse's jars and an epoch's Spark "
                                   "settings (the product's `bin/ipcount connect-server`, in the background); it takes only "
                                   "clients with its token (a private file it makes). Point the pipeline at it "
                                   "with spark_remote and spark_remote_token_file, which `start` prints; epochs "
                                   "then run in the calling process with a remote session.")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--port", type=positive_int, default=15002, help="the server's port (default 15002)")
    p.add_argument("--master", default="local[*]", help="the server's Spark master (default local[*]; a "
                                                        "standalone cluster: spark://host:7077)")
    p.add_argument("--state-dir", default=str(STATE_DIR / "spark-connect"), help="its log and token file")


def _spark_connect(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount_lab.embedded_connect import EmbeddedSparkConnect

    server = EmbeddedSparkConnect(state_dir=Path(args.state_dir), port=args.port, master=args.master)
    if args.action == "start":
        server.start()
        for name, value in server.settings().items():
            print(f'export IPCOUNT_{name.upper()}="{value}"')
    elif args.action == "stop":
        server.stop()
    else:
        print(server.status())
        return EXIT_OK if server.pid() is not None and server.is_listening() else EXIT_FAILED
    return EXIT_OK


def _postgres_arguments(sub) -> None:
    p = sub.add_parser("postgres", help="manage an embedded PostgreSQL server for Airflow's metadata",
                       description="Start, stop or inspect Debian's PostgreSQL server (bin/setup --postgres "
                                   "installs it) on 127.0.0.1 with a database and role `airflow` (its password "
                                   "in STATE_DIR/password, mode 0600). Then run Airflow on it with "
                                   "`bin/lab airflow --database postgres ...` or `bin/run --airflow-db "
                                   "postgres`. Run as root, the server runs as the OS user postgres.")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--port", type=int, default=5433, help="port on 127.0.0.1 (default 5433; 5432 is left to a "
                                                         "system cluster)")
    p.add_argument("--state-dir", default=str(STATE_DIR / "postgres"), help="the cluster, its log and password")


def _postgres(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount_lab.embedded_postgres import EmbeddedPostgres

    server = EmbeddedPostgres(state_dir=Path(args.state_dir), port=args.port)
    if args.action == "start":
        server.start()
    elif args.action == "stop":
        server.stop()
    else:
        print(server.status())
        return EXIT_OK if server.is_running() else EXIT_FAILED
    return EXIT_OK


def _airflow_arguments(sub) -> None:
    p = sub.add_parser("airflow", help="run an airflow command in the embedded stack's environment",
                       description="Run `airflow ARGS...` with the embedded stack's settings (SQLite in "
                                   "AIRFLOW_HOME or the embedded PostgreSQL, LocalExecutor, this repo's dags/ "
                                   "and plugins/, the spark_default connection), e.g. `bin/lab airflow "
                                   "dags list`.")
    p.add_argument("--airflow-home", default=str(STATE_DIR / "airflow"), help="AIRFLOW_HOME (default .local/airflow)")
    p.add_argument("--api-port", type=int, default=8080, help="api-server port (default 8080)")
    p.add_argument("--database", choices=("sqlite", "postgres"), default="sqlite",
                   help="the metadata database: SQLite in AIRFLOW_HOME (default), or the embedded PostgreSQL "
                        "(`bin/lab postgres start` first)")
    p.add_argument("--postgres-port", type=int, default=5433, help="the embedded PostgreSQL's port (default 5433)")
    p.add_argument("--postgres-state-dir", default=str(STATE_DIR / "postgres"),
                   help="the embedded PostgreSQL's state dir (default .local/postgres)")
    p.add_argument("airflow_args", nargs=argparse.REMAINDER, help="arguments for airflow")
    add_config_flags(p)


def _airflow(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount_lab.embedded_airflow import airflow_env, keep_passwords_private

    keep_passwords_private(Path(args.airflow_home))
    database = None
    if args.database == "postgres":
        from ipcount_lab.embedded_postgres import EmbeddedPostgres

        database = EmbeddedPostgres(state_dir=Path(args.postgres_state_dir), port=args.postgres_port) \
            .airflow_environment()
    env = airflow_env(Path(args.airflow_home), args.api_port, spark_master=cfg.spark_master, database=database)
    # The DAG reads its settings from IPCOUNT_* variables: hand over any given as flags.
    for name, value in cfg.to_dict().items():
        if getattr(args, name, None) is not None:
            env[env_name(name)] = str(value)
    airflow = str(Path(sys.executable).parent / "airflow")
    os.execve(airflow, [airflow, *args.airflow_args], env)


def _model_arguments(sub) -> None:
    p = sub.add_parser("model", help="the model test of the ledger as a long run, with its figures",
                       description="Run the model test of the ledger (tests/integration/test_ledger_model.py): "
                                   "random sequences of operations and faults over the real epoch code on real "
                                   "delta-rs tables, every invariant checked after every step; print the "
                                   "sequences, steps and operations it ran. Exit 0 only with no violation. "
                                   "Needs a checkout (the tests), no broker and no JVM.")
    p.add_argument("--sequences", type=positive_int, default=200, help="random sequences to run (default 200)")
    p.add_argument("--steps", type=positive_int, default=60, help="at most this many steps each (default 60)")
    p.add_argument("--seed", type=int, default=None, help="Hypothesis's seed (default: a random one, printed)")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")


def _model(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    import random

    from ipcount_lab.model_run import run_model

    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"[lab] model test: {args.sequences} sequences of up to {args.steps} steps, seed {seed}", flush=True)
    try:
        run = run_model(args.sequences, args.steps, seed,
                        progress=lambda n, steps: print(f"[lab] {n} of {args.sequences} sequences done, "
                                                        f"{steps} steps", flush=True))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    print(run.line())
    if args.json:
        Path(args.json).write_text(json.dumps(run.to_dict(), indent=2) + "\n")
    if not run.passed:
        print(run.failure, file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


# name -> (adds its sub-parser, runs it), in the order --help lists them.
COMMANDS: dict[str, tuple[Callable[[Any], None], Command]] = {
    "generate": (_generate_arguments, _generate),
    "chaos": (_chaos_arguments, _chaos),
    "model": (_model_arguments, _model),
    "kafka": (_kafka_arguments, _kafka),
    "s3": (_s3_arguments, _s3),
    "spark-cluster": (_spark_cluster_arguments, _spark_cluster),
    "spark-connect": (_spark_connect_arguments, _spark_connect),
    "postgres": (_postgres_arguments, _postgres),
    "airflow": (_airflow_arguments, _airflow),
}


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(argv, COMMANDS, prog="lab", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
