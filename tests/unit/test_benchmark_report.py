"""The benchmark's report arithmetic: throughput ratios and the printed table."""
from __future__ import annotations

from ipcount.devtools.benchmark import Measurement, ratios, table


def m(name, wall, work, records=1000, peak=512.0):
    return Measurement(name, name, records, wall, work, peak, {"read": work / 2} if name == "pipeline" else {})


def test_ratios_are_throughput_ratios():
    results = {"pipeline": m("pipeline", 20.0, 10.0), "peer": m("peer", 30.0, 20.0),
               "spark_count": m("spark_count", 8.0, 2.0), "kafka_python": m("kafka_python", 4.0, 4.0, peak=None)}
    rs = ratios(results)
    assert rs["pipeline / peer (work)"] == 2.0 and rs["pipeline / peer (wall)"] == 1.5
    assert rs["pipeline / spark read limit (work)"] == 0.2
    assert rs["pipeline / kafka-python drain (work)"] == 0.4
    assert ratios({"peer": m("peer", 1, 1)}) == {}  # nothing to compare without the pipeline


def test_table_lists_each_measurement_and_ratio():
    results = {"pipeline": m("pipeline", 20.0, 10.0), "kafka_python": m("kafka_python", 4.0, 4.0, peak=None)}
    text = table(results, ratios(results))
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["measurement", "records"]
    assert lines[1].split()[:6] == ["pipeline", "1000", "20.0", "10.0", "100", "512"] and "read 5.00" in lines[1]
    assert lines[2].split()[:6] == ["kafka_python", "1000", "4.0", "4.0", "250", "-"]
    assert "pipeline / kafka-python drain (work)" in text
    assert m("x", 1, 0).records_per_second == 0.0


def test_history_growth_and_empty_epoch_ratios():
    results = {"epoch_after_1": m("epoch_after_1", 40.0, 20.0), "epoch_after_100": m("epoch_after_100", 44.0, 24.0),
               "server_epoch_after_2": m("server_epoch_after_2", 5.0, 4.0),
               "server_epoch_after_101": m("server_epoch_after_101", 6.0, 5.0),
               "empty_submit": m("empty_submit", 12.0, 0.5, records=0), "empty_server": m("empty_server", 0.2, 0.1, 0),
               "idle_check": m("idle_check", 1.5, 0.3, records=0, peak=None)}
    rs = ratios(results)
    # Time ratios (later / earlier), the server's measured from its own first epoch.
    assert rs["epoch after 100 / after 1 (work)"] == 1.2 and rs["epoch after 100 / after 1 (wall)"] == 1.1
    assert rs["epoch server: epoch after 101 / after 2 (work)"] == 1.25
    assert rs["empty epoch: spark-submit / idle check (wall)"] == 8.0
    assert rs["empty epoch: spark-submit / empty server (wall)"] == 60.0
    assert "empty epoch through spark-submit: 12.0 s wall" in table(results, rs)
