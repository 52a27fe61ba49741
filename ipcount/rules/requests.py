"""Backfill requests: what to count, into which target. Pure parsing and checks, no I/O.

A request names either per-partition offset ranges (``"0:100-200,2:0-50"``, half-open ``[from, until)``) or a time range
that the broker's offsets-for-times lookup turns into offsets, and a target: ``main`` (the pipeline's own tables) or the
name of a replay table set with its own ledger. Everything a user typed is checked here, before anything is written, and
never reaches SQL text or a file path unchecked.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

from ipcount.rules.errors import BadRequestError
from ipcount.rules.offsets import OffsetRange, describe

MAIN_TARGET = "main"
_TARGET = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
_SPEC_ITEM = re.compile(r"^(\d+)\s*:\s*(\d+)\s*-\s*(\d+)$")


def check_target(name: str) -> str:
    """``main`` or a plain lower-case identifier (it becomes a directory name)."""
    if not isinstance(name, str) or not _TARGET.match(name):
        raise BadRequestError(
            f"target must be 'main' or a plain identifier (lower-case letters, digits and '_', starting "
            f"with a letter, at most 63 characters); found {name!r}")
    return name


def parse_offsets(spec: str, topic: str) -> tuple[OffsetRange, ...]:
    """``"0:100-200, 2:0-50"`` -> ranges; a partition may appear more than once, but its ranges must not overlap."""
    ranges: list[OffsetRange] = []
    for item in filter(None, (x.strip() for x in str(spec).split(","))):
        m = _SPEC_ITEM.match(item)
        if not m:
            raise BadRequestError(f"offsets entry {item!r} is not partition:from-until (e.g. '0:100-200'; "
                                  "from inclusive, until exclusive)")
        partition, start, until = (int(g) for g in m.groups())
        if until <= start:
            raise BadRequestError(f"offsets entry {item!r}: until ({until}) must be greater than from ({start})")
        ranges.append(OffsetRange(topic, partition, start, until))
    if not ranges:
        raise BadRequestError("offsets is empty; expected partition:from-until[,...], e.g. '0:100-200'")
    ranges.sort()
    for a, b in zip(ranges, ranges[1:]):
        if a.partition == b.partition and b.from_offset < a.until_offset:
            raise BadRequestError(f"offsets ranges {a} and {b} overlap; give each offset once")
    return tuple(ranges)


# Kafka record timestamps are epoch milliseconds >= 0; Python's datetime ends with year 9999.
MAX_TIME_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z


def parse_time(text: str | int, what: str) -> int:
    """ISO 8601 (``2026-11-21T10:00:00Z``; no zone means UTC) or epoch milliseconds -> ms, between 1970 and the end of
    year 9999."""
    if isinstance(text, int) and not isinstance(text, bool):
        ms, raw = text, str(text)
    else:
        raw = str(text).strip()
        if re.fullmatch(r"-?\d{1,30}", raw):
            ms = int(raw)
        else:
            try:
                when = datetime.fromisoformat(raw)
            except ValueError:
                raise BadRequestError(f"{what} {raw!r} is not an ISO 8601 time (e.g. 2026-11-21T10:00:00Z) "
                                      "or epoch milliseconds") from None
            if when.tzinfo is None:
                when = when.replace(tzinfo=timezone.utc)
            ms = int(when.timestamp() * 1000)
    if not 0 <= ms <= MAX_TIME_MS:
        raise BadRequestError(f"{what} {raw!r} is out of range: a time must lie between 1970-01-01T00:00:00Z "
                              f"(0 ms) and 9999-12-31T23:59:59.999Z ({MAX_TIME_MS} ms)")
    return ms


def format_ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class BackfillRequest:
    """Count ``offsets`` (or the records with timestamps in ``[from_ms, until_ms)``) into ``target``."""

    target: str = MAIN_TARGET
    offsets: tuple[OffsetRange, ...] = ()
    from_ms: int | None = None
    until_ms: int | None = None

    def __post_init__(self) -> None:
        check_target(self.target)
        by_time = self.from_ms is not None or self.until_ms is not None
        if bool(self.offsets) == by_time:
            raise BadRequestError("give either offsets or a time range (from and until), not both and not neither")
        if by_time:
            if self.from_ms is None or self.until_ms is None:
                raise BadRequestError("a time range needs both from and until")
            if self.until_ms <= self.from_ms:
                raise BadRequestError(f"until ({format_ms(self.until_ms)}) must be after from "
                                      f"({format_ms(self.from_ms)})")

    @property
    def by_time(self) -> bool:
        return self.from_ms is not None

    @property
    def request_id(self) -> str:
        """Stable for the same request, so re-running it after a crash continues the same backfill (its chunks chain
        their watermark) instead of starting another."""
        what = (f"time:{self.from_ms}-{self.until_ms}" if self.by_time
                else "offsets:" + ",".join(str(r) for r in self.offsets))
        return "bf-" + hashlib.sha256(f"{self.target}|{what}".encode()).hexdigest()[:12]

    def describe(self) -> str:
        what = (f"records with timestamps in [{format_ms(self.from_ms)}, {format_ms(self.until_ms)})"
                if self.by_time else describe(self.offsets))
        return f"{what} into target {self.target}"

    def check_time(self, now_ms: int) -> None:
        if self.by_time and self.until_ms > now_ms:
            raise BadRequestError(
                f"the time range ends in the future ({format_ms(self.until_ms)} is after now, "
                f"{format_ms(now_ms)}); records that do not exist yet cannot be backfilled - end it at "
                "or before now")


REQUEST_FIELDS = ("target", "offsets", "from_time", "until_time")


def json_object(given: Mapping[str, Any] | str, what: str, known: Sequence[str]) -> dict[str, Any]:
    """``given`` (or the JSON text of it) as an object of only ``known`` fields; else a BadRequestError naming
    ``what``."""
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except ValueError as e:
            raise BadRequestError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(given, Mapping):
        raise BadRequestError(f"{what} must be a JSON object")
    if unknown := sorted(set(given) - set(known)):
        raise BadRequestError(f"unknown field(s) {', '.join(unknown)} in {what}; known: {', '.join(known)}")
    return dict(given)


def request_from_fields(fields: Mapping[str, Any] | str, topic: str,
                        time_names: tuple[str, str] = ("from_time", "until_time")) -> BackfillRequest:
    """A request from the backfill form's fields (or their JSON, or the CLI's flags; a run's request as
    :func:`ipcount.jobs.runs.request_fields` writes it); None and "" count as absent. ``time_names`` name the time
    fields in messages."""
    fields = json_object(fields, "the request", REQUEST_FIELDS)
    # (0 is a time: epoch ms 0)
    target, offsets, start, until = (None if fields.get(k) in (None, "") else fields[k] for k in REQUEST_FIELDS)
    target = target or MAIN_TARGET
    if offsets is not None and (start is not None or until is not None):
        raise BadRequestError("give either offsets or from_time/until_time, not both")
    if offsets is not None:
        return BackfillRequest(target=target, offsets=parse_offsets(offsets, topic))
    if start is not None and until is not None:
        return BackfillRequest(target=target, from_ms=parse_time(start, time_names[0]),
                               until_ms=parse_time(until, time_names[1]))
    raise BadRequestError("give offsets ('partition:from-until,...') or both from_time and until_time")


def check_against_log(topic: str, ranges: tuple[OffsetRange, ...], earliest: Mapping[int, int],
                      latest: Mapping[int, int]) -> None:
    """Every requested offset must exist: a known partition, not deleted, not beyond the end."""
    for r in ranges:
        if r.partition not in latest:
            raise BadRequestError(f"topic {topic} has no partition {r.partition} (it has "
                                  f"{', '.join(str(p) for p in sorted(latest))})")
        if r.from_offset < earliest[r.partition]:
            raise BadRequestError(
                f"offsets [{r.from_offset}, {earliest[r.partition]}) of {topic}-{r.partition} were already "
                f"deleted by retention (the log now starts at {earliest[r.partition]}); start the range there")
        if r.until_offset > latest[r.partition]:
            raise BadRequestError(
                f"{r} reaches beyond the end of the log: {topic}-{r.partition} ends at "
                f"{latest[r.partition]} (last stable offset); end the range there")
