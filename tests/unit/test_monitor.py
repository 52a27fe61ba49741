"""The monitoring pages' pure logic: epoch status, pages, health, time ranges, charts, notes;
and what bounds their cost: the answer cache (over real delta-rs tables) and the run-note
listener's stay inside the scheduler."""
from __future__ import annotations

import gc
import socketserver
import threading
import time
import tracemalloc
import xml.etree.ElementTree as ET
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from ipcount.orchestration.monitor import model
from ipcount.orchestration.monitor.charts import bar_chart, line_chart, time_chart
from ipcount.orchestration.monitor.notes import NOTE_LIMIT, run_note
from ipcount.rules.errors import ConfigError

T0 = datetime(2026, 11, 21, 12, 0, tzinfo=timezone.utc)


def row(epoch, partition, f, u, status="committed", run_id="r1", **extra):
    base = {"epoch": epoch, "topic": "t", "partition": partition, "from_offset": f, "until_offset": u,
            "status": status, "run_id": run_id, "kind": "scheduled", "request_id": None,
            "records_read": u - f, "records_counted": u - f - 2, "records_late": 1, "records_malformed": 1,
            # a map column as Arrow gives it: (key, value) pairs
            "stage_seconds": [("merge", 0.5), ("plan", 0.1), ("read", 1.0)], "duration_seconds": 2.0,
            "sink_version": epoch + 1, "planned_at": T0, "committed_at": T0 if status == "committed" else None}
    return {**base, **extra}


@pytest.mark.parametrize("planned,run_state,want", [
    (False, None, "committed"), (False, "failed", "committed"), (True, "running", "running"),
    (True, "queued", "running"), (True, "failed", "failed"), (True, "success", "failed"), (True, None, "failed")])
def test_epoch_status(planned, run_state, want):
    assert model.epoch_status(planned, run_state) == want


def test_epoch_rows_assemble_partitions_newest_first_and_sum_only_live_ranges():
    rows = [row(1, 0, 0, 10), row(1, 1, 0, 20), row(2, 0, 10, 15, status="planned", run_id="r2"),
            row(2, 1, 20, 30, status="lost", run_id="r2", records_read=None, records_counted=None,
                records_late=None, records_malformed=None)]
    got = model.epoch_rows(rows, {"r2": ("ipcount_epoch", "running")})
    assert [e.epoch for e in got] == [2, 1]
    running, done = got
    assert running.status == "running" and running.dag_id == "ipcount_epoch"
    assert running.ranges == {0: (10, 15)} and running.lost == {1: (20, 30)}
    assert done.status == "committed" and done.run_state is None
    assert done.ranges == {0: (0, 10), 1: (0, 20)}
    assert (done.records_read, done.records_counted, done.records_late, done.records_malformed) == (30, 26, 2, 2)
    assert list(done.stage_seconds) == ["plan", "read", "merge"]  # pipeline order, not the map's
    d = done.to_dict()
    assert d["ranges"] == {"0": [0, 10], "1": [0, 20]} and d["committed_at"] == T0.isoformat()


def test_epochs_are_published_below_the_publisher_s_next_version():
    rows = [row(1, 0, 0, 10, sink_version=4), row(2, 0, 10, 20, sink_version=5), row(3, 0, 20, 30, sink_version=None),
            row(4, 0, 30, 40, status="planned", run_id="r4", sink_version=None)]
    epochs = model.epoch_rows(rows, {"r4": ("ipcount_epoch", "running")})
    assert model.with_published(epochs, None) == epochs
    assert {e.epoch: e.published for e in model.with_published(epochs, 5)} == {1: True, 2: False, 3: None, 4: None}
    assert model.with_published(epochs, 6)[2].to_dict()["published"] is True


def test_pages_and_their_bounds():
    p = model.page_of(101, 3, 50)
    assert (p.pages, p.start, p.has_prev, p.has_next) == (3, 100, True, False)
    assert model.page_of(0, 1, 50).pages == 1
    for number, size in ((0, 50), (1, 0), (1, 501)):
        with pytest.raises(model.BadQueryError):
            model.page_of(10, number, size)


