"""The monitoring app the Airflow api-server mounts under ``/ipcount`` (see ``plugins/ipcount_monitor.py``): HTML
pages for people and the same data as JSON under ``/ipcount/api/`` for scripts. Every route needs an authenticated
Airflow user allowed to read the epoch DAG, checked by Airflow's own security dependency (JWT in the ``Authorization``
header, or the UI's session cookie). Backfills - their epochs in the ledger, their DAG runs, the replay targets they
make - are shown only to a user the auth manager also lets read the backfill DAG (:class:`model.Access`)."""
from __future__ import annotations

import hmac
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool

from ipcount.orchestration.dags import BACKFILL_DAG_ID, EPOCH_DAG_ID, maintenance_schedule
from ipcount.orchestration.monitor import model
from ipcount.orchestration.monitor.charts import bar_chart, line_chart, time_chart
from ipcount.orchestration.monitor.data import BrokerPositions, BrokerProbe, PipelineTables, publish_groups
from ipcount.orchestration.monitor.runs import failed_since_success, run_states, run_target
from ipcount.rules.config import PipelineConfig
from ipcount.rules.errors import ConfigError
from ipcount.rules.requests import MAIN_TARGET
from ipcount.storage.delta import DeltaReader
from ipcount.storage.tableset import replay_targets

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))


def _authorized():
    """Airflow's check that the caller may read the epoch DAG (401 without a login)."""
    from airflow.api_fastapi.core_api.security import requires_access_dag

    return Depends(requires_access_dag(method="GET", param_dag_id=EPOCH_DAG_ID))


