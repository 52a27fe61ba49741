"""I/O: everything that talks to Kafka, Delta tables or the Spark session, and nothing that
decides what an epoch is (that is :mod:`ipcount.rules`).

- :mod:`.broker`  the broker outside Spark (kafka-python): log offsets, start positions, group commits
- :mod:`.delta`   Delta table helpers: delta-rs reads, table creation, commits once per transaction id
- :mod:`.retry`   the retry loop: races lost to concurrent commits, a broker not ready yet
- :mod:`.ledger`  the offset ledger: write-ahead and commit MERGEs, reads
- :mod:`.sink`    the counts, dead-letter and late-record tables, written idempotently per epoch
- :mod:`.table_files`  data files Spark's executors write into (and read from) a table's location
- :mod:`.spark`   the Spark session and the settings spark-submit needs for the same
- :mod:`.connect_server`  the Spark Connect server epochs run on, with those settings
- :mod:`.publisher`  the sink topic's transactional producer (one transaction per counts version)
- :mod:`.tableset`   the table set's manifest on Delta
- :mod:`.maintenance`  compaction, checkpoints, log cleanup and vacuum of a table set, and its log
"""
