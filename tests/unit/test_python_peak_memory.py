"""The benchmark's and the cluster test's measure of the task's memory: a process's own peak,
not the peak Linux carries over ``execve`` from the process that started it."""
from __future__ import annotations

import subprocess
import sys

CHILD = ("import resource; from ipcount_lab.bench_rounds import python_peak_rss_mb; "
         "print(python_peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")


def test_a_child_of_a_large_process_reports_its_own_peak():
    ballast = bytearray(700 * 2**20)
    ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # touched: resident in this process
    own, inherited = map(float, subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                                               check=True).stdout.split())
    del ballast
    assert inherited > 700          # ru_maxrss: this test process's size, carried over the exec
    assert 10 < own < 400, own      # VmHWM: the child's own (its imports, no ballast)