def _may_read(user: Any, dag_id: str) -> bool:
    """Whether Airflow's auth manager lets ``user`` read the DAG (its per-DAG permissions; a database look)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails
    from airflow.models.dag import DagModel

    details = DagDetails(id=dag_id, team_name=DagModel.get_team_name(dag_id))
    return bool(get_auth_manager().is_authorized_dag(method="GET", details=details, user=user))


def _access():
    """The caller's :class:`model.Access`, from Airflow's auth manager."""
    from airflow.api_fastapi.core_api.security import get_user

    # (Depends as the default, not in an annotation: this module's annotations are strings, which FastAPI resolves in
    # the module, where get_user is not.)
    def access(user: Any = Depends(get_user)) -> model.Access:
        return model.Access(backfills=_may_read(user, BACKFILL_DAG_ID), backfill_dag_id=BACKFILL_DAG_ID)
    return Depends(access)


class Monitor:
    """What the routes share: the pipeline's configuration, the table reader, the broker probe."""

    def __init__(self, cfg: PipelineConfig | None = None) -> None:
        self._cfg = cfg
        self.reader = DeltaReader()
        self.broker = BrokerProbe()

    @property
    def cfg(self) -> PipelineConfig:
        if self._cfg is None:  # read when first needed: a bad config is a page, not a dead plugin
            self._cfg = PipelineConfig.load()
        return self._cfg

    def targets(self, access: model.Access) -> list[str]:
        return [t for t in replay_targets(self.cfg) if t == MAIN_TARGET or access.backfills]

    def target(self, name: str, access: model.Access) -> tuple[PipelineConfig, PipelineTables]:
        access.check_target(name, MAIN_TARGET)
        targets = replay_targets(self.cfg)
        if name not in targets:
            raise model.BadQueryError(f"unknown target {name!r}; known: {', '.join(targets)}")
        cfg = self.cfg.for_target(name)
        return cfg, PipelineTables(cfg, self.reader)

    # -- the four views, as data ----------------------------------------------------------
    def epochs(self, target: str, status: str | None, kind: str | None, run_id: str | None,
               page: int, page_size: int, access: model.Access) -> dict[str, Any]:
        _, tables = self.target(target, access)
        status = model.check_choice("status", status, model.STATUSES)
        kind = model.check_choice("kind", kind, model.KINDS)
        kinds = access.kinds((kind,) if kind else model.KINDS)
        run_id = run_id or None
        planned = [r for r in tables.unfinished() if r.matches(kinds, run_id)]
        if status in (model.RUNNING, model.FAILED):  # planned epochs: Airflow tells running from failed
            states = run_states(r.run_id for r in planned)
            refs = [r for r in planned
                    if model.epoch_status(True, states.get(r.run_id or "", (None, None))[1]) == status]
            pg = model.page_of(len(refs), page, page_size)
            shown = refs[pg.start:pg.start + pg.size]
        else:  # counted and paged in the ledger: the newest ids, or every row for a page far back
            committed = status == model.COMMITTED
            pg = model.page_of(tables.epoch_count(kinds, run_id) - (len(planned) if committed else 0), page, page_size)
            shown = tables.epoch_page(kinds, run_id, pg.start, pg.size, committed_only=committed)
        rows = tables.epoch_rows([r.epoch for r in shown])
        epochs = model.epoch_rows(rows, run_states(r.run_id for r in shown))
        published_until = self.broker.published_until(self.cfg) if target == MAIN_TARGET else None  # (replays: never)
        epochs = model.with_published(epochs, published_until)
        return {"target": target, "total": pg.total, "page": pg.number, "pages": pg.pages, "page_size": pg.size,
                "epochs": epochs, "page_info": pg, "published_column": published_until is not None}

    def partitions(self, cfg: PipelineConfig, tables: PipelineTables) -> tuple[BrokerPositions, list[dict[str, Any]]]:
        """The broker's answer, and per partition: log start and end, chain position, group offset and both lags."""
        positions = self.broker.positions(cfg)
        chain = tables.chain_positions()
        waiting = tables.chain_lag(positions.log_start, positions.log_end)
        partitions = []
        for p in sorted(set(positions.log_end) | set(chain)):
            end, group = positions.log_end.get(p), positions.group.get(p)
            partitions.append({"partition": p, "log_start": positions.log_start.get(p), "log_end": end,
                               "ledger_position": chain.get(p), "group_offset": group, "lag": waiting.get(p),
                               "group_lag": None if end is None or group is None else end - group})
        return positions, partitions

    def health(self, target: str, access: model.Access,
               partitions: tuple[BrokerPositions, list[dict[str, Any]]] | None = None) -> model.Health:
        """The health line (``partitions``: the target's :meth:`partitions`, if read already)."""
        cfg, tables = self.target(target, access)
        positions, per_partition = partitions or self.partitions(cfg, tables)
        planned = access.visible(tables.unfinished())
        unfinished = model.epoch_rows(tables.epoch_rows([r.epoch for r in planned]),
                                      run_states(r.run_id for r in planned)) if planned else []
        last = tables.last_committed()
        lag = sum(p["lag"] for p in per_partition if p["lag"] is not None) if positions.log_end else None
        now = datetime.now(timezone.utc)
        interval = model.schedule_interval(cfg.schedule, now, cfg.on_data_poll_seconds)
        health = model.assess_health(
            now, last[0] if last else None, last[1] if last else None, interval,
            lag, unfinished, failed_since_success() if target == MAIN_TARGET else (), positions.error,
            watermark_ms=last[2] if last else None)
        return model.with_maintenance(health, now, tables.last_maintenance(),
                                      model.schedule_interval(maintenance_schedule(cfg) or "", now))

    def lag(self, target: str, last: int, access: model.Access) -> dict[str, Any]:
        if not 1 <= last <= 1000:
            raise model.BadQueryError(f"epochs must be between 1 and 1000, got {last}")
        cfg, tables = self.target(target, access)
        positions, partitions = self.partitions(cfg, tables)
        history = tables.lag_history(last)
        return {"target": target, "partitions": partitions, "broker_error": positions.error,
                "group_id": cfg.group_id, "topic": cfg.topic,
                "history": [{"epoch": e, "committed_at": at.isoformat() if at else None,
                             "lag": {str(p): n for p, n in sorted(lags.items())}} for e, at, lags in history]}

    def counts(self, target: str, start: str | None, until: str | None, top: int,
               access: model.Access) -> dict[str, Any]:
        if not 1 <= top <= 1000:
            raise model.BadQueryError(f"top must be between 1 and 1000, got {top}")
        cfg, tables = self.target(target, access)
        begin, end = model.counts_range(model.parse_instant("from", start), model.parse_instant("until", until),
                                        tables.latest_window_end(), cfg.window_seconds)
        return {"target": target, "from": begin.isoformat(), "until": end.isoformat(),
                "top_ips": tables.top_ips(begin, end, top, cache=not start and not until),
                "windows": [{"window_start": w["window_start"].isoformat(), "requests": w["requests"],
                             "ips": w["ips"], "final": w["final"]} for w in tables.requests_per_window(begin, end)]}

    def publish(self, group: str | None) -> dict[str, Any]:
        own = publish_groups(self.cfg)
        if group and group not in own:
            raise model.BadQueryError(
                f"group must be one of the pipeline's own consumer groups ({', '.join(own)}), got {group!r}; the "
                "monitor shows no other group's offsets (bin/ipcount consumer-groups -- --describe --group NAME "
                "shows any group the broker lets your own login see)")
        return self.broker.publish(self.cfg, group or None)


