"""Pure rules, no I/O and no pyspark, kafka, delta, deltalake or airflow imports: what an
offset range, a plan, a ledger row, a record and a setting mean. Unit-tested on literals.

- :mod:`.config`    the one frozen, validated :class:`~.config.PipelineConfig`
- :mod:`.errors`    one exception base carrying its exit code
- :mod:`.offsets`   offset ranges and epoch planning
- :mod:`.coverage`  which offsets a ledger already owns (interval arithmetic)
- :mod:`.ledger`    the ledger's schema and rules: statuses, kinds, plans, chain positions, summaries
- :mod:`.ledger_summary`  the ledger's summary row: what every final epoch up to one id left
- :mod:`.requests`  backfill requests: parsing and checks
- :mod:`.records`   the record format: the specification the Spark parser implements
- :mod:`.finality`  which counts rows a scheduled epoch must look at to mark windows final
- :mod:`.tableset`  what a table set means, fixed when it is created (its manifest)
- :mod:`.publish`   what the publisher sends to the sink topic, and its cursor
- :mod:`.maintenance`  which counts partitions are final, how long a vacuum keeps files, run reports
- :mod:`.kafka_security`  the Kafka security settings as each client's options
- :mod:`.kafka_properties`  consumer properties passed through, checked against Kafka's names
- :mod:`.private_files`   files that hold secrets: private from their first byte
- :mod:`.lineage`   the datasets' names: Airflow Asset URIs and OpenLineage namespaces
- :mod:`.alerts`    when the chain lags or is stale enough to alert
- :mod:`.file_stats`  a data file's statistics as a Delta add action records them
"""
