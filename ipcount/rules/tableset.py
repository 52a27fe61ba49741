"""What a table set means, fixed when it is created (pure: no Spark, no Delta).

A table set is one target's counts table and ledger (with its dead-letter and late-record
tables). The settings that decide what its rows count - the window, the lateness, where
event time comes from, the parser's limits, the record format - and who writes it (the
pipeline id is the prefix of the sink's Delta ``txnAppId``) are recorded as table
properties of both the counts table and the ledger: the **manifest**. Each also names the
other by its Delta table id, so a ledger recreated beside an old counts table (whose
transaction ids would make Delta silently skip the new ledger's epochs 1..N), or a
counts table recreated beside a ledger with history, is refused, never skipped or
doubled.

Every epoch, resume, backfill and rebuild checks the manifest against its configuration
before it writes; ``verify`` and ``rebuild`` read the recorded meaning instead of
today's settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from ipcount.rules.errors import TableSetMismatch

if TYPE_CHECKING:
    from ipcount.rules.config import PipelineConfig

PREFIX = "ipcount."
# The settings that decide what the rows mean.
MEANING = ("topic", "window_seconds", "allowed_lateness_seconds", "event_time", "max_value_bytes",
           "max_event_time_ahead_seconds")
# The record format's version: 2 counts IPs in canonical form, bounds event times against
# the Kafka timestamp and reads time-zone offsets as java.time does.
RECORD_FORMAT = "2"
OWNER = "pipeline_id"
FORMAT_KEY, LEDGER_ID, COUNTS_ID = "record_format", "ledger_table_id", "counts_table_id"


def key(name: str) -> str:
    return PREFIX + name


@dataclass(frozen=True)
class Difference:
    name: str
    recorded: str | None
    wanted: str

    def text(self) -> str:
        return f"{self.name}: recorded {self.recorded if self.recorded is not None else '(none)'}, now {self.wanted}"


def manifest(cfg: PipelineConfig, ledger_id: str, counts_id: str) -> dict[str, str]:
    """The table properties a table set written with ``cfg`` carries (on both tables)."""
    props = {key(name): str(getattr(cfg, name)) for name in (OWNER, *MEANING)}
    props[key(FORMAT_KEY)] = RECORD_FORMAT
    props[key(LEDGER_ID)], props[key(COUNTS_ID)] = ledger_id, counts_id
    return props


def has_manifest(properties: Mapping[str, str]) -> bool:
    return key(OWNER) in properties


def differences(recorded: Mapping[str, str], wanted: Mapping[str, str]) -> list[Difference]:
    """The manifest entries of ``wanted`` that ``recorded`` holds with another value."""
    return [Difference(k[len(PREFIX):], recorded.get(k), v) for k, v in wanted.items() if recorded.get(k) != v]


def check(table: str, recorded: Mapping[str, str], wanted: Mapping[str, str]) -> None:
    """Refuse to write ``table`` (its recorded manifest) with a run whose manifest differs."""
    diffs = differences(recorded, wanted)
    if not diffs:
        return
    names = {d.name for d in diffs}
    lines = "; ".join(d.text() for d in diffs)
    if names & {LEDGER_ID, COUNTS_ID}:
        advice = ("the counts table and the ledger were not created together (one was deleted or replaced): "
                  "writing would skip or double epochs. Put back the table that belongs with the other, or "
                  "start a new table set (a new warehouse, or new counts and ledger locations)")
    elif names & {OWNER}:
        advice = ("pipeline_id is the prefix of the sink's Delta transaction ids: changed, a replayed epoch "
                  "would be counted twice. Run with the recorded pipeline_id")
    else:
        advice = ("what a table set counts is fixed when it is created. Run with the recorded values, or count "
                  "under the new ones into a new table set: a new warehouse (or counts and ledger locations), "
                  "or 'ipcount backfill --target NAME' for a replay target")
    raise TableSetMismatch(f"table set of {table} does not match this run ({lines}): {advice}")


def recorded_settings(properties: Mapping[str, str]) -> dict[str, Any]:
    """The meaning settings a manifest records, as :class:`PipelineConfig` values (for
    ``PipelineConfig.replace``): verify and rebuild use them, not today's settings."""
    return {name: properties[key(name)] for name in MEANING if key(name) in properties}
