"""The real Airflow: the DAG folder imports cleanly, and `airflow dags test` runs a real epoch,
on each metadata database the pipeline supports: SQLite and PostgreSQL."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from ipcount.orchestration.monitor.links import run_page_path
from ipcount.storage import broker as broker_io
from ipcount.storage.ledger import committed_epochs
from ipcount_lab.embedded_airflow import airflow_env
from ipcount_lab.generator import TrafficGenerator, produce
from tests.airflow_services import airflow_database, metadata_rows
from tests.conftest import BROKER_PASSWORD, connect_connection, free_port
from tests.connect_sessions import clear_of_half_hour_edge, session_process
from tests.ground_truth import expected_tables
from tests.tables import counts, dead_letters, epoch_ranges, last_maintenance

# spark_default at a master nothing serves: a task that spark-submitted could not run.
NO_SPARK_MASTER = {"AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "spark://127.0.0.1:1"})}

pytestmark = pytest.mark.airflow


def _iso_ms(text: str) -> int:
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def _env(airflow_environ, cfg=None):
    env = dict(airflow_environ)
    if cfg is not None:
        env.update(cfg.to_env())
    return env


def _airflow(airflow_environ, *args, cfg=None, timeout=600):
    return subprocess.run([str(Path(sys.executable).parent / "airflow"), *args],
                          env=_env(airflow_environ, cfg), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", params=["sqlite"])
def airflow_environ(request, tmp_path_factory):
    """An Airflow home's environment, its metadata in a fresh database of the given kind:
    SQLite, and PostgreSQL for the tests parametrized with both (the real epoch here, and
    the scheduler's backfill in test_airflow_backfill.py): what a DAG does does not depend
    on the metadata database, which runs and tasks do."""
    with airflow_database(request.param) as database:
        env = airflow_env(tmp_path_factory.mktemp("airflow"), api_port=18080, database=database)
        proc = _airflow(env, "db", "migrate")
        assert proc.returncode == 0, proc.stderr[-3000:]
        yield env


def test_dag_folder_imports_without_errors(airflow_environ):
    script = (
        "import json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        "from airflow.configuration import conf\n"
        "from airflow.triggers.base import BaseEventTrigger\n"
        "bag = DagBag(dag_folder=conf.get('core', 'dags_folder'))\n"
        "info = {'errors': bag.import_errors}\n"
        "for name, d in sorted(bag.dags.items()):\n"
        "  info[name] = {'tasks': sorted(d.task_ids), 'max_active_runs': d.max_active_runs,\n"
        "    'catchup': d.catchup, 'retries': d.default_args['retries'],\n"
        "    'schedule': getattr(d.timetable, 'summary', None) or str(d.schedule),\n"
        "    'periodic': getattr(d.timetable, 'periodic', False), 'timetable': type(d.timetable).__name__,\n"
        "    'params': sorted(d.params.keys())}\n"
        "  info[name + ' lineage'] = {t.task_id: [sorted(a.uri for a in t.inlets),\n"
        "                                         sorted(a.uri for a in t.outlets)]\n"
        "                             for t in d.tasks if t.inlets or t.outlets}\n"
        "  info[name + ' watchers'] = {a.uri: [[w.name, BaseEventTrigger.hash(*w.trigger.serialize())]\n"
        "                                      for w in a.watchers]\n"
        "                             for t in d.tasks for a in [*t.inlets, *t.outlets]\n"
        "                             if getattr(a, 'watchers', None)}\n"
        "print(json.dumps(info))\n")
    proc = subprocess.run([sys.executable, "-c", script], env=_env(airflow_environ), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = {k: v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()
            if not k.endswith((" lineage", " watchers"))}
    from ipcount.orchestration.dags import BACKFILL_PARAMS, RUN_PARAMS

    assert info.pop("ipcount_maintenance") == {
        "tasks": ["maintain"], "max_active_runs": 1, "catchup": False, "retries": 1, "schedule": "@hourly",
        "periodic": False, "timetable": "CronTriggerTimetable", "params": []}
    assert info == {
        "errors": {},
        "ipcount_epoch": {"tasks": ["backfill_interval", "choose_path", "commit_offsets", "publish_counts",
                                    "publish_summary", "run_epoch"],
                          "max_active_runs": 1, "catchup": False, "retries": 2, "schedule": "* * * * *",
                          "periodic": True, "timetable": "CronDataIntervalTimetable", "params": sorted(RUN_PARAMS)},
        "ipcount_backfill": {"tasks": ["check_request", "publish_counts", "publish_summary", "run_backfill"],
                             "max_active_runs": 16, "catchup": False, "retries": 1, "schedule": "None",
                             "periodic": False, "timetable": "NullTimetable", "params": sorted(BACKFILL_PARAMS)},
    }
    # the lowest-latency schedule: each run as the last one ends
    proc = subprocess.run([sys.executable, "-c", script],
                          env={**_env(airflow_environ), "IPCOUNT_SCHEDULE": "@continuous"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    epoch_dag = json.loads(proc.stdout.strip().splitlines()[-1])["ipcount_epoch"]
    assert (epoch_dag["timetable"], epoch_dag["max_active_runs"]) == ("ContinuousTimetable", 1), epoch_dag
    # Lineage for the asset graph: the source topic -> the tables -> the sink topic
    lineage = {"IPCOUNT_BOOTSTRAP_SERVERS": "b1:9093,b2:9093", "IPCOUNT_TOPIC": "web.requests-v1",
               "IPCOUNT_WAREHOUSE": "/srv/wh", "IPCOUNT_PUBLISH": "true", "IPCOUNT_PUBLISH_TOPIC": "ip-counts"}
    proc = subprocess.run([sys.executable, "-c", script], env={**_env(airflow_environ), **lineage},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    source, sink = ["kafka://b1:9093/web.requests-v1"], ["kafka://b1:9093/ip-counts"]
    written = ["file:///srv/wh/dead_letters", "file:///srv/wh/late_records", "file:///srv/wh/ledger"]
    assert info["ipcount_epoch lineage"] == {
        "run_epoch": [source, written], "backfill_interval": [source, written],
        "publish_counts": [["file:///srv/wh/counts"], sink], "publish_summary": [[], ["file:///srv/wh/counts"]]}
    # (a backfill's tables are the main ones only when its summary is not skipped: a replay's are its own)
    assert info["ipcount_backfill lineage"] == {
        "run_backfill": [source, []], "publish_counts": [["file:///srv/wh/counts"], sink],
        "publish_summary": [[], ["file:///srv/wh/counts", *written]]}
    assert info["ipcount_maintenance lineage"] == {"maintain": [[], ["file:///srv/wh/maintenance"]]}
    assert not info["ipcount_epoch watchers"]
    # Runs started by new records: the source Asset's watcher (or the fallback clock). Every DAG
    # declares the Asset with the same watcher: Airflow keeps those of the DAG parsed last.
    proc = subprocess.run([sys.executable, "-c", script],
                          env={**_env(airflow_environ), **lineage, "IPCOUNT_SCHEDULE": "on-data"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["errors"] == {}
    assert (info["ipcount_epoch"]["timetable"], info["ipcount_epoch"]["max_active_runs"]) == \
        ("AssetOrTimeSchedule", 1), info["ipcount_epoch"]
    watchers = info["ipcount_epoch watchers"]
    assert list(watchers) == source and [name for name, _ in watchers[source[0]]] == ["ipcount_new_records"]
    assert info["ipcount_backfill watchers"] == watchers


@pytest.mark.parametrize("airflow_environ", ["sqlite", "postgres"], indirect=True)
def test_dag_test_runs_a_real_epoch_through_spark_submit(airflow_environ, cfg):
    gen = TrafficGenerator(seed=31, events_per_second=50, malformed_share=0.03)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(400, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    # No Spark Connect connection: the task spark-submits (the provider's hook logs the command).
    # Publishing is on: the epoch's counts reach the sink topic too.
    cfg = cfg.replace(publish=True, publish_topic=f"sink_{cfg.topic}")

    proc = _airflow(airflow_environ, "dags", "test", "ipcount_epoch", cfg=cfg)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert "Spark-Submit cmd:" in proc.stdout + proc.stderr

    epochs = committed_epochs(cfg.ledger_path)
    assert len(epochs) == 1 and epochs[0].run_id.startswith("manual__")
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead
    assert epochs[0].records_read == len(produced)
    assert broker_io.group_offsets(cfg) == dict(Counter(p.partition for p in produced))
    # The counts MERGE's change data feed, published: a read_committed fold equals the table.
    sink = KafkaConsumer(bootstrap_servers=cfg.bootstrap_servers, isolation_level="read_committed",
                         enable_auto_commit=False, consumer_timeout_ms=3000)
    sink.assign([TopicPartition(cfg.publish_topic, p) for p in range(3)])
    sink.seek_to_beginning()
    values = [json.loads(m.value) for m in sink]
    sink.close()
    assert {v["kind"] for v in values} == {"live"} and {v["epoch"] for v in values} == {1}
    assert Counter({(_iso_ms(v["window_start"]), v["ip"]): v["count"] for v in values}) == counts(cfg)
    assert len(values) == len(counts(cfg))  # each row once

    db = lambda sql, **params: metadata_rows(airflow_environ, sql, **params)  # noqa: E731
    # JSON columns as their text, which SQLite and PostgreSQL both give.
    ((extra,),) = db("SELECT CAST(e.extra AS TEXT) FROM asset_event e JOIN asset a ON a.id = e.asset_id "
                     "WHERE a.uri = :uri", uri=f"file://{cfg.counts_path}")
    published = json.loads(extra)
    assert published["epochs"][0]["epoch"] == 1
    assert published["epochs"][0]["ranges"] == {
        str(p): {"from_offset": f, "until_offset": u} for p, (f, u) in epoch_ranges(cfg)[0].items()}
    assert published["records_counted"] == sum(expected.counts.values())

    # The run's note (written by the monitoring plugin's listener) and the epoch task's link.
    # (This run's: the Airflow home is the module's, and other tests' runs have notes too.)
    run_id = epochs[0].run_id
    (note,), = db("SELECT n.content FROM dag_run r JOIN dag_run_note n ON n.dag_run_id = r.id "
                  "WHERE r.dag_id = 'ipcount_epoch' AND r.run_id = :run_id", run_id=run_id)
    spans = " ".join(f"p{p} [{f}, {u})" for p, (f, u) in sorted(epoch_ranges(cfg)[0].items()))
    assert f"**epoch 1** (scheduled) committed: {spans}; read {len(produced)}, counted " \
           f"{sum(expected.counts.values())}" in note
    ((link,),) = db("SELECT CAST(value AS TEXT) FROM xcom WHERE run_id = :run_id AND task_id = 'run_epoch' "
                    "AND key = '_link_EpochPageLink'", run_id=run_id)
    assert json.loads(link).endswith(run_page_path("ipcount_epoch", run_id))

    # Nothing new now: the next run finds that out without Spark and skips the epoch.
    proc = _airflow(airflow_environ, "dags", "test", "ipcount_epoch", cfg=cfg)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert "skipping the epoch: nothing new" in proc.stdout + proc.stderr
    (second,), = db("SELECT run_id FROM dag_run WHERE dag_id = 'ipcount_epoch' ORDER BY id DESC LIMIT 1")
    states = dict(db("SELECT task_id, state FROM task_instance WHERE dag_id = 'ipcount_epoch' AND run_id = :run_id",
                     run_id=second))
    assert second != run_id
    assert states == {"choose_path": "success", "run_epoch": "skipped", "backfill_interval": "skipped",
                      "commit_offsets": "skipped", "publish_counts": "skipped", "publish_summary": "skipped"}
    assert [e.epoch for e in committed_epochs(cfg.ledger_path)] == [1]

    # The maintenance DAG on the same tables (publish on: it reads the publisher's position).
    proc = _airflow(airflow_environ, "dags", "test", "ipcount_maintenance", cfg=cfg)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    logged = last_maintenance(cfg)
    assert sorted(r["table"] for r in logged) == ["counts", "dead_letters", "late_records", "ledger", "maintenance"]
    assert logged[0]["run_id"].startswith("manual__") and all(r["files_after"] >= 1 for r in logged
                                                              if r["table"] in ("counts", "ledger"))
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead


def test_run_params_and_a_kafka_connection_reach_the_task_on_spark_connect(airflow_environ, cfg, broker, connect):
    """The run's Params reach the task on Spark Connect as the same flags spark-submit gets.
    The pipeline's Kafka settings come from an Airflow connection of type kafka (SASL_SSL,
    SCRAM): every task logs in with it (the idle check; the epoch, whose Kafka read runs on
    the Connect server with the password file the task wrote; the group commit); the DAG's
    own brokers setting is unusable, and spark_default names a master nothing serves."""
    secure = cfg.replace(**broker.client_settings("SASL_SSL"))
    gen = TrafficGenerator(seed=32, events_per_second=50)
    produced = produce(secure.bootstrap_servers, cfg.topic, gen.records(300, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3, client_options=broker_io.client_options(secure))
    conf = json.dumps({"max_records_per_epoch": 90, "commit_offsets": True, "start_position": "specific",
                       "start_offsets": "1:40"})
    connection = {"conn_type": "kafka", "extra": {
        "bootstrap.servers": secure.bootstrap_servers, "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "ipcount", "sasl.password": BROKER_PASSWORD,
        "ssl.ca.location": secure.kafka_ssl_cafile}}
    dag_cfg = cfg.replace(spark_connect_connection="ipcount_connect", kafka_connection="ipcount_kafka",
                          bootstrap_servers="127.0.0.1:1", commit_offsets=False)
    env = {**_env(airflow_environ, dag_cfg), **connect_connection(connect), **NO_SPARK_MASTER,
           "AIRFLOW_CONN_IPCOUNT_KAFKA": json.dumps(connection)}
    proc = subprocess.run([str(Path(sys.executable).parent / "airflow"), "dags", "test", "ipcount_epoch", "-c", conf],
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "Spark-Submit cmd:" not in out
    assert "Kafka settings from connection 'ipcount_kafka'" in out and BROKER_PASSWORD not in out
    (ranges,) = epoch_ranges(cfg)
    assert ranges[1][0] == 40 and sum(u - f for f, u in ranges.values()) == 90
    assert counts(cfg) == expected_tables(produced, [ranges]).counts
    # commit_offsets: off in the pipeline's settings, on for this run (a Param).
    assert broker_io.group_offsets(secure) == {p: u for p, (f, u) in ranges.items()}


def test_invalid_run_params_are_refused_before_anything_runs(airflow_environ, cfg):
    proc = _airflow(airflow_environ, "dags", "test", "ipcount_epoch", "-c", json.dumps({"window_seconds": 0}), cfg=cfg)
    assert proc.returncode != 0
    assert "window_seconds" in proc.stdout + proc.stderr
    assert committed_epochs(cfg.ledger_path) == []


def _ledger_rows(cfg):
    from tests.tables import ledger
    return ledger(cfg) if Path(cfg.ledger_path).exists() else []


def test_backfill_dag_counts_a_range_once_and_refuses_bad_requests(airflow_environ, cfg, connect):
    from tests.tables import lanes

    # The backfill runs in its task on the Spark Connect server (no master for spark-submit).
    cfg = cfg.replace(spark_connect_connection="ipcount_connect")
    airflow_environ = {**airflow_environ, **connect_connection(connect), **NO_SPARK_MASTER}

    gen = TrafficGenerator(seed=33, events_per_second=50, malformed_share=0.03)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(300, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    conf = json.dumps({"offsets": "0:0-60,1:10-50", "max_records_per_epoch": 40})
    proc = _airflow(airflow_environ, "dags", "test", "ipcount_backfill", "-c", conf, cfg=cfg)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert "Spark-Submit cmd:" not in proc.stdout + proc.stderr
    rows = _ledger_rows(cfg)
    assert {r["kind"] for r in rows} == {"backfill"} and all(r["run_id"].startswith("manual__") for r in rows)
    assert len({r["epoch"] for r in rows}) == 3                   # 100 offsets at 40 per epoch
    (epochs,) = lanes(cfg).values()
    covered = Counter()
    for ranges in epochs:
        for p, (f, u) in ranges.items():
            covered[p] += u - f
    assert covered == {0: 60, 1: 40}
    assert counts(cfg) == expected_tables(produced, epochs).counts

    # The same request again: a reported no-op.
    proc = _airflow(airflow_environ, "dags", "test", "ipcount_backfill", "-c", conf, cfg=cfg)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert "skipping what the ledger already owns" in proc.stdout + proc.stderr
    assert len(_ledger_rows(cfg)) == len(rows)

    # A bad request fails in check_request, before Spark starts and before any write ...
    proc = _airflow(airflow_environ, "dags", "test", "ipcount_backfill", "-c", json.dumps({"offsets": "0:0-100000"}),
                    cfg=cfg)
    assert proc.returncode != 0 and "beyond the end of the log" in proc.stdout + proc.stderr, \
        (proc.stdout + proc.stderr)[-3000:]
    # ... and a target that is not a plain identifier is refused by the form's JSON schema.
    proc = _airflow(airflow_environ, "dags", "test", "ipcount_backfill", "-c",
                    json.dumps({"offsets": "0:0-10", "target": "../x"}), cfg=cfg)
    assert proc.returncode != 0 and "target" in proc.stdout + proc.stderr
    assert len(_ledger_rows(cfg)) == len(rows)
    assert not (Path(cfg.warehouse) / "replays").exists()


def test_dag_test_runs_the_epoch_in_its_task_on_a_spark_connect_server(airflow_environ, cfg, connect):
    # The task's Spark Connect session comes from the connection (its password: the server's
    # token). spark_default names a master nothing serves, so a spark-submit could not run.
    gen = TrafficGenerator(seed=37, events_per_second=50, malformed_share=0.03)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(300, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    # The task joins the pipeline's shared session (where a process of the pipeline left a
    # mark) and leaves it open for the next (the provider's operator would stop it).
    cfg = cfg.replace(spark_connect_connection="ipcount_connect")
    clear_of_half_hour_edge(300)
    shared = session_process(cfg.replace(**connect.settings()), set_mark="before the task")
    env = {**airflow_environ, **NO_SPARK_MASTER, **connect_connection(connect)}
    proc = _airflow(env, "dags", "test", "ipcount_epoch", cfg=cfg)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert connect.token() not in proc.stdout + proc.stderr
    joined = f"on Spark Connect session {shared['session_id']} (the pipeline's shared session)"
    assert joined in proc.stdout + proc.stderr
    assert session_process(cfg.replace(**connect.settings())) == {**shared, "mark": "before the task"}
    epochs = committed_epochs(cfg.ledger_path)
    assert len(epochs) == 1 and epochs[0].run_id.startswith("manual__") and epochs[0].records_read == len(produced)
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead


def _last_run_tasks(airflow_environ, dag_id: str = "ipcount_epoch") -> dict[str, tuple[str, int]]:
    """The last run's tasks: task id -> (state, tries)."""
    rows = metadata_rows(airflow_environ, "SELECT task_id, state, try_number FROM task_instance WHERE dag_id = :dag "
                         "AND run_id = (SELECT run_id FROM dag_run WHERE dag_id = :dag ORDER BY id DESC LIMIT 1)",
                         dag=dag_id)
    return {task: (state, tries) for task, state, tries in rows}


