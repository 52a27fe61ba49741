"""Publishing to the sink topic against the real broker: the folded topic equals the counts
table, every version is published exactly once across kills, a zombie publisher is fenced.

These tests write the counts table's versions with delta-rs (MERGEs with change data feed,
the commit info an epoch's MERGE carries), so they need no Spark; the epoch's own MERGE is
published in the epoch tests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import ProducerFencedError
from kafka.structs import OffsetAndMetadata

from ipcount.jobs.publish import publish_pending
from ipcount.rules.config import COMMAND_SETTINGS, REPO_ROOT, PipelineConfig
from ipcount.rules.errors import PublisherFenced
from ipcount.rules.publish import CHANGE_DATA_FEED, Cursor, SinkRecord
from ipcount.storage.publisher import Publisher, create_sink_topic

SCHEMA = pa.schema([("window_start", pa.timestamp("us", "UTC")), ("window_end", pa.timestamp("us", "UTC")),
                    ("ip", pa.string()), ("count", pa.int64()), ("first_epoch", pa.int64()),
                    ("last_epoch", pa.int64()), ("is_final", pa.bool_())])
W = datetime(2026, 11, 21, 10, tzinfo=timezone.utc)


@pytest.fixture
def pub_cfg(broker, tmp_path) -> PipelineConfig:
    from deltalake import DeltaTable, write_deltalake

    name = uuid.uuid4().hex[:8]
    cfg = PipelineConfig(bootstrap_servers=broker.bootstrap_servers, pipeline_id=f"pub_{name}", topic=f"src_{name}",
                         warehouse=str(tmp_path / "warehouse"), publish=True, publish_topic=f"sink_{name}")
    # Made with the feed off, as by a pipeline that had publishing off until now.
    write_deltalake(cfg.counts_path, pa.Table.from_pylist([], schema=SCHEMA))
    DeltaTable(cfg.counts_path).alter.set_table_properties({CHANGE_DATA_FEED: "true"})
    return cfg


def merge_epoch(cfg: PipelineConfig, epoch: int, counts: dict[tuple[int, str], int], final_before: int | None = None):
    """An epoch's counts MERGE as the sink does it: add counts (window index, ip), mark
    windows before ``final_before`` final, with the commit info ``epoch=N``."""
    from deltalake import CommitProperties, DeltaTable

    rows = [{"window_start": W + timedelta(seconds=5 * w), "window_end": W + timedelta(seconds=5 * w + 5), "ip": ip,
             "count": n, "first_epoch": epoch, "last_epoch": epoch,
             "is_final": final_before is not None and w < final_before} for (w, ip), n in counts.items()]
    final = "false" if final_before is None else \
        f"t.window_end <= '{(W + timedelta(seconds=5 * final_before)).isoformat()}'"
    merge = (DeltaTable(cfg.counts_path)
             .merge(pa.Table.from_pylist(rows, schema=SCHEMA), "t.window_start = s.window_start AND t.ip = s.ip",
                    source_alias="s", target_alias="t",
                    commit_properties=CommitProperties(custom_metadata={"userMetadata": f"epoch={epoch}"}))
             .when_matched_update({"count": "t.count + s.count", "last_epoch": "s.last_epoch",
                                   "is_final": f"t.is_final OR s.is_final OR {final}"})
             .when_not_matched_insert_all())
    if final_before is not None:
        merge = merge.when_not_matched_by_source_update({"is_final": "true"}, predicate=f"NOT t.is_final AND {final}")
    merge.execute()


def table_now(cfg: PipelineConfig) -> dict[tuple[str, str], tuple[int, bool]]:
    from deltalake import DeltaTable

    rows = DeltaTable(cfg.counts_path).to_pyarrow_table().to_pylist()
    return {(r["window_start"].isoformat(timespec="milliseconds").replace("+00:00", "Z"), r["ip"]):
            (r["count"], r["is_final"]) for r in rows}


def sink(cfg: PipelineConfig, isolation: str = "read_committed") -> list:
    consumer = KafkaConsumer(bootstrap_servers=cfg.bootstrap_servers, isolation_level=isolation,
                             enable_auto_commit=False, consumer_timeout_ms=3000)
    consumer.assign([TopicPartition(cfg.publish_topic, p) for p in range(3)])
    consumer.seek_to_beginning()
    try:
        return list(consumer)
    finally:
        consumer.close()


def folded(records) -> dict[tuple[str, str], tuple[int, bool]]:
    out = {}
    for r in records:
        key, value = json.loads(r.key), json.loads(r.value)
        out[(key["window_start"], key["ip"])] = (value["count"], value["is_final"])
    return out


def per_version(records) -> Counter:
    return Counter(dict(r.headers)["ipcount-version"].decode() for r in records)


def test_the_folded_topic_equals_the_counts_table_and_each_version_is_sent_once(pub_cfg):
    cfg = pub_cfg
    merge_epoch(cfg, 1, {(0, "10.0.0.1"): 2, (0, "10.0.0.2"): 1})
    first = publish_pending(cfg)          # the table whole, as of version 2 (0: creation, 1: the feed on)
    assert [(v, e, n) for v, e, n in first.published] == [(2, None, 2)]
    merge_epoch(cfg, 2, {(0, "10.0.0.1"): 3, (1, "10.0.0.3"): 1}, final_before=1)   # window 0 now final
    merge_epoch(cfg, 4, {(1, "10.0.0.3"): 2})     # a backfill-like epoch committing out of order
    merge_epoch(cfg, 3, {(0, "10.0.0.2"): 1})     # into the final window: a correction
    report = publish_pending(cfg)
    assert [(v, e) for v, e, _ in report.published] == [(3, 2), (4, 4), (5, 3)]
    assert report.cursor == Cursor(report.cursor.table_id, 6, 3)
    records = sink(cfg)
    assert folded(records) == table_now(cfg)
    # version 2 changed both rows of window 0 (one counted, one only finalized) and added one
    assert per_version(records) == Counter({"2": 2, "3": 3, "4": 1, "5": 1})
    assert {json.loads(r.value)["kind"] for r in records if dict(r.headers)["ipcount-version"] == b"2"} == {"snapshot"}
    correction = [json.loads(r.value) for r in records if dict(r.headers)["ipcount-version"] == b"5"]
    assert correction[0]["correction"] and correction[0]["count"] == 2 and correction[0]["epoch"] == 3
    assert publish_pending(cfg).published == [] and len(sink(cfg)) == len(records)   # nothing new, nothing sent


@pytest.mark.parametrize("point", ["publish_before_commit", "publish_after_commit"])
def test_a_publisher_killed_mid_publish_leaves_no_version_twice_and_none_out(pub_cfg, point):
    cfg = pub_cfg
    merge_epoch(cfg, 1, {(0, "10.0.0.1"): 1})
    publish_pending(cfg)
    merge_epoch(cfg, 2, {(0, "10.0.0.1"): 1, (0, "10.0.0.9"): 4})
    proc = subprocess.run([sys.executable, "-m", "ipcount.cli", "publish", *cfg.to_args(COMMAND_SETTINGS["publish"])], cwd=REPO_ROOT,
                          env={**os.environ, "IPCOUNT_CRASH_AT": point}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    again = publish_pending(cfg)     # fences the dead one (aborting its open transaction), then goes on
    assert [v for v, _, _ in again.published] == ([] if point == "publish_after_commit" else [3])
    records = sink(cfg)
    assert per_version(records) == Counter({"2": 1, "3": 2}) and folded(records) == table_now(cfg)
    if point == "publish_before_commit":  # the killed attempt's records exist, aborted
        assert per_version(sink(cfg, "read_uncommitted"))["3"] == 4


def test_a_zombie_publisher_is_fenced_and_its_records_stay_invisible(pub_cfg):
    cfg = pub_cfg
    create_sink_topic(cfg, cfg.publish_topic)
    zombie = Publisher(cfg, cfg.publish_topic)
    zombie.producer.begin_transaction()
    zombie.producer.send(cfg.publish_topic, key=b"k", value=b"from the zombie")
    zombie.producer.flush()
    live = Publisher(cfg, cfg.publish_topic)   # a retry of the task, say
    try:
        with pytest.raises(ProducerFencedError):   # the zombie's commit of its open transaction
            zombie.producer.send_offsets_to_transaction(
                {TopicPartition(cfg.publish_topic, 0): OffsetAndMetadata(9, Cursor("t", 9).metadata(), -1)},
                f"{cfg.pipeline_id}-publisher")
            zombie.producer.commit_transaction()
        assert live.publish([SinkRecord(b"k", b"live", ())], Cursor("t", 1)) == 1
        assert live.cursor() == Cursor("t", 1)
        with pytest.raises(PublisherFenced, match="took over"):   # the zombie's next publish, too
            zombie.publish([SinkRecord(b"k", b"zombie again", ())], Cursor("t", 2))
    finally:
        live.close()
        zombie.close()
    assert [r.value for r in sink(cfg)] == [b"live"]


def test_the_monitor_shows_the_cursor_and_a_sink_consumer_s_lag(pub_cfg):
    from ipcount.orchestration.monitor.data import BrokerProbe, publish_status

    cfg = pub_cfg
    merge_epoch(cfg, 1, {(0, "10.0.0.1"): 1, (0, "10.0.0.2"): 1})
    publish_pending(cfg)
    merge_epoch(cfg, 2, {(1, "10.0.0.1"): 1})
    status = publish_status(cfg, group="alerts")
    assert status["error"] is None and (status["counts_version"], status["next_version"]) == (3, 3)
    assert BrokerProbe(ttl_seconds=0).published_until(cfg) == 3   # the epochs page: epoch 2 not yet
    assert status["versions_behind"] == 1 and status["last_epoch"] is None  # (the snapshot has no epoch)
    assert all(p["group_offset"] is None for p in status["group"]["partitions"])
    publish_pending(cfg)
    consumer = KafkaConsumer(cfg.publish_topic, bootstrap_servers=cfg.bootstrap_servers, group_id="alerts",
                             isolation_level="read_committed", auto_offset_reset="earliest",
                             enable_auto_commit=False, consumer_timeout_ms=5000)
    assert len(list(consumer)) == 3
    consumer.commit()
    consumer.close()
    status = publish_status(cfg, group="alerts")
    assert (status["versions_behind"], status["last_epoch"]) == (0, 2)
    assert BrokerProbe(ttl_seconds=0).published_until(cfg) == 4
    # (a transaction's commit marker takes an offset: a read_committed consumer's position passes it)
    assert sum(p["lag"] for p in status["group"]["partitions"]) == 0
    assert publish_status(cfg.replace(publish=False)) == {"publish": False}


def test_an_epoch_killed_while_publishing_is_published_once_from_the_merge_s_change_feed(cfg, spark):
    """The real path: `ipcount epoch` with publishing on (the counts MERGE writes the change
    data feed), killed with the records sent but not committed; the next epoch run publishes
    the version once, and more epochs go on from there."""
    from ipcount.jobs.epoch import run_epoch
    from ipcount.orchestration.monitor.data import BrokerProbe
    from ipcount_lab.generator import TrafficGenerator, produce
    from tests.tables import counts, ledger_rows

    cfg = cfg.replace(publish=True, publish_topic=f"sink_{cfg.topic}", max_records_per_epoch=150)
    gen = TrafficGenerator(seed=51, events_per_second=40, late_share=0.05, malformed_share=0.03)
    produce(cfg.bootstrap_servers, cfg.topic, gen.records(300, 1_795_255_200_000), partition_of=lambda i, r: i % 3)
    proc = subprocess.run([sys.executable, "-m", "ipcount.cli", "epoch", *cfg.to_args()], cwd=REPO_ROOT,
                          env={**os.environ, "IPCOUNT_CRASH_AT": "publish_before_commit"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert run_epoch(cfg, spark) is not None   # epoch 2 (in-process: it does not publish)
    report = publish_pending(cfg)              # epoch 1's version again, then epoch 2's
    sink_versions = {r["epoch"]: r["sink_version"] for r in ledger_rows(cfg.ledger_path)}
    assert BrokerProbe(ttl_seconds=0).published_until(cfg) == max(sink_versions.values()) + 1  # the monitor
    assert [e for _, e, _ in report.published if e is not None] == [1, 2]
    records = sink(cfg)
    versions = per_version(records)
    assert all(n == len({r.key for r in records if dict(r.headers)["ipcount-version"].decode() == v})
               for v, n in versions.items())   # no key twice in one version
    got = Counter({(_ms(json.loads(r.value)["window_start"]), json.loads(r.value)["ip"]): json.loads(r.value)["count"]
                   for r in records})
    assert got == counts(cfg) and {json.loads(r.value)["kind"] for r in records} == {"live"}
    # The killed attempt's records of epoch 1 are in the log, aborted: only read_uncommitted sees them.
    epoch_1 = {v for v, e, _ in report.published if e == 1}.pop()
    assert per_version(sink(cfg, "read_uncommitted"))[str(epoch_1)] == 2 * versions[str(epoch_1)] > 0


def _ms(text: str) -> int:
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def test_a_replaced_counts_table_is_refused_until_resync_sends_it_whole(pub_cfg):
    import shutil

    from deltalake import DeltaTable, write_deltalake

    from ipcount.rules.errors import ConfigError

    cfg = pub_cfg
    merge_epoch(cfg, 1, {(0, "10.0.0.1"): 1})
    publish_pending(cfg)
    shutil.rmtree(cfg.counts_path)   # a rebuild swapped in: another table, versions from 0 again
    write_deltalake(cfg.counts_path, pa.Table.from_pylist([], schema=SCHEMA))
    DeltaTable(cfg.counts_path).alter.set_table_properties({CHANGE_DATA_FEED: "true"})
    merge_epoch(cfg, 1, {(0, "10.0.0.1"): 2, (0, "10.0.0.7"): 1})
    with pytest.raises(ConfigError, match="the table is now .*--resync"):
        publish_pending(cfg)
    report = publish_pending(cfg, resync=True)
    assert [(v, e, n) for v, e, n in report.published] == [(2, None, 2)]
    assert folded(sink(cfg)) == table_now(cfg)


def test_a_change_no_epoch_made_stops_publishing_loudly(pub_cfg):
    from deltalake import CommitProperties, DeltaTable

    from ipcount.rules.errors import ConfigError

    cfg = pub_cfg
    merge_epoch(cfg, 1, {(0, "10.0.0.1"): 1})
    publish_pending(cfg)
    DeltaTable(cfg.counts_path).update(updates={"count": "count + 100"},  # a hand-made fix, say
                                       commit_properties=CommitProperties(custom_metadata={"userMetadata": "fix"}))
    with pytest.raises(ConfigError, match="counts version 3 changed 1 row.* but no epoch made it"):
        publish_pending(cfg)
    assert folded(sink(cfg)) != table_now(cfg)  # nothing of it was sent


def test_a_cursor_kafka_expired_is_taken_from_the_topic_and_nothing_is_sent_twice(pub_cfg):
    """Kafka deletes an idle group's offsets after offsets.retention.minutes; deleting the
    publisher group does the same at once."""
    from deltalake import DeltaTable

    from ipcount.storage.broker import admin_client
    from ipcount.storage.publisher import publisher_id, read_cursor

    cfg = pub_cfg
    merge_epoch(cfg, 1, {(0, "10.0.0.1"): 1, (1, "10.0.0.2"): 2})
    merge_epoch(cfg, 2, {(1, "10.0.0.2"): 1})
    assert [(v, n) for v, _, n in publish_pending(cfg).published] == [(3, 2)]   # the table whole, as of 3
    DeltaTable(cfg.counts_path).alter.set_table_properties({"delta.logRetentionDuration": "interval 31 days"})
    assert [v for v, _, _ in publish_pending(cfg).published] == [4]  # a version without records
    before = per_version(sink(cfg))
    with admin_client(cfg) as admin:
        admin.delete_groups([publisher_id(cfg)])
    assert read_cursor(cfg, cfg.publish_topic) is None
    merge_epoch(cfg, 3, {(2, "10.0.0.3"): 4})
    report = publish_pending(cfg)
    assert [(v, e, n) for v, e, n in report.published] == [(4, None, 0), (5, 3, 1)]  # 4 again: the cursor only
    assert per_version(sink(cfg)) == before + Counter({"5": 1})
    assert folded(sink(cfg)) == table_now(cfg) and read_cursor(cfg, cfg.publish_topic).next_version == 6


def sink_policy(cfg: PipelineConfig, policy: str) -> None:
    """Set the sink topic's cleanup.policy, as an operator does with kafka-configs."""
    from kafka.admin import ConfigResource, ConfigResourceType

    from ipcount.storage.broker import admin_client

    with admin_client(cfg) as admin:
        answer = admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, cfg.publish_topic,
                                                     {"cleanup.policy": policy})])
    assert answer["topic"][cfg.publish_topic] == "OK", answer


