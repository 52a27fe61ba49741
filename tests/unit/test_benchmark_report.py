"""The benchmark's report arithmetic: throughput ratios and the printed table."""
from __future__ import annotations

from ipcount.benchmark import Measurement, ratios, table


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
