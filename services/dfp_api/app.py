"""The FastAPI app factory: ``create_app(settings)``."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import Histogram

from . import errors
from .deps import BEARER_SCHEME
from .limits import BodyLimitMiddleware
from .routes import health, jobs, keys
from .settings import ApiSettings
from .state import ApiState
from .web import web

# one histogram (its _count is the request count by route and status): one update per request
LATENCY = Histogram("dfp_api_request_seconds", "HTTP request latency by route and status",
                    ["method", "route", "status"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))


class MetricsMiddleware:
    """Counts requests by route template and status (pure ASGI, so streaming responses pass through)."""

    def __init__(self, app):
        self.app = app

    _children: dict = {}

    @classmethod
    def _observe(cls, method: str, path: str, status: int, seconds: float) -> None:
        key = (method, path, status)
        child = cls._children.get(key)
        if child is None:  # a label lookup costs more than the observation: keep the children
            child = cls._children[key] = LATENCY.labels(method, path, str(status))
        child.observe(seconds)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = getattr(scope.get("route"), "path", None) or "unmatched"
            self._observe(scope["method"], path, status[0], time.perf_counter() - start)


def create_app(settings: ApiSettings) -> FastAPI:
    """Build the API. Redis clients open with the app's lifespan and close with it."""
    state = ApiState.build(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await state.close()

    app = FastAPI(
        title="dflash-pipeline",
        version="1.0.0",
        summary="Control plane: submit, watch and cancel generate / tokenize / train / pipeline jobs.",
        lifespan=lifespan,
        # their pages load scripts from a CDN, on the origin where the jobs page keeps the key
        docs_url="/docs" if settings.api_docs else None,
        redoc_url="/redoc" if settings.api_docs else None,
    )
    app.state.api = state
    errors.install(app)
    # the routes go on the app's own router: an included router is one more router to match and pass every
    # request through (in FastAPI's lazily included routers, a second match of its routes)
    for router in (jobs, keys, health, web):
        app.router.routes.extend(router.routes)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware)
    _document(app, settings)
    return app


def _document(app: FastAPI, settings: ApiSettings) -> None:
    """Auth is one plain dependency (see deps.require); state the bearer scheme in the document here,
    and the page size this server's settings allow."""
    generate = app.openapi

    def openapi() -> dict:
        doc = generate()
        for param in doc["paths"]["/v1/jobs"]["get"].get("parameters", []):
            if param["name"] == "limit" and param["in"] == "query":
                param["schema"]["maximum"] = settings.max_page_size
        doc.setdefault("components", {}).setdefault("securitySchemes", {}).update(BEARER_SCHEME)
        for path, operations in doc["paths"].items():
            if path.startswith("/v1/"):
                for operation in operations.values():
                    operation["security"] = [{"HTTPBearer": []}]
        return doc

    app.openapi = openapi
