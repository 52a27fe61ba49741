"""The epoch as a Spark application: ``spark-submit spark_jobs/epoch_job.py --help``.

This is what the DAG submits. It is the same code as ``bin/ipcount epoch``; only the way
Spark starts differs (spark-submit hands it the master, jars and settings).
"""
from __future__ import annotations

import sys

from ipcount.cli import main

if __name__ == "__main__":
    sys.exit(main(["epoch", *sys.argv[1:]]))
