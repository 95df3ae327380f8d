"""Request dependencies as ``Annotated`` aliases: app state, caller, scopes, existing job."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Annotated

import redis
from dfp_shared.jobs.store import JobNotFound, JobRecord
from fastapi import Depends, Path, Request
from fastapi.exceptions import RequestValidationError

from .auth import ANONYMOUS, UNLOADABLE, Principal, format_expiry
from .errors import ApiError
from .quotas import REFUSALS, StreamSlot
from .ratelimit import RateLimiter
from .settings import ApiSettings
from .state import ApiState
from .store import AsyncJobReader


async def get_state(request: Request) -> ApiState:
    return request.app.state.api


State = Annotated[ApiState, Depends(get_state)]


async def get_settings(state: State) -> ApiSettings:
    return state.settings


async def get_redis(state: State) -> redis.Redis:
    return state.redis


async def get_reader(state: State) -> AsyncJobReader:
    return state.reader


Settings = Annotated[ApiSettings, Depends(get_settings)]
SyncRedis = Annotated[redis.Redis, Depends(get_redis)]
Reader = Annotated[AsyncJobReader, Depends(get_reader)]


def _bearer_token(request: Request) -> str | None:
    value = request.headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _reject_unknown_query(request: Request) -> None:
    """A query parameter the route does not declare is a 422, like an unknown body field."""
    if not request.query_params:
        return
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    # kept on the route itself: a cache keyed by id() would answer for another app's route once this one is
    # collected and its id reused (tests build many apps in one process)
    names = getattr(route, "_declared_query_names", None)
    if names is None:
        names = frozenset(p.alias for p in dependant.query_params)
        route._declared_query_names = names
    unknown = sorted(set(request.query_params) - names)
    if unknown:
        raise RequestValidationError([{"loc": ("query", name), "msg": "unknown query parameter",
                                       "type": "extra_forbidden"} for name in unknown])


def _expired(principal: Principal) -> str:
    return f"API key expired at {format_expiry(datetime.fromtimestamp(principal.expires_at, timezone.utc))}"


def require(scope: str):
    """A dependency: the caller named by the bearer key (401 if missing, unknown or expired), charged one
    request (429 over the key's rate), holding ``scope`` (403). One function on purpose: FastAPI's
    per-request cost grows with every dependency in the tree, and this runs on every request."""

    async def caller(request: Request) -> Principal:
        state: ApiState = request.app.state.api
        principal = _authenticate(request, state)
        await _charge(request, state.limiter, principal, scope)
        return principal

    caller.__name__ = f"require_{scope}"
    return caller


def _authenticate(request: Request, state: ApiState) -> Principal:
    """The caller named by the bearer key (401 if missing, unknown or expired); in process, no Redis."""
    if state.keyring is None:
        return ANONYMOUS
    token = _bearer_token(request)
    if token is None:
        raise ApiError(401, "unauthenticated", "missing API key (Authorization: Bearer <key>)",
                       {"WWW-Authenticate": "Bearer"})
    principal = state.keyring.authenticate(token)
    if principal is None:
        message = "invalid API key" if state.keyring.problem is None else UNLOADABLE
        raise ApiError(401, "unauthenticated", message, {"WWW-Authenticate": "Bearer"})
    if principal.expires_at is not None and principal.expired(time.time()):
        raise ApiError(401, "unauthenticated", _expired(principal),
                       {"WWW-Authenticate": 'Bearer error="invalid_token"'})
    return principal


async def _charge(request: Request, limiter: RateLimiter, principal: Principal, scope: str) -> None:
    """One request on ``principal``'s rate (429 over it), then its scope (403) and the query (422)."""
    decision = await limiter.hit(principal.name)
    if not decision.allowed:
        REFUSALS.labels("rate_limited").inc()
        raise ApiError(429, "rate_limited",
                       f"rate limit of {request.app.state.api.settings.rate_limit_per_s:g} requests/s exceeded",
                       {"Retry-After": str(decision.retry_after_s)},
                       usage={"remaining": decision.remaining, "rate_limit_per_s": limiter.rate,
                              "burst": limiter.burst})
    if not principal.allows(scope):
        raise ApiError(403, "forbidden", f"this API key lacks the {scope!r} scope")
    _reject_unknown_query(request)


def key_recheck(request: Request, scope: str = "read") -> Callable[[JobRecord], str | None] | None:
    """For a response that outlives its request (an event stream): a check, run at every poll, of the
    request's key against the key set as it is now. It returns why the key no longer holds (revoked,
    the key set failed to load, expired, scope gone, or the job no longer the key's to see), else
    None. None instead of a check when auth is disabled. Not charged to the rate limit."""
    keyring = request.app.state.api.keyring
    if keyring is None:
        return None
    token = _bearer_token(request) or ""

    def check(job: JobRecord) -> str | None:
        principal = keyring.authenticate(token)
        if principal is None:
            return "this API key is no longer valid" if keyring.problem is None else UNLOADABLE
        if principal.expired(time.time()):
            return _expired(principal)
        if not principal.allows(scope):
            return f"this API key lacks the {scope!r} scope"
        if not principal.may_see(job.owner):
            return "this API key may no longer see the job"
        return None

    return check


read_caller = require("read")
Reading = Annotated[Principal, Depends(read_caller)]
Writing = Annotated[Principal, Depends(require("write"))]

BEARER_SCHEME = {"HTTPBearer": {"type": "http", "scheme": "bearer",
                                "description": "An API key: `Authorization: Bearer <key>`."}}
"""The OpenAPI security scheme of every route that depends on :data:`Reading` or :data:`Writing`."""

JobId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="Job id.")]


def visible(caller: Principal, job: JobRecord) -> JobRecord:
    """``job`` if the caller may see it (its own, or any for an admin); else 404, as for a job that
    does not exist, so another principal's job ids reveal nothing."""
    if not caller.may_see(job.owner):
        raise JobNotFound(job.id)
    return job


async def existing_job(job_id: JobId, request: Request, caller: Reading) -> JobRecord:
    """The job named in the path (404 if unknown or another principal's)."""
    return visible(caller, await request.app.state.api.reader.get(job_id))


ExistingJob = Annotated[JobRecord, Depends(existing_job)]


async def open_stream(job_id: JobId, request: Request) -> tuple[JobRecord, StreamSlot]:
    """The job named in the path and a place for one more event stream of the caller's key, which the stream
    releases when it ends. Admitted on the streams' own Redis pool only, after a place in this process was
    found (429 at the key's limit before any pool is asked), so a burst of streams never waits on, nor
    exhausts, the pool of every other request."""
    state: ApiState = request.app.state.api
    principal = _authenticate(request, state)
    slot = state.streams.enter(principal.name)
    try:
        await _charge(request, state.stream_limiter, principal, "read")
        job = visible(principal, await state.stream_reader.get(job_id))
        await state.streams.take(slot)
    except BaseException:
        await slot.release()
        raise
    return job, slot


OpenStream = Annotated[tuple[JobRecord, StreamSlot], Depends(open_stream)]
