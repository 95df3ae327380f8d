"""Submitting jobs: the one place that turns a job record into queued work.

``queue_job`` creates the job record and puts one ``plan`` task on the job type's stream; the
service's worker that claims it expands it into per-unit tasks (files, prompt shards, a training
run). A pipeline gets no task of its own: its first stage is queued as a job of its own, and
:mod:`.job_flow` starts each later stage when the one before it ends.
"""

from __future__ import annotations

import logging
import uuid

import redis

from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobRecord, JobState, JobStore
from dfp_shared.jobs.types import JOB_TYPES, PIPELINE, job_type
from dfp_shared.specs import PipelineSpec
from dfp_shared.storage.roots import StorageRoots

log = logging.getLogger(__name__)

PLAN_KEY = "plan"


def validate_spec(type_name: str, spec: dict) -> dict:
    """Validate ``spec`` with the job type's model; returns the normalised dict (raises ValueError)."""
    return job_type(type_name).spec.model_validate(spec).model_dump(mode="json")


def with_default_outputs(type_name: str, spec: dict, roots: StorageRoots, job_id: str, field: str = "spec") -> dict:
    """``spec`` with every unset ``output`` set to a prefix of the job's own under the storage root (raises
    OutsideRoots for an output a spec names inside that reserved area)."""
    if type_name == PIPELINE.name:
        return {**spec, **{stage: with_default_outputs(stage, dict(spec.get(stage) or {}), roots,
                                                       f"{job_id}/{stage}", f"{field}.{stage}")
                           for stage in PipelineSpec.stages_of(spec)}}
    if spec.get("output") is None:
        return {**spec, "output": roots.job_prefix(job_id)}
    roots.check_explicit_output(spec["output"], f"{field}.output")
    return spec


def queue_job(r: redis.Redis, type_name: str, spec: dict, *, idempotency_key: str | None = None,
              parent_id: str | None = None, stage: str | None = None, owner: str | None = None,
              roots: StorageRoots | None = None) -> tuple[JobRecord, bool]:
    """Create a job and queue its plan task (a pipeline: its first stage). Returns (job, created); an
    idempotency key already used returns the existing job and False.

    With ``roots`` (the API's), every storage URI of the spec must lie inside them (raises
    :class:`~dfp_shared.storage.roots.OutsideRoots`), and an unset ``output`` becomes a per-job prefix.
    """
    spec = validate_spec(type_name, spec)
    kind = JOB_TYPES[type_name]
    job_id = uuid.uuid4().hex[:16]
    if roots is not None:
        spec = with_default_outputs(type_name, spec, roots, job_id)
        roots.check_spec(type_name, spec)
        roots.check_reservations(type_name, spec, owner)
    jobs = JobStore(r)
    job, created = jobs.create(type_name, spec, job_id=job_id, idempotency_key=idempotency_key, parent_id=parent_id,
                               stage=stage, primary_unit=kind.primary_unit, owner=owner)
    if not created:
        return job, False
    if kind is PIPELINE:
        stages = PipelineSpec.stages_of(spec)
        jobs.set_totals(job.id, stages=len(stages))
        jobs.transition(job.id, JobState.running)
        first = stages[0]
        start_stage(r, job, first, dict(spec[first]))
    else:
        TaskQueue(r, kind.stream).enqueue(job.id, PLAN_KEY, {"plan": True})
    return jobs.get(job.id), True


def start_stage(r: redis.Redis, pipeline: JobRecord, stage: str, stage_spec: dict) -> JobRecord:
    """Queue a pipeline's ``stage`` as a job of its own (once: a second call returns the same job)."""
    jobs = JobStore(r)
    child, _ = queue_job(r, stage, stage_spec, idempotency_key=f"pipeline:{pipeline.id}:{stage}",
                         parent_id=pipeline.id, stage=stage, owner=pipeline.owner)
    jobs.set_outputs(pipeline.id, **{f"{stage}_job": child.id})
    jobs.emit(pipeline.id, "stage", {"stage": stage, "job_id": child.id})
    log.info("pipeline stage started", extra={"job_id": pipeline.id, "stage": stage, "stage_job": child.id})
    return child
