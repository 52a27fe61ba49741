"""The epoch server: epochs run in one warm session, through the same CLI code as spark-submit,
count exactly once (also when the server dies mid-epoch), and bad requests leave it serving."""
from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from ipcount.devtools.generator import TrafficGenerator, produce
from ipcount.rules.ledger import summaries_in
from ipcount.server import client
from tests.conftest import free_port, run_until_idle
from tests.ground_truth import expected_tables
from tests.tables import counts, dead_letters, epoch_ranges, late_records, ledger


def _epoch(url, cfg, *extra):
    lines = []
    result = client.submit(url, ["epoch", *cfg.to_args(), "--summary-json", *extra], on_log=lines.append)
    return result, summaries_in(result["stdout"]), lines


def test_epochs_in_the_server_chain_and_count_exactly_once(epoch_server, cfg):
    gen = TrafficGenerator(seed=41, events_per_second=40, malformed_share=0.03)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(600, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    cfg = cfg.replace(max_records_per_epoch=250)

    # One request, up to five epochs: 600 records in epochs of at most 250, then nothing new.
    result, summaries, lines = _epoch(epoch_server, cfg, "--epochs", "5")
    assert result["exit_code"] == 0, lines
    assert [s.epoch for s in summaries] == [1, 2, 3, None]
    assert [s.records_read for s in summaries] == [250, 250, 100, 0]
    assert any("planned epoch 2" in line for line in lines)  # the log came back with the result

    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead
    assert late_records(cfg) == expected.late

    # More records: the next request continues the chain where it ended.
    more = produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, 1_795_255_260_000),
                   partition_of=lambda i, r: i % 3)
    result, summaries, _ = _epoch(epoch_server, cfg)
    assert result["exit_code"] == 0 and summaries[0].epoch == 4 and summaries[0].records_read == 90
    ranges = epoch_ranges(cfg)
    for before, after in zip(ranges, ranges[1:]):
        assert all(after[p][0] == before[p][1] for p in after)
    assert counts(cfg) == expected_tables(produced + more, ranges).counts


def test_a_command_past_its_limit_is_cancelled_and_its_epoch_finished_after(epoch_server, cfg):
    gen = TrafficGenerator(seed=44, events_per_second=40, malformed_share=0.03)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(300, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    lines = []
    cut = client.submit(epoch_server, ["epoch", *cfg.to_args()], on_log=lines.append, limit_seconds=1.0)
    assert cut["exit_code"] != 0, lines
    assert "its time limit" in cut["error"]
    assert client.health(epoch_server)["busy"] is False  # the server is free again

    # The cancelled epoch (if it got as far as its plan) is finished from the ledger.
    result, summaries, lines = _epoch(epoch_server, cfg, "--epochs", "3")
    assert result["exit_code"] == 0, lines
    assert sum(s.records_read for s in summaries) == 300
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead


def test_bad_requests_are_refused_and_the_server_keeps_serving(epoch_server, cfg):
    result, _, lines = _epoch(epoch_server, cfg, "--max-records-per-epoch", "0")
    assert result["exit_code"] == 2 and any("max_records_per_epoch must be an integer >= 1" in x for x in lines)
    result = client.submit(epoch_server, ["epoch", "--no-such-flag"], on_log=lines.append)
    assert result["exit_code"] == 2 and any("unrecognized arguments: --no-such-flag" in x for x in lines)
    result = client.submit(epoch_server, ["verify", *cfg.to_args()], on_log=lines.append)
    assert result["exit_code"] == 2 and "runs epoch, backfill, rebuild" in result["error"]
    result, _, lines = _epoch(epoch_server, cfg.replace(topic="no_such_topic_here"))
    assert result["exit_code"] == 4 and any("no_such_topic_here" in x for x in lines)

    request = urllib.request.Request(epoch_server + "/run", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400 and "expected" in refused.value.read().decode()
    assert ledger(cfg) == []  # none of the above recorded an epoch
    assert client.health(epoch_server)["status"] == "ok"


def test_a_server_killed_mid_epoch_leaves_an_epoch_the_next_run_finishes(broker, cfg, spark, tmp_path):
    """SIGKILL after the sink commit, before the ledger commit (the crash test's hook, in
    the server's process): the client hears that the server broke off, and the next run
    finishes the epoch with its recorded range - the tables equal a run that never crashed."""
    produced = produce(cfg.bootstrap_servers, cfg.topic,
                       TrafficGenerator(seed=43, events_per_second=40).records(300, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ipcount.cli", "serve", "--no-warm-up", "--port", str(port),
                                 *cfg.to_args()], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "IPCOUNT_CRASH_AT": "after_sink"})
    try:
        client.wait_until_ready(url, proc, tmp_path / "server.log")
        with pytest.raises(client.EpochServerError, match="closed the connection|Connection"):
            _epoch(url, cfg)
        assert proc.wait(timeout=60) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
    assert {(r["epoch"], r["status"]) for r in ledger(cfg)} == {(1, "planned")}  # written ahead, not committed
    (summary,) = run_until_idle(cfg, spark)
    assert summary.resumed and summary.epoch == 1 and summary.records_read == 300
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead


def test_a_server_whose_jvm_dies_stops_instead_of_answering(broker, cfg, tmp_path):
    """Health checks must not find a server that can run nothing: the DAG's task then
    spark-submits instead."""
    import psutil

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ipcount.cli", "serve", "--no-warm-up", "--port", str(port),
                                 *cfg.to_args()], stdout=log, stderr=subprocess.STDOUT)
    try:
        client.wait_until_ready(url, proc, log_path)
        (jvm,) = [p for p in psutil.Process(proc.pid).children(recursive=True) if "java" in p.name()]
        jvm.kill()
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    assert client.health(url, timeout=1.0) is None
    assert "the Spark driver's JVM is gone" in log_path.read_text()