def create_app(cfg: PipelineConfig | None = None) -> FastAPI:
    monitor = Monitor(cfg)
    # FastAPI's own docs routes skip app dependencies: these are served below, behind the login.
    app = FastAPI(title="ipcount monitor", description=__doc__, docs_url=None, openapi_url=None, redoc_url=None)
    _add_error_handlers(app)
    access = _access()
    pages = APIRouter(dependencies=[_authorized()])   # every route but the metrics, which check their own
    _add_api_routes(app, pages, monitor, access)
    _add_page_routes(pages, monitor, access)
    app.include_router(pages)
    _add_metrics_route(app, monitor)
    app.state.monitor = monitor
    return app


def _add_metrics_route(app: FastAPI, monitor: Monitor) -> None:
    from airflow.api_fastapi.core_api.security import bearer_scheme

    @app.get("/metrics", response_class=Response)
    async def metrics(request: Request, bearer: Any = Depends(bearer_scheme)) -> Response:
        """The pipeline's metrics in Prometheus's text format, for a scraper with the token of ``metrics_token_file``
        or any Airflow login that may read the epoch DAG."""
        from ipcount.orchestration.monitor.metrics import exposition

        who = await _scraper(request, bearer, monitor)
        body, content_type = await run_in_threadpool(exposition, monitor, who, request.headers.get("accept"))
        return Response(body, media_type=content_type)


async def _scraper(request: Request, bearer: Any, monitor: Monitor) -> model.Access:
    """Who scrapes: the holder of the scrape token sees every kind of epoch; anyone else needs an Airflow login
    allowed to read the epoch DAG, as the pages do (401 without one, 403 for a forged or refused one)."""
    from airflow.api_fastapi.core_api.security import get_user

    presented = bearer.credentials if bearer is not None and bearer.scheme.lower() == "bearer" else None
    if presented and monitor.cfg.metrics_token_file:
        token = read_scrape_token(monitor.cfg.metrics_token_file)
        if hmac.compare_digest(presented.encode(), token.encode()):
            return model.Access(backfills=True, backfill_dag_id=BACKFILL_DAG_ID)
    user = await get_user(request, None, bearer)
    # (the auth manager looks at the metadata database: off the event loop)
    if not await run_in_threadpool(_may_read, user, EPOCH_DAG_ID):
        raise HTTPException(403, f"reading the metrics needs read access to the DAG {EPOCH_DAG_ID}")
    return model.Access(backfills=await run_in_threadpool(_may_read, user, BACKFILL_DAG_ID),
                        backfill_dag_id=BACKFILL_DAG_ID)


_TOKENS: dict[str, tuple[float, str]] = {}   # file -> (its mtime, its token)


