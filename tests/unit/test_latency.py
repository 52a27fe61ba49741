"""The latency figures: which epochs count, and the percentiles over their records."""
from __future__ import annotations

import pytest

from ipcount.jobs.latency import EpochLatency, chain_epochs, commit_times, percentile, report


def row(epoch, partition, start, until, version, status="committed", kind="scheduled"):
    return {"epoch": epoch, "partition": partition, "from_offset": start, "until_offset": until,
            "sink_version": version, "status": status, "kind": kind}


def test_percentiles_are_nearest_rank():
    values = list(range(1, 101))
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 100)) == (50, 95, 100)
    assert percentile([7.0], 50) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_only_the_chain_s_committed_epochs_with_counts_are_measured():
    rows = [row(1, 0, 0, 10, 3), row(1, 1, 0, 0, 3),          # an empty range is no records
            row(2, 0, 10, 20, None),                          # wrote no counts
            row(3, 0, 20, 30, 5, kind="backfill"),
            row(4, 0, 30, 40, 6, status="planned"),
            {**row(5, 0, 40, 50, 7), "kind": None},          # older rows: no kind is the chain
            row(6, 0, 50, 60, 99)]                            # its version is not in the log read
    assert chain_epochs(rows, {3: 1_000, 5: 2_000, 6: 3_000, 7: 4_000}) == [
        (1, 1_000, [(0, 0, 10)]), (5, 4_000, [(0, 40, 50)])]
    assert chain_epochs(rows, {3: 1_000, 7: 4_000}, last=1) == [(5, 4_000, [(0, 40, 50)])]


def test_a_record_waits_from_its_timestamp_to_its_epoch_s_counts_commit():
    found = report([EpochLatency(2, 10_000, (9_000, 8_000)), EpochLatency(1, 5_000, (4_500, 1_000, 2_000))])
    assert (found.epochs, found.records, found.first_epoch, found.last_epoch) == (2, 5, 1, 2)
    # waits: 1, 2, 0.5, 4, 3 s
    assert (found.p50_seconds, found.p95_seconds, found.max_seconds) == (2.0, 4.0, 4.0)
    assert "p50 2.0 s, p95 4.0 s" in found.line()
    assert report([]).records == 0 and "no counted records" in report([]).line()


def test_a_commit_landing_after_the_table_is_loaded_shifts_no_version_s_time(tmp_path):
    """delta-rs's history(n) numbers down from the loaded snapshot's version but lists the
    commits made since too: each epoch then took the next version's commit time."""
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    path = str(tmp_path / "counts")
    for n in range(3):                                           # versions 0-2
        write_deltalake(path, pa.table({"n": [n]}), mode="append")
    loads = []

    def load_then_commit():                                       # version 3 lands after the first load
        loads.append(DeltaTable(path))
        if len(loads) == 1:
            write_deltalake(path, pa.table({"n": [3]}), mode="append")
        return loads[-1]

    found = commit_times(path, 1, load_counts=load_then_commit)
    logged = {h["version"]: int(h["timestamp"]) for h in DeltaTable(path).history()}   # read with none landing
    assert found == {v: logged[v] for v in (1, 2, 3)}
