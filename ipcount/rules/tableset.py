"""What a table set means, fixed when it is created (pure: no Spark, no Delta).

A table set is one target's four tables. The settings that decide what its rows count and who writes it (the pipeline id
prefixes the sink's Delta transaction ids) are recorded as table properties of all four - the **manifest** - with each
table's Delta table id, so a table recreated or pointed elsewhere beside the others is refused, never silently skipped
or doubled. Every write checks the manifest first; ``verify`` and ``rebuild`` read the recorded meaning instead of
today's settings; a rebuild's target records which ledger it rebuilds (``rebuild_of``). docs/data-model.md has more.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ipcount.rules.config import MEANING, PipelineConfig  # (MEANING: the settings declared with use "meaning")
from ipcount.rules.errors import TableSetMismatch

PREFIX = "ipcount."
# The record format's version: 2 counts IPs in canonical form, bounds event times against the Kafka timestamp and reads
# time-zone offsets as java.time does.
RECORD_FORMAT = "2"
OWNER = "pipeline_id"
FORMAT_KEY = "record_format"
LEDGER_ID, COUNTS_ID, DEAD_LETTER_ID, LATE_ID = ("ledger_table_id", "counts_table_id", "dead_letter_table_id",
                                                 "late_table_id")
TABLE_IDS = (LEDGER_ID, COUNTS_ID, DEAD_LETTER_ID, LATE_ID)
# Named since the side tables joined the manifest: a manifest recorded before lacks them, and gains them (an upgrade,
# not a change).
ADDED_IDS = (DEAD_LETTER_ID, LATE_ID)
# The Delta table id of the ledger a rebuild's target rebuilds.
REBUILD_OF = "rebuild_of"
NEW_TABLE_SET = ("start a new table set: a new warehouse, or new counts, ledger, dead-letter and late-record "
                 "locations")


def key(name: str) -> str:
    return PREFIX + name


@dataclass(frozen=True)
class Difference:
    name: str
    recorded: str | None
    wanted: str

    def text(self) -> str:
        return f"{self.name}: recorded {self.recorded if self.recorded is not None else '(none)'}, now {self.wanted}"


def locations(cfg: PipelineConfig) -> dict[str, str]:
    """Where ``cfg``'s four tables are, by the manifest entry naming each."""
    return {LEDGER_ID: cfg.ledger_path, COUNTS_ID: cfg.counts_path, DEAD_LETTER_ID: cfg.dead_letter_path,
            LATE_ID: cfg.late_path}


def manifest(cfg: PipelineConfig, table_ids: Mapping[str, str], rebuild_of: str | None = None) -> dict[str, str]:
    """The table properties a table set written with ``cfg`` carries (on all four tables); ``table_ids``: the Delta
    table id of each, by :data:`TABLE_IDS` entry; ``rebuild_of``: for a rebuild's target, the source ledger's id."""
    props = {key(name): str(getattr(cfg, name)) for name in (OWNER, *MEANING)}
    props[key(FORMAT_KEY)] = RECORD_FORMAT
    props.update({key(name): table_ids[name] for name in TABLE_IDS})
    if rebuild_of is not None:
        props[key(REBUILD_OF)] = rebuild_of
    return props


def has_manifest(properties: Mapping[str, str]) -> bool:
    return key(OWNER) in properties


def differences(recorded: Mapping[str, str], wanted: Mapping[str, str]) -> list[Difference]:
    """The manifest entries of ``wanted`` that ``recorded`` holds with another value (an :data:`ADDED_IDS` entry that it
    lacks is not one: :func:`missing`)."""
    return [Difference(k[len(PREFIX):], recorded.get(k), v) for k, v in wanted.items()
            if recorded.get(k) != v and k not in missing(recorded)]


def missing(recorded: Mapping[str, str]) -> set[str]:
    """The :data:`ADDED_IDS` entries a manifest recorded before they existed lacks."""
    return {key(name) for name in ADDED_IDS if key(name) not in recorded} if has_manifest(recorded) else set()


def check(table: str, recorded: Mapping[str, str], wanted: Mapping[str, str]) -> None:
    """Refuse to write ``table`` (its recorded manifest) with a run whose manifest differs."""
    diffs = differences(recorded, wanted)
    if not diffs:
        return
    names = {d.name for d in diffs}
    lines = "; ".join(d.text() for d in diffs)
    if names & {REBUILD_OF}:
        advice = ("a rebuild writes only into a fresh target or its own earlier rebuild of the same source; this "
                  "one holds another table set (a backfill's, or another source's rebuild), whose epochs would "
                  "pass for replayed ones and be skipped: rebuild into a new name")
    elif names & set(TABLE_IDS):
        advice = ("the tables of a set were not created together (one was deleted, replaced or pointed elsewhere): "
                  "writing would skip or double epochs, or lose their dead letters and late records. Put back "
                  f"the table that belongs with the others, or {NEW_TABLE_SET}")
    elif names & {OWNER}:
        advice = ("pipeline_id is the prefix of the sink's Delta transaction ids: changed, a replayed epoch "
                  "would be counted twice. Run with the recorded pipeline_id")
    else:
        advice = ("what a table set counts is fixed when it is created. Run with the recorded values, or count "
                  "under the new ones into a new table set: a new warehouse (or new counts, ledger, dead-letter "
                  "and late-record locations), or 'ipcount backfill --target NAME' for a replay target")
    raise TableSetMismatch(f"table set of {table} does not match this run ({lines}): {advice}")


def check_unclaimed(with_epochs: Sequence[str], ledger: str, ledger_is_new: bool, rebuild: bool) -> None:
    """Refuse tables without a manifest that hold epoch commits (``with_epochs``, their locations) where those commits
    are another set's: beside a new ledger (no manifest, no epochs), whose epochs 1..N Delta would skip there as already
    written; and in a rebuild's target. Anywhere else they are a table set of a version that recorded no manifest on
    them, which gets it."""
    if not with_epochs:
        return
    tables = ", ".join(with_epochs)
    if rebuild:
        raise TableSetMismatch(f"the rebuild's target holds epoch commits in {tables}, but no manifest (written by a "
                               "version without manifests, or not by ipcount): a rebuild writes only into a fresh "
                               "target or its own earlier rebuild of the same source; rebuild into a new name")
    if ledger_is_new:
        raise TableSetMismatch(f"epoch commits of another table set are in {tables}, but the ledger {ledger} is new: "
                               "Delta would skip its epochs 1..N there as already written, and their dead letters "
                               "and late records would vanish. Put back the ledger (and counts table) that belong "
                               f"with them, or {NEW_TABLE_SET}")


def recorded_settings(properties: Mapping[str, str]) -> dict[str, Any]:
    """The meaning settings a manifest records, as :class:`PipelineConfig` values (for ``PipelineConfig.replace``):
    verify and rebuild use them, not today's settings."""
    return {name: properties[key(name)] for name in MEANING if key(name) in properties}