def test_choices():
    assert model.check_choice("status", "", model.STATUSES) is None
    assert model.check_choice("status", "all", model.STATUSES) is None
    assert model.check_choice("status", "failed", model.STATUSES) == "failed"
    with pytest.raises(model.BadQueryError, match="status must be one of committed, running, failed"):
        model.check_choice("status", "done", model.STATUSES)


def test_schedule_interval():
    assert model.schedule_interval("* * * * *", T0) == timedelta(minutes=1)
    assert model.schedule_interval("*/5 * * * *", T0 + timedelta(seconds=7)) == timedelta(minutes=5)
    assert model.schedule_interval("@daily", T0) == timedelta(days=1)
    # every schedule the settings take (@quarterly is Airflow's, not croniter's; spaces are kept)
    assert model.schedule_interval(" @quarterly ", T0) in (timedelta(days=d) for d in (90, 91, 92))
    assert model.schedule_interval("not a cron", T0) is None
    assert model.schedule_interval("on-data", T0, poll_seconds=2) == timedelta(seconds=2)  # the watcher's looks


def test_health_states():
    minute = timedelta(minutes=1)
    ok = model.assess_health(T0, 7, T0 - 2 * minute, minute, 40, [], [])
    assert ok.state == "ok" and ok.problems == () and ok.age_seconds == 120
    # Old but nothing waiting: an empty epoch commits nothing, so that is not late.
    assert model.assess_health(T0, 7, T0 - 60 * minute, minute, 0, [], []).state == "ok"
    late = model.assess_health(T0, 7, T0 - 4 * minute, minute, 40, [], [])
    assert late.state == "late" and "40 records waiting" in late.problems[0]
    assert model.assess_health(T0, None, None, minute, None, [], []).state == "idle"
    stuck = model.epoch_rows([row(8, 0, 0, 5, status="planned", run_id="r8")], {"r8": ("ipcount_epoch", "failed")})
    failing = model.assess_health(T0, 7, T0, minute, 40, stuck, ["r8"])
    assert failing.state == "failing" and failing.unfinished == (8,)
    assert any("epoch 8" in p and "resumes" in p for p in failing.problems)
    assert any("1 failed run(s)" in p for p in failing.problems)
    running = model.epoch_rows([row(8, 0, 0, 5, status="planned", run_id="r8")], {"r8": ("ipcount_epoch", "running")})
    assert model.assess_health(T0, 7, T0, minute, 40, running, []).state == "ok"
    assert model.assess_health(T0, 7, T0, minute, None, [], [], broker_error="down").state == "failing"


def test_health_shows_the_last_maintenance_and_flags_one_the_schedule_missed():
    day = timedelta(days=1)
    healthy = model.assess_health(T0, 7, T0, timedelta(minutes=1), 0, [], [])
    never = model.with_maintenance(healthy, T0, [], day)
    assert (never.maintained_at, never.maintenance, never.problems) == (None, (), ())  # a new pipeline
    rows = [{"table": t, "location": f"/w/{t}", "files_before": 9, "files_after": 1, "bytes_after": 10_000,
             "compacted_files": 9, "vacuumed_files": 4, "log_bytes": None, "checkpoint_bytes": None,
             "notes": "", "finished_at": T0 - k * timedelta(seconds=1)} for k, t in enumerate(("ledger", "counts"))]
    fresh = model.with_maintenance(healthy, T0, rows, day)
    assert fresh.maintained_at == T0 and fresh.problems == () and fresh.state == "ok"
    assert fresh.maintenance == ("counts: 9 -> 1 files (0.01 MB), compacted 9, vacuumed 4",
                                 "ledger: 9 -> 1 files (0.01 MB), compacted 9, vacuumed 4")
    assert fresh.to_dict()["maintained_at"] == T0.isoformat() and len(fresh.to_dict()["maintenance"]) == 2
    stale = model.with_maintenance(healthy, T0 + 2 * day + timedelta(hours=1), rows, day)
    assert stale.state == "ok" and "maintenance last ran 49 h ago (schedule: every 24 h)" in stale.problems[0]
    assert model.with_maintenance(healthy, T0 + 30 * day, rows, None).problems == ()  # by hand only


