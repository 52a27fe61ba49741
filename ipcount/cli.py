"""Command line: ``bin/ipcount <command> --help``.

    epoch      run one checkpoint epoch (the code path the DAG's Spark job runs)
    backfill   count an offset or time range the ledger does not own yet, in bounded epochs
    verify     recount what a table's ledger says is counted, straight from Kafka, and compare
    rebuild    replay a ledger's committed epochs into a fresh replay table set
    watch      print a line per epoch as epochs commit (reads the ledger, no JVM)
    latency    how long records waited to be counted: produce time -> counts commit, p50/p95
    publish    publish committed counts to the sink topic, exactly once (no JVM)
    generate   produce access-log traffic to the source topic
    chaos      kill epochs, backfills, DAG runs, the broker and a Spark Connect server at random
               on a topic of its own, then recount: duplicates and losses must be 0
    kafka      start / stop / status of the embedded broker (--secure: SASL and TLS too; --nodes 3:
               a three-node cluster); create-topic
    s3         start / stop / status of an embedded S3-compatible server (s3proxy), for tables on S3
    spark-cluster  start / stop / status of a local Spark standalone master and workers
    spark-connect  start / stop / status / serve of a local Spark Connect server for remote epochs
    postgres   start / stop / status of an embedded PostgreSQL server for Airflow's metadata
    consumer-groups  Kafka's kafka-consumer-groups tool, logged in with the pipeline's settings
    config     print the effective configuration
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Sequence

from ipcount.rules.config import SETTINGS, STATE_DIR, PipelineConfig, env_name, flag
from ipcount.rules.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, BadRequestError, ConfigError, IpcountError

log = logging.getLogger("ipcount")


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "pipeline settings (override --config file and IPCOUNT_* environment variables)")
    group.add_argument("--config", metavar="FILE", help="TOML or JSON file of settings (or $IPCOUNT_CONFIG)")
    for s in SETTINGS:
        help_text = f"{s.help} (default: {s.default}; env {s.env})"
        if s.type == "bool":
            group.add_argument(flag(s.name), dest=s.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(flag(s.name), dest=s.name, metavar=s.name.upper(), default=None, help=help_text)


def _positive_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.001 <= value <= 1_000_000:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be between 0.001 and 1000000 records per second, not {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def load_config(args: argparse.Namespace) -> PipelineConfig:
    """The settings, from the command's flags where it has them (a command without the
    settings flags reads the file and IPCOUNT_* variables only)."""
    overrides = {f.name: getattr(args, f.name, None) for f in fields(PipelineConfig)}
    return PipelineConfig.load(config_file=getattr(args, "config", None), **overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ipcount", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (add_arguments, _) in COMMANDS.items():
        add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for noisy in ("kafka", "py4j"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args)
    except ConfigError as e:
        parser.exit(EXIT_USAGE, f"ipcount {args.command}: error: {e}\n")
    _, command = COMMANDS[args.command]
    try:
        return command(args, cfg)
    except IpcountError as e:  # every pipeline error carries its exit code and a message
        log.error("%s", e)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


def run_in_session(args: Sequence[str], spark=None) -> None:
    """``ipcount ARGS`` in this process on ``spark``: an Airflow task's Spark Connect session,
    made by its operator from the task's connection. An error when the command fails (its log
    says why)."""
    from ipcount.storage.spark import given_session

    with given_session(spark):
        code = main([str(a) for a in args])
    if code != EXIT_OK:
        raise RuntimeError(f"`ipcount {args[0]}` failed with exit code {code} (see the log above)")


def _crash_hook():
    from ipcount.jobs.crash import crash_hook

    return crash_hook(os.environ.get("IPCOUNT_CRASH_AT") or None)


# -- epoch ---------------------------------------------------------------------------------

def _epoch_arguments(sub) -> None:
    p = sub.add_parser("epoch", help="run one checkpoint epoch",
                       description="Run one exactly-once epoch: plan the next offset ranges from the ledger "
                                   "(or finish an unfinished epoch with its recorded ranges), read them from "
                                   "Kafka, count per IP and window into Delta, commit the ledger, then commit "
                                   "the offsets to the consumer group (if commit_offsets). Exit codes: 0 done "
                                   "or nothing to read, 2 bad settings, 3 data loss, 4 broker unreachable.")
    _add_config_flags(p)
    p.add_argument("--run-id", help="Airflow run id recorded in the ledger (set by the DAG)")
    p.add_argument("--skip-offset-commit", action="store_true",
                   help="stop after the ledger commit; the DAG commits offsets in its own task")
    p.add_argument("--skip-publish", action="store_true",
                   help="do not publish to publish_topic after each epoch; the DAG publishes in its own task")
    p.add_argument("--summary-json", action="store_true", help="print the epoch summary as JSON")
    p.add_argument("--epochs", type=_positive_int, default=1, metavar="N",
                   help="run up to N epochs one after another in one Spark session, stopping at the first "
                        "with nothing new to read (default 1); each is a whole epoch of its own")


def _epoch(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.jobs.epoch import run_epoch
    from ipcount.jobs.group_commit import commit_group_offsets_from_ledger
    from ipcount.jobs.publish import publish_step
    from ipcount.rules.ledger import EpochSummary
    from ipcount.storage.spark import get_spark

    crash = _crash_hook()
    spark = get_spark(cfg)
    # Several epochs in one session (catching up after downtime) pay the JVM and Spark
    # start once; each is still a whole epoch, exactly as if run on its own.
    for _ in range(args.epochs):
        started = time.monotonic()
        summary = run_epoch(cfg, spark, run_id=args.run_id, crash=crash)
        if summary is None:
            summary = EpochSummary(None, seconds=time.monotonic() - started)
        print(summary.line(), flush=True)
        if not args.skip_offset_commit:
            crash("before_kafka_commit")
            started = time.monotonic()
            commit_group_offsets_from_ledger(cfg)
            summary = summary.with_stages(kafka_commit=time.monotonic() - started)
        if args.summary_json:
            print(json.dumps(summary.to_dict()), flush=True)
        if cfg.publish and not args.skip_publish:  # after the summary: a failed publish undoes no epoch
            publish_step(cfg, crash)
        if summary.plan is None:
            break
    return EXIT_OK


# -- backfill ------------------------------------------------------------------------------

def _backfill_arguments(sub) -> None:
    p = sub.add_parser("backfill", help="count an offset or time range, exactly once",
                       description="Count the records of the given offset ranges (or with timestamps in the "
                                   "given time range) that the target's ledger does not own yet, in epochs "
                                   "of at most max_records_per_epoch offsets, each committed on its own. "
                                   "Asking twice counts once; what was already counted is reported as "
                                   "skipped. Re-run the same command to finish a backfill that crashed. "
                                   "Exit codes: 0 done, 2 bad request or settings, 3 data loss, 4 broker.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--offsets", metavar="SPEC",
                      help="per-partition half-open ranges 'partition:from-until,...', e.g. '0:0-500,2:100-200'")
    what.add_argument("--from-time", metavar="TIME",
                      help="start of a time range (ISO 8601, e.g. 2026-11-21T10:00:00Z, or epoch ms); "
                           "resolved per partition with the broker's offsets-for-times lookup")
    what.add_argument("--request-json", metavar="JSON",
                      help='the request as one JSON object, as the backfill DAG passes it: {"target": ..., '
                           '"offsets": ... | "from_time": ..., "until_time": ...} (empty values are ignored)')
    p.add_argument("--until-time", metavar="TIME", help="end of the time range (exclusive); needs --from-time")
    p.add_argument("--target", default="main",
                   help="'main' (the pipeline's tables, default) or a replay table name: a plain identifier; "
                        "its tables and ledger live under <warehouse>/replays/<name>/")
    p.add_argument("--run-id", help="Airflow run id recorded in the ledger (set by the DAG)")
    p.add_argument("--summary-json", action="store_true", help="print the backfill report as JSON")
    _add_config_flags(p)


def _backfill_request(args: argparse.Namespace, cfg: PipelineConfig):
    from ipcount.rules.requests import request_from_fields

    if args.request_json is not None:
        return request_from_fields(args.request_json, cfg.topic)
    if args.offsets is not None and args.until_time is not None:
        raise BadRequestError("--until-time goes with --from-time, not with --offsets")
    if args.from_time is not None and args.until_time is None:
        raise BadRequestError("--from-time needs --until-time (the end of the range, exclusive)")
    return request_from_fields({"target": args.target, "offsets": args.offsets, "from_time": args.from_time,
                                "until_time": args.until_time}, cfg.topic, time_names=("--from-time", "--until-time"))


def _backfill(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.jobs.backfill import resolve, run_backfill
    from ipcount.storage.spark import get_spark

    crash = _crash_hook()
    request = _backfill_request(args, cfg)
    resolved = resolve(cfg, request)  # checked, with the broker, before Spark starts
    report = run_backfill(cfg, get_spark(cfg), request, run_id=args.run_id, crash=crash, resolved=resolved)
    print(report.line(), flush=True)
    if args.summary_json:
        print(json.dumps(report.to_dict()), flush=True)
    return EXIT_OK


# -- verify, rebuild -----------------------------------------------------------------------

def _verify_arguments(sub) -> None:
    p = sub.add_parser("verify", help="recount a table's committed offsets from Kafka and compare",
                       description="Recount every offset the target's ledger has committed, straight from "
                                   "Kafka with a plain consumer and the Python record specification, and "
                                   "compare with the counts table per window and IP. Prints each difference. "
                                   "Exit codes: 0 equal, 1 different, 4 broker unreachable.")
    p.add_argument("--target", default="main", help="'main' (default) or a replay table name")
    p.add_argument("--from-time", metavar="TIME", help="only compare windows starting at or after this time")
    p.add_argument("--until-time", metavar="TIME", help="only compare windows starting before this time")
    p.add_argument("--max-differences", type=int, default=50, help="differences to print (default 50)")
    _add_config_flags(p)


def _verify(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.jobs.verify import verify
    from ipcount.rules.requests import parse_time

    report = verify(cfg, args.target,
                    parse_time(args.from_time, "--from-time") if args.from_time else None,
                    parse_time(args.until_time, "--until-time") if args.until_time else None)
    for d in report.differences[:args.max_differences]:
        print(d.line())
    if len(report.differences) > args.max_differences:
        print(f"... and {len(report.differences) - args.max_differences} more")
    print(report.line(), flush=True)
    return EXIT_OK if report.ok else EXIT_FAILED


def _rebuild_arguments(sub) -> None:
    p = sub.add_parser("rebuild", help="replay a ledger's committed epochs into a fresh replay table set",
                       description="Replay every committed epoch of the source's ledger (same ranges, "
                                   "watermarks and epoch ids, in the order their counts were committed) into "
                                   "the replay target --into; the result equals the source row for row as "
                                   "long as Kafka still holds the offsets. Resumable: re-run it after a "
                                   "crash. Exit codes: 0 done, 2 bad request, 3 offsets no longer in Kafka.")
    p.add_argument("--into", required=True, help="replay target to write (a plain identifier, not 'main')")
    p.add_argument("--source", default="main", help="target whose ledger is replayed (default main)")
    p.add_argument("--run-id", help="run id recorded in the target's ledger")
    _add_config_flags(p)


def _rebuild(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.jobs.rebuild import rebuild
    from ipcount.storage.spark import get_spark

    report = rebuild(cfg, get_spark(cfg), args.into, args.source, run_id=args.run_id)
    print(report.line(), flush=True)
    return EXIT_OK


# -- publish, watch ------------------------------------------------------------------------

def _publish_arguments(sub) -> None:
    p = sub.add_parser("publish", help="publish committed counts to the sink topic, exactly once",
                       description="Publish every counts-table version not published yet to publish_topic: the "
                                   "rows each epoch changed, one Kafka transaction per version holding the records "
                                   "and the publisher's cursor (a first publish sends the table whole, unless its "
                                   "change data feed was on from its creation). The sink topic must be "
                                   "compacted only (cleanup.policy=compact). Runs "
                                   "without Spark; needs publish = true (which turns on the counts table's change "
                                   "data feed at the next epoch).")
    _add_config_flags(p)
    p.add_argument("--resync", action="store_true",
                   help="send the counts table whole as a snapshot and publish on from it: when the table was "
                        "replaced (a rebuild swapped in), or the publisher's cursor is gone and the sink topic "
                        "was emptied (publishing never starts over without it)")


def _publish(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.jobs.publish import publish_pending

    if not cfg.publish:
        raise ConfigError("publish is off for this pipeline; set publish = true (--publish or IPCOUNT_PUBLISH)")
    report = publish_pending(cfg, _crash_hook(), resync=args.resync)
    print(f"published {len(report.published)} counts version(s), {report.records} record(s), to "
          f"{cfg.publish_topic}; next version {report.cursor.next_version if report.cursor else '-'}")
    return EXIT_OK


def _watch_arguments(sub) -> None:
    p = sub.add_parser("watch", help="print a line per epoch as epochs commit",
                       description="Follow the ledger and print one line per committed epoch.")
    _add_config_flags(p)
    p.add_argument("--epochs", type=int, default=None, help="exit after this many new epochs")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (exit 1)")
    p.add_argument("--from-start", action="store_true", help="also print epochs committed before now")


def _latency_arguments(sub) -> None:
    p = sub.add_parser("latency", help="how long records waited to be counted (p50, p95)",
                       description="From each record's Kafka timestamp (its produce time) to the commit of the "
                                   "counts-table version that counts it, over the scheduled chain's committed "
                                   "epochs: read after the fact from the ledger, the counts table's log and the "
                                   "topic (no JVM).")
    _add_config_flags(p)
    p.add_argument("--epochs", type=int, default=None, help="only the last N committed epochs (default all)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def _latency(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.devtools.latency import measure

    if args.epochs is not None and args.epochs < 1:
        raise ConfigError(f"--epochs must be at least 1; found {args.epochs}")
    found = measure(cfg, args.epochs)
    print(json.dumps(found.as_dict()) if args.json else found.line())
    return EXIT_OK if found.records else EXIT_FAILED


def _watch(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.storage.ledger import committed_epochs

    last = 0
    if not args.from_start:
        done = committed_epochs(cfg.ledger_path)
        last = done[-1].epoch if done else 0
    seen, started = 0, time.monotonic()
    print(f"watching ledger {cfg.ledger_path} (epochs after {last})", flush=True)
    while args.epochs is None or seen < args.epochs:
        for e in committed_epochs(cfg.ledger_path, after_epoch=last):
            print(e.line(), flush=True)
            last, seen = e.epoch, seen + 1
        if args.timeout is not None and time.monotonic() - started > args.timeout:
            print(f"timed out after {args.timeout:.0f}s with {seen} new epoch(s)", file=sys.stderr)
            return EXIT_FAILED
        if args.epochs is None or seen < args.epochs:
            time.sleep(2)
    return EXIT_OK


# -- the embedded stack: generate, kafka, airflow; config ----------------------------------

def _generate_arguments(sub) -> None:
    p = sub.add_parser("generate", help="produce access-log traffic to the source topic",
                       description="Produce generated access-log records (JSON and NGINX lines, some "
                                   "out of order, a few late, ~1%% malformed) to the source topic.")
    _add_config_flags(p)
    p.add_argument("--rate", type=_positive_rate, default=200.0, help="records per second (default 200)")
    p.add_argument("--count", type=_positive_int, default=None, help="stop after this many records (default: forever)")
    p.add_argument("--seed", type=int, default=7, help="random seed (default 7)")


def _generate(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.devtools.generator import TrafficGenerator, stream
    from ipcount.storage.broker import client_options

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
    p.add_argument("--kills", type=_positive_int, default=None,
                   help="kills to survive (default 20; resumed: the paused run's, or this many in all)")
    p.add_argument("--records", type=_positive_int, default=None,
                   help="about this many records, produced in batches of records/(kills+1): one batch before "
                        "the first round and one before each round (default 3000)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default 1)")
    p.add_argument("--max-minutes", type=_positive_int, default=60,
                   help="stop killing after this, in this sitting (default 60)")
    p.add_argument("--scenarios", default=None,
                   help=f"which to take turns with, comma-separated (default all: {','.join(_chaos_scenarios())}; "
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
    _add_config_flags(p)


def _chaos_scenarios() -> tuple[str, ...]:
    from ipcount.devtools.chaos import SCENARIOS

    return SCENARIOS


def _chaos(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.devtools.chaos import embedded_broker, report_json, restartable, run_chaos

    kafka = embedded_broker(args.broker_state_dir, cfg.bootstrap_servers)
    if args.resume:
        fixed = [flag for flag, value in (("--records", args.records), ("--seed", args.seed),
                                          ("--scenarios", args.scenarios), ("--workdir", args.workdir))
                 if value is not None]
        if fixed:
            raise BadRequestError(f"{', '.join(fixed)}: a resumed run keeps its own; leave them out")
        scenarios = ()  # the run's own
    elif args.scenarios is None:
        scenarios = _chaos_scenarios()
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
                                   "min.insync.replicas 2), create the source topic, or give a user SCRAM "
                                   "credentials on any broker (scram-user: --username and --password-file).")
    p.add_argument("action", choices=("start", "stop", "status", "create-topic", "scram-user"))
    p.add_argument("--port", type=int, default=9092, help="broker port on 127.0.0.1 (default 9092)")
    p.add_argument("--nodes", type=int, choices=(1, 3), default=1,
                   help="1: a single broker (default); 3: a cluster, which start prints the bootstrap servers of")
    p.add_argument("--state-dir", help="broker config, data and log (default .local/kafka, or "
                                       ".local/kafka-cluster with --nodes 3)")
    p.add_argument("--secure", action="store_true",
                   help="start: also serve SASL_SSL, SASL_PLAINTEXT and mutual-TLS SSL on the next three "
                        "ports (a dev CA and a user's password under STATE_DIR/secure), and print the "
                        "settings that reach each (single broker only)")
    p.add_argument("--partitions", type=int, default=3, help="partitions of a created topic (default 3)")
    p.add_argument("--username", help="scram-user: the user to give SCRAM-SHA-256 and -512 credentials")
    p.add_argument("--password-file", help="scram-user: a private file (mode 0600) holding the user's password")
    _add_config_flags(p)


def _kafka(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.devtools.embedded_kafka import EmbeddedKafka, EmbeddedKafkaCluster, SecureListeners
    from ipcount.rules.kafka_security import read_private_file
    from ipcount.storage.broker import create_topic, upsert_scram_user

    if args.action == "scram-user":
        if not args.username or not args.password_file:
            raise ConfigError("scram-user needs --username and --password-file")
        upsert_scram_user(cfg, args.username, read_private_file(args.password_file, "--password-file"))
        return EXIT_OK
    if args.action == "create-topic":
        create_topic(cfg, args.partitions)
        return EXIT_OK
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
    _add_config_flags(p)


def _s3(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.devtools.embedded_s3 import EmbeddedS3

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
    _add_config_flags(p)


def _spark_cluster(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.devtools.embedded_spark import EmbeddedSparkCluster

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
                                   "pyspark, with the Kafka and Delta jars and an epoch's Spark settings; it "
                                   "takes only clients with its token (a private file it makes). Point the "
                                   "pipeline at it with spark_remote and spark_remote_token_file, which `start` "
                                   "prints; epochs then run in the calling process with a remote session.")
    p.add_argument("action", choices=("start", "stop", "status", "serve"),
                   help="serve: start and stay in the foreground until SIGTERM (a container's main process)")
    p.add_argument("--port", type=_positive_int, default=15002, help="the server's port (default 15002)")
    p.add_argument("--master", default="local[*]", help="the server's Spark master (default local[*]; a "
                                                        "standalone cluster: spark://host:7077)")
    p.add_argument("--state-dir", default=str(STATE_DIR / "spark-connect"), help="its log and token file")


def _spark_connect(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.devtools.embedded_connect import EmbeddedSparkConnect

    server = EmbeddedSparkConnect(state_dir=Path(args.state_dir), port=args.port, master=args.master)
    if args.action == "serve":
        return server.serve()
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
                                   "`bin/ipcount airflow --database postgres ...` or `bin/run --airflow-db "
                                   "postgres`. Run as root, the server runs as the OS user postgres.")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--port", type=int, default=5433, help="port on 127.0.0.1 (default 5433; 5432 is left to a "
                                                         "system cluster)")
    p.add_argument("--state-dir", default=str(STATE_DIR / "postgres"), help="the cluster, its log and password")
    _add_config_flags(p)


def _postgres(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.devtools.embedded_postgres import EmbeddedPostgres

    server = EmbeddedPostgres(state_dir=Path(args.state_dir), port=args.port)
    if args.action == "start":
        server.start()
    elif args.action == "stop":
        server.stop()
    else:
        print(server.status())
        return EXIT_OK if server.is_running() else EXIT_FAILED
    return EXIT_OK


def _consumer_groups_arguments(sub) -> None:
    p = sub.add_parser("consumer-groups", help="Kafka's kafka-consumer-groups, logged in as the pipeline",
                       description="Run Kafka's kafka-consumer-groups tool against the pipeline's broker with "
                                   "its Kafka security settings (a private --command-config file, removed "
                                   "afterwards), e.g. `bin/ipcount consumer-groups --config p.toml -- "
                                   "--describe --group ipcount`.")
    _add_config_flags(p)
    p.add_argument("tool_args", nargs=argparse.REMAINDER, help="after --: the tool's own arguments")


def _consumer_groups(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.storage.broker import consumer_groups_command

    tool_args = args.tool_args[1:] if args.tool_args[:1] == ["--"] else args.tool_args
    return consumer_groups_command(cfg, tool_args)


def _airflow_arguments(sub) -> None:
    p = sub.add_parser("airflow", help="run an airflow command in the embedded stack's environment",
                       description="Run `airflow ARGS...` with the embedded stack's settings (SQLite in "
                                   "AIRFLOW_HOME or the embedded PostgreSQL, LocalExecutor, this repo's dags/ "
                                   "and plugins/, the spark_default connection), e.g. `bin/ipcount airflow "
                                   "dags list`.")
    p.add_argument("--airflow-home", default=str(STATE_DIR / "airflow"), help="AIRFLOW_HOME (default .local/airflow)")
    p.add_argument("--api-port", type=int, default=8080, help="api-server port (default 8080)")
    p.add_argument("--database", choices=("sqlite", "postgres"), default="sqlite",
                   help="the metadata database: SQLite in AIRFLOW_HOME (default), or the embedded PostgreSQL "
                        "(`bin/ipcount postgres start` first)")
    p.add_argument("--postgres-port", type=int, default=5433, help="the embedded PostgreSQL's port (default 5433)")
    p.add_argument("--postgres-state-dir", default=str(STATE_DIR / "postgres"),
                   help="the embedded PostgreSQL's state dir (default .local/postgres)")
    p.add_argument("airflow_args", nargs=argparse.REMAINDER, help="arguments for airflow")
    _add_config_flags(p)


def _airflow(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.devtools.embedded_airflow import airflow_env, keep_passwords_private

    keep_passwords_private(Path(args.airflow_home))
    database = None
    if args.database == "postgres":
        from ipcount.devtools.embedded_postgres import EmbeddedPostgres

        database = EmbeddedPostgres(state_dir=Path(args.postgres_state_dir), port=args.postgres_port) \
            .airflow_environment()
    env = airflow_env(Path(args.airflow_home), args.api_port, spark_master=cfg.spark_master, database=database)
    # The DAG reads its settings from IPCOUNT_* variables: hand over any given as flags.
    for name, value in cfg.to_dict().items():
        if getattr(args, name, None) is not None:
            env[env_name(name)] = str(value)
    airflow = str(Path(sys.executable).parent / "airflow")
    os.execve(airflow, [airflow, *args.airflow_args], env)


def _config_arguments(sub) -> None:
    p = sub.add_parser("config", help="print the effective configuration as JSON")
    _add_config_flags(p)


def _config(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    out = cfg.to_dict()
    out.update(counts_path=cfg.counts_path, ledger_path=cfg.ledger_path,
               dead_letter_path=cfg.dead_letter_path, late_path=cfg.late_path)
    print(json.dumps(out, indent=2))
    return EXIT_OK


Command = Callable[[argparse.Namespace, PipelineConfig], int]
# name -> (adds its sub-parser, runs it), in the order --help lists them.
COMMANDS: dict[str, tuple[Callable[[Any], None], Command]] = {
    "epoch": (_epoch_arguments, _epoch),
    "publish": (_publish_arguments, _publish),
    "backfill": (_backfill_arguments, _backfill),
    "verify": (_verify_arguments, _verify),
    "rebuild": (_rebuild_arguments, _rebuild),
    "watch": (_watch_arguments, _watch),
    "latency": (_latency_arguments, _latency),
    "generate": (_generate_arguments, _generate),
    "chaos": (_chaos_arguments, _chaos),
    "kafka": (_kafka_arguments, _kafka),
    "s3": (_s3_arguments, _s3),
    "spark-cluster": (_spark_cluster_arguments, _spark_cluster),
    "spark-connect": (_spark_connect_arguments, _spark_connect),
    "postgres": (_postgres_arguments, _postgres),
    "consumer-groups": (_consumer_groups_arguments, _consumer_groups),
    "airflow": (_airflow_arguments, _airflow),
    "config": (_config_arguments, _config),
}


if __name__ == "__main__":
    sys.exit(main())
