"""``bin/lab model``: the model test of the ledger (tests/integration/test_ledger_model.py) as
a long run: Hypothesis's sequences of operations over the real epoch code on real delta-rs
tables, checked after every step, with a seed of its own; then what it covered, in figures.

The test writes a line per sequence to a report file (``IPCOUNT_MODEL_REPORT``): its steps
and how many of each operation ran. Run from a checkout (it needs the tests)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_TEST = "tests/integration/test_ledger_model.py::test_ledger_model"


@dataclass
class ModelRun:
    seed: int
    sequences_wanted: int
    max_steps: int
    sequences: int = 0
    steps: int = 0
    operations: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    passed: bool = False
    failure: str = ""

    def line(self) -> str:
        ops = ", ".join(f"{name} {n}" for name, n in self.operations.most_common())
        per_step = 1000 * self.seconds / self.steps if self.steps else 0.0
        verdict = "0 invariant violations" if self.passed else "FAILED: an invariant was violated (below)"
        return (f"model run, seed {self.seed}: {self.sequences} sequences of up to {self.max_steps} steps, "
                f"{self.steps} steps in {self.seconds:.0f} s ({per_step:.0f} ms a step); {verdict}\n"
                f"operations: {ops}")

    def to_dict(self) -> dict:
        return {"seed": self.seed, "sequences": self.sequences, "max_steps": self.max_steps, "steps": self.steps,
                "operations": dict(self.operations), "seconds": round(self.seconds, 1), "passed": self.passed}


def run_model(sequences: int, steps: int, seed: int, progress=None, every_seconds: float = 60.0) -> ModelRun:
    """Run the model test with ``sequences`` sequences of up to ``steps`` steps from ``seed``;
    ``progress(sequences, steps)`` is told how far it got every ``every_seconds``."""
    if not (REPO_ROOT / MODEL_TEST.split("::")[0]).exists():
        raise FileNotFoundError(f"{MODEL_TEST.split('::')[0]} is not under {REPO_ROOT}: run from a checkout")
    run = ModelRun(seed, sequences, steps)
    with tempfile.TemporaryDirectory(prefix="ipcount-model-") as tmp:
        report = Path(tmp) / "sequences.jsonl"
        env = {**os.environ, "IPCOUNT_MODEL_EXAMPLES": str(sequences), "IPCOUNT_MODEL_STEPS": str(steps),
               "IPCOUNT_MODEL_REPORT": str(report)}
        output = Path(tmp) / "pytest.log"
        started = time.monotonic()
        with output.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "pytest", MODEL_TEST, "-q", "-p", "no:cacheprovider",
                                     f"--hypothesis-seed={seed}", "--hypothesis-show-statistics"],
                                    cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            while True:
                try:
                    proc.wait(timeout=every_seconds)
                    break
                except subprocess.TimeoutExpired:
                    if progress is not None:
                        progress(*_sequences(report)[:2])
        run.seconds = time.monotonic() - started
        run.sequences, run.steps, run.operations = _sequences(report)
        run.passed = proc.returncode == 0
        if not run.passed:  # the whole output kept: the falsifying steps come before the statistics
            kept = REPO_ROOT / ".local" / "model-runs" / f"seed-{seed}.log"
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text(output.read_text())
            run.failure = f"the run's whole output (the failing steps first): {kept}"
    return run


def _sequences(report: Path) -> tuple[int, int, Counter]:
    """(sequences, steps, operations) of the report so far."""
    sequences, steps, operations = 0, 0, Counter()
    for line in report.read_text().splitlines() if report.exists() else ():
        if line.endswith("}"):  # (a line being written is left for the next look)
            sequence = json.loads(line)
            sequences, steps = sequences + 1, steps + sequence["steps"]
            operations.update(sequence["operations"])
    return sequences, steps, operations