def test_health_flags_a_watermark_ahead_of_the_wall_clock():
    now_ms = int(T0.timestamp() * 1000)
    assert model.assess_health(T0, 7, T0, timedelta(minutes=1), 0, [], [], watermark_ms=now_ms + 30_000).state == "ok"
    ahead = model.assess_health(T0, 7, T0, timedelta(minutes=1), 0, [], [], watermark_ms=now_ms + 2 * 3_600_000)
    assert ahead.state == "failing"
    assert "120 min ahead of the wall clock" in ahead.problems[0] and "event_time_ahead" in ahead.problems[0]


def test_time_ranges():
    assert model.parse_instant("from", "2026-11-21T10:00") == datetime(2026, 11, 21, 10, tzinfo=timezone.utc)
    assert model.parse_instant("from", "2026-11-21T10:00:00Z") == datetime(2026, 11, 21, 10, tzinfo=timezone.utc)
    assert model.parse_instant("from", "") is None
    with pytest.raises(model.BadQueryError, match="from must be an ISO-8601 time"):
        model.parse_instant("from", "yesterday")
    for far in ("0001-01-01T00:00", "9999-12-31T23:59"):
        with pytest.raises(model.BadQueryError, match="until must lie between 1970-01-01 and 2200-01-01"):
            model.parse_instant("until", far)
    assert model.counts_range(None, None, T0, 5) == (T0 - timedelta(hours=1), T0)
    assert model.counts_range(T0 - timedelta(minutes=5), None, T0, 5) == (T0 - timedelta(minutes=5), T0)
    with pytest.raises(model.BadQueryError, match="must be before until"):
        model.counts_range(T0, T0 - timedelta(seconds=1), None, 5)
    # The earliest until gets a default range that starts no earlier than 1970.
    epoch0 = model.parse_instant("until", "1970-01-01T00:30")
    assert model.counts_range(None, epoch0, None, 5) == (model.EARLIEST_INSTANT, epoch0)
    # One row per window: 10,000 windows at most (13:53:20 of 5-s windows, 6 days 22:40 of 60-s ones).
    assert model.counts_range(T0 - timedelta(seconds=50_000), T0, None, 5)[0] == T0 - timedelta(seconds=50_000)
    with pytest.raises(model.BadQueryError, match=r"spans 10,001 windows of 5 s; at most 10,000 at a time \(13:53:20\)"):
        model.counts_range(T0 - timedelta(seconds=50_005), T0, None, 5)
    assert model.counts_range(T0 - timedelta(days=6), T0, None, 60)[0] == T0 - timedelta(days=6)


def test_charts_are_valid_svg_with_one_mark_per_value():
    svg = ET.fromstring(line_chart("lag", "Lag", [1, 2, 3], {"p0": [5, 3, 0], "p1": [1, None, 2]}))
    ns = "{http://www.w3.org/2000/svg}"
    lines = svg.findall(f"{ns}polyline")
    assert [p.get("data-series") for p in lines] == ["p0", "p1"]
    assert [len(p.get("points").split()) for p in lines] == [3, 2]
    bars = ET.fromstring(bar_chart("w", "Windows", ["a", "b"], [10, 0], [False, True])).findall(f"{ns}rect")
    assert len([b for b in bars if b.get("class") == "bar"]) == 2
    assert "no data yet" in line_chart("lag", "Lag", [], {}) and "no data yet" in bar_chart("w", "W", [], [])
    assert "&lt;x&gt;" in line_chart("lag", "<x>", [1], {"<x>": [1]})  # labels are escaped


