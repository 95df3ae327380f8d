"""Job operations behind the routes: submit for a caller (with idempotency), list, cancel (cascading).

These call the shared sync job code (:mod:`dfp_shared.jobs.submit`, :mod:`dfp_shared.jobs.flow`,
:class:`~dfp_shared.jobs.store.JobStore`)
and run in a worker thread of the API.
"""

from __future__ import annotations

import logging

import redis
from dfp_shared.jobs.flow import advance_pipeline
from dfp_shared.jobs.store import (
    IDEMPOTENCY_PREFIX,
    IllegalTransition,
    JobNotFound,
    JobRecord,
    JobState,
    JobStore,
)
from dfp_shared.jobs.submit import queue_job, validate_spec, with_default_outputs
from dfp_shared.jobs.types import PIPELINE
from dfp_shared.specs import PipelineSpec
from dfp_shared.storage.roots import OutsideRoots, StorageRoots
from fastapi.exceptions import RequestValidationError

from .quotas import check_active_jobs, count_job, jobs_lock

log = logging.getLogger(__name__)


class IdempotencyConflict(ValueError):
    """The idempotency key was used before for a different request."""


def submit_for_caller(r: redis.Redis, caller: str, job_type: str, spec: dict, idempotency_key: str | None,
           roots: StorageRoots, max_active: int = 0) -> tuple[JobRecord, bool]:
    """Create and queue a job owned by ``caller``. A repeated idempotency key (scoped to the caller)
    returns the first job. A storage URI outside ``roots`` is a 422 naming the field and the roots.
    With ``max_active``, a caller that has that many queued or running jobs gets a 429
    (:class:`~.quotas.QuotaExceeded`) instead (a replay is never refused)."""
    scoped = f"api:{caller}:{idempotency_key}" if idempotency_key else None
    try:
        if max_active and not (scoped and r.exists(IDEMPOTENCY_PREFIX + scoped)):
            with jobs_lock(r, caller):
                check_active_jobs(r, caller, max_active)
                job, created = queue_job(r, job_type, spec, idempotency_key=scoped, owner=caller, roots=roots)
                if created:
                    count_job(r, caller, job.id)
        else:
            job, created = queue_job(r, job_type, spec, idempotency_key=scoped, owner=caller, roots=roots)
    except OutsideRoots as exc:
        field, _, reason = str(exc).partition(": ")
        raise RequestValidationError([{"loc": ("body", *field.split(".")), "msg": reason,
                                       "type": "storage_root"}]) from None
    if not created and (job.type != job_type or job.spec != with_default_outputs(
            job_type, validate_spec(job_type, spec), roots, job.id)):
        raise IdempotencyConflict(
            f"Idempotency-Key was already used for job {job.id} with a different type or spec")
    log.info("job submitted" if created else "job submit replayed",
             extra={"job_id": job.id, "type": job_type, "caller": caller})
    return job, created


def list_jobs(r: redis.Redis, state: str | None, job_type: str | None, offset: int, limit: int,
              owner: str | None = None) -> tuple[list[JobRecord], int]:
    """A page of jobs (``owner``: only that principal's), read without their specs."""
    return JobStore(r).list(state=state, job_type=job_type, owner=owner, offset=offset, limit=limit, spec=False)


def cancel(r: redis.Redis, caller: str, job_id: str, owner: str | None = None) -> JobRecord:
    """Cancel a queued or running job. A pipeline cancels its running stage; a cancelled stage
    ends its pipeline. Raises JobNotFound (also for a job that is not ``owner``'s, when given), or
    IllegalTransition when the job already finished."""
    jobs = JobStore(r)
    rec = jobs.get(job_id)
    if owner is not None and rec.owner != owner:
        raise JobNotFound(job_id)
    if rec.state.terminal:
        raise IllegalTransition(job_id, rec.state.value, JobState.cancelled.value)
    rec = jobs.cancel(job_id)
    log.info("job cancelled", extra={"job_id": job_id, "type": rec.type, "caller": caller})
    if rec.type == PIPELINE.name:
        for stage in PipelineSpec.stages_of(rec.spec or {}):
            child = rec.outputs.get(f"{stage}_job")
            if not child:
                continue
            try:
                if not jobs.get(child).state.terminal:
                    jobs.cancel(child)
                    log.info("pipeline stage cancelled", extra={"job_id": child, "pipeline": job_id})
            except (JobNotFound, IllegalTransition):
                continue
    elif rec.parent_id:
        advance_pipeline(r, rec)
    return jobs.get(job_id)
