"""Developer tools, not part of the pipeline: the embedded stack (a Kafka broker from Maven
jars, Airflow on SQLite), the traffic generator, and the benchmark with its peer (Spark
Structured Streaming).

- :mod:`.embedded_kafka`    a real single-node KRaft broker on 127.0.0.1
- :mod:`.embedded_airflow`  Airflow's environment on the embedded stack
- :mod:`.generator`         access-log traffic, seedable
- :mod:`.benchmark`         ``bin/benchmark``
- :mod:`.peer`              the Structured Streaming contender
"""
