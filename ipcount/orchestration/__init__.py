"""Airflow: what the DAG files wire together, kept here so they stay thin.

- :mod:`.dags`       DAG ids, Params, the spark-submit arguments, the run summary
- :mod:`.lineage`    the Assets: source topic, tables, sink topic
- :mod:`.watcher`    the on-data schedule's trigger: new records start a run
- :mod:`.alerts`     the freshness check's and the Deadline Alert's wiring
- :mod:`.operators`  the operators of the Spark tasks (spark-submit or Spark Connect)
- :mod:`.kafka_connection`  the Kafka settings of an Airflow connection, for tasks and the monitor
- :mod:`.monitor`    the monitoring plugin's pages, run notes and task link
"""