def test_a_permanent_error_fails_its_task_at_once_and_a_transient_one_is_retried(airflow_environ, cfg, connect):
    """Errors keep their type from the run to Airflow: a table set that counts 5 s windows
    refuses a run counting 10 s ones (TableSetMismatch), in the task's own process on Spark
    Connect and spark-submitted (exit code 2) alike, in one try; a Connect server that is
    not there is a service away, and the task is tried again (retries 2: three tries)."""
    gen = TrafficGenerator(seed=38, events_per_second=50)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(120, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    on_connect = cfg.replace(spark_connect_connection="ipcount_connect")
    connect_env = {**airflow_environ, **connect_connection(connect), **NO_SPARK_MASTER}
    proc = _airflow(connect_env, "dags", "test", "ipcount_epoch", cfg=on_connect)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    produce(cfg.bootstrap_servers, cfg.topic, gen.records(30, 1_795_255_300_000), partition_of=lambda i, r: i % 3)

    other_window = {"window_seconds": cfg.window_seconds * 2}
    for env, run_cfg, said in [(connect_env, on_connect.replace(**other_window), "TableSetMismatch: table set of"),
                               (airflow_environ, cfg.replace(**other_window), "exited with code 2")]:
        proc = _airflow(env, "dags", "test", "ipcount_epoch", cfg=run_cfg)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and said in out and "not retried" in out, out[-5000:]
        assert _last_run_tasks(airflow_environ)["run_epoch"] == ("failed", 1)

    nobody = {"AIRFLOW_CONN_IPCOUNT_CONNECT": json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1",
                                                           "port": free_port()})}
    proc = _airflow({**airflow_environ, **NO_SPARK_MASTER, **nobody}, "dags", "test", "ipcount_epoch", cfg=on_connect)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and out.count("no Spark Connect server answers at") >= 3, out[-5000:]
    assert _last_run_tasks(airflow_environ)["run_epoch"] == ("failed", 3)

    # None of it wrote anything: the tables hold the first epoch alone.
    assert [e.epoch for e in committed_epochs(cfg.ledger_path)] == [1]
    assert counts(cfg) == expected_tables(produced, epoch_ranges(cfg)).counts


