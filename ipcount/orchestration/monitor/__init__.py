"""Monitoring in the Airflow UI: the epochs, lag and counts pages of the ``ipcount_monitor``
plugin (``plugins/ipcount_monitor.py``), the DAG-run notes and the epoch task's extra link.

- :mod:`.model`   pure logic: epoch status, pagination, schedule health, time ranges
- :mod:`.charts`  pure SVG charts (no JavaScript: the UI may embed pages in a sandboxed iframe)
- :mod:`.data`    reads the Delta tables with delta-rs (no JVM) and the broker's offsets
- :mod:`.runs`    reads Airflow's own DAG runs (inside the api-server and scheduler)
- :mod:`.app`     the FastAPI app the api-server mounts under ``/ipcount``
- :mod:`.metrics` the pipeline's metrics in Prometheus's text format (``/ipcount/metrics``)
- :mod:`.notes`   the listener that writes each run's epoch summary into its DAG-run note
- :mod:`.run_rows` the child process that reads a run's ledger rows for its note
- :mod:`.links`   the epoch task's "Epoch page" extra link
"""
