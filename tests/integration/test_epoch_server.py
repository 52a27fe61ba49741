"""The epoch server: epochs run in one warm session, through the same CLI code as spark-submit,
count exactly once (also when the server dies mid-epoch), and bad requests leave it serving."""
from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ipcount.devtools.generator import TrafficGenerator, produce
from ipcount.rules.ledger import summaries_in
from ipcount.server import client
from ipcount.server.auth import read_token
from tests.conftest import free_port, run_until_idle
from tests.ground_truth import expected_tables
from tests.tables import counts, dead_letters, epoch_ranges, late_records, ledger


def _epoch(cfg, *extra):
    """An epoch request for ``cfg`` (a pipeline the server serves), with its token."""
    lines = []
    result = client.submit(cfg.epoch_server, ["epoch", *cfg.to_args(), "--summary-json", *extra],
                           read_token(cfg.epoch_server_token_path), on_log=lines.append)
    return result, summaries_in(result["stdout"]), lines


def test_epochs_in_the_server_chain_and_count_exactly_once(epoch_server, cfg):
    cfg = epoch_server.serve(cfg)
    gen = TrafficGenerator(seed=41, events_per_second=40, malformed_share=0.03)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(600, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    cfg = cfg.replace(max_records_per_epoch=250)

    # One request, up to five epochs: 600 records in epochs of at most 250, then nothing new.
    result, summaries, lines = _epoch(cfg, "--epochs", "5")
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
    result, summaries, _ = _epoch(cfg)
    assert result["exit_code"] == 0 and summaries[0].epoch == 4 and summaries[0].records_read == 90
    ranges = epoch_ranges(cfg)
    for before, after in zip(ranges, ranges[1:]):
        assert all(after[p][0] == before[p][1] for p in after)
    assert counts(cfg) == expected_tables(produced + more, ranges).counts


def test_a_command_past_its_limit_is_cancelled_and_its_epoch_finished_after(epoch_server, cfg):
    cfg = epoch_server.serve(cfg)
    gen = TrafficGenerator(seed=44, events_per_second=40, malformed_share=0.03)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(300, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    lines = []
    cut = client.submit(epoch_server.url, ["epoch", *cfg.to_args()], epoch_server.token, on_log=lines.append,
                        limit_seconds=1.0)
    assert cut["exit_code"] != 0, lines
    assert "its time limit" in cut["error"]
    assert client.health(epoch_server.url)["busy"] is False  # the server is free again

    # The cancelled epoch (if it got as far as its plan) is finished from the ledger.
    result, summaries, lines = _epoch(cfg, "--epochs", "3")
    assert result["exit_code"] == 0, lines
    assert sum(s.records_read for s in summaries) == 300
    expected = expected_tables(produced, epoch_ranges(cfg))
    assert counts(cfg) == expected.counts and dead_letters(cfg) == expected.dead


def test_bad_requests_are_refused_and_the_server_keeps_serving(epoch_server, cfg, tmp_path):
    cfg = epoch_server.serve(cfg)
    url, token = epoch_server.url, epoch_server.token
    result, _, lines = _epoch(cfg, "--max-records-per-epoch", "0")
    assert result["exit_code"] == 2 and any("max_records_per_epoch must be an integer >= 1" in x for x in lines)
    result = client.submit(url, ["epoch", "--no-such-flag"], token, on_log=lines.append)
    assert result["exit_code"] == 2 and "unrecognized arguments: --no-such-flag" in result["error"]
    result = client.submit(url, ["verify", *cfg.to_args()], token, on_log=lines.append)
    assert result["exit_code"] == 2 and "runs epoch, backfill, rebuild" in result["error"]

    # The server's pipelines are its own: a request may not point one at other tables,
    # brokers or topics, make up a pipeline, or bring a config file.
    for flags, refused in [(["--ledger-table", str(tmp_path / "x")], "--ledger-table"),
                           (["--ledger-t", str(tmp_path / "x")], "--ledger-table"),  # argparse's abbreviation
                           (["--topic", "no_such_topic_here"], "--topic"),
                           (["--bootstrap-servers", "10.9.9.9:9092"], "--bootstrap-servers"),
                           (["--pipeline-id", "made_up"], "serves no pipeline 'made_up'"),
                           (["--config", "/etc/passwd"], "--config: the epoch server runs with its own"),
                           (["--epochs", "100000"], "--epochs: at most 1000")]:
        result = client.submit(url, ["epoch", *cfg.to_args(), *flags], token, on_log=lines.append)
        assert result["exit_code"] == 2 and refused in result["error"], (flags, result)
    assert "root:" not in str(result) + "".join(lines)

    def post(body: bytes, **headers):
        request = urllib.request.Request(url + "/run", data=body, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {token}", **headers})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        return refused.value.code

    good = json.dumps({"args": ["epoch", *cfg.to_args()]}).encode()
    assert post(b"{not json") == 400
    assert post(good, Authorization="") == 401
    assert post(good, Authorization="Bearer " + "x" * 43) == 401
    with pytest.raises(client.EpochServerError, match="HTTP 401"):
        client.submit(url, ["epoch", *cfg.to_args()], "not-the-token")
    # A web page's cross-site POST: text/plain needs no preflight, and carries an Origin.
    assert post(good, **{"Content-Type": "text/plain"}) == 415
    assert post(good, Origin="http://evil.example") == 403
    # Too large: refused on its Content-Length, before a byte of it is read.
    connection = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=30)
    connection.putrequest("POST", "/run")
    for name, value in {"Content-Type": "application/json", "Authorization": f"Bearer {token}",
                        "Content-Length": "300000"}.items():
        connection.putheader(name, value)
    connection.endheaders()
    assert connection.getresponse().status == 413
    connection.close()
    assert not Path(cfg.ledger_path).exists() or ledger(cfg) == []  # none of the above recorded an epoch
    assert client.health(url)["status"] == "ok"


def test_a_server_killed_mid_epoch_leaves_an_epoch_the_next_run_finishes(broker, cfg, spark, tmp_path):
    """SIGKILL after the sink commit, before the ledger commit (the crash test's hook, in
    the server's process): the client hears that the server broke off, and the next run
    finishes the epoch with its recorded range - the tables equal a run that never crashed."""
    produced = produce(cfg.bootstrap_servers, cfg.topic,
                       TrafficGenerator(seed=43, events_per_second=40).records(300, 1_795_255_200_000),
                       partition_of=lambda i, r: i % 3)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = cfg.replace(epoch_server=url, epoch_server_token_file=str(tmp_path / "token"))
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ipcount.cli", "serve", "--no-warm-up", "--port", str(port),
                                 *cfg.to_args()], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "IPCOUNT_CRASH_AT": "after_sink"})
    try:
        client.wait_until_ready(url, proc, tmp_path / "server.log")
        with pytest.raises(client.EpochServerError, match="closed the connection|Connection"):
            _epoch(cfg)
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
    cfg = cfg.replace(epoch_server_token_file=str(tmp_path / "token"))
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