def test_openlineage_events_name_the_datasets_of_the_assets(airflow_environ, cfg, connect, tmp_path):
    pytest.importorskip("airflow.providers.openlineage", reason="the optional provider: bin/setup --lineage")
    cfg = cfg.replace(spark_connect_connection="ipcount_connect", publish=True, publish_topic=f"sink_{cfg.topic}")
    gen = TrafficGenerator(seed=39, events_per_second=50)
    produce(cfg.bootstrap_servers, cfg.topic, gen.records(120, 1_795_255_200_000), partition_of=lambda i, r: i % 3)
    events = tmp_path / "openlineage.jsonl"
    transport = {"type": "file", "log_file_path": str(events), "append": True}
    env = {**airflow_environ, **NO_SPARK_MASTER, **connect_connection(connect),
           "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(transport), "AIRFLOW__OPENLINEAGE__NAMESPACE": "ipcount"}
    proc = _airflow(env, "dags", "test", "ipcount_epoch", cfg=cfg)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert len(committed_epochs(cfg.ledger_path)) == 1
    done = {}
    for line in events.read_text().splitlines():
        event = json.loads(line)
        if event["eventType"] == "COMPLETE" and event["job"]["name"].startswith("ipcount_epoch."):
            done[event["job"]["name"].split(".", 1)[1]] = [
                sorted([d["namespace"], d["name"]] for d in event.get(side) or []) for side in ("inputs", "outputs")]
    # The datasets as OpenLineage names them (Kafka: the first bootstrap server; files: the path)
    server = cfg.bootstrap_servers.split(",")[0]
    source, sink = [f"kafka://{server}", cfg.topic], [f"kafka://{server}", f"sink_{cfg.topic}"]
    counts_table = ["file", str(Path(cfg.warehouse) / "counts")]
    written = sorted(["file", str(Path(cfg.warehouse) / name)] for name in ("ledger", "dead_letters", "late_records"))
    # (the epoch writes the counts; publish_summary sends their Asset event)
    assert done == {"choose_path": [[], []], "run_epoch": [[source], sorted([counts_table, *written])],
                    "commit_offsets": [[], []], "publish_counts": [[counts_table], [sink]],
                    "publish_summary": [[], [counts_table]]}, done


def test_backfill_form_checks_say_what_to_fix(cfg):
    """check_request's logic in-process (the DAG test above runs it for real once)."""
    from ipcount.orchestration.dags import check_backfill_request
    from ipcount.rules.errors import BadRequestError

    produce(cfg.bootstrap_servers, cfg.topic, TrafficGenerator(seed=34).records(30, 1_795_255_200_000),
            partition_of=lambda i, r: i % 3)
    for bad, message in [({"offsets": "0:0-10", "from_time": "2026-11-20T00:00:00Z"}, "not both"),
                         ({"target": "main"}, "give offsets"),
                         ({"from_time": "2026-11-20T00:00:00Z"}, "give offsets"),
                         ({"offsets": "5:0-1"}, "has no partition 5"),
                         ({"offsets": "0:3-2"}, "must be greater"),
                         ({"from_time": "2026-11-20T01:00:00Z", "until_time": "2026-11-20T00:00:00Z"}, "must be after")]:
        with pytest.raises(BadRequestError, match=message):
            check_backfill_request(cfg, bad)
    ok = check_backfill_request(cfg, {"offsets": "0:0-10", "target": "audit"})
    assert ok["target"] == "audit" and ok["ranges"] == [f"{cfg.topic}-0[0,10)"]
    assert not Path(cfg.warehouse).exists()


def test_the_postgres_command_serves_airflow_commands(tmp_path_factory):
    """`bin/lab postgres start`, then `bin/lab airflow --database postgres ...` on it."""
    import shutil
    import tempfile

    from ipcount_lab.embedded_postgres import EmbeddedPostgres

    state = Path(tempfile.mkdtemp(prefix="ipcount-pg-cli-"))  # under /tmp: reachable by the OS user postgres
    where = ["--port", str(free_port()), "--state-dir", str(state)]
    cli = lambda *args: subprocess.run([sys.executable, "-m", "ipcount_lab.cli", *args], capture_output=True,  # noqa: E731
                                       text=True, timeout=300)
    try:
        assert cli("postgres", "status", *where).returncode != 0
        started = cli("postgres", "start", *where)
        assert started.returncode == 0, started.stderr[-3000:]
        assert cli("postgres", "start", *where).returncode == 0          # idempotent
        assert cli("postgres", "status", *where).returncode == 0
        home = tmp_path_factory.mktemp("airflow_pg")
        db = ["airflow", "--airflow-home", str(home), "--database", "postgres", "--postgres-port", where[1],
              "--postgres-state-dir", str(state)]
        for command in (["db", "migrate"], ["db", "check"]):
            proc = cli(*db, *command)
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        # Airflow's tables are in PostgreSQL, not in a SQLite file in the home.
        server = EmbeddedPostgres(state_dir=state, port=int(where[1]))
        rows = metadata_rows({"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": server.sqlalchemy_url()},
                             "SELECT count(*) FROM information_schema.tables WHERE table_name = 'dag_run'")
        assert rows == [(1,)] and not (home / "airflow.db").exists()
        assert (state / "password").stat().st_mode & 0o077 == 0
    finally:
        cli("postgres", "stop", *where)
        shutil.rmtree(state, ignore_errors=True)
    assert cli("postgres", "status", *where).returncode != 0


def test_check_freshness_fails_the_run_when_the_chain_lags(airflow_environ, cfg, connect):
    # Each epoch counts at most 100 offsets: of 300 records, a run leaves 200 waiting.
    cfg = cfg.replace(spark_connect_connection="ipcount_connect", max_records_per_epoch=100,
                      alert_lag_records=150, alert_stale_seconds=3600)
    gen = TrafficGenerator(seed=38, events_per_second=50)
    produce(cfg.bootstrap_servers, cfg.topic, gen.records(300, 1_795_255_200_000), partition_of=lambda i, r: i % 3)
    env = {**airflow_environ, **NO_SPARK_MASTER, **connect_connection(connect)}
    proc = _airflow(env, "dags", "test", "ipcount_epoch", cfg=cfg)
    out = proc.stdout + proc.stderr
    (counted,) = epoch_ranges(cfg)
    waiting = sum(end - counted.get(p, (0, 0))[1] for p, end in broker_io.partition_offsets(cfg)[1].items())
    assert waiting == 200, (counted, waiting)
    assert "the pipeline is falling behind: 200 records wait past the chain, over alert_lag_records 150" in out, \
        out[-5000:]
    assert "check_freshness" in out and proc.returncode != 0, (proc.returncode, out[-3000:])
    # Under the threshold the check passes, and the run with it.
    proc = _airflow(env, "dags", "test", "ipcount_epoch", cfg=cfg.replace(alert_lag_records=1000))
    assert proc.returncode == 0 and "the chain keeps up" in proc.stdout + proc.stderr, \
        (proc.stdout + proc.stderr)[-3000:]
    assert len(epoch_ranges(cfg)) == 2
