"""The pipeline as a Spark application, as the DAGs submit it:
``spark-submit spark_jobs/epoch_job.py RUN_JSON``, one argument holding the run
(:class:`ipcount.jobs.runs.Run`). By hand it takes ``ipcount``'s own arguments:
``spark-submit spark_jobs/epoch_job.py [epoch|backfill|rebuild] --help`` (without a command,
one epoch). The code is ``bin/ipcount``'s; only the way Spark starts differs (spark-submit
hands it the master, jars and settings).
"""
from __future__ import annotations

import sys

from ipcount.cli import main, run_main

COMMANDS = ("epoch", "backfill", "rebuild")

if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 1 and args[0].lstrip().startswith("{"):
        sys.exit(run_main(args[0]))
    sys.exit(main(args if args[:1] and args[0] in COMMANDS else ["epoch", *args]))
