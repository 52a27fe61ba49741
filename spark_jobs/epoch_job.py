"""The pipeline as a Spark application: ``spark-submit spark_jobs/epoch_job.py [epoch|backfill|rebuild] --help``.

This is what the DAGs submit. It is the same code as ``bin/ipcount epoch`` (or ``backfill``);
only the way Spark starts differs (spark-submit hands it the master, jars and settings).
Without a command it runs one epoch.
"""
from __future__ import annotations

import sys

from ipcount.cli import main

COMMANDS = ("epoch", "backfill", "rebuild")

if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args if args[:1] and args[0] in COMMANDS else ["epoch", *args]))
