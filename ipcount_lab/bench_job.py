"""One measurement of ``bin/benchmark`` (the peer or a read-only limit), as a Spark
application: ``spark-submit ipcount_lab/bench_job.py {peer,spark_count} ...``; the
kafka-python limit runs it with plain Python. Prints one JSON line."""
from __future__ import annotations

import sys

from ipcount_lab.benchmark import job_main

if __name__ == "__main__":
    sys.exit(job_main())