@pytest.mark.parametrize("policy", ["delete", "compact,delete"])
def test_a_sink_topic_that_deletes_by_time_is_refused_until_it_is_compacted_only(pub_cfg, policy):
    """Time retention would empty the topic: consumers could no longer fold it into the
    table, and a publisher whose cursor expired meanwhile would find nothing to go on from."""
    from ipcount.rules.errors import ConfigError
    from ipcount.storage.broker import admin_client

    cfg = pub_cfg
    with admin_client(cfg) as admin:
        admin.create_topics({cfg.publish_topic: {"num_partitions": 3, "configs": {"cleanup.policy": policy}}},
                            wait_for_metadata=True)
    merge_epoch(cfg, 1, {(0, "10.0.0.1"): 1})
    with pytest.raises(ConfigError, match=rf"sink topic {cfg.publish_topic} has cleanup.policy={policy}.*"
                                          r"--add-config cleanup.policy=compact"):
        publish_pending(cfg)
    assert sink(cfg) == []
    sink_policy(cfg, "compact")   # what the message asks for
    assert [n for _, _, n in publish_pending(cfg).published] == [1]
    assert folded(sink(cfg)) == table_now(cfg)


def test_a_sink_topic_the_publisher_creates_is_compacted_only(pub_cfg):
    from kafka.admin import ConfigResource, ConfigResourceType

    from ipcount.storage.broker import admin_client

    cfg = pub_cfg
    assert create_sink_topic(cfg, cfg.publish_topic) and not create_sink_topic(cfg, cfg.publish_topic)
    with admin_client(cfg) as admin:
        described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, cfg.publish_topic,
                                                           ["cleanup.policy"])], config_filter="all")
    assert described["topic"][cfg.publish_topic]["cleanup.policy"]["value"] == "compact"


