"""Request dependencies as ``Annotated`` aliases: app state, caller, scopes, existing job."""

from __future__ import annotations

from typing import Annotated

import redis
from dfp_shared.jobs import JobRecord
from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .auth import ANONYMOUS, Principal
from .errors import ApiError
from .settings import ApiSettings
from .state import ApiState
from .store import AsyncJobReader

bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer <key>`.")


def get_state(request: Request) -> ApiState:
    return request.app.state.api


State = Annotated[ApiState, Depends(get_state)]


def get_settings(state: State) -> ApiSettings:
    return state.settings


def get_redis(state: State) -> redis.Redis:
    return state.redis


def get_reader(state: State) -> AsyncJobReader:
    return state.reader


Settings = Annotated[ApiSettings, Depends(get_settings)]
SyncRedis = Annotated[redis.Redis, Depends(get_redis)]
Reader = Annotated[AsyncJobReader, Depends(get_reader)]


async def authenticate(state: State,
                       creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
    """The caller named by the bearer key (401 if missing or unknown), charged one request (429)."""
    if state.keyring is None:
        principal = ANONYMOUS
    else:
        if creds is None or not creds.credentials:
            raise ApiError(401, "unauthenticated", "missing API key (Authorization: Bearer <key>)",
                           {"WWW-Authenticate": "Bearer"})
        principal = state.keyring.authenticate(creds.credentials)
        if principal is None:
            raise ApiError(401, "unauthenticated", "invalid API key", {"WWW-Authenticate": "Bearer"})
    decision = await state.limiter.hit(principal.name)
    if not decision.allowed:
        raise ApiError(429, "rate_limited", f"rate limit of {state.settings.rate_limit_per_s:g} requests/s exceeded",
                       {"Retry-After": str(decision.retry_after_s)})
    return principal


Caller = Annotated[Principal, Depends(authenticate)]


def _scope(scope: str):
    async def check(caller: Caller) -> Principal:
        if not caller.allows(scope):
            raise ApiError(403, "forbidden", f"this API key lacks the {scope!r} scope")
        return caller

    return check


Reading = Annotated[Principal, Depends(_scope("read"))]
Writing = Annotated[Principal, Depends(_scope("write"))]

JobId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="Job id.")]


async def existing_job(job_id: JobId, reader: Reader, _: Reading) -> JobRecord:
    """The job named in the path (404 if unknown)."""
    return await reader.get(job_id)


ExistingJob = Annotated[JobRecord, Depends(existing_job)]
