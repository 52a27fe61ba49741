"""What each command does, composed from the rules and the storage layer.

- :mod:`.runs`          a typed run (epochs, a backfill, a rebuild): what the CLI, the DAGs'
                        tasks and spark-submit's application execute
- :mod:`.epoch`         one checkpoint epoch: plan, record, read, sink, ledger commit
- :mod:`.group_commit`  step 7, optional: ledger positions -> the Kafka consumer group
- :mod:`.backfill`      count an offset or time range the ledger does not own yet
- :mod:`.rebuild`       replay a ledger's committed epochs into a fresh replay table set
- :mod:`.verify`        recount from Kafka in plain Python and compare
- :mod:`.idle`          does the scheduled chain have anything to do? (no JVM; the on-data watch too)
- :mod:`.transform`     the Spark parse, classify and tally steps
- :mod:`.tally`         an epoch's tally split (Arrow) into metrics, counts, dead letters, late rows
- :mod:`.publish`       committed counts to the sink topic, exactly once (no JVM)
- :mod:`.latency`       how long records waited to be counted, measured after the fact (no JVM)
- :mod:`.maintenance`   the maintenance command: every table compacted, checkpointed, vacuumed (no JVM)
- :mod:`.crash`         crash points and the step markers each epoch step logs
"""