def test_a_time_chart_places_points_by_time_so_pauses_show():
    ns = "{http://www.w3.org/2000/svg}"
    times = [T0, T0 + timedelta(seconds=10), T0 + timedelta(seconds=90), None]
    svg = ET.fromstring(time_chart("t", "Lag over time", times, {"p0": [5, 3, 9, 7], "p1": [1, None, 2, 4]}))
    lines = svg.findall(f"{ns}polyline")
    assert [p.get("data-series") for p in lines] == ["p0", "p1"]
    xs = [float(point.split(",")[0]) for point in lines[0].get("points").split()]
    assert len(xs) == 3 and xs[0] < xs[1] < xs[2]           # the point with no time is left out
    # spacing proportional to time: 10 s, then 80 s (not evenly, as the epoch-indexed chart)
    assert (xs[2] - xs[1]) / (xs[1] - xs[0]) == pytest.approx(8, rel=1e-3)
    labels = [t.text for t in svg.findall(f"{ns}text")]
    assert "2026-11-21 12:00:00" in labels and "12:01:30 UTC" in labels
    assert "no data yet" in time_chart("t", "T", [None], {"a": [1]})
    one = ET.fromstring(time_chart("t", "T", [T0], {"a": [1]})).findall(f"{ns}circle")
    assert len(one) == 1


def test_run_note():
    rows = [row(3, 0, 0, 10, run_id="r"), row(3, 1, 5, 9, run_id="r"), row(4, 0, 10, 12, status="planned", run_id="r")]
    note = run_note("ipcount_epoch", "scheduled__x", rows)
    assert "**epoch 3** (scheduled) committed: p0 [0, 10) p1 [5, 9); read 14, counted 10, late 2, malformed 2" in note
    assert "**epoch 4** unfinished: p0 [10, 12)" in note
    assert "(/ipcount/runs/ipcount_epoch/scheduled__x)" in note
    assert "No epoch" in run_note("ipcount_epoch", "r", [])
    many = [row(e, p, e * 10, e * 10 + 5, run_id="r") for e in range(1, 60) for p in range(3)]
    long = run_note("ipcount_backfill", "r", many, target="audit")
    assert len(long) <= NOTE_LIMIT and "more epoch(s)" in long and "into target `audit`" in long



def test_a_run_note_lists_apart_the_epochs_the_run_finished_for_another_run():
    """A commit writes the committing run's id: a backfill run that first finishes another
    request's unfinished chunk, and the chain's run that resumes the epoch a failed run left,
    hold that epoch's rows; the ledger's ``planned_by`` says whose it is."""
    theirs = dict(kind="backfill", request_id="bf-x", planned_by="manual__a")
    mine = dict(kind="backfill", request_id="bf-y", planned_by="manual__b")
    rows = [row(1, 0, 0, 10, run_id="manual__b", **theirs), row(1, 1, 0, 5, run_id="manual__b", **theirs),
            row(2, 0, 10, 20, run_id="manual__b", **mine), row(3, 0, 20, 25, "planned", run_id="manual__b", **mine)]
    note = run_note("ipcount_backfill", "manual__b", rows)
    own, _, other = note.partition("Epochs it finished for another run or request:")
    assert "- **epoch 2** (backfill) committed: p0 [10, 20)" in own and "**epoch 3** unfinished: p0 [20, 25)" in own
    assert "epoch 1" not in own
    assert ("- **epoch 1** (backfill for request `bf-x`, planned by run `manual__a`) committed: p0 [0, 10) "
            "p1 [0, 5); read 15, counted 11, late 2, malformed 2; counts v2") in other

    rows = [row(4, 0, 0, 10, run_id="scheduled__b", planned_by="scheduled__a")]
    note = run_note("ipcount_epoch", "scheduled__b", rows)
    own, _, other = note.partition("Epochs it finished for another run or request:")
    assert "None of its own." in own and "epoch 4" not in own
    assert "- **epoch 4** (scheduled, planned by run `scheduled__a`) committed: p0 [0, 10)" in other
    note = run_note("ipcount_epoch", "scheduled__b", [row(4, 0, 0, 10, run_id="scheduled__b", planned_by=None)])
    assert "- **epoch 4** (scheduled, planned by a run without a run id) committed" in note


