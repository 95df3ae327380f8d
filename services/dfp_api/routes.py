"""HTTP routes: jobs (submit, list, get, cancel, events, metrics), the calling key (whoami) and health."""

from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Annotated

from dfp_shared.jobs.store import METRICS_PAGE_MAX, JobRecord, JobState
from dfp_shared.jobs.types import PIPELINE
from dfp_shared.metrics import metrics_payload
from dfp_shared.specs.train import MAX_STEPS
from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.sse import EventSourceResponse, ServerSentEvent
from prometheus_client import Counter
from pydantic import TypeAdapter, ValidationError

from . import service
from .deps import (
    ExistingJob,
    JobId,
    OpenStream,
    Reader,
    Reading,
    Settings,
    State,
    SyncRedis,
    Writing,
    key_recheck,
    read_caller,
    visible,
)
from .events import job_events
from .schemas import (
    Caller,
    Health,
    Job,
    JobPage,
    JobRequest,
    JobSummary,
    JobType,
    MetricPage,
    error_responses,
)

STRICT_REQUEST: TypeAdapter = TypeAdapter(JobRequest)
SUBMITTED = Counter("dfp_api_jobs_submitted_total", "Jobs created through the API", ["type"])

jobs = APIRouter(prefix="/v1/jobs", tags=["jobs"])
keys = APIRouter(prefix="/v1", tags=["keys"])
health = APIRouter(tags=["health"])

IdempotencyKey = Annotated[str, Header(  # not "| None": a header is absent or a string, never null
    alias="Idempotency-Key", min_length=1, max_length=200, pattern=r"^[!-~]+$",
    description="Makes a retried submit return the job the first one created.")]


def _job(rec: JobRecord) -> Job:
    # field by field: dataclasses.asdict deep-copies, which costs more than the whole Redis read
    return Job(id=rec.id, type=rec.type, state=rec.state, spec=rec.spec, created_at=rec.created_at,
               started_at=rec.started_at, finished_at=rec.finished_at, error=rec.error, outputs=rec.outputs,
               counters=rec.counters, totals=rec.totals, primary_unit=rec.primary_unit, parent_id=rec.parent_id,
               stage=rec.stage, owner=rec.owner, progress=rec.progress())


def _summary(rec: JobRecord) -> JobSummary:
    return JobSummary(id=rec.id, type=rec.type, state=rec.state, created_at=rec.created_at,
                      started_at=rec.started_at, finished_at=rec.finished_at, error=rec.error, outputs=rec.outputs,
                      counters=rec.counters, totals=rec.totals, primary_unit=rec.primary_unit,
                      parent_id=rec.parent_id, stage=rec.stage, owner=rec.owner, progress=rec.progress())


@jobs.post("", status_code=201, response_model=Job,
           responses={200: {"model": Job, "description": "Replay: the job this Idempotency-Key created"},
                      **error_responses(401, 403, 409, 413, 422, 429, 503)})
async def post_job(body: JobRequest, caller: Writing, r: SyncRedis, request: Request, response: Response,
                   idempotency_key: IdempotencyKey = None) -> Job:
    """Submit a generate, tokenize, train, pipeline, evaluate, cache or import_gguf job. Returns 201 (created) or 200
    (replayed)."""
    try:  # strict, as the document states: no 0 for false, no "3" for 3
        body = STRICT_REQUEST.validate_json(await request.body(), strict=True)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]) from None
    spec = body.spec.model_dump(mode="json")
    api = request.app.state.api
    rec, created = await run_in_threadpool(service.submit_for_caller, r, caller.name, body.type, spec, idempotency_key,
                                           api.roots, api.settings.max_active_jobs_per_key)
    if created:
        SUBMITTED.labels(body.type).inc()
    else:
        response.status_code = 200
    return _job(rec)


@jobs.get("", response_model=JobPage, responses=error_responses(401, 403, 422, 429, 503))
async def list_jobs(caller: Reading, r: SyncRedis, settings: Settings,
                    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
                    type: Annotated[JobType | None, Query(description="Only jobs of this type.")] = None,
                    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
                    limit: Annotated[int, Query(ge=1, le=10_000, description="Page size.")] = 50) -> JobPage:
    """The caller's jobs (an admin's: every job), newest first, filtered by state and type; items
    leave the spec out (GET /v1/jobs/{id} has it)."""
    if limit > settings.max_page_size:
        raise RequestValidationError([{"loc": ("query", "limit"), "type": "less_than_equal",
                                       "msg": f"Input should be less than or equal to {settings.max_page_size}"}])
    page, total = await run_in_threadpool(service.list_jobs, r, state.value if state else None,
                                          type.value if type else None, offset, limit,
                                          None if caller.sees_all else caller.name)
    return JobPage(items=[_summary(rec) for rec in page], total=total, offset=offset, limit=limit)


