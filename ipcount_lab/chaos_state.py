"""A chaos run's state between sittings (``bin/lab chaos --pause`` / ``--resume``).

A long run takes longer than one sitting (docs/exactly-once.md has the figures), so it can
pause and go on later on the same topic, warehouse and broker: this file holds what the next
sitting needs. Randomness is drawn per round (:func:`round_rng`), so no generator state is saved and
a resumed run makes the same choices an unpaused one would. What retention rounds deleted is
here too (how far per partition); the deleted records themselves are kept beside it
(:data:`DELETED_FILE`), read back before each deletion, for the final recount.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ipcount.rules.errors import ConfigError

STATE_FORMAT = 1
RETENTION, REBUILD = "retention", "rebuild"
# Every scenario a run takes turns with (ipcount_lab.chaos runs them).
SCENARIOS = ("chain", "race", "backfill", "dag", "broker", RETENTION, REBUILD, "answers", "connect")
STATE_FILE = "state.json"
DELETED_FILE = "deleted-records.jsonl"


def round_rng(seed: int, round_no: int) -> random.Random:
    """The random choices of round ``round_no`` (0: the run's set-up) of the run ``seed``."""
    return random.Random(f"chaos/{seed}/{round_no}")


@dataclass
class RunState:
    """Where a run's data is, what it was asked for, and how far it got."""

    name: str                    # topic, pipeline id and directory of the run
    seed: int
    kills_wanted: int
    scenarios: list[str]
    order: list[str]             # the scenarios' turn order (shuffled once)
    batch: int                   # records produced before each round
    clock_ms: int                # the source's event-time clock
    max_records_per_epoch: int
    kill_window: list[float] = field(default_factory=lambda: [2.0, 30.0])
    write_window: float = 20.0
    publish: bool = False
    backfills: list[str] = field(default_factory=list)   # every backfill request made (the finish completes them)
    kills: int = 0
    rounds: int = 0
    by_scenario: dict[str, int] = field(default_factory=dict)
    by_phase: dict[str, int] = field(default_factory=dict)
    partitions_added: int = 0
    strays: int = 0
    deleted: dict[str, int] = field(default_factory=dict)  # partition -> the highest log start a retention round set
    sittings: list[dict] = field(default_factory=list)   # {"started", "stopped", "kills"}
    object_store: bool = False   # the warehouse is on the run's own S3 store, behind a proxy that loses answers
    answers_lost: int = 0        # commit answers the proxy lost (in answers rounds)
    executor_rounds: int = 0     # rounds whose processes had Spark's executors write the files
    rebuilt: list[int] | None = None  # the source's committed epochs when the replay target was completed

    def next_scenario(self) -> str:
        """The scenario of the next round: the order's next, except that when the run rebuilds,
        retention waits until every other scenario has had a round and half the kills are made
        (it takes a turn anyway when nothing else can), and rebuild has no more rounds once the
        rebuild was completed or records were deleted (a rebuild replays only offsets Kafka
        still holds, and the completed one is what the recount checks). A retention that
        waited takes the first round it may have, rather than its next turn in the order."""
        n = len(self.order)
        others_done = all(s in self.by_scenario for s in self.order if s != RETENTION)
        waits = REBUILD in self.order and not (others_done and 2 * self.kills >= self.kills_wanted)
        candidates = [self.order[(self.rounds + k) % n] for k in range(n)]
        able = [s for s in candidates if not (s == REBUILD and (self.deleted or self.rebuilt is not None))]
        if REBUILD in self.order and not waits and RETENTION in able and RETENTION not in self.by_scenario:
            return RETENTION
        for s in able:
            if not (s == RETENTION and waits):
                return s
        if able:
            return able[0]
        raise ConfigError(f"no scenario of {', '.join(self.order)} can take a round: the rebuild is done, and it was "
                          "the only one; name more scenarios")

    def enough(self, pausing: bool) -> bool:
        """Whether the kills wanted are made - and, for a run that is to finish now rather than
        pause, every scenario has had its round (a round may kill more than one)."""
        return self.kills >= self.kills_wanted and (pausing or set(self.order) <= set(self.by_scenario))

    def deleted_marks(self) -> dict[int, int]:
        """Partition -> every offset below it was deleted by a retention round (JSON keys are text)."""
        return {int(p): o for p, o in self.deleted.items()}

    def mark_deleted(self, partition: int, until: int) -> None:
        self.deleted[str(partition)] = max(until, self.deleted.get(str(partition), 0))

    def save(self, path: Path) -> None:
        """Written whole or not at all (a kill of chaos itself leaves the last round's state)."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"format": STATE_FORMAT, **asdict(self)}, indent=1, sort_keys=True))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> RunState:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no chaos run to resume at {path.parent} (its state.json is missing)") from None
        except ValueError as e:
            raise ConfigError(f"the chaos run's state {path} is not JSON: {e}") from None
        if data.pop("format", None) != STATE_FORMAT:
            raise ConfigError(f"the chaos run's state {path} has another format; start a new run")
        try:
            return cls(**data)
        except TypeError as e:
            raise ConfigError(f"the chaos run's state {path} does not fit this version: {e}") from None