def test_a_run_note_lists_apart_an_epoch_counted_for_another_request():
    """A backfill run that gives up another request's chunk whose offsets aged out counts the
    rest of it as a new epoch of its own planning, but for that other request."""
    rows = [row(5, 0, 0, 10, run_id="manual__b", planned_by="manual__b", kind="backfill", request_id="bf-x"),
            row(6, 0, 10, 20, run_id="manual__b", planned_by="manual__b", kind="backfill", request_id="bf-y")]
    note = run_note("ipcount_backfill", "manual__b", rows, request_id="bf-y")
    own, _, other = note.partition("Epochs it finished for another run or request:")
    assert "- **epoch 6** (backfill) committed" in own and "epoch 5" not in own
    assert "- **epoch 5** (backfill for request `bf-x`) committed: p0 [0, 10)" in other
    # Many of both: the run's own come first, and the note stays within Airflow's limit.
    many = ([row(e, p, e * 10, e * 10 + 5, run_id="r", planned_by="x") for e in range(1, 4) for p in range(3)]
            + [row(e, p, e * 10, e * 10 + 5, run_id="r") for e in range(4, 40) for p in range(3)])
    long = run_note("ipcount_epoch", "r", many)
    assert len(long) <= NOTE_LIMIT and long.endswith("- ... and 32 more epoch(s)")  # 29 own, 3 not
    assert "**epoch 4**" in long and "**epoch 1**" not in long


def test_a_run_s_request_is_the_one_its_epoch_task_counts():
    """The note tells the run's own backfill request from others by the id its epoch task's
    request gets: the backfill DAG's form, or an `airflow backfill create` run's interval."""
    from ipcount.orchestration.monitor.notes import _Run
    from ipcount.orchestration.monitor.run_rows import request_id
    from ipcount.rules.requests import BackfillRequest, parse_offsets

    form = SimpleNamespace(id=1, dag_id="ipcount_backfill", run_id="manual__b", run_type="manual",
                           conf={"target": "audit", "offsets": "0:0-10,2:5-9", "max_records_per_epoch": 5})
    run = _Run.of(form)
    assert run.target == "audit"
    assert request_id(run.request, "t") == BackfillRequest("audit", parse_offsets("0:0-10,2:5-9", "t")).request_id
    interval = SimpleNamespace(id=2, dag_id="ipcount_epoch", run_id="backfill__x", run_type="backfill", conf={},
                               data_interval_start=T0, data_interval_end=T0 + timedelta(hours=1))
    ms = int(T0.timestamp() * 1000)
    assert request_id(_Run.of(interval).request, "t") == BackfillRequest(from_ms=ms, until_ms=ms + 3_600_000).request_id
    chain = SimpleNamespace(id=3, dag_id="ipcount_epoch", run_id="scheduled__x", run_type="scheduled", conf={})
    assert _Run.of(chain).request == "" and request_id("", "t") is None
    assert request_id('{"offsets": "0:9-5"}', "t") is None  # refused: its run counted nothing


def test_access_without_the_backfill_dag_hides_backfills_and_refuses_replay_targets():
    from ipcount.orchestration.monitor.model import Access, ForbiddenError

    from types import SimpleNamespace

    full = Access(backfills=True, backfill_dag_id="ipcount_backfill")
    epochs_only = Access(backfills=False, backfill_dag_id="ipcount_backfill")
    refs = [SimpleNamespace(epoch=1, kind="scheduled"), SimpleNamespace(epoch=2, kind="backfill"),
            SimpleNamespace(epoch=3, kind="scheduled")]
    assert [r.epoch for r in full.visible(refs)] == [1, 2, 3]
    assert [r.epoch for r in epochs_only.visible(refs)] == [1, 3]
    full.check_target("audit", "main"), full.check_dag("ipcount_backfill")
    epochs_only.check_target("main", "main"), epochs_only.check_dag("ipcount_epoch")
    with pytest.raises(ForbiddenError, match="replay target 'audit' .* needs read access to the DAG ipcount_backfill"):
        epochs_only.check_target("audit", "main")
    with pytest.raises(ForbiddenError, match="runs of ipcount_backfill needs read access"):
        epochs_only.check_dag("ipcount_backfill")