def test_a_cursor_expired_over_an_emptied_sink_topic_does_not_start_again_from_version_0(pub_cfg):
    """The topic was emptied by time retention (cleanup.policy=delete, since set right) and
    Kafka expired the publisher group's offsets: nothing in the topic says how far publishing
    got, but records were deleted from it, so it did publish. Sending every version again is
    for the operator to ask for."""
    import shutil

    from deltalake import write_deltalake
    from kafka import TopicPartition

    from ipcount.rules.errors import ConfigError
    from ipcount.storage.broker import admin_client
    from ipcount.storage.publisher import committed_reader, publisher_id, read_cursor

    cfg = pub_cfg
    shutil.rmtree(cfg.counts_path)  # the feed on from version 0: a first publish sends every version
    write_deltalake(cfg.counts_path, pa.Table.from_pylist([], schema=SCHEMA),
                    configuration={CHANGE_DATA_FEED: "true"})
    for epoch in (1, 2, 3):
        merge_epoch(cfg, epoch, {(epoch, "10.0.0.1"): epoch, (epoch, "10.0.0.2"): 1})
    assert [(v, n) for v, _, n in publish_pending(cfg).published] == [(0, 0), (1, 2), (2, 2), (3, 2)]
    sink_policy(cfg, "delete")
    with committed_reader(cfg) as consumer:   # retention deletes every record, as it does once they are old
        parts = [TopicPartition(cfg.publish_topic, p) for p in range(3)]
        ends = consumer.end_offsets(parts)
    with admin_client(cfg) as admin:
        admin.delete_records(ends)
        admin.delete_groups([publisher_id(cfg)])   # what offsets.retention.minutes does to an idle group
    sink_policy(cfg, "compact")
    assert sink(cfg) == [] and read_cursor(cfg, cfg.publish_topic) is None
    merge_epoch(cfg, 4, {(4, "10.0.0.3"): 1})
    with pytest.raises(ConfigError, match=rf"cursor .* is gone.* {cfg.publish_topic} .*`ipcount publish --resync`"):
        publish_pending(cfg)
    assert sink(cfg) == [] and read_cursor(cfg, cfg.publish_topic) is None   # nothing sent
    report = publish_pending(cfg, resync=True)   # asked for: the table whole, once
    assert [(v, e, n) for v, e, n in report.published] == [(4, None, 7)]
    assert folded(sink(cfg)) == table_now(cfg) and read_cursor(cfg, cfg.publish_topic).next_version == 5
    assert publish_pending(cfg).published == []


