"""The epoch server: one long-lived, warm Spark driver that runs the DAGs' commands.

- :mod:`.server`  the HTTP server; it runs each request with the command runner it is given
- :mod:`.client`  health, submit, wait until ready: for the operator, the benchmark, the tests
- :mod:`.vetting` what the server accepts from a request (pure)
- :mod:`.auth`    the server's shared token, in a private file
"""
