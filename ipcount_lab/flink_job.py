"""The seeds' reference job in Flink SQL: bin/benchmark's Flink contender (``--only flink``).

Runs under PyFlink in its own virtualenv (``bin/setup --flink``), so it imports nothing of
the project's. It reads a bounded offset range of the requests topic (``read_committed``),
parses each value in SQL (a flat JSON object ``{"ip": ..., "ts": ...}`` or an access-log
line, the shapes the benchmark's generator writes), counts requests per client IP in
tumbling event-time windows and writes the counts to a Kafka topic with the exactly-once
sink (a transaction per checkpoint). Everything runs in the JVM: no Python UDF.

Flink SQL has no allowed lateness: a window fires once, when the watermark passes its end,
and a record behind the watermark is dropped. The watermark trails the largest event time
by ``--watermark-delay-seconds``, more than the generator's records ever trail (40 s at
most), so on its data nothing is dropped and the counts equal the pipeline's for a range
read in one epoch.

It is not the record specification: it takes any time after 1970 (the spec: 2000-2100),
Java's date parsing moves 31/Nov to 30/Nov, only +0000 access-log times are read, and IPv6
text is counted as written, not in its canonical form. On the generator's records these
change nothing; the benchmark's recount would say if they did.

``--sink-topic`` may be given several times: the jobs run one after another in this process
(one JVM; PyFlink's local executor starts a mini cluster per job). Each prints a JSON line
with its net runtime as Flink reports it and its time from submission to done.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

# The access-log line: client, identity, user, [time +0000], the request. Java regex in SQL
# literals (no escapes but '').
NGINX = r"^(\S+) \S+ \S+ \[([0-9]{2}/[A-Za-z]{3}/[0-9]{4}:[0-9]{2}:[0-9]{2}:[0-9]{2}) \+0000\] "
# 'yyyy-MM-ddTHH:mm:ss.SSSZ' as a Java pattern in an SQL literal; TO_TIMESTAMP is NULL where
# a text does not fit it.
ISO_MS = "yyyy-MM-dd''T''HH:mm:ss.SSS''Z''"
# An IPv4 address, or IPv6 text.
OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
IP = rf"^(({OCTET}\.){{3}}{OCTET}|[0-9a-f.]*:[0-9a-f:.]*)$"
# Event time of a record that has none: never counted (the view drops it) and far behind
# every watermark, so it moves nothing.
NO_TIME = "TIMESTAMP '1970-01-01 00:00:00.000'"

CLIENT = f"CASE WHEN `value` LIKE '{{%' THEN JSON_VALUE(`value`, '$.ip') ELSE REGEXP_EXTRACT(`value`, '{NGINX}', 1) END"
TS = "JSON_VALUE(`value`, '$.ts')"
# Flink SQL has no variables: each mention of CLIENT or TS is evaluated again, so each is
# mentioned as few times as may be. A value with U+FFFD was not UTF-8 (raw decodes bad bytes
# to it).
WELL_FORMED = f"REGEXP(COALESCE({CLIENT}, ''), '{IP}') AND POSITION(U&'\\FFFD' IN `value`) = 0"
# Only a well-formed record's time may move the watermark: a malformed record's own time
# (the generator's bad_shape record is dated weeks ahead) would make every later one late.
EVENT_TIME = f"""CASE WHEN {WELL_FORMED} THEN COALESCE(CASE
  WHEN `value` LIKE '{{%' THEN COALESCE(TO_TIMESTAMP({TS}, '{ISO_MS}'),
                                      CAST(TO_TIMESTAMP_LTZ(TRY_CAST({TS} AS BIGINT), 3) AS TIMESTAMP(3)))
  ELSE TO_TIMESTAMP(REGEXP_EXTRACT(`value`, '{NGINX}', 2), 'dd/MMM/yyyy:HH:mm:ss') END, {NO_TIME}) ELSE {NO_TIME} END"""


def offsets(spec: dict[int, int]) -> str:
    return ";".join(f"partition:{p},offset:{o}" for p, o in sorted(spec.items()))


def with_options(options: dict[str, str]) -> str:
    """A table's WITH clause."""
    return "WITH (\n" + ",\n".join(f"  '{key}' = '{value}'" for key, value in options.items()) + "\n)"