def test_the_answer_cache_holds_at_most_its_bytes(tmp_path):
    """Any reader of the epoch DAG can ask for many distinct big answers: what the cache keeps
    of them stays within its byte bound (least recently used out first), and an answer bigger
    than the bound is returned but not kept. Measured as the Python memory the reader holds."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from ipcount.storage.delta import DeltaReader

    path = str(tmp_path / "table")
    write_deltalake(path, pa.table({"n": list(range(20_000)), "s": [f"value {i:06d}" for i in range(20_000)]}))
    reader = DeltaReader()
    reader.cache_bytes = 2_000_000
    assert reader.query(path, "SELECT count(*) AS c FROM t") == [{"c": 20_000}]   # (opens the table)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for low in range(0, 20_000, 500):    # 40 answers of 2,000 rows (about 0.5 MB each)
            rows = reader.query(path, f"SELECT * FROM t WHERE n >= {low} AND n < {low + 2000}")
            assert [r["n"] for r in rows] == list(range(low, min(low + 2000, 20_000)))
        assert len(reader.query(path, "SELECT * FROM t")) == 20_000   # bigger than the bound
        del rows
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1.5 * reader.cache_bytes, f"the reader holds {held:,} bytes of answers"
    last = "SELECT * FROM t WHERE n >= 19500 AND n < 21500"
    assert reader.query(path, last) is reader.query(path, last)       # still a cache


def test_ranges_inside_one_block_share_one_cached_answer(tmp_path):
    """The pages query epoch ranges in whole blocks of epochs and time ranges in whole hours:
    distinct ranges from a page's parameters share one cache key, and each page still gets
    exactly the epochs and windows it asked for."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from ipcount.orchestration.monitor.data import PipelineTables
    from ipcount.rules.config import PipelineConfig
    from ipcount.storage.delta import DeltaReader
    from ipcount.storage.ledger import ledger_schema

    cfg = PipelineConfig(warehouse=str(tmp_path / "warehouse"), topic="t")
    write_deltalake(cfg.ledger_path, pa.Table.from_pylist(
        [{"epoch": e, "topic": "t", "partition": 0, "from_offset": e * 10, "until_offset": e * 10 + 10,
          "status": "committed", "planned_at": T0, "run_id": f"r{e}", "kind": "scheduled"} for e in range(1, 251)],
        schema=ledger_schema()))
    minute = timedelta(minutes=1)
    windows = [T0 + i * minute for i in range(150)]    # 12:00 to 14:29, one-minute windows
    write_deltalake(cfg.counts_path, pa.Table.from_pylist(
        [{"window_start": w, "window_end": w + minute, "ip": ip, "count": i + n, "is_final": i < 100}
         for i, w in enumerate(windows) for n, ip in enumerate(("10.0.0.1", "10.0.0.2"))],
        schema=pa.schema([("window_start", pa.timestamp("us", tz="UTC")), ("window_end", pa.timestamp("us", tz="UTC")),
                          ("ip", pa.string()), ("count", pa.int64()), ("is_final", pa.bool_())])))
    reader = DeltaReader()
    tables = PipelineTables(cfg, reader)

    assert sorted(r["epoch"] for r in tables.epoch_rows([105, 110])) == [105, 110]
    assert sorted(r["epoch"] for r in tables.epoch_rows(list(range(150, 171)))) == list(range(150, 171))

    def expected(start, until):
        return [{"window_start": w, "requests": 2 * i + 1, "ips": 2, "final": i < 100}
                for i, w in enumerate(windows) if start <= w and w + minute <= until]

    for start, until in ((T0 + 5 * minute, T0 + 20 * minute), (T0 + 7.5 * minute, T0 + 50.5 * minute)):
        got = tables.requests_per_window(start, until)
        assert [{k: w[k] for k in ("window_start", "requests", "ips", "final")} for w in got] == expected(start, until)
    assert len({sql for path, _, sql in reader._answers if path == cfg.ledger_path}) == 1
    assert len({sql for path, _, sql in reader._answers if path == cfg.counts_path}) == 1