@jobs.get("/{job_id}", response_model=Job, responses=error_responses(401, 403, 404, 422, 429, 503))
async def get_job(job_id: JobId, request: Request) -> Response:
    """A job's spec, state, progress (rate, ETA), error and outputs (404 for another principal's job)."""
    # the hot path: the key is checked by a call, not a dependency (solving one costs more than the Redis read);
    # the body is built from the model, so it matches the document, and is sent as is (no second validation
    # pass); the owner comes with the record
    caller = await read_caller(request)
    job = visible(caller, await request.app.state.api.reader.get(job_id))
    return Response(_job(job).model_dump_json(), media_type="application/json")


@jobs.post("/{job_id}/cancel", response_model=Job,
           responses=error_responses(401, 403, 404, 409, 413, 422, 429, 503))
async def cancel_job(job_id: JobId, caller: Writing, r: SyncRedis) -> Job:
    """Cancel a queued or running job (a pipeline also cancels its running stage). 409 if it already ended;
    404 for another principal's job (an admin may cancel any)."""
    return _job(await run_in_threadpool(service.cancel, r, caller.name, job_id,
                                        None if caller.sees_all else caller.name))


@jobs.get("/{job_id}/events", response_class=EventSourceResponse,
          responses=error_responses(401, 403, 404, 422, 429, 503, explicit_json=True))
async def job_event_stream(
    opened: OpenStream, settings: Settings, state: State, request: Request,
    last_event_id: Annotated[str, Header(alias="Last-Event-ID", pattern=r"^\d+-\d+$",
                                         description="Resume after this event id.")] = None,
) -> AsyncIterable[ServerSentEvent]:
    """Server-sent events: `state`, `stage` and worker events (with ids), `progress` snapshots, and a
    final `end` when the job is finished. The key is checked again at every poll: once it is revoked,
    expired or may no longer see the job, the stream sends `unauthorized` and closes. A key may hold
    DFLASH_MAX_STREAMS_PER_KEY streams open at once (one more is a 429)."""
    job, slot = opened
    try:
        async for event in job_events(job_id=job.id, reader=state.stream_reader, after=last_event_id or "0-0",
                                      poll_s=settings.sse_poll_s, max_s=settings.sse_max_s,
                                      still_allowed=key_recheck(request), on_poll=slot.renew):
            yield event
    finally:
        await slot.release()


@jobs.get("/{job_id}/metrics", response_model=MetricPage, responses=error_responses(401, 403, 404, 422, 429, 503))
async def job_metrics(job: ExistingJob, reader: Reader,
                      after: Annotated[int, Query(ge=-1, le=MAX_STEPS, description="Points after this step.")] = -1,
                      limit: Annotated[int, Query(ge=1, le=METRICS_PAGE_MAX, description="Page size.")] = 500,
                      ) -> MetricPage:
    """A train job's metric history (for a pipeline, its train stage's): points after step `after`, oldest
    first; new points also arrive on the job's event stream as `metrics` events."""
    job_id = job.outputs.get("train_job") if job.type == PIPELINE.name else job.id
    if not job_id:  # a pipeline before its train stage
        return MetricPage(job_id=job.id, items=[], next_after=None)
    items = await reader.metrics(job_id, after, limit)
    return MetricPage(job_id=job_id, items=items, next_after=int(items[-1]["step"]) if len(items) == limit else None)


@keys.get("/whoami", response_model=Caller, responses=error_responses(401, 403, 422, 429, 503))
async def whoami(caller: Reading) -> Caller:
    """The calling key's name and scopes: the principal its jobs and their outputs belong to."""
    return Caller(name=caller.name, scopes=sorted(caller.scopes))


@health.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process serves requests."""
    return Health(status="ok")


@health.get("/readyz", response_model=Health, responses={503: {"model": Health, "description": "Not ready"}})
async def readyz(state: State, response: Response) -> Health:
    """Readiness: Redis answers (on connections of its own, which no caller's requests or streams hold)."""
    try:
        await state.probe_redis.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        response.status_code = 503
        return Health(status="unavailable", checks={"redis": type(exc).__name__})
    return Health(status="ok", checks={"redis": "ok"})


@health.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus"}})
async def metrics() -> Response:
    body, content_type = metrics_payload()
    return Response(body, media_type=content_type)
