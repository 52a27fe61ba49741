"""Does the scheduled chain have anything to do? Answered without a JVM.

An epoch launched through spark-submit pays for a JVM, a Spark session and a look at four
Delta logs before it can find out that nothing new arrived; on a quiet topic that is most
of what a scheduled run costs. This check reads the ledger with delta-rs and the log ends
with kafka-python - well under a second - and the DAG skips the Spark job when it says idle.

It only ever says "idle" when the Spark job would certainly commit nothing: any doubt
(no ledger yet, an unfinished epoch, new or vanished partitions, offsets aged out, a read
that failed) means "run", and the job decides with its full checks. The ledger stays the
only source of positions; the consumer group is never read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ipcount.rules.config import PipelineConfig
from ipcount.rules.ledger_summary import committed_chain
from ipcount.storage.ledger import Ledger


@dataclass(frozen=True)
class Verdict:
    run: bool
    why: str


def verdict(positions: Mapping[int, int], unfinished: list[int], earliest: Mapping[int, int],
            latest: Mapping[int, int]) -> Verdict:
    """Whether the next scheduled epoch must run, and why (pure)."""
    if unfinished:
        return Verdict(True, f"epoch {unfinished[0]} is unfinished: finishing it with its recorded ranges")
    if not positions:
        return Verdict(True, "the ledger has no committed scheduled epoch yet")
    if set(positions) != set(latest):
        return Verdict(True, f"partitions changed: the ledger has {sorted(positions)}, the topic {sorted(latest)}")
    aged = [p for p in sorted(positions) if earliest[p] > positions[p]]
    if aged:
        return Verdict(True, "offsets aged out on partition(s) " + ", ".join(
            f"{p} ([{positions[p]}, {earliest[p]}))" for p in aged))
    new = {p: latest[p] - positions[p] for p in sorted(positions) if latest[p] > positions[p]}
    if new:
        return Verdict(True, f"{sum(new.values())} new offset(s): " + " ".join(f"p{p}+{n}" for p, n in new.items()))
    return Verdict(False, "nothing new: the chain is at the log end " +
                   " ".join(f"p{p}={o}" for p, o in sorted(positions.items())))


def check(cfg: PipelineConfig) -> Verdict:
    """The verdict for ``cfg``'s scheduled chain, from the ledger and the broker. A failure
    to look is a reason to run: the job then reports it properly."""
    try:
        from ipcount.storage import broker

        view = Ledger(cfg.ledger_path).view()
        _, positions, unfinished = committed_chain(view.summary, cfg.topic, view.tail)
        if unfinished or not positions:
            return verdict(positions, unfinished, {}, {})
        earliest, latest = broker.partition_offsets(cfg)
    except Exception as e:  # noqa: BLE001 - the Spark job gives the authoritative error
        return Verdict(True, f"could not check without Spark ({type(e).__name__}: {e}); running the epoch")
    return verdict(positions, unfinished, earliest, latest)
