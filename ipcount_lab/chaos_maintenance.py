"""Maintenance racing chaos's rounds: a thread of the chaos process runs the product's
maintenance (:func:`ipcount.storage.maintenance.maintain`) over and over on the run's tables
while epochs, backfills, DAG runs and rebuilds commit and are killed. Its vacuum keeps no
retention beyond what the publisher still reads, so every file a commit replaced goes at
once: the hardest case for a reader or writer on an older snapshot.

A maintenance run that fails (it lost a race, the store lost an answer, the broker was down
for the publisher's position) is counted and logged, not fatal: what chaos judges is the
tables, recounted at the finish.
"""
from __future__ import annotations

import logging
import threading
from types import TracebackType

from ipcount.jobs.maintenance import next_unpublished_version
from ipcount.rules.config import PipelineConfig
from ipcount.storage.maintenance import maintain
from ipcount.storage.sink import Sink

log = logging.getLogger(__name__)

PAUSE_SECONDS = 1.0  # between two maintenance runs


class MaintenanceBeside:
    """``with MaintenanceBeside(cfg) as m:`` maintenance over and over until the block ends."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.runs = self.compacted = self.vacuumed = self.floor = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-maintenance", daemon=True)

    def __enter__(self) -> MaintenanceBeside:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(300)
        log.info("chaos: %s", self.line())

    def line(self) -> str:
        return (f"maintenance ran {self.runs} time(s) beside the rounds ({self.compacted} files compacted, "
                f"{self.vacuumed} vacuumed, transactions retired through epoch {self.floor}, "
                f"{len(self.failures)} run(s) failed)")

    def _loop(self) -> None:
        publisher = (lambda: next_unpublished_version(self.cfg)) if self.cfg.publish else None
        while not self._stop.wait(PAUSE_SECONDS):
            try:
                run = maintain(self.cfg, f"chaos-{self.runs + len(self.failures) + 1}", publisher, retention_hours=0)
                floor = min(Sink(self.cfg).floors().values())
            except Exception as e:  # noqa: BLE001 - counted and logged; the recount judges the tables
                self.failures.append(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
                log.info("chaos: maintenance failed: %s", self.failures[-1])
                continue
            self.runs += 1
            self.compacted += sum(t.compacted_files for t in run.tables)
            self.vacuumed += sum(t.vacuumed_files for t in run.tables)
            self.floor = max(self.floor, floor)
