"""Command line: ``ipcount <command> --help`` (``bin/ipcount`` in a checkout).

    epoch      run one checkpoint epoch (the code path the DAG's Spark task runs)
    backfill   count an offset or time range the ledger does not own yet, in bounded epochs
    verify     recount what a table's ledger says is counted, straight from Kafka, and compare
    rebuild    replay a ledger's committed epochs into a fresh replay table set
    maintain   compact, checkpoint and vacuum every table of the set (no JVM)
    watch      print a line per epoch as epochs commit (reads the ledger, no JVM)
    latency    how long records waited to be counted: produce time -> counts commit, p50/p95
    publish    publish committed counts to the sink topic, exactly once (no JVM)
    create-topic     create the source topic on the pipeline's broker
    scram-user       give a Kafka user SCRAM credentials on the pipeline's broker
    connect-server   run the Spark Connect server epochs use, in the foreground (a container's)
    consumer-groups  Kafka's kafka-consumer-groups tool, logged in with the pipeline's settings
    config     print the effective configuration

In a checkout, the lab (the embedded stack on one machine, traffic, chaos, the benchmark) has its own command line:
``ipcount-lab --help`` (``bin/lab``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import fields
from typing import Any, Callable, Iterable, Mapping, Sequence

from ipcount.rules.config import COMMAND_SETTINGS, SETTINGS, PipelineConfig, flag
from ipcount.rules.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, BadRequestError, ConfigError, IpcountError

log = logging.getLogger("ipcount")
Command = Callable[[argparse.Namespace, PipelineConfig], int]


def add_config_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """The settings flags (all, or only ``names``: what the command reads) and --config."""
    group = parser.add_argument_group(
        "pipeline settings (override --config file and IPCOUNT_* environment variables)")
    group.add_argument("--config", metavar="FILE", help="TOML or JSON file of settings (or $IPCOUNT_CONFIG)")
    wanted = None if names is None else set(names)
    for s in SETTINGS:
        if wanted is not None and s.name not in wanted:
            continue
        details = [] if s.default == "" else [f"default: {s.default}"]  # (an empty one is in s.help)
        if s.type == "int":
            details.append(f"{s.minimum} to {s.maximum}")
        help_text = f"{s.help} ({'; '.join([*details, f'env {s.env}'])})"
        if s.type == "bool":
            group.add_argument(flag(s.name), dest=s.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(flag(s.name), dest=s.name, metavar=s.name.upper(), default=None, help=help_text)


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < 1e9:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text}")
    return value


def port_number(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 1 to 65535, not {value}")
    return value


def not_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def load_config(args: argparse.Namespace) -> PipelineConfig:
    """The settings, from the command's flags where it has them (a command without the settings flags reads the file and
    IPCOUNT_* variables only; one that reads no setting gets the defaults)."""
    if COMMAND_SETTINGS.get(args.command) == ():
        return PipelineConfig()
    overrides = {f.name: getattr(args, f.name, None) for f in fields(PipelineConfig)}
    return PipelineConfig.load(config_file=getattr(args, "config", None), **overrides)


def build_parser(commands: Mapping[str, tuple[Callable[[Any], None], Command]] | None = None,
                 prog: str = "ipcount", doc: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``commands`` (default: the product's), its help from ``doc``'s paragraphs."""
    doc = __doc__ if doc is None else doc
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=doc.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for add_arguments, _ in (COMMANDS if commands is None else commands).values():
        add_arguments(sub)
    return parser


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from ipcount.jobs.runs import quiet_clients

    quiet_clients()


def main(argv: Sequence[str] | None = None,
         commands: Mapping[str, tuple[Callable[[Any], None], Command]] | None = None, prog: str = "ipcount",
         doc: str | None = None) -> int:
    """Run a command of ``commands`` (default: the product's; the lab's CLI passes its own)."""
    _logging()
    commands = COMMANDS if commands is None else commands
    parser = build_parser(commands, prog, doc)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args)
    except ConfigError as e:
        parser.exit(EXIT_USAGE, f"{prog} {args.command}: error: {e}\n")
    _, command = commands[args.command]
    return _exit_code(lambda: command(args, cfg))


def _exit_code(work: Callable[[], int]) -> int:
    """``work``'s exit code, or its error's (logged in one line)."""
    try:
        return work()
    except IpcountError as e:  # every pipeline error carries its exit code and a message
        log.error("%s", e)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


def run_main(run_json: str) -> int:
    """spark-submit's application as the DAGs submit it: one argument, the run as JSON
    (:meth:`ipcount.jobs.runs.Run.to_json`); its exit code says how it ended."""
    from ipcount.jobs.runs import Run, execute

    def work() -> int:
        execute(Run.from_json(run_json))
        return EXIT_OK

    _logging()
    return _exit_code(work)


