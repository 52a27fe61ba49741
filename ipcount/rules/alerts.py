"""When the pipeline falls behind enough to alert: the rules of the epoch DAG's ``check_freshness`` task (settings
``alert_lag_records`` and ``alert_stale_seconds``)."""
from __future__ import annotations

from typing import Mapping


def breaches(lag: Mapping[int, int], last_commit_age_seconds: float | None, lag_records: int,
             stale_seconds: int) -> list[str]:
    """What is over its threshold (a threshold of 0 is off): more than ``lag_records`` offsets waiting past the chain,
    or records waiting and no commit for over ``stale_seconds`` (a chain that never committed has no age to judge)."""
    waiting = sum(n for n in lag.values() if n > 0)
    found = []
    if lag_records and waiting > lag_records:
        found.append(f"{waiting} records wait past the chain, over alert_lag_records {lag_records} ("
                     + ", ".join(f"p{p} {n}" for p, n in sorted(lag.items()) if n > 0) + ")")
    if stale_seconds and waiting and last_commit_age_seconds is not None and last_commit_age_seconds > stale_seconds:
        found.append(f"{waiting} records wait and the chain's last commit was {last_commit_age_seconds:.0f} s ago, "
                     f"over alert_stale_seconds {stale_seconds}")
    return found
