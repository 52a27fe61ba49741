"""Tables on object storage: s3proxy, a real S3-compatible server, started by the project's
own module. Epochs and a crash count exactly there; racing commits from separate processes
land once; and against a store that ignores conditional writes the same race loses
commits - the guard every commit rests on, shown to matter."""
from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ipcount.jobs import idle
from ipcount.jobs.rebuild import rebuild
from ipcount.jobs.verify import verify
from ipcount.orchestration.monitor.data import PipelineTables
from ipcount.rules.config import COMMAND_SETTINGS
from ipcount.rules.requests import MAIN_TARGET
from ipcount.storage.delta import DeltaReader
from ipcount.storage.tableset import replay_targets
from ipcount_lab.generator import TrafficGenerator, produce
from ipcount_lab.lossy_proxy import pass_on, reply
from tests.conftest import free_port, run_until_idle
from tests.ground_truth import expected_tables
from tests.tables import counts, dead_letters, epoch_ranges, finality, late_records, ledger

BASE_MS = 1_795_255_200_000
ROUNDS = 20


def test_epochs_and_a_crash_on_object_storage_count_exactly(s3_cfg, spark, object_store):
    cfg = s3_cfg.replace(max_records_per_epoch=400)
    gen = TrafficGenerator(seed=71, events_per_second=50, late_share=0.04, malformed_share=0.03)
    produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(1000, BASE_MS), partition_of=lambda i, r: i % 3)
    # The first epoch is killed after its sink commits, before its ledger commit.
    proc = subprocess.run([sys.executable, "-m", "ipcount.cli", "epoch", *cfg.to_args()],
                          env={**os.environ, "IPCOUNT_CRASH_AT": "after_sink"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert {r["status"] for r in ledger(cfg)} == {"planned"}

    summaries = run_until_idle(cfg, spark)
    assert summaries[0].resumed and summaries[0].epoch == 1
    ranges = epoch_ranges(cfg)
    assert len(ranges) >= 3
    expected = expected_tables(produced, ranges)
    assert counts(cfg) == expected.counts
    assert dead_letters(cfg) == expected.dead and expected.dead
    assert late_records(cfg) == expected.late and expected.late
    assert finality(cfg) == {key: key[0] + 10_000 <= expected.watermark_ms for key in expected.counts}
    # what reads the tables reads them there: verify, the idle check, the monitor's queries
    assert verify(cfg).ok
    watched = subprocess.run([sys.executable, "-m", "ipcount.cli", "watch", "--from-start", "--epochs",
                              str(len(ranges)), "--timeout", "60", *cfg.to_args(COMMAND_SETTINGS["watch"])],
                             capture_output=True, text=True, timeout=120)   # the AWS variables come along
    assert watched.returncode == 0, watched.stderr[-3000:]
    assert [line.split(" committed")[0] for line in watched.stdout.splitlines()[1:]] == \
        [f"epoch {n}" for n in range(1, len(ranges) + 1)]
    verdict = idle.check(cfg)
    assert not verdict.run and verdict.why.startswith("nothing new"), verdict
    tables = PipelineTables(cfg, DeltaReader())
    assert [e.epoch for e in tables.newest_epochs(len(ranges) + 5)] == list(range(len(ranges), 0, -1))
    assert tables.epoch_count(("scheduled", "backfill")) == len(ranges)
    assert tables.latest_window_end().timestamp() * 1000 == max(w for w, _ in expected.counts) + 5_000
    assert replay_targets(cfg) == [MAIN_TARGET]
    rebuild(cfg, spark, into="audit")          # a replay table set there: the monitor lists it
    assert replay_targets(cfg) == [MAIN_TARGET, "audit"]
    # the tables are objects in the store's bucket, not files under a local warehouse
    stored = object_store.state_dir / "data" / object_store.bucket / cfg.topic / "warehouse"
    assert {p.name for p in stored.iterdir()} == {"counts", "ledger", "dead_letters", "late_records", "replays"}


# -- racing commits ------------------------------------------------------------------------

def commit_from_snapshots(path: str, racer: int, rounds: int, loaded, done, results) -> None:
    """Each round: load the table, wait for the other racer, append as the snapshot's next
    version with no retry (the step every commit of the pipeline takes), report."""
    import pyarrow as pa
    from deltalake import CommitProperties, DeltaTable, write_deltalake
    from deltalake.exceptions import CommitFailedError

    for r in range(rounds):
        table = DeltaTable(path)
        loaded.wait()
        try:
            write_deltalake(table, pa.table({"racer": [racer]}), mode="append",
                            commit_properties=CommitProperties(max_commit_retries=0))
            results.put((r, True))
        except CommitFailedError:
            results.put((r, False))
        done.wait()


def race(path: str, rounds: int) -> tuple[int, int, int]:
    """Two processes commit from the same snapshot, ``rounds`` times: (rounds with exactly
    one winner, commits reported made, rows in the table)."""
    import pyarrow as pa
    from deltalake import DeltaTable

    from ipcount.storage.delta import read_rows

    DeltaTable.create(path, schema=pa.schema([("racer", pa.int64())]))
    ctx = multiprocessing.get_context("spawn")
    loaded, done, results = ctx.Barrier(2), ctx.Barrier(2), ctx.Queue()
    racers = [ctx.Process(target=commit_from_snapshots, args=(path, i, rounds, loaded, done, results)) for i in (0, 1)]
    for p in racers:
        p.start()
    won = [results.get(timeout=120) for _ in range(2 * rounds)]
    for p in racers:
        p.join(60)
    assert [p.exitcode for p in racers] == [0, 0]
    winners = Counter(r for r, ok in won if ok)
    return sum(winners[r] == 1 for r in range(rounds)), sum(winners.values()), len(read_rows(path))


class IgnoresConditionalWrites(BaseHTTPRequestHandler):
    """Passes requests on to ``upstream`` without their If-None-Match / If-Match headers: an
    S3-compatible store that does not support conditional writes, or a log store that does
    not ask for them (delta-spark's S3SingleDriverLogStore between two JVMs)."""
    protocol_version = "HTTP/1.1"
    upstream = 0

    def log_message(self, *args) -> None:
        pass

    def forward(self) -> None:
        reply(self, *pass_on(self, self.upstream, drop=("if-none-match", "if-match")))

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward


def serve_ignoring_conditions(port: int, upstream: int) -> None:
    IgnoresConditionalWrites.upstream = upstream
    ThreadingHTTPServer(("127.0.0.1", port), IgnoresConditionalWrites).serve_forever()


def test_racing_commits_land_once_and_a_store_without_conditional_writes_loses_them(object_store, monkeypatch,
                                                                                       tmp_path):
    from ipcount_lab.embedded_s3 import EmbeddedS3

    for name, value in object_store.environment().items():
        monkeypatch.setenv(name, value)
    one_winner, reported, rows = race(object_store.uri("races", "safe"), rounds=ROUNDS)
    assert (one_winner, reported, rows) == (ROUNDS, ROUNDS, ROUNDS)

    # The same race against a store that drops the conditions. (Signatures cover the
    # condition headers, so this store checks none: the proxy could not forward them otherwise.)
    unsigned = EmbeddedS3(state_dir=tmp_path / "unsigned", port=free_port(), authorization=False)
    unsigned.start()
    # In a process of its own: delta-rs calls hold this one's interpreter while they wait.
    port = free_port()
    proxy = multiprocessing.get_context("spawn").Process(target=serve_ignoring_conditions, args=(port, unsigned.port),
                                                        daemon=True)
    proxy.start()
    try:
        direct = race(unsigned.uri("races", "direct"), rounds=ROUNDS)
        socket.create_connection(("127.0.0.1", port), timeout=10).close()  # the proxy is up
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        one_winner, reported, rows = race(unsigned.uri("races", "naive"), rounds=ROUNDS)
    finally:
        proxy.kill()
        unsigned.stop()
    assert direct == (ROUNDS, ROUNDS, ROUNDS)                 # the unsigned store itself keeps the guard
    assert reported > rows                     # naive: commits reported made and then lost
    assert one_winner < ROUNDS
    print(f"naive store: {reported} commits reported, {rows} in the table")


def test_four_processes_appending_one_epoch_on_object_storage_land_it_once(object_store, monkeypatch):
    from tests.integration.test_side_table_appends import race_appends

    for name, value in object_store.environment().items():
        monkeypatch.setenv(name, value)
    race_appends(object_store.uri("races", "appends"))


def test_the_s3_command_starts_a_store_the_pipeline_can_use(tmp_path):
    port = free_port()
    where = ["--port", str(port), "--state-dir", str(tmp_path / "s3")]

    def s3(action: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ipcount_lab.cli", "s3", action, *where], capture_output=True,
                              text=True, timeout=120)
    started = s3("start")
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        assert s3("status").returncode == 0
        # its lines, run by a shell, point delta-rs at it
        script = started.stdout + '\nexec "$0" -c "from ipcount.storage.delta import rs_create_table, has_table; ' \
            'from ipcount.storage.ledger import ledger_schema; import os; w = os.environ[\'IPCOUNT_WAREHOUSE\']; ' \
            'rs_create_table(w + \'/ledger\', ledger_schema()); print(has_table(w + \'/ledger\'))"'
        made = subprocess.run(["bash", "-c", script, sys.executable], capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")})
        assert made.stdout.strip() == "True", made.stderr[-3000:]
        assert (tmp_path / "s3" / "data" / "ipcount" / "warehouse" / "ledger" / "_delta_log").is_dir()
    finally:
        s3("stop")
    assert s3("status").returncode == 1


def test_the_compose_object_store_takes_one_commit_per_version(tmp_path):
    """docker-compose.yml's s3 service, its command run here (its port and paths moved onto this
    machine), with the pipeline's AWS settings from the same file: delta-rs commits there, and
    of two commits of one version the store takes one."""
    import time
    import urllib.error
    import urllib.request

    import pyarrow as pa
    import yaml
    from deltalake import CommitProperties, DeltaTable, write_deltalake
    from deltalake.exceptions import CommitFailedError

    from ipcount.rules.config import REPO_ROOT

    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    port, secret = free_port(), f"compose-{os.getpid()}-{free_port()}"
    command = (compose["services"]["s3"]["command"][-1].replace("$$", "$").replace("--port 9000", f"--port {port}")
               .replace("/data/s3", str(tmp_path / "s3")))
    (tmp_path / "s3").mkdir()
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])  # `python`: this venv's
    with open(tmp_path / "s3.log", "w") as log:
        store = subprocess.Popen(["bash", "-c", command], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "S3_SECRET": secret, "PATH": path}, start_new_session=True)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
            except urllib.error.HTTPError:
                break                                  # refused unsigned: it answers
            except OSError:
                assert store.poll() is None, (tmp_path / "s3.log").read_text()[-3000:]
                time.sleep(0.2)
        else:
            raise AssertionError("the compose s3 command did not answer: " + (tmp_path / "s3.log").read_text()[-3000:])
        env = compose["x-ipcount-env"]
        options = {**{k: v for k, v in env.items() if k.startswith("AWS_")},
                   "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_SECRET_ACCESS_KEY": secret}
        path = env["IPCOUNT_WAREHOUSE"] + "/probe"
        write_deltalake(path, pa.table({"n": [0]}), storage_options=options)
        first, second = (DeltaTable(path, storage_options=options) for _ in range(2))   # one snapshot, twice
        no_retry = CommitProperties(max_commit_retries=0)
        write_deltalake(first, pa.table({"n": [1]}), mode="append", commit_properties=no_retry)
        with pytest.raises(CommitFailedError):
            write_deltalake(second, pa.table({"n": [2]}), mode="append", commit_properties=no_retry)
        assert sorted(DeltaTable(path, storage_options=options).to_pyarrow_table()["n"].to_pylist()) == [0, 1]
    finally:
        store.terminate()                      # as docker stops a container: SIGTERM to its main process
        assert store.wait(timeout=60) == 0, (tmp_path / "s3.log").read_text()[-3000:]