class _StalledStore(socketserver.ThreadingTCPServer):
    """An object store that takes requests and answers none until released (then: 403)."""
    daemon_threads = True

    def __init__(self) -> None:
        self.asked, self.release = threading.Event(), threading.Event()
        store = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.recv(65536)
                store.asked.set()
                store.release.wait(120)
                self.request.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

        super().__init__(("127.0.0.1", 0), Handler)


def test_the_run_note_listener_reads_no_ledger_inside_the_scheduler(monkeypatch, caplog):
    """Airflow calls the listener inside the scheduler's loop: a ledger on an object store that
    does not answer must hold up neither the hook nor, while the note's read waits, any other
    thread of the scheduler (delta-rs keeps the GIL through some waits)."""
    from ipcount.orchestration.monitor import notes

    store = _StalledStore()
    threading.Thread(target=store.serve_forever, daemon=True).start()
    monkeypatch.delenv("IPCOUNT_CONFIG", raising=False)
    monkeypatch.setenv("IPCOUNT_WAREHOUSE", "s3://stalled/warehouse")
    for name, value in (("AWS_ENDPOINT_URL", f"http://127.0.0.1:{store.server_address[1]}"), ("AWS_ALLOW_HTTP", "true"),
                        ("AWS_ACCESS_KEY_ID", "key"), ("AWS_SECRET_ACCESS_KEY", "secret"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    run = SimpleNamespace(id=1, dag_id="ipcount_epoch", run_id="scheduled__stalled", run_type="scheduled", conf={},
                          note=None)
    hook = threading.Thread(target=notes.on_dag_run_success, args=(run, "success"), daemon=True)
    try:
        started = time.monotonic()
        hook.start()
        hook.join(5)
        assert not hook.is_alive(), "the listener waited for the ledger inside the scheduler"
        assert time.monotonic() - started < 1
        assert store.asked.wait(30)     # the note's read is under way, and waits
        ticks, until = 0, time.monotonic() + 2
        while time.monotonic() < until:
            time.sleep(0.01)
            ticks += 1
        assert ticks > 50, "the scheduler's threads stood still while the note's read waited"
    finally:
        store.release.set()
        hook.join(60)
    assert notes.wait_idle(60)          # then the read fails: no note, a line in the log
    assert ("no epoch note for run scheduled__stalled: reading its ledger rows failed: StorageUnavailableError"
            in caplog.text)
    store.shutdown()


def test_the_monitor_reads_an_old_ledger_by_its_summary_and_its_newest_ids(tmp_path, monkeypatch):
    """A ledger of 3,000 epochs (a summary folded over them), then real plans and commits: a
    backfill, an epoch left planned, chain epochs. Every answer of the bounded reads equals
    the one read from every row, and a first page reads only the newest ids."""
    from deltalake import DeltaTable

    from ipcount.orchestration.monitor import data
    from ipcount.orchestration.monitor.data import PipelineTables
    from ipcount.rules.config import PipelineConfig
    from ipcount.rules.ledger import BACKFILL, EpochPlan, PartitionMetrics
    from ipcount.rules.offsets import OffsetRange
    from ipcount.storage.delta import DeltaReader
    from ipcount.storage.ledger import Ledger
    from ipcount_lab import bench_year

    cfg = PipelineConfig(warehouse=str(tmp_path / "w"), topic="t", pipeline_id="p")
    end_ms = bench_year.history_end(int(time.time() * 1000))
    ledger = Ledger(cfg.ledger_path)
    ledger.ensure()
    bench_year._ledger(cfg, bench_year.TableSet(3000, True, cfg.warehouse, "t", end_ms), 2, end_ms - 3000 * 60_000)

    def plan(epoch: int, kind: str = "scheduled", at: int | None = None) -> EpochPlan:
        at = epoch - 1 if at is None else at
        return EpochPlan(epoch, tuple(OffsetRange("t", p, at, at + 1) for p in range(2)), kind=kind,
                         request_id="req" if kind == BACKFILL else None)
    for epoch, p in ((3001, plan(3001)), (3002, plan(3002, BACKFILL, 9000)), (3003, plan(3003)),
                     (3004, plan(3004, at=3003)), (3005, plan(3005, BACKFILL, 9001))):
        ledger.record_plan(p, f"run-{epoch}")
        if epoch != 3005:   # the second backfill epoch stays planned
            ledger.commit(p, {0: PartitionMetrics(1, 1), 1: PartitionMetrics(1, 1)}, end_ms + epoch, epoch, 1.0,
                          f"run-{epoch}", lag_after={0: 7, 1: 8})

    rows = DeltaTable(cfg.ledger_path).to_pyarrow_table().to_pylist()
    rows = [r for r in rows if r["topic"] == "t"]
    every = sorted({r["epoch"] for r in rows}, reverse=True)
    kind = {r["epoch"]: r["kind"] or "scheduled" for r in rows}
    planned = {r["epoch"] for r in rows if r["status"] == "planned"}
    chain = [r for r in rows if r["status"] == "committed" and (r["kind"] or "scheduled") == "scheduled"]

    reader = DeltaReader()
    tables = PipelineTables(cfg, reader)
    assert tables.view().summary is not None and tables.view().summary.through >= 2990
    assert [r.epoch for r in tables.unfinished()] == [3005] == sorted(planned)
    assert tables.epoch_count(("scheduled", BACKFILL)) == len(every) == 3005
    assert tables.epoch_count((BACKFILL,)) == 2 and tables.epoch_count(("scheduled",), "run-3004") == 1
    assert tables.epoch_count(()) == 0 and tables.epoch_page((), None, 0, 50) == []   # no kind it may see
    page = tables.epoch_page(("scheduled", BACKFILL), None, 0, 50)
    assert [r.epoch for r in page] == every[:50] and page[0].planned and page[0].kind == BACKFILL
    assert [r.epoch for r in tables.epoch_page(("scheduled",), None, 40, 20, committed_only=True)] == \
        [e for e in every if kind[e] == "scheduled" and e not in planned][40:60]
    far = tables.epoch_page(("scheduled", BACKFILL), None, 2990, 50)   # reaches back to epoch 1
    assert [r.epoch for r in far] == every[2990:3040]
    assert tables.chain_positions() == {p: max(r["until_offset"] for r in chain if r["partition"] == p)
                                        for p in range(2)} == {0: 3004, 1: 3004}
    epoch, committed_at, watermark = tables.last_committed()
    assert (epoch, watermark) == (3004, end_ms + 3004) and committed_at is not None
    history = tables.lag_history(3)
    assert [e for e, _, _ in history] == [3001, 3003, 3004] and all(at is not None for _, at, _ in history)

    # Every read so far was bounded by epoch ids (the view's own, and one count of the epochs
    # the summary holds, aside): none read every row.
    ledger_sql = [sql for path, _, sql in reader._answers if path == cfg.ledger_path and not sql.startswith("#")]
    unbounded = [sql for sql in ledger_sql if "epoch" not in sql.split("WHERE", 1)[-1]]
    assert unbounded == [], unbounded
    monkeypatch.setattr(data, "DEEP_PAGE", 100)   # a page that far back reads every row: the same epochs
    assert [r.epoch for r in tables.epoch_page(("scheduled", BACKFILL), None, 2990, 50)] == every[2990:3040]


def test_the_scrape_token_is_private_long_enough_and_read_again_when_it_changes(tmp_path):
    import os

    from ipcount.orchestration.monitor.app import read_scrape_token
    from ipcount.rules.private_files import write_private_file

    path = write_private_file(tmp_path / "token", "a" * 32 + "\n")
    assert read_scrape_token(str(path)) == "a" * 32
    write_private_file(path, "b" * 40)
    os.utime(path, ns=(1, 1))   # a new mtime, whatever the file system's clock resolution
    assert read_scrape_token(str(path)) == "b" * 40
    write_private_file(path, "short")
    os.utime(path, ns=(2, 2))
    with pytest.raises(ConfigError, match="has 5 characters; use at least 32"):
        read_scrape_token(str(path))
    write_private_file(path, "c" * 32)
    os.chmod(path, 0o644)
    os.utime(path, ns=(3, 3))
    with pytest.raises(ConfigError, match="open to others"):
        read_scrape_token(str(path))
