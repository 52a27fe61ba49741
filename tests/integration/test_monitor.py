"""The monitoring plugin, served by a real Airflow api-server over real Delta tables that
real epochs wrote: its JSON endpoints against the ledger, the broker and counts recounted
in plain Python; its authentication; and its pages in headless Chromium.

The tests run in file order: the first sees the pipeline before any epoch.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from ipcount.jobs.group_commit import commit_group_offsets_from_ledger
from ipcount.rules.config import REPO_ROOT, PipelineConfig
from ipcount.rules.private_files import write_private_file
from ipcount.storage import broker as broker_io
from ipcount.storage.maintenance import maintain
from ipcount_lab.embedded_airflow import admin_password, passwords_file
from ipcount_lab.generator import TrafficGenerator, produce
from tests.airflow_auth import PATH as AUTH_MANAGER
from tests.airflow_services import access_token, airflow, airflow_services, service_env
from tests.browser import ARTIFACTS, browser_page, log_in
from tests.conftest import BROKER_PASSWORD, free_port, run_until_idle
from tests.ground_truth import expected_tables
from tests.tables import last_maintenance, ledger

pytestmark = pytest.mark.airflow
BASE_MS = 1_795_255_200_000
RESTRICTED = "epochs_only"  # may read ipcount_epoch, not ipcount_backfill


def committed_ranges(cfg: PipelineConfig) -> list[dict[int, tuple[int, int]]]:
    """The committed epochs' ranges in epoch order (the crashed epoch's planned rows left out)."""
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for r in ledger(cfg):
        if r["status"] == "committed":
            out.setdefault(r["epoch"], {})[r["partition"]] = (r["from_offset"], r["until_offset"])
    return [out[e] for e in sorted(out)]


@dataclass
class Server:
    cfg: PipelineConfig
    url: str
    home: Path
    token: str
    scrape_token: str

    def get(self, path: str, token: str | None = "default", cookie: str | None = None):
        """(status, body) of GET ``/ipcount<path>``; JSON bodies parsed."""
        headers = {}
        if token == "default":
            token = self.token
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if cookie:
            headers["Cookie"] = f"_token={cookie}"
        request = urllib.request.Request(f"{self.url}/ipcount{path}", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                status, body, kind = r.status, r.read().decode(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            status, body, kind = e.code, e.read().decode(), e.headers.get("Content-Type", "")
        return status, (json.loads(body) if kind.startswith("application/json") else body)

    def metrics(self, token: str | None = None) -> dict[tuple[str, frozenset], float]:
        """One scrape of /ipcount/metrics (with the scrape token unless ``token``), parsed:
        (sample name, labels but the pipeline's) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        status, body = self.get("/metrics", token=token or self.scrape_token)
        assert status == 200, (status, body)
        samples = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                labels = dict(sample.labels)
                assert labels.pop("pipeline") == self.cfg.pipeline_id, sample
                samples[(sample.name, frozenset(labels.items()))] = sample.value
        return samples

    def api(self, path: str):
        status, body = self.get(path)
        assert status == 200, (path, status, body)
        return body


@pytest.fixture(scope="module")
def server(broker, tmp_path_factory):
    from ipcount.storage.broker import create_topic

    root = tmp_path_factory.mktemp("monitor")
    name = f"m_{uuid.uuid4().hex[:8]}"
    cfg = PipelineConfig(bootstrap_servers=broker.bootstrap_servers, topic=name, group_id=f"g_{name}",
                         pipeline_id=f"p_{name}", warehouse=str(root / "warehouse"), spark_master="local[2]",
                         max_records_per_epoch=250, schedule="*/5 * * * *")
    create_topic(cfg, 3)
    home = root / "airflow"
    home.mkdir()
    port = free_port()
    env = service_env(home, cfg, port)
    # A second user, who may read the epoch DAG but not the backfill DAG (per-DAG permissions,
    # as FAB or Keycloak give them; the simple auth manager knows roles only).
    # (The auth manager is the tests' own module: the api-server imports it from the checkout.)
    env.update({"AIRFLOW__CORE__AUTH_MANAGER": AUTH_MANAGER, "IPCOUNT_TEST_DAG_DENY": f"{RESTRICTED}:ipcount_backfill",
                "PYTHONPATH": str(REPO_ROOT),
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"admin:admin,{RESTRICTED}:viewer"})
    # The monitor asks the broker over SASL_SSL, logged in with an Airflow connection of type
    # kafka, as in a secured deployment (the tests' own clients use PLAINTEXT).
    secure = broker.client_settings("SASL_SSL")
    env.update({"IPCOUNT_KAFKA_CONNECTION": "ipcount_kafka", "AIRFLOW_CONN_IPCOUNT_KAFKA": json.dumps(
        {"conn_type": "kafka", "extra": {"bootstrap.servers": secure["bootstrap_servers"],
                                         "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                                         "sasl.username": "ipcount", "sasl.password": BROKER_PASSWORD,
                                         "ssl.ca.location": secure["kafka_ssl_cafile"]}})})
    # A scraper's token for /ipcount/metrics (a private file, as the setting asks).
    scrape_token = secrets.token_urlsafe(32)
    env["IPCOUNT_METRICS_TOKEN_FILE"] = str(write_private_file(root / "scrape-token", scrape_token + "\n"))
    airflow(env, "db", "migrate")
    with airflow_services(home, env, services=("api-server",)):
        url = f"http://127.0.0.1:{port}"
        passwords = passwords_file(home)
        assert admin_password(home) and passwords.stat().st_mode & 0o777 == 0o600  # written, owner only
        yield Server(cfg, url, home, access_token(url, home), scrape_token)


@pytest.fixture(scope="module")
def pipeline(server, spark):
    """Three committed epochs (600 records), a consumer-group commit, an epoch left planned
    by a crashed run (90 records), and 30 more records nobody read yet."""
    cfg = server.cfg
    gen = TrafficGenerator(seed=41, events_per_second=40, malformed_share=0.03)
    counted = produce(cfg.bootstrap_servers, cfg.topic, gen.records(600, BASE_MS), partition_of=lambda i, r: i % 3)
    assert len(run_until_idle(cfg, spark)) == 3
    commit_group_offsets_from_ledger(cfg)
    planned = produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, BASE_MS + 60_000),
                      partition_of=lambda i, r: i % 3)
    proc = subprocess.run([sys.executable, "-m", "ipcount.cli", "epoch", *cfg.to_args(), "--run-id", "manual__crashed"],
                          env={**os.environ, "IPCOUNT_CRASH_AT": "after_plan"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]
    waiting = produce(cfg.bootstrap_servers, cfg.topic, gen.records(30, BASE_MS + 120_000),
                      partition_of=lambda i, r: i % 3)
    return counted, planned, waiting


def test_an_empty_pipeline_shows_empty_pages(server):
    assert not Path(server.cfg.ledger_path).exists()
    assert server.api("/api/epochs") == {"target": "main", "total": 0, "page": 1, "pages": 1, "page_size": 50,
                                         "epochs": []}
    health = server.api("/api/health")
    assert (health["state"], health["last_epoch"], health["total_lag"], health["unfinished_epochs"]) == \
        ("idle", None, 0, [])
    assert health["interval_seconds"] == 300 and health["maintained_at"] is None
    lag = server.api("/api/lag")
    assert [(p["partition"], p["log_end"], p["ledger_position"], p["lag"]) for p in lag["partitions"]] == \
        [(0, 0, None, 0), (1, 0, None, 0), (2, 0, None, 0)]
    assert lag["history"] == [] and lag["broker_error"] is None
    counts = server.api("/api/counts")
    assert counts["top_ips"] == [] and counts["windows"] == []
    status, html = server.get("/epochs")
    assert status == 200 and 'id="no-epochs"' in html and "the ledger of target main is empty" in html
    for page in ("/lag", "/counts"):
        status, html = server.get(page)
        assert status == 200 and "no data yet" in html
    metrics = server.metrics()      # no ledger yet: the log ends, no epoch, nothing counted
    assert {k: v for k, v in metrics.items() if k[0] in ("ipcount_lag_records", "ipcount_chain_position")} == \
        {("ipcount_lag_records", frozenset({("partition", str(p))})): 0 for p in range(3)}
    assert metrics[("ipcount_health", frozenset({("state", "idle")}))] == 1
    assert metrics[("ipcount_epochs_total", frozenset({("kind", "scheduled")}))] == 0
    assert not [k for k in metrics if k[0].startswith(("ipcount_last_", "ipcount_epoch_", "ipcount_maintenance"))]


def test_epochs_endpoint_matches_the_ledger(server, pipeline):
    counted, planned, _ = pipeline
    rows = ledger(server.cfg)
    expected = expected_tables(counted, committed_ranges(server.cfg))

    page = server.api("/api/epochs?page_size=3")
    assert (page["total"], page["pages"]) == (4, 2)
    assert [e["epoch"] for e in page["epochs"]] == [4, 3, 2]
    crashed = page["epochs"][0]
    assert (crashed["status"], crashed["run_id"], crashed["dag_id"]) == ("failed", "manual__crashed", None)
    assert crashed["ranges"] == {str(r["partition"]): [r["from_offset"], r["until_offset"]]
                                 for r in rows if r["epoch"] == 4}
    assert sum(u - f for f, u in crashed["ranges"].values()) == len(planned)
    older = server.api("/api/epochs?page=2&page_size=3")["epochs"]
    committed = page["epochs"][1:] + older
    assert [e["epoch"] for e in committed] == [3, 2, 1] and {e["status"] for e in committed} == {"committed"}
    for e in committed:
        mine = [r for r in rows if r["epoch"] == e["epoch"]]
        assert e["ranges"] == {str(r["partition"]): [r["from_offset"], r["until_offset"]] for r in mine}
        assert e["sink_version"] == mine[0]["sink_version"] and set(e["stage_seconds"]) >= {"plan", "read", "merge"}
    assert sum(e["records_read"] for e in committed) == len(counted)
    assert sum(e["records_counted"] for e in committed) == sum(expected.counts.values())
    assert sum(e["records_malformed"] for e in committed) == len(expected.dead)
    assert sum(e["records_late"] for e in committed) == len(expected.late)

    assert [e["epoch"] for e in server.api("/api/epochs?status=failed")["epochs"]] == [4]
    assert [e["epoch"] for e in server.api("/api/epochs?status=committed")["epochs"]] == [3, 2, 1]
    assert server.api("/api/epochs?kind=backfill")["total"] == 0
    assert [e["epoch"] for e in server.api("/api/epochs?run_id=manual__crashed")["epochs"]] == [4]
    for query, message in (("status=done", "status must be one of committed, running, failed"),
                           ("page=0", "page must be 1 or more"), ("target=nope", "unknown target 'nope'"),
                           ("page=two", "bad parameter: page:")):
        status, body = server.get(f"/api/epochs?{query}")
        assert status == 400 and message in body["detail"], (query, body)

    health = server.api("/api/health")
    assert health["state"] == "failing" and health["last_epoch"] == 3 and health["unfinished_epochs"] == [4]
    assert any("epoch 4" in p and "resumes" in p for p in health["problems"])
    assert health["total_lag"] == len(planned) + 30
    assert (health["maintained_at"], health["maintenance"]) == (None, [])

    # After a maintenance run (it changes no row: the other tests' answers stay), what it did.
    run = maintain(server.cfg)
    health = server.api("/api/health")
    assert datetime.fromisoformat(health["maintained_at"]) == run.finished_at
    assert health["maintenance"] == [t.line() for t in sorted(run.tables, key=lambda t: t.table)]
    assert any(line.startswith("counts: ") for line in health["maintenance"])


def test_lag_endpoint_matches_broker_and_ledger(server, pipeline):
    _, planned, waiting = pipeline
    earliest, latest = broker_io.partition_offsets(server.cfg)
    chain = {}
    for r in ledger(server.cfg):
        if r["status"] == "committed":
            chain[r["partition"]] = max(chain.get(r["partition"], 0), r["until_offset"])
    lag = server.api("/api/lag")  # the monitor's broker answers come over SASL_SSL (see the server fixture)
    assert lag["broker_error"] is None
    assert {p["partition"]: (p["log_start"], p["log_end"], p["ledger_position"], p["group_offset"], p["lag"])
            for p in lag["partitions"]} == {
        p: (earliest[p], latest[p], chain[p], chain[p], latest[p] - chain[p]) for p in latest}
    assert sum(p["lag"] for p in lag["partitions"]) == len(planned) + len(waiting)
    history = {h["epoch"]: h["lag"] for h in lag["history"]}
    assert set(history) == {1, 2, 3}
    for r in ledger(server.cfg):
        if r["status"] == "committed":
            assert history[r["epoch"]][str(r["partition"])] == r["lag_after"]


def test_metrics_endpoint_matches_the_ledger_and_the_broker(server, pipeline):
    counted, planned, waiting = pipeline
    rows = ledger(server.cfg)
    committed = [r for r in rows if r["status"] == "committed"]
    expected = expected_tables(counted, committed_ranges(server.cfg))
    _, latest = broker_io.partition_offsets(server.cfg)
    chain = {}
    for r in committed:
        chain[r["partition"]] = max(chain.get(r["partition"], 0), r["until_offset"])

    m = server.metrics()

    def one(name: str, **labels) -> float:
        return m[(name, frozenset((k, str(v)) for k, v in labels.items()))]
    assert one("ipcount_broker_up") == 1
    for p in latest:
        assert (one("ipcount_log_end_offset", partition=p), one("ipcount_chain_position", partition=p),
                one("ipcount_lag_records", partition=p)) == (latest[p], chain[p], latest[p] - chain[p])
    assert sum(one("ipcount_lag_records", partition=p) for p in latest) == len(planned) + len(waiting)
    last = max(r["epoch"] for r in committed)
    mine = [r for r in committed if r["epoch"] == last]
    assert one("ipcount_last_committed_epoch") == last == 3
    assert one("ipcount_last_commit_timestamp_seconds") == pytest.approx(mine[0]["committed_at"].timestamp())
    assert 0 < one("ipcount_last_commit_age_seconds") < 3600
    assert one("ipcount_epoch_duration_seconds") == pytest.approx(mine[0]["duration_seconds"])
    stages = dict(mine[0]["stage_seconds"])
    assert {stage for (name, labels) in m if name == "ipcount_epoch_stage_seconds" for _, stage in labels} == \
        set(stages) >= {"plan", "read", "merge"}
    assert all(one("ipcount_epoch_stage_seconds", stage=k) == pytest.approx(v) for k, v in stages.items())
    assert one("ipcount_unfinished_epochs") == 1                        # the crashed run's epoch 4
    assert [s for s in ("ok", "late", "idle", "failing") if one("ipcount_health", state=s) == 1] == ["failing"]
    (maintained,) = {r["finished_at"] for r in last_maintenance(server.cfg)}
    assert one("ipcount_maintenance_last_run_timestamp_seconds") == pytest.approx(maintained.timestamp())
    # counters: the committed epochs' records, against the ground truth
    assert one("ipcount_epochs_total", kind="scheduled") == 3
    assert one("ipcount_records_read_total", kind="scheduled") == len(counted)
    assert one("ipcount_records_counted_total", kind="scheduled") == sum(expected.counts.values())
    assert one("ipcount_records_malformed_total", kind="scheduled") == len(expected.dead)
    assert one("ipcount_records_late_total", kind="scheduled") == len(expected.late)
    assert one("ipcount_records_read_total", kind="backfill") == 0

    # Who may scrape: the token's holder, or an Airflow login that may read the epoch DAG.
    assert server.get("/metrics", token=None)[0] == 401
    assert server.get("/metrics", token="x" * 43)[0] == 403           # neither the token nor a JWT
    by_login, by_token = server.metrics(token=server.token), server.metrics()     # the admin's JWT
    assert by_login.keys() == by_token.keys()
    assert {k: v for k, v in by_login.items() if "age" not in k[0]} == \
        {k: v for k, v in by_token.items() if "age" not in k[0]}
    status, body = server.get("/metrics", token=None, cookie=server.token)     # the UI's session
    assert status == 200 and "ipcount_lag_records" in body


def test_counts_endpoint_matches_a_plain_python_recount(server, pipeline):
    counted, _, _ = pipeline
    expected = expected_tables(counted, committed_ranges(server.cfg)).counts
    start = datetime.fromtimestamp(min(w for w, _ in expected) / 1000, timezone.utc)
    until = datetime.fromtimestamp(max(w for w, _ in expected) / 1000 + 5, timezone.utc)
    query = f"from={start.isoformat()}&until={until.isoformat()}".replace("+", "%2B")
    data = server.api(f"/api/counts?{query}&top=5")
    per_ip = Counter()
    per_window = Counter()
    for (window, ip), n in expected.items():
        per_ip[ip] += n
        per_window[window] += n
    assert [(r["ip"], r["requests"]) for r in data["top_ips"]] == \
        sorted(per_ip.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
    got_windows = {int(datetime.fromisoformat(w["window_start"]).timestamp() * 1000): w["requests"]
                   for w in data["windows"]}
    assert got_windows == dict(per_window)
    # A narrower range counts only the windows inside it.
    narrow = server.api(f"/api/counts?from={start.isoformat()}&until={(start + timedelta(seconds=10)).isoformat()}"
                        .replace("+", "%2B"))
    assert sum(w["requests"] for w in narrow["windows"]) == sum(
        n for w, n in per_window.items() if w < (start.timestamp() + 5) * 1000 + 1)
    status, body = server.get("/api/counts?from=yesterday")
    assert status == 400 and "from must be an ISO-8601 time" in body["detail"]
    # Out of range, or more windows than one page lists: a 400 that says what to fix, not a 500
    # or a scan of all history.
    status, body = server.get("/api/counts?until=0001-01-01T00:00")
    assert status == 400 and "until must lie between 1970-01-01 and 2200-01-01" in body["detail"]
    status, body = server.get("/api/counts?from=2000-01-01T00:00&until=2100-01-01T00:00")
    assert status == 400 and "at most 10,000 at a time" in body["detail"] and "narrow the range" in body["detail"]


def test_thousands_of_epochs_page_quickly(server, pipeline, spark):
    """A replay target whose ledger holds 3,000 epochs (9,000 rows), appended in 30 commits."""
    from deltalake import write_deltalake

    from ipcount.storage.ledger import Ledger, arrow_rows

    cfg = server.cfg.for_target("history")
    Ledger(cfg.ledger_path).ensure()
    now = datetime.now(timezone.utc)
    for first in range(1, 3001, 100):
        rows = [{"epoch": e, "topic": cfg.topic, "partition": p, "from_offset": e * 10, "until_offset": e * 10 + 10,
                 "status": "planned" if e == 1234 else "committed", "planned_at": now,
                 "committed_at": None if e == 1234 else now, "records_read": 10, "records_counted": 9,
                 "records_late": 0, "records_malformed": 1, "sink_version": e, "duration_seconds": 1.5,
                 "run_id": f"scheduled__{e}", "lag_after": 0, "stage_seconds": {"plan": 0.1}, "kind": "scheduled"}
                for e in range(first, first + 100) for p in range(3)]
        write_deltalake(cfg.ledger_path, arrow_rows(rows), mode="append")

    started = time.monotonic()
    page = server.api("/api/epochs?target=history&page=7&page_size=100")
    first_seconds = time.monotonic() - started
    assert (page["total"], page["pages"]) == (3000, 30)
    assert [e["epoch"] for e in page["epochs"]] == list(range(2400, 2300, -1))
    assert all(e["ranges"] == {str(p): [e["epoch"] * 10, e["epoch"] * 10 + 10] for p in range(3)}
               for e in page["epochs"])
    started = time.monotonic()
    last = server.api("/api/epochs?target=history&page=30&page_size=100")
    again_seconds = time.monotonic() - started
    assert [e["epoch"] for e in last["epochs"]][-1] == 1
    assert [e["epoch"] for e in server.api("/api/epochs?target=history&status=failed")["epochs"]] == [1234]
    status, html = server.get("/epochs?target=history&page=2")
    assert status == 200 and html.count('class="epoch"') == 50 and 'id="next-page"' in html
    print(f"3000-epoch ledger: page 7 in {first_seconds:.3f} s (first read), page 30 in {again_seconds:.3f} s")


def test_every_route_needs_an_authenticated_airflow_user(server, pipeline):
    for path in ("/api/epochs", "/api/health", "/api/lag", "/api/counts", "/api/openapi.json", "/api/docs"):
        status, body = server.get(path, token=None)
        assert status == 401 and body == {"detail": "Not authenticated"}, (path, status, body)
        status, _ = server.get(path, token="not-a-jwt")
        assert status == 403, path
    status, html = server.get("/epochs", token=None)
    assert status == 401 and "Log in to Airflow first" in html and "epoch" not in html.split("Log in")[0].lower()
    status, html = server.get("/runs/ipcount_epoch/x", token=None)
    assert status == 401
    # The Airflow UI's session cookie is enough (that is how the embedded page is reached).
    status, body = server.get("/api/epochs", token=None, cookie=server.token)
    assert status == 200 and body["total"] == 4
    assert set(server.api("/api/openapi.json")["paths"]) >= {"/api/health", "/api/epochs", "/api/lag", "/api/counts"}


def test_publish_endpoint_shows_only_the_pipeline_s_own_consumer_groups(server):
    """Any reader of the epoch DAG may call it: other consumer groups' offsets are refused,
    with where to look instead."""
    cfg = server.cfg
    status, body = server.get("/api/publish?group=someone-elses-service")
    assert status == 400, body
    assert body["detail"] == (
        f"group must be one of the pipeline's own consumer groups ({cfg.group_id}, {cfg.pipeline_id}-publisher), got "
        "'someone-elses-service'; the monitor shows no other group's offsets (bin/ipcount consumer-groups -- "
        "--describe --group NAME shows any group the broker lets your own login see)")
    for query in ("", "?group=", f"?group={cfg.group_id}", f"?group={cfg.pipeline_id}-publisher"):
        assert server.api(f"/api/publish{query}") == {"publish": False}, query   # (publishing is off here)


def test_pages_in_headless_chromium_after_logging_in(server, pipeline):
    with browser_page() as page:
        page.goto(f"{server.url}/ipcount/epochs")
        assert "Log in to Airflow first" in page.content()
        log_in(page, server.url, server.home)

        # The plugin's entry in the UI's navigation: the epochs page inside Airflow's frame.
        page.goto(f"{server.url}/plugin/ipcount")
        frame = page.frame_locator("iframe[title='ipcount pipeline']")
        rows = frame.locator("tr.epoch")
        rows.first.wait_for(timeout=60_000)
        assert rows.count() == 4
        assert frame.locator("tr.epoch[data-status=failed]").count() == 1
        assert frame.locator("#epochs-chart rect.bar").count() == 4
        # the three committed epochs by commit time: read, counted, late, malformed
        assert frame.locator("#records-time-chart polyline.series").count() == 4
        assert frame.locator("#records-time-chart circle").count() == 3 * 4
        assert "FAILING" in frame.locator("#health").inner_text()
        assert "maintenance: " in frame.locator("#health").inner_text()
        page.screenshot(path=str(ARTIFACTS / "monitor-epochs.png"), full_page=True)

        frame.locator("nav a", has_text="Lag").click()
        frame.locator("#lag-chart polyline.series").first.wait_for(timeout=30_000)
        assert frame.locator("#lag-chart polyline.series").count() == 3
        assert frame.locator("#lag-time-chart polyline.series").count() == 3
        assert frame.locator("tr.partition").count() == 3
        page.screenshot(path=str(ARTIFACTS / "monitor-lag.png"), full_page=True)

        frame.locator("nav a", has_text="Counts").click()
        frame.locator("#window-chart rect.bar").first.wait_for(timeout=30_000)
        assert frame.locator("tr.ip").count() == 20
        page.screenshot(path=str(ARTIFACTS / "monitor-counts.png"), full_page=True)
    assert (ARTIFACTS / "monitor-epochs.png").stat().st_size > 10_000


def test_a_user_who_may_read_only_the_epoch_dag_sees_nothing_of_backfills(server, pipeline, spark):
    """Last in the file: it adds a backfill to the main ledger and a replay target."""
    from ipcount.jobs.backfill import run_backfill
    from ipcount.rules.requests import BackfillRequest, parse_offsets

    cfg = server.cfg
    before = server.api("/api/epochs?page_size=500")["total"]
    _, end = broker_io.partition_offsets(cfg)
    produce(cfg.bootstrap_servers, cfg.topic, TrafficGenerator(seed=47).records(60, BASE_MS + 180_000),
            partition_of=lambda i, r: i % 3)
    _, latest = broker_io.partition_offsets(cfg)
    fresh = parse_offsets(",".join(f"{p}:{end[p]}-{latest[p]}" for p in sorted(latest)), cfg.topic)
    run_backfill(cfg, spark, BackfillRequest(offsets=fresh))                    # into the main ledger
    run_backfill(cfg, spark, BackfillRequest(target="audit", offsets=fresh))    # a replay target
    admin = server.api("/api/epochs?page_size=500")
    backfilled = [e["epoch"] for e in admin["epochs"] if e["kind"] == "backfill"]
    assert backfilled and admin["total"] == before + len(backfilled)
    assert server.api("/api/epochs?target=audit")["total"] >= 1

    token = access_token(server.url, server.home, RESTRICTED)
    status, body = server.get("/api/epochs?page_size=500", token=token)
    assert status == 200 and body["total"] == before
    assert {e["kind"] for e in body["epochs"]} == {"scheduled"}
    status, body = server.get("/api/epochs?kind=backfill", token=token)
    assert status == 200 and body["total"] == 0
    for path in ("/api/epochs?target=audit", "/api/counts?target=audit", "/api/lag?target=audit",
                 "/api/health?target=audit"):
        status, body = server.get(path, token=token)
        assert status == 403 and "needs read access to the DAG ipcount_backfill" in body["detail"], (path, body)
    status, html = server.get("/runs/ipcount_backfill/manual__x", token=token)
    assert status == 403 and "ipcount_backfill" in html
    status, html = server.get("/epochs", token=token)
    assert status == 200 and "audit" not in html and 'class="epoch"' in html
    status, html = server.get("/epochs", token="default")  # the admin is offered the replay target
    assert status == 200 and "audit" in html
    # The metrics: the backfill's epochs for the scrape token, none of them for that user
    totals = server.metrics()
    assert totals[("ipcount_epochs_total", frozenset({("kind", "backfill")}))] == len(backfilled)
    assert totals[("ipcount_records_read_total", frozenset({("kind", "backfill")}))] == sum(
        r["records_read"] for r in ledger(cfg) if r.get("kind") == "backfill" and r["status"] == "committed")
    assert not [k for k in server.metrics(token=token) if ("kind", "backfill") in k[1]]


def test_a_run_note_tells_the_run_s_epochs_from_those_it_finished_for_others(cfg, spark, monkeypatch):
    """Real runs over a real ledger, their notes made as the listener makes them (the rows read
    by run_rows in a child process): backfill run A's chunk of request X, left planned when A
    failed, is finished by run B of request Y before B's own chunk; the chain's run D resumes
    the epoch run C left. A commit writes its run's id over the planner's in the ledger."""
    from types import SimpleNamespace

    from ipcount.jobs.backfill import run_backfill
    from ipcount.jobs.epoch import run_epoch
    from ipcount.orchestration.monitor import notes
    from ipcount.rules.requests import request_from_fields

    class Failed(Exception):
        pass

    def fail_after_plan(point: str) -> None:
        if point == "after_plan":
            raise Failed(point)

    gen = TrafficGenerator(seed=43, events_per_second=40)
    produce(cfg.bootstrap_servers, cfg.topic, gen.records(90, BASE_MS), partition_of=lambda i, r: i % 3)
    x, y = {"offsets": "0:0-10,1:0-10"}, {"offsets": "2:0-10"}
    with pytest.raises(Failed):
        run_backfill(cfg, spark, request_from_fields(x, cfg.topic), run_id="manual__a", crash=fail_after_plan)
    run_backfill(cfg, spark, request_from_fields(y, cfg.topic), run_id="manual__b")
    with pytest.raises(Failed):
        run_epoch(cfg, spark, run_id="scheduled__c", crash=fail_after_plan)
    run_epoch(cfg, spark, run_id="scheduled__d")
    assert {(r["epoch"], r["run_id"]) for r in ledger(cfg)} == {
        (1, "manual__b"), (2, "manual__b"), (3, "scheduled__d")}

    monkeypatch.delenv("IPCOUNT_CONFIG", raising=False)
    for name, value in cfg.to_env().items():
        monkeypatch.setenv(name, value)

    def note(dag_id: str, run_id: str, conf: dict) -> tuple[str, str]:
        """(the run's own part, the part about others' epochs) of its note."""
        run = SimpleNamespace(id=1, dag_id=dag_id, run_id=run_id, run_type="manual", conf=conf)
        own, _, other = notes._note(notes._Run.of(run)).partition("Epochs it finished for another run or request:")
        return own, other

    own, other = note("ipcount_backfill", "manual__b", y)
    assert "- **epoch 2** (backfill) committed: p2 [0, 10); read 10" in own and "epoch 1" not in own
    assert (f"- **epoch 1** (backfill for request `{request_from_fields(x, cfg.topic).request_id}`, planned by run "
            "`manual__a`) committed: p0 [0, 10) p1 [0, 10); read 20") in other
    own, other = note("ipcount_epoch", "scheduled__d", {})
    assert "None of its own." in own
    assert ("- **epoch 3** (scheduled, planned by run `scheduled__c`) committed: p0 [10, 30) p1 [10, 30) "
            "p2 [10, 30); read 60") in other