def test_the_counts_log_keeps_what_is_not_published_and_the_publisher_then_cleans_it(pub_cfg):
    """Once published, no checkpoint deletes counts commits the publisher has not sent, however
    old, nor does maintenance, nor a run with publishing off; once it has sent them, the
    publisher lets them go."""
    from deltalake import DeltaTable

    from ipcount.jobs.maintenance import run_maintenance
    from ipcount.rules.maintenance import log_properties
    from ipcount.storage.delta import CHECKPOINT_EVERY
    from ipcount.storage.sink import Sink

    cfg = pub_cfg
    # What the sink's ensure() gives a published counts table (version 2).
    DeltaTable(cfg.counts_path).alter.set_table_properties({**CHECKPOINT_EVERY, **log_properties(1, published=True)})
    log_dir = os.path.join(cfg.counts_path, "_delta_log")

    def versions() -> list[int]:
        return sorted(int(n.split(".")[0]) for n in os.listdir(log_dir) if n.endswith(".json"))

    merge_epoch(cfg, 1, {(0, "10.0.0.1"): 1})
    assert publish_pending(cfg).cursor.next_version == 4   # version 3 sent whole; from 4 on, version by version
    for epoch in range(2, 14):
        merge_epoch(cfg, epoch, {(epoch % 4, f"10.0.0.{epoch % 3}"): epoch})
    old = datetime.now().timestamp() - 3 * 3600   # three hours back: past the retention (1 h)
    for name in os.listdir(log_dir):
        os.utime(os.path.join(log_dir, name), (old, old))
    for epoch in range(14, 26):
        merge_epoch(cfg, epoch, {(epoch % 4, f"10.0.0.{epoch % 3}"): epoch})   # checkpoints on the way
    assert versions()[0] == 0                  # no checkpoint deleted a commit
    # A run with publishing off (reconfigured, or just without IPCOUNT_PUBLISH) neither turns
    # the cleanup on nor cleans: the table was published, and versions 4.. are not sent yet.
    Sink(cfg.replace(publish=False)).ensure()
    assert DeltaTable(cfg.counts_path).metadata().configuration["delta.enableExpiredLogCleanup"] == "false"
    counts_run = {t.table: t for t in run_maintenance(cfg.replace(publish=False)).tables}["counts"]
    assert any("log kept" in n for n in counts_run.notes), counts_run.notes
    assert versions()[0] == 0                  # nor did maintenance

    latest = DeltaTable(cfg.counts_path).version()   # (27, and maintenance's commits after it)
    report = publish_pending(cfg)              # reads the change data feed of versions 4..latest
    assert [v for v, _, _ in report.published] == list(range(4, latest + 1))
    records = sink(cfg)
    assert folded(records) == table_now(cfg)
    assert set(per_version(records)) == {str(v) for v in range(3, 28)}   # the snapshot, then each MERGE
    # Sent, then let go: aged commits below a checkpoint left the log (delta-rs keeps those from
    # the checkpoint that a version still within the retention is read from: here 9).
    assert versions()[0] > 3
    assert publish_pending(cfg).published == [] and len(sink(cfg)) == len(records)