def test_commits_whose_answers_were_lost_are_counted_exactly_once(cfg, spark, monkeypatch, tmp_path):
    """Every third commit the store takes never gets its answer back (the connection closes
    instead), so the client tries again and is told the commit exists, or gives up. Each
    writer - table creation, the manifest, plans, sink commits, ledger commits - must find
    its own commit there and go on, never take it for another's or make it twice."""
    from ipcount.jobs.backfill import run_backfill
    from ipcount.rules.requests import BackfillRequest, parse_offsets
    from ipcount_lab.embedded_s3 import EmbeddedS3
    from ipcount_lab.lossy_proxy import start_proxy
    from tests.tables import lanes

    store = EmbeddedS3(state_dir=tmp_path / "lossy", port=free_port(), authorization=False)
    store.start()
    lost = multiprocessing.get_context("spawn").Value("i", 0)
    proxy, port = start_proxy(store.port, 3, lost)
    try:
        for name, value in store.environment().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        cfg = cfg.replace(warehouse=store.uri(cfg.topic, "warehouse"), max_records_per_epoch=60)
        gen = TrafficGenerator(seed=31, events_per_second=50)
        produced = produce(cfg.bootstrap_servers, cfg.topic, gen.records(180, BASE_MS),
                           partition_of=lambda i, r: i % 3)
        assert len(run_until_idle(cfg, spark)) == 3
        audit = cfg.for_target("audit")
        run_backfill(cfg, spark, BackfillRequest(target="audit", offsets=parse_offsets("0:0-60,1:0-60,2:0-60",
                                                                                       cfg.topic)))
    finally:
        proxy.kill()
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.endpoint)   # read back directly
    try:
        assert lost.value >= 5, lost.value
        for target in (cfg, audit):
            assert {r["status"] for r in ledger(target)} == {"committed"}
            want = Counter()
            for epochs in lanes(target).values():
                want += expected_tables(produced, epochs).counts
            assert counts(target) == want and sum(want.values()) > 150
    finally:
        store.stop()
