"""The lab, not part of the product (which never imports it, and whose image leaves it out):
the embedded stack (Kafka from Maven jars, an S3 store, PostgreSQL, a Spark cluster and
Connect server, Airflow's environment), the traffic generator, chaos, and the benchmark with
its peers (Spark Structured Streaming, Flink SQL).

- :mod:`.cli`                ``bin/lab``: the lab's commands
- :mod:`.errors`             the lab's errors: a service of the embedded stack that did not start
- :mod:`.service`            what the services share: pid files, logs, readiness, stopping (Kafka, s3proxy,
                             Spark, the Connect server; PostgreSQL keeps pg_ctl's own)
- :mod:`.embedded_kafka`     a real KRaft broker (or three) on 127.0.0.1
- :mod:`.dev_tls`            a throwaway CA and certificates for the broker's TLS listeners
- :mod:`.embedded_s3`        an S3-compatible store (s3proxy) for tables on object storage
- :mod:`.lossy_proxy`        a proxy in front of it that loses the answers to commits
- :mod:`.embedded_postgres`  PostgreSQL for Airflow's metadata database
- :mod:`.embedded_spark`     a Spark standalone cluster from the pinned pyspark
- :mod:`.embedded_connect`   a Spark Connect server that epochs can run on (``spark_remote``)
- :mod:`.embedded_airflow`   Airflow's environment on the embedded stack
- :mod:`.generator`          access-log traffic, seedable
- :mod:`.chaos`              ``bin/lab chaos``: random SIGKILLs, then a plain-Python recount
- :mod:`.chaos_state`        a chaos run's state between sittings
- :mod:`.chaos_maintenance`  maintenance racing the rounds, in a thread of the chaos process
- :mod:`.model_run`          ``bin/lab model``: the model test of the ledger as a long run, with figures
- :mod:`.benchmark`          ``bin/benchmark``
- :mod:`.bench_job`          the benchmark's Spark application (spark-submit): the peer, the limits, the rounds
- :mod:`.bench_rounds`       warm against warm: the contenders round after round
- :mod:`.bench_stats`        medians, spreads and round-by-round ratios
- :mod:`.bench_profile`      where an epoch's read stage spends its time
- :mod:`.bench_growth`       how the counts MERGE's cost grows with the table
- :mod:`.bench_year`         real epochs on table sets a year old (synthesized), maintained or not
- :mod:`.bench_log`          the results log (docs/performance/results.csv): a report's figures as rows
- :mod:`.bench_charts`       the results log drawn: SVG charts and the performance page's table
- :mod:`.peer`               the Structured Streaming contender
- :mod:`.bench_flink`        the Flink contender: runs its job, checks its sink topic against a recount
- :mod:`.flink_job`          the seeds' job in Flink SQL (runs under PyFlink's own virtualenv)
"""
