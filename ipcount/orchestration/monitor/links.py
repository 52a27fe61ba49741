"""The "Epoch page" extra link on the tasks that run epochs: it opens the monitoring page of the epochs that task's DAG
run committed (Airflow 3 computes the link on the worker when the task ends and keeps it in XCom)."""
from __future__ import annotations

import os
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

URL_PREFIX = "/ipcount"


def run_page_path(dag_id: str, run_id: str) -> str:
    return f"{URL_PREFIX}/runs/{quote(dag_id, safe='')}/{quote(run_id, safe='')}"


class EpochPageLink(BaseOperatorLink):
    name = "Epoch page"

    def get_link(self, operator, *, ti_key) -> str:
        # Absolute when the api-server's public address is configured, else relative to it.
        base = os.environ.get("AIRFLOW__API__BASE_URL", "").rstrip("/")
        return base + run_page_path(ti_key.dag_id, ti_key.run_id)
