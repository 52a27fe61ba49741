"""Airflow plugin: the pipeline's monitoring pages in the Airflow UI.

- a FastAPI app under ``/ipcount`` (epochs, lag, counts; JSON under ``/ipcount/api``),
  served by the api-server and shown in the UI's navigation ("Browse" > "ipcount pipeline");
- an "Epochs" tab on each DAG run of the pipeline's DAGs;
- a listener that writes each run's epochs into its DAG-run note.

The code lives in ``ipcount.orchestration.monitor``; this file only wires it in. The app is imported on
its first request, so the scheduler and workers, which load plugins too, do not pay for it.
"""
from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from ipcount.orchestration.monitor import notes
from ipcount.orchestration.monitor.links import URL_PREFIX


class _MonitorApp:
    """ASGI app that builds the real one on first use."""

    def __init__(self) -> None:
        self._app = None

    async def __call__(self, scope, receive, send) -> None:
        if self._app is None:
            from ipcount.orchestration.monitor.app import create_app

            self._app = create_app()
        await self._app(scope, receive, send)


class IpcountMonitorPlugin(AirflowPlugin):
    name = "ipcount_monitor"
    fastapi_apps = [{"app": _MonitorApp(), "url_prefix": URL_PREFIX, "name": "ipcount monitor"}]
    external_views = [
        {"name": "ipcount pipeline", "href": f"{URL_PREFIX}/epochs", "url_route": "ipcount",
         "destination": "nav", "category": "browse"},
        {"name": "Epochs", "href": f"{URL_PREFIX}/runs/{{DAG_ID}}/{{RUN_ID}}", "destination": "dag_run"},
    ]
    listeners = [notes]