# -- epoch ---------------------------------------------------------------------------------

def _epoch_arguments(sub) -> None:
    p = sub.add_parser("epoch", help="run one checkpoint epoch",
                       description="Run one exactly-once epoch: plan the next offset ranges from the ledger "
                                   "(or finish an unfinished epoch with its recorded ranges), read them from "
                                   "Kafka, count per IP and window into Delta, commit the ledger, then commit "
                                   "the offsets to the consumer group (if commit_offsets). Exit codes: 0 done "
                                   "or nothing to read, 2 bad settings, 3 data loss, 4 broker unreachable.")
    add_config_flags(p)
    p.add_argument("--run-id", help="a run id to record in the ledger (a DAG run records its own)")
    p.add_argument("--skip-publish", action="store_true",
                   help="do not publish to publish_topic after each epoch (ipcount publish does it later)")
    p.add_argument("--summary-json", action="store_true", help="print the epoch summary as JSON")
    p.add_argument("--epochs", type=positive_int, default=1, metavar="N",
                   help="run up to N epochs one after another in one Spark session, stopping at the first "
                        "with nothing new to read (default 1); each is a whole epoch of its own")


def _epoch(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.jobs.runs import EPOCH, Run, execute

    run = Run(EPOCH, cfg, run_id=args.run_id, epochs=args.epochs, publish=not args.skip_publish)
    execute(run, report=_reporter(args.summary_json))
    return EXIT_OK


def _reporter(as_json: bool):
    """Print each result's JSON after its line, when asked."""
    def report(result) -> None:
        if as_json:
            print(json.dumps(result.to_dict()), flush=True)
    return report


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
    p.add_argument("--until-time", metavar="TIME", help="end of the time range (exclusive); needs --from-time")
    p.add_argument("--target", type=not_empty,
                   help="'main' (the pipeline's tables, default) or a replay table name: a plain identifier; "
                        "its tables and ledger live under <warehouse>/replays/<name>/")
    p.add_argument("--run-id", help="a run id to record in the ledger (a DAG run records its own)")
    p.add_argument("--summary-json", action="store_true", help="print the backfill report as JSON")
    add_config_flags(p)


def _backfill_request(args: argparse.Namespace, cfg: PipelineConfig):
    from ipcount.rules.requests import request_from_fields

    if args.offsets is not None and args.until_time is not None:
        raise BadRequestError("--until-time goes with --from-time, not with --offsets")
    if args.from_time is not None and args.until_time is None:
        raise BadRequestError("--from-time needs --until-time (the end of the range, exclusive)")
    return request_from_fields({"target": args.target or "main", "offsets": args.offsets, "from_time": args.from_time,
                                "until_time": args.until_time}, cfg.topic, time_names=("--from-time", "--until-time"))


def _backfill(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.jobs.runs import BACKFILL, Run, execute

    execute(Run(BACKFILL, cfg, run_id=args.run_id, request=_backfill_request(args, cfg)),
            report=_reporter(args.summary_json))
    return EXIT_OK


# -- verify, rebuild -----------------------------------------------------------------------

def _verify_arguments(sub) -> None:
    p = sub.add_parser("verify", help="recount a table's committed offsets from Kafka and compare",
                       description="Recount every offset the target's ledger has committed, straight from "
                                   "Kafka with a plain consumer and the Python record specification, and "
                                   "compare with the counts table per window and IP. Prints each difference. "
                                   "A verify of nothing is no pass: no committed offsets, or no counted window "
                                   "in the time range, exits 1. Exit codes: 0 equal, 1 different or nothing "
                                   "to compare, 2 bad request or settings, or no such table set, 4 broker "
                                   "unreachable or topic missing, 5 object storage unreachable.")
    p.add_argument("--target", default="main", type=not_empty, help="'main' (default) or a replay table name")
    p.add_argument("--from-time", metavar="TIME", help="only compare windows starting at or after this time")
    p.add_argument("--until-time", metavar="TIME", help="only compare windows starting before this time")
    p.add_argument("--max-differences", type=non_negative_int, default=50,
                   help="differences to print (default 50)")
    add_config_flags(p, COMMAND_SETTINGS["verify"])


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
    add_config_flags(p)


def _rebuild(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.jobs.runs import REBUILD, Run, execute

    execute(Run(REBUILD, cfg, run_id=args.run_id, into=args.into, source=args.source))
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
    add_config_flags(p, COMMAND_SETTINGS["publish"])
    p.add_argument("--resync", action="store_true",
                   help="send the counts table whole as a snapshot and publish on from it: when the table was "
                        "replaced (a rebuild swapped in), or the publisher's cursor is gone and the sink topic "
                        "was emptied (publishing never starts over without it)")


def _publish(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.jobs.crash import crash_from_env
    from ipcount.jobs.publish import publish_pending
    from ipcount.storage.tableset import existing

    if not cfg.publish:
        raise ConfigError("publish is off for this pipeline; set publish = true (--publish or IPCOUNT_PUBLISH)")
    existing(cfg, command="publish", ledger=False)  # (it reads the counts table's versions only)
    report = publish_pending(cfg, crash_from_env(), resync=args.resync)
    print(f"published {len(report.published)} counts version(s), {report.records} record(s), to "
          f"{cfg.publish_topic}; next version {report.cursor.next_version if report.cursor else '-'}")
    return EXIT_OK


def _maintain_arguments(sub) -> None:
    p = sub.add_parser("maintain", help="compact, checkpoint and vacuum every table of the set",
                       description="Maintain every table of the pipeline's set once: pack small files into big "
                                   "ones (the counts table only in its final partitions), "
                                   "retire the transactions of epochs the ledger holds as final, write a "
                                   "checkpoint, delete log files older than the table's log retention, and "
                                   "delete data files no version has referenced for vacuum_retention_hours. Safe "
                                   "beside running epochs: a step that loses to an epoch's commit is left for the "
                                   "next run. Each run is logged, a row per table, in the maintenance table. Runs "
                                   "without Spark; reads the publisher's position from Kafka when publish is on.")
    add_config_flags(p, COMMAND_SETTINGS["maintain"])


def _maintain(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.jobs.maintenance import run_maintenance
    from ipcount.storage.tableset import existing

    existing(cfg, command="maintain")
    run = run_maintenance(cfg)
    for line in run.lines():
        print(line)
    print(f"maintenance {run.run_id} logged to {cfg.maintenance_path}")
    return EXIT_OK


def _watch_arguments(sub) -> None:
    p = sub.add_parser("watch", help="print a line per epoch as epochs commit",
                       description="Follow the ledger and print one line per committed epoch.")
    add_config_flags(p, COMMAND_SETTINGS["watch"])
    p.add_argument("--epochs", type=positive_int, default=None, help="exit after this many new epochs")
    p.add_argument("--timeout", type=positive_seconds, default=None,
                   help="give up after this many seconds (exit 1)")
    p.add_argument("--from-start", action="store_true", help="also print epochs committed before now")


def _latency_arguments(sub) -> None:
    p = sub.add_parser("latency", help="how long records waited to be counted (p50, p95)",
                       description="From each record's Kafka timestamp (its produce time) to the commit of the "
                                   "counts-table version that counts it, over the scheduled chain's committed "
                                   "epochs: read after the fact from the ledger, the counts table's log and the "
                                   "topic (no JVM).")
    add_config_flags(p, COMMAND_SETTINGS["latency"])
    p.add_argument("--epochs", type=positive_int, default=None,
                   help="only the last N committed epochs (default all)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def _latency(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.jobs.latency import measure

    found = measure(cfg, args.epochs)
    print(json.dumps(found.as_dict()) if args.json else found.line())
    return EXIT_OK if found.records else EXIT_FAILED


def _watch(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.storage.delta import has_table
    from ipcount.storage.ledger import committed_epochs

    last = 0
    if not has_table(cfg.ledger_path):  # (refuses a location no table can be at)
        print(f"no ledger at {cfg.ledger_path} yet: waiting for the first epoch", file=sys.stderr, flush=True)
    elif not args.from_start:
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


# -- operations: topic, users, the Spark Connect server; consumer groups, config ----------

def _create_topic_arguments(sub) -> None:
    p = sub.add_parser("create-topic", help="create the source topic on the pipeline's broker",
                       description="Create the pipeline's source topic (topic) on its broker with --partitions "
                                   "partitions, replicated as the brokers' default.replication.factor says; "
                                   "nothing happens when it exists.")
    p.add_argument("--partitions", type=positive_int, default=3, help="partitions of the topic (default 3)")
    add_config_flags(p, COMMAND_SETTINGS["create-topic"])


def _create_topic(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.storage.broker import create_topic

    create_topic(cfg, args.partitions)
    return EXIT_OK


def _scram_user_arguments(sub) -> None:
    p = sub.add_parser("scram-user", help="give a Kafka user SCRAM credentials on the pipeline's broker",
                       description="Give --username SCRAM-SHA-256 and -512 credentials (made or replaced) on "
                                   "the pipeline's broker, the password read from a private file, never from "
                                   "the command line; the pipeline logs in with its own Kafka settings.")
    p.add_argument("--username", required=True, type=not_empty, help="the user to give credentials")
    p.add_argument("--password-file", required=True, help="a private file (mode 0600) holding the user's password")
    add_config_flags(p, COMMAND_SETTINGS["scram-user"])


def _scram_user(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.rules.private_files import read_private_file
    from ipcount.storage.broker import upsert_scram_user

    upsert_scram_user(cfg, args.username, read_private_file(args.password_file, "--password-file"))
    return EXIT_OK


def _connect_server_arguments(sub) -> None:
    p = sub.add_parser("connect-server", help="run the Spark Connect server epochs use, in the foreground",
                       description="Run Spark's Connect server with the Kafka source's and the parse's jars "
                                   "and the Spark settings epochs use (what spark_remote points epochs at) in "
                                   "the foreground until SIGTERM or SIGINT, as a container's main process; exit "
                                   "code 0 when stopped by a signal. It takes only clients with the token in "
                                   "--token-file.")
    p.add_argument("--port", type=port_number, default=15002, help="the server's port (default 15002)")
    p.add_argument("--bind", default="127.0.0.1", type=not_empty,
                   help="the address it listens on (default 127.0.0.1: it has no TLS, so keep it off networks "
                        "others reach)")
    p.add_argument("--master", default="local[*]", type=not_empty,
                   help="the Spark master of its sessions (default local[*]; a standalone cluster: "
                        "spark://host:7077)")
    p.add_argument("--cores", type=positive_int, default=os.cpu_count() or 2,
                   help="tasks per stage by default (spark.default.parallelism; default: this machine's CPUs)")
    p.add_argument("--token-file", required=True, help="a private file (mode 0600) holding the clients' token")


def _connect_server(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.rules.private_files import read_private_file
    from ipcount.storage.connect_server import check_bindable, serve, server_command, server_environment

    token = read_private_file(args.token_file, "--token-file").strip()
    if not token:
        raise ConfigError(f"--token-file {args.token_file} is empty")
    check_bindable(args.bind, args.port)
    log.info("Spark Connect server on %s:%d (master %s)", args.bind, args.port, args.master)
    return serve(server_command(args.port, args.master, args.cores, args.bind), server_environment(token))


def _consumer_groups_arguments(sub) -> None:
    p = sub.add_parser("consumer-groups", help="Kafka's kafka-consumer-groups, logged in as the pipeline",
                       description="Run Kafka's kafka-consumer-groups tool against the pipeline's broker with "
                                   "its Kafka security settings (a private --command-config file, removed "
                                   "afterwards), e.g. `bin/ipcount consumer-groups --config p.toml -- "
                                   "--describe --group ipcount`.")
    add_config_flags(p, COMMAND_SETTINGS["consumer-groups"])
    p.add_argument("tool_args", nargs=argparse.REMAINDER, help="after --: the tool's own arguments")


def _consumer_groups(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    from ipcount.storage.broker import consumer_groups_command

    tool_args = args.tool_args[1:] if args.tool_args[:1] == ["--"] else args.tool_args
    return consumer_groups_command(cfg, tool_args)


def _config_arguments(sub) -> None:
    p = sub.add_parser("config", help="print the effective configuration as JSON")
    add_config_flags(p)


def _config(args: argparse.Namespace, cfg: PipelineConfig) -> int:
    out = cfg.to_dict()
    out.update(counts_path=cfg.counts_path, ledger_path=cfg.ledger_path,
               dead_letter_path=cfg.dead_letter_path, late_path=cfg.late_path,
               maintenance_path=cfg.maintenance_path)
    print(json.dumps(out, indent=2))
    return EXIT_OK


# name -> (adds its sub-parser, runs it), in the order --help lists them.
COMMANDS: dict[str, tuple[Callable[[Any], None], Command]] = {
    "epoch": (_epoch_arguments, _epoch),
    "publish": (_publish_arguments, _publish),
    "backfill": (_backfill_arguments, _backfill),
    "verify": (_verify_arguments, _verify),
    "rebuild": (_rebuild_arguments, _rebuild),
    "maintain": (_maintain_arguments, _maintain),
    "watch": (_watch_arguments, _watch),
    "latency": (_latency_arguments, _latency),
    "create-topic": (_create_topic_arguments, _create_topic),
    "scram-user": (_scram_user_arguments, _scram_user),
    "connect-server": (_connect_server_arguments, _connect_server),
    "consumer-groups": (_consumer_groups_arguments, _consumer_groups),
    "config": (_config_arguments, _config),
}


if __name__ == "__main__":
    sys.exit(main())
