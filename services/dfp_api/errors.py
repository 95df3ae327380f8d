"""Error responses: one JSON shape ``{"error", "message", "fields"?}`` for every failure."""

from __future__ import annotations

import logging
import re

from dfp_shared.jobs.store import IllegalTransition, JobNotFound
from dfp_shared.jobs.types import JOB_TYPES
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from .quotas import QuotaExceeded
from .service import IdempotencyConflict

log = logging.getLogger(__name__)

_DOTTED = re.compile(r"[a-z_]\w*(\.\w+)+")


class ApiError(Exception):
    def __init__(self, status: int, error: str, message: str, headers: dict[str, str] | None = None,
                 usage: dict | None = None):
        super().__init__(message)
        self.status, self.error, self.message, self.headers, self.usage = status, error, message, headers, usage


def _body(error: str, message: str, fields: list[dict] | None = None, usage: dict | None = None) -> dict:
    out = {"error": error, "message": message}
    if fields is not None:
        out["fields"] = fields
    if usage is not None:
        out["usage"] = usage
    return out


def field_errors(exc: RequestValidationError) -> list[dict]:
    """Each pydantic error as {field, location, reason}; the union tag is dropped from body paths."""
    out = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ())]
        where = loc[0] if loc else "body"
        path = loc[1:]
        if where == "body" and len(path) > 1 and path[0] in JOB_TYPES:
            path = path[1:]
        reason = err.get("msg", "invalid")
        if reason.startswith("Value error, "):
            reason = reason[len("Value error, "):]
            head, sep, rest = reason.partition(": ")
            if sep and _DOTTED.fullmatch(head):  # a check across fields that names the one at fault
                path, reason = [*path, *head.split(".")], rest
        out.append({"field": ".".join(path) or where, "location": where, "reason": reason})
    return out


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette names only the first route's)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return JSONResponse(_body(exc.error, exc.message, usage=exc.usage), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(QuotaExceeded)
    async def _quota(_: Request, exc: QuotaExceeded):
        return JSONResponse(_body(exc.reason, exc.message, usage=exc.usage), status_code=429,
                            headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        fields = field_errors(exc)
        message = "; ".join(f"{f['field']}: {f['reason']}" for f in fields) or "invalid request"
        return JSONResponse(_body("invalid_request", message, fields), status_code=422)

    @app.exception_handler(JobNotFound)
    async def _not_found(_: Request, exc: JobNotFound):
        return JSONResponse(_body("not_found", f"no job {exc.args[0]!r}"), status_code=404)

    @app.exception_handler(IllegalTransition)
    async def _conflict(_: Request, exc: IllegalTransition):
        return JSONResponse(_body("illegal_transition", str(exc)), status_code=409)

    @app.exception_handler(IdempotencyConflict)
    async def _idem(_: Request, exc: IdempotencyConflict):
        return JSONResponse(_body("idempotency_conflict", str(exc)), status_code=409)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400:  # FastAPI's "error parsing the body": one shape for all bad input
            reason = f"not decodable: {exc.detail}"
            return JSONResponse(_body("invalid_request", f"body: {reason}", [
                {"field": "body", "location": "body", "reason": reason}]), status_code=422)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(request))
        return JSONResponse(_body(code, str(exc.detail)), status_code=exc.status_code, headers=headers or None)

    async def _redis_down(_: Request, exc: Exception):
        log.error("redis unavailable", extra={"error": str(exc)})
        return JSONResponse(_body("unavailable", "job store (Redis) unavailable; retry later"), status_code=503,
                            headers={"Retry-After": "5"})

    app.add_exception_handler(RedisConnectionError, _redis_down)
    app.add_exception_handler(RedisTimeoutError, _redis_down)
