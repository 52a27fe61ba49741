"""ipcount: exactly-once Kafka -> Delta Lake epochs, orchestrated by Airflow.

The subpackages are layers; each imports only from the layers below it (checked by
``tests/unit/test_layers.py`` with import-linter):

- :mod:`ipcount.cli`            the command line (``bin/ipcount``, ``spark_jobs/epoch_job.py``)
- :mod:`ipcount.orchestration`  Airflow: DAG support, the operator, the monitoring plugin's code
- :mod:`ipcount.jobs`           what a command does: epoch, backfill, rebuild, verify, idle check
- :mod:`ipcount.storage`        I/O: the broker, Delta tables, the ledger, the sink, the Spark session
- :mod:`ipcount.rules`          pure rules: config, offsets, coverage, the ledger's rules, records

The lab (the embedded stack, traffic, chaos, the benchmark) is the package ``ipcount_lab``
beside this one; the product never imports it.
"""