def read_scrape_token(path: str) -> str:
    """The scrape token of ``metrics_token_file``, read again when the file changes."""
    from ipcount.rules.private_files import read_private_file

    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        mtime = -1.0
    held = _TOKENS.get(path)
    if held is None or held[0] != mtime:
        token = read_private_file(path, "metrics_token_file")
        if len(token) < MIN_SCRAPE_TOKEN:
            raise ConfigError(f"metrics_token_file: the token in {path} has {len(token)} characters; use at least "
                              f"{MIN_SCRAPE_TOKEN} (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
        held = _TOKENS[path] = (mtime, token)
    return held[1]


MIN_SCRAPE_TOKEN = 32


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(model.BadQueryError)
    async def bad_query(request: Request, e: model.BadQueryError):
        return _error(request, 400, str(e))

    @app.exception_handler(model.ForbiddenError)
    async def forbidden(request: Request, e: model.ForbiddenError):
        return _error(request, 403, str(e))

    @app.exception_handler(ConfigError)
    async def bad_config(request: Request, e: ConfigError):
        return _error(request, 500, f"the pipeline's configuration is invalid: {e}")

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(request: Request, e: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ())[1:])}: {err.get('msg')}"
                             for err in e.errors())
        return _error(request, 400, f"bad parameter: {problems}")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return _error(request, e.status_code, str(e.detail), getattr(e, "headers", None))


def _add_api_routes(app: FastAPI, router: APIRouter, monitor: Monitor, access: Any) -> None:
    """The same data as the pages, as JSON under ``/api/``, and its OpenAPI docs."""
    @router.get("/api/openapi.json", include_in_schema=False)
    def openapi() -> dict[str, Any]:
        return app.openapi()

    @router.get("/api/docs", include_in_schema=False)
    def docs(request: Request) -> HTMLResponse:
        from fastapi.openapi.docs import get_swagger_ui_html

        return get_swagger_ui_html(openapi_url=request.scope.get("root_path", "") + "/api/openapi.json",
                                   title="ipcount monitor API")

    @router.get("/api/health")
    def api_health(target: str = "main", who: model.Access = access) -> dict[str, Any]:
        return monitor.health(target, who).to_dict()

    @router.get("/api/epochs")
    def api_epochs(target: str = "main", status: str | None = None, kind: str | None = None,
                   run_id: str | None = None, page: int = 1, page_size: int = Query(50),
                   who: model.Access = access) -> dict[str, Any]:
        data = monitor.epochs(target, status, kind, run_id, page, page_size, who)
        data.pop("page_info")
        data.pop("published_column")
        data["epochs"] = [e.to_dict() for e in data["epochs"]]
        return data

    @router.get("/api/lag")
    def api_lag(target: str = "main", epochs: int = 50, who: model.Access = access) -> dict[str, Any]:
        return monitor.lag(target, epochs, who)

    @router.get("/api/publish")
    def api_publish(group: str | None = None, who: model.Access = access) -> dict[str, Any]:
        """Publishing to the sink topic: the publisher's cursor against the counts versions, and the lag on the sink
        topic of one of the pipeline's own consumer groups (``group``)."""
        return monitor.publish(group)

    @router.get("/api/counts")
    def api_counts(target: str = "main", start: str | None = Query(None, alias="from"),
                   until: str | None = None, top: int = 20, who: model.Access = access) -> dict[str, Any]:
        return monitor.counts(target, start, until, top, who)


