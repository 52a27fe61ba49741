"""The epoch job on a Spark standalone cluster (a master and two workers from the pinned
pyspark, started by the project's own module), with the tables on S3: the same commands,
one setting changed. A crash, a backfill beside the chain and the resumed epoch give the
ground truth."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ipcount.storage.ledger import committed_epochs
from ipcount_lab.embedded_airflow import airflow_env
from ipcount_lab.embedded_connect import EmbeddedSparkConnect
from ipcount_lab.embedded_spark import EmbeddedSparkCluster, cluster_env
from ipcount_lab.generator import TrafficGenerator, produce
from tests.conftest import connect_connection, free_port
from tests.ground_truth import expected_tables
from tests.integration.test_backfill import assert_tables_match, ends_of, produce_dataset
from tests.tables import counts, dead_letters, epoch_ranges, lanes, ledger


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory, object_store):
    """Started and stopped with the command users have: ``bin/lab spark-cluster``; its workers
    reach the object store (executors write large epochs' files into the tables there)."""
    cluster = EmbeddedSparkCluster(state_dir=tmp_path_factory.mktemp("spark_cluster"), port=free_port(),
                                   webui_port=free_port())
    where = ["--port", str(cluster.port), "--webui-port", str(cluster.webui_port), "--state-dir",
             str(cluster.state_dir)]
    started = subprocess.run([sys.executable, "-m", "ipcount_lab.cli", "spark-cluster", "start", *where],
                             env={**os.environ, **object_store.environment()}, capture_output=True, text=True,
                             timeout=300)
    assert started.returncode == 0, started.stderr[-3000:]
    assert f'IPCOUNT_SPARK_MASTER="{cluster.master_url}"' in started.stdout
    yield cluster
    subprocess.run([sys.executable, "-m", "ipcount_lab.cli", "spark-cluster", "stop", *where], timeout=120)
    assert cluster.alive_workers() == 0


def cli(cfg, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **cluster_env(), **({"IPCOUNT_CRASH_AT": crash_at} if crash_at else {})}
    return subprocess.run([sys.executable, "-m", "ipcount.cli", *args, *cfg.to_args()], env=env,
                          capture_output=True, text=True, timeout=600)


def applications(cluster) -> list[dict]:
    with urllib.request.urlopen(cluster.webui_url + "/json", timeout=5) as answer:
        state = json.load(answer)
    return state.get("activeapps", []) + state.get("completedapps", [])


def test_a_crash_a_backfill_and_the_resumed_epoch_on_a_cluster(s3_cfg, spark_cluster):
    cfg = s3_cfg.replace(spark_master=spark_cluster.master_url, max_records_per_epoch=600)
    produced = produce_dataset(cfg, 1200, seed=81)

    crashed = cli(cfg, "epoch", crash_at="after_sink")     # killed between its sink and ledger commits
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    planned = {r["partition"]: r["until_offset"] for r in ledger(cfg)}
    assert {r["status"] for r in ledger(cfg)} == {"planned"}

    rest = ",".join(f"{p}:{planned[p]}-{end}" for p, end in sorted(ends_of(produced).items()))
    backfill = cli(cfg, "backfill", "--offsets", rest)       # the offsets after epoch 1's, as another lane;
    assert backfill.returncode == 0, backfill.stderr[-3000:]  # before its chunk's writes it finishes epoch 1
    assert "the chain's epoch 1 is unfinished; finishing it first with its recorded ranges" in backfill.stderr

    after = cli(cfg, "epoch")                                # the chain's next run finds nothing left
    assert after.returncode == 0, after.stderr[-3000:]
    assert "no new records" in after.stdout, after.stdout

    assert {r["status"] for r in ledger(cfg)} == {"committed"}
    kinds = lanes(cfg)
    assert "scheduled" in kinds and len(kinds) == 2, list(kinds)     # the chain and the backfill's lane
    assert_tables_match(cfg, produced)
    # every run was an application of the cluster, its executors on the workers
    apps = applications(spark_cluster)
    assert len(apps) == 3 and all(a["cores"] >= 1 for a in apps), apps


# Runs the epoch command and, as it exits, prints its Python process's own peak resident
# memory (VmHWM: getrusage's ru_maxrss would report this test process's size, which Linux
# carries over the exec).
PEAK_MEMORY = ("import atexit, runpy, sys; from ipcount_lab.bench_rounds import python_peak_rss_mb; "
               "atexit.register(lambda: print('python-peak-rss-mb', python_peak_rss_mb(), file=sys.stderr)); "
               "sys.argv[0] = 'ipcount'; runpy.run_module('ipcount.cli', run_name='__main__')")


def test_epochs_of_a_client_per_record_on_the_cluster_with_the_driver_and_task_capped(s3_cfg, spark_cluster):
    """Every record from a client of its own: the tally has a row per record. Three such
    epochs in one long-lived session on the cluster, the Spark driver's heap capped at
    512 MB and the task's Python process staying under 512 MB: the executors write the rows
    into the tables on S3, and the tables equal the ground truth."""
    cfg = s3_cfg.replace(spark_master=spark_cluster.master_url, max_records_per_epoch=20_000,
                         max_driver_tally_rows=5_000)
    gen = TrafficGenerator(seed=85, events_per_second=2_000, malformed_share=0.01, late_share=0.01,
                           distinct_clients=True)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(60_000, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    env = {**os.environ, **cluster_env(), "SPARK_DRIVER_MEMORY": "512m"}
    proc = subprocess.run([sys.executable, "-c", PEAK_MEMORY, "epoch", "--epochs", "10", *cfg.to_args()], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert proc.stderr.count("Spark's executors write them") == 3, proc.stderr[-5000:]
    peak_mb = float(proc.stderr.rsplit("python-peak-rss-mb", 1)[1].split()[0])
    assert 50 < peak_mb < 512, peak_mb
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert len(expected.counts) > 55_000                      # about a row per record
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead


@pytest.mark.airflow
def test_the_dags_epoch_task_runs_on_a_connect_server_in_front_of_the_cluster(cfg, spark_cluster,
                                                                             tmp_path_factory):
    """The DAG's Spark task through a ``spark_connect`` connection, the server's sessions on
    the cluster (after the test above: an application holds the workers' cores while it runs).
    spark_default names a master nothing serves, so a spark-submit could not run."""
    gen = TrafficGenerator(seed=83, events_per_second=50, malformed_share=0.03)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(400, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    server = EmbeddedSparkConnect(state_dir=tmp_path_factory.mktemp("connect-on-cluster"), port=free_port(),
                                  master=spark_cluster.master_url, cores=2)
    env = {**airflow_env(tmp_path_factory.mktemp("airflow-on-cluster"), api_port=free_port()),
           **cfg.replace(spark_connect_connection="ipcount_connect").to_env(), **connect_connection(server),
           "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "spark://127.0.0.1:1"})}
    airflow = str(Path(sys.executable).parent / "airflow")
    migrated = subprocess.run([airflow, "db", "migrate"], env=env, capture_output=True, text=True, timeout=600)
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    server.start()
    try:
        proc = subprocess.run([airflow, "dags", "test", "ipcount_epoch"], env=env, capture_output=True, text=True,
                              timeout=600)
    finally:
        server.stop()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    epochs = committed_epochs(cfg.ledger_path)
    assert len(epochs) == 1 and epochs[0].run_id.startswith("manual__") and epochs[0].records_read == len(produced)
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead
    ran = [a for a in applications(spark_cluster) if a["name"] == "ipcount-connect"]
    assert len(ran) == 1 and ran[0]["cores"] >= 1, applications(spark_cluster)