def source_ddl(args: argparse.Namespace, ending: dict[int, int]) -> str:
    return f"""CREATE TEMPORARY TABLE raw_requests (
  `value` STRING,
  event_time AS {EVENT_TIME},
  WATERMARK FOR event_time AS event_time - INTERVAL '{args.watermark_delay_seconds}' SECOND
) """ + with_options({
        "connector": "kafka", "topic": args.topic, "properties.bootstrap.servers": args.bootstrap_servers,
        "properties.group.id": f"flink-{args.topic}", "properties.isolation.level": "read_committed",
        "scan.startup.mode": "specific-offsets", "scan.startup.specific-offsets": offsets(dict.fromkeys(ending, 0)),
        "scan.bounded.mode": "specific-offsets", "scan.bounded.specific-offsets": offsets(ending), "format": "raw"})


# A record counts when it is well-formed and has a time (EVENT_TIME).
REQUESTS_VIEW = f"""CREATE TEMPORARY VIEW requests AS
SELECT {CLIENT} AS ip, event_time FROM raw_requests WHERE event_time > {NO_TIME}"""


def sink_ddl(args: argparse.Namespace, topic: str) -> str:
    return "CREATE TEMPORARY TABLE ip_counts (window_start TIMESTAMP(3), ip STRING, requests BIGINT) " + with_options({
        "connector": "kafka", "topic": topic, "properties.bootstrap.servers": args.bootstrap_servers,
        "properties.transaction.timeout.ms": "600000", "sink.delivery-guarantee": "exactly-once",
        "sink.transactional-id-prefix": f"{topic}-{uuid.uuid4().hex[:8]}",
        "format": "json", "json.timestamp-format.standard": "ISO-8601"})


COUNT = """INSERT INTO ip_counts
SELECT window_start, ip, COUNT(*) AS requests
FROM TABLE(TUMBLE(TABLE requests, DESCRIPTOR(event_time), INTERVAL '{seconds}' SECOND))
GROUP BY window_start, window_end, ip"""


def run_job(args: argparse.Namespace, ending: dict[int, int], sink_topic: str) -> dict:
    from pyflink.table import EnvironmentSettings, TableEnvironment

    env = TableEnvironment.create(EnvironmentSettings.in_streaming_mode())
    conf = env.get_config()
    for key, value in (("pipeline.jars", f"file://{args.connector_jar}"),
                       ("table.local-time-zone", "UTC"),
                       ("execution.checkpointing.interval", f"{args.checkpoint_ms} ms"),
                       ("execution.checkpointing.mode", "EXACTLY_ONCE"),
                       # On files, as a deployment keeps them: in the JobManager's heap (the
                       # default) a checkpoint fails once a state passes 5 MB, as the windows'
                       # state does at 5M records, and with it the job.
                       ("execution.checkpointing.storage", "filesystem"),
                       ("execution.checkpointing.dir", Path(args.checkpoint_dir).resolve().as_uri()),
                       ("parallelism.default", str(args.parallelism)),
                       # A failing job fails the run: Flink would restart it without end.
                       ("restart-strategy.type", "none")):
        conf.set(key, value)
    env.execute_sql(source_ddl(args, ending))
    env.execute_sql(REQUESTS_VIEW)
    env.execute_sql(sink_ddl(args, sink_topic))
    started = time.monotonic()
    result = env.execute_sql(COUNT.format(seconds=args.window_seconds))
    done = result.get_job_client().get_job_execution_result().result()
    return {"sink_topic": sink_topic, "runtime_ms": done.get_net_runtime(),
            "seconds": round(time.monotonic() - started, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flink_job.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap-servers", required=True)
    p.add_argument("--topic", required=True, help="the requests topic")
    p.add_argument("--ending", required=True, help="JSON: partition -> end offset (the range starts at 0)")
    p.add_argument("--sink-topic", action="append", required=True,
                   help="where one job writes its counts (pre-created); again for another job in this process")
    p.add_argument("--connector-jar", required=True, help="flink-sql-connector-kafka's jar")
    p.add_argument("--window-seconds", type=int, default=5)
    p.add_argument("--watermark-delay-seconds", type=int, default=60)
    p.add_argument("--checkpoint-ms", type=int, default=1000,
                   help="checkpoint interval: the sink commits its transaction at each (default 1000)")
    p.add_argument("--checkpoint-dir", required=True, help="where the job's checkpoints go (a directory)")
    p.add_argument("--parallelism", type=int, default=2, help="bin/benchmark gives the machine's cores (default 2)")
    args = p.parse_args(argv)
    ending = {int(k): int(v) for k, v in json.loads(args.ending).items()}
    for n, topic in enumerate(args.sink_topic, 1):
        result = run_job(args, ending, topic)
        print(json.dumps({"job": n, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