def _add_page_routes(router: APIRouter, monitor: Monitor, access: Any) -> None:
    """The HTML pages: epochs (also per DAG run), lag, counts."""
    def render(request: Request, template: str, who: model.Access, **context: Any) -> HTMLResponse:
        target = context.get("target", "main")
        base = request.scope.get("root_path", "")
        try:
            health = monitor.health(target, who)
            targets = monitor.targets(who)
        except (model.BadQueryError, model.ForbiddenError):
            health, targets = None, ["main"]
        return TEMPLATES.TemplateResponse(request, template, {
            "base": base, "health": health, "targets": targets, "cfg": monitor.cfg, "target": target,
            "statuses": model.STATUSES, "kinds": model.KINDS, "committed": model.COMMITTED, **context})

    @router.get("/", include_in_schema=False)
    def root(request: Request):
        return RedirectResponse(request.scope.get("root_path", "") + "/epochs")

    @router.get("/epochs", response_class=HTMLResponse, name="epochs_page")
    def epochs_page(request: Request, target: str = "main", status: str | None = None, kind: str | None = None,
                    run_id: str | None = None, page: int = 1, page_size: int = 50, who: model.Access = access):
        data = monitor.epochs(target, status, kind, run_id, page, page_size, who)
        return render(request, "epochs.html", who, status=status or "", kind=kind or "", run_id=run_id or "",
                      **_epoch_charts(data["epochs"]), **data)

    @router.get("/runs/{dag_id}/{run_id}", response_class=HTMLResponse)
    def run_page(request: Request, dag_id: str, run_id: str, who: model.Access = access):
        who.check_dag(dag_id)
        target = run_target(dag_id, run_id)
        if target is None:
            raise HTTPException(404, f"no run {run_id!r} of DAG {dag_id!r}")
        data = monitor.epochs(target, None, None, run_id, 1, 500, who)
        return render(request, "epochs.html", who, status="", kind="", run_id=run_id, run_dag_id=dag_id,
                      **_epoch_charts(data["epochs"]), **data)

    @router.get("/lag", response_class=HTMLResponse)
    def lag_page(request: Request, target: str = "main", epochs: int = 50, who: model.Access = access):
        data = monitor.lag(target, epochs, who)
        xs = [h["epoch"] for h in data["history"]]
        parts = sorted({p for h in data["history"] for p in h["lag"]}, key=int)
        per_partition = {f"p{p}": [h["lag"].get(p) for h in data["history"]] for p in parts}
        chart = line_chart("lag-chart", "Lag after each epoch, per partition", xs, per_partition)
        over_time = time_chart("lag-time-chart", "Lag after each epoch over time, per partition",
                               [datetime.fromisoformat(h["committed_at"]) if h["committed_at"] else None
                                for h in data["history"]], per_partition)
        return render(request, "lag.html", who, chart=chart, time_chart=over_time, epochs=epochs, **data)

    @router.get("/counts", response_class=HTMLResponse)
    def counts_page(request: Request, target: str = "main", start: str | None = Query(None, alias="from"),
                    until: str | None = None, top: int = 20, who: model.Access = access):
        data = monitor.counts(target, start, until, top, who)
        windows = data["windows"]
        chart = bar_chart("window-chart", "Requests per window", [w["window_start"][11:19] for w in windows],
                          [w["requests"] for w in windows], [not w["final"] for w in windows])
        return render(request, "counts.html", who, chart=chart, top=top, this_from=data["from"],
                      this_until=data["until"], **data)


def _epoch_charts(epochs: list[model.EpochRow]) -> dict[str, str]:
    """The epochs page's charts: records counted per epoch (oldest left), and records by commit time."""
    shown = list(reversed(epochs))
    committed = sorted((e for e in epochs if e.committed_at is not None), key=lambda e: e.committed_at)
    records = {n: [getattr(e, f"records_{n}") for e in committed] for n in ("read", "counted", "late", "malformed")}
    chart = bar_chart("epochs-chart", "Records counted per epoch (lighter: not committed)",
                      [f"epoch {e.epoch}" for e in shown], [e.records_counted for e in shown],
                      [e.status != model.COMMITTED for e in shown])
    over_time = time_chart("records-time-chart", "Records per epoch over time (committed epochs of this page)",
                           [e.committed_at for e in committed], records)
    return {"chart": chart, "time_chart": over_time}


def _error(request: Request, status: int, message: str, headers: dict | None = None):
    if _is_api(request):
        return JSONResponse({"detail": message}, status_code=status, headers=headers)
    return TEMPLATES.TemplateResponse(request, "error.html", {
        "status": status, "message": message, "base": request.scope.get("root_path", ""),
        "login": status in (401, 403)}, status_code=status, headers=headers)


def _is_api(request: Request) -> bool:
    root, path = request.scope.get("root_path", ""), request.url.path
    return (path[len(root):] if root and path.startswith(root) else path).startswith(("/api/", "/metrics"))
