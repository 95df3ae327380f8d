"""Submitting jobs and finishing them: the one place that turns a job record into queued work.

``submit_job`` creates the job record and puts one ``plan`` task on the job type's stream; the
service's worker that claims it expands it into per-unit tasks (files, prompt shards, a training
run). ``finish_job`` moves a job to a terminal state and, when the job is a pipeline stage,
starts the next stage or ends the pipeline.
"""

from __future__ import annotations

import logging
import uuid

import redis

from .jobs import IllegalTransition, JobRecord, JobState, JobStore
from .queue import TaskQueue
from .specs import PRIMARY_UNIT, SPECS, TASK_STREAM, PipelineSpec
from .storage_roots import StorageRoots

log = logging.getLogger(__name__)

PLAN_KEY = "plan"
# stage -> (field of the next stage's spec, output of this stage that feeds it)
PIPELINE_WIRING = {"generate": ("tokenize", "input", "completions"), "tokenize": ("train", "dataset", "dataset")}


def validate_spec(job_type: str, spec: dict) -> dict:
    """Validate ``spec`` with the job type's model; returns the normalised dict (raises ValueError)."""
    if job_type not in SPECS:
        raise ValueError(f"unknown job type {job_type!r}; expected one of {sorted(SPECS)}")
    return SPECS[job_type].model_validate(spec).model_dump(mode="json")


def with_default_outputs(job_type: str, spec: dict, roots: StorageRoots, job_id: str, field: str = "spec") -> dict:
    """``spec`` with every unset ``output`` set to a prefix of the job's own under the storage root (raises
    OutsideRoots for an output a spec names inside that reserved area)."""
    if job_type == "pipeline":
        return {**spec, **{stage: with_default_outputs(stage, dict(spec.get(stage) or {}), roots,
                                                       f"{job_id}/{stage}", f"{field}.{stage}")
                           for stage in PipelineSpec.STAGES}}
    if spec.get("output") is None:
        return {**spec, "output": roots.job_prefix(job_id)}
    roots.check_explicit_output(spec["output"], f"{field}.output")
    return spec


def submit_job(r: redis.Redis, job_type: str, spec: dict, *, idempotency_key: str | None = None,
               parent_id: str | None = None, stage: str | None = None, owner: str | None = None,
               roots: StorageRoots | None = None) -> tuple[JobRecord, bool]:
    """Create a job and queue its plan task. Returns (job, created); an idempotency key already used
    returns the existing job and False.

    With ``roots`` (the API's), every storage URI of the spec must lie inside them (raises
    :class:`~dfp_shared.storage_roots.OutsideRoots`), and an unset ``output`` becomes a per-job prefix.
    """
    spec = validate_spec(job_type, spec)
    job_id = uuid.uuid4().hex[:16]
    if roots is not None:
        spec = with_default_outputs(job_type, spec, roots, job_id)
        roots.check_spec(job_type, spec)
    jobs = JobStore(r)
    job, created = jobs.create(job_type, spec, job_id=job_id, idempotency_key=idempotency_key, parent_id=parent_id,
                               stage=stage, primary_unit=PRIMARY_UNIT.get(job_type, "tasks"), owner=owner)
    if not created:
        return job, False
    if job_type == "pipeline":
        jobs.set_totals(job.id, stages=len(PipelineSpec.STAGES))
        jobs.transition(job.id, JobState.running)
        _start_stage(r, job, "generate", dict(spec["generate"]))
    else:
        TaskQueue(r, TASK_STREAM.get(job_type, job_type)).enqueue(job.id, PLAN_KEY, {"plan": True})
    return jobs.get(job.id), True


def _start_stage(r: redis.Redis, pipeline: JobRecord, stage: str, stage_spec: dict) -> JobRecord:
    jobs = JobStore(r)
    child, _ = submit_job(r, stage, stage_spec, idempotency_key=f"pipeline:{pipeline.id}:{stage}",
                          parent_id=pipeline.id, stage=stage, owner=pipeline.owner)
    jobs.set_outputs(pipeline.id, **{f"{stage}_job": child.id})
    jobs.emit(pipeline.id, "stage", {"stage": stage, "job_id": child.id})
    log.info("pipeline stage started", extra={"job_id": pipeline.id, "stage": stage, "stage_job": child.id})
    return child


def finish_job(r: redis.Redis, job_id: str, state: JobState | str, *, error: str | None = None,
               outputs: dict | None = None) -> JobRecord | None:
    """Move a job to a terminal state (idempotent: a job already finished is left as it is) and
    advance its pipeline, if any. Returns the record, or None if it had already finished."""
    jobs = JobStore(r)
    state = JobState(state)
    if not state.terminal:
        raise ValueError(f"finish_job needs a terminal state, not {state.value!r}")
    if outputs:
        jobs.set_outputs(job_id, **outputs)
    try:
        rec = jobs.transition(job_id, state, error=error)
    except IllegalTransition:
        return None
    if rec.parent_id:
        advance_pipeline(r, rec)
    return rec


def advance_pipeline(r: redis.Redis, stage_job: JobRecord) -> None:
    """After a stage ends: start the next stage with this one's output, or end the pipeline."""
    jobs = JobStore(r)
    parent = jobs.get(stage_job.parent_id)
    if parent.state.terminal:
        return
    if stage_job.state != JobState.succeeded:
        finish_job(r, parent.id, JobState.failed if stage_job.state == JobState.failed else JobState.cancelled,
                   error=f"stage {stage_job.stage} ({stage_job.id}) {stage_job.state.value}: {stage_job.error or ''}".strip())
        return
    jobs.add_progress(parent.id, stages=1)
    if stage_job.stage not in PIPELINE_WIRING:
        finish_job(r, parent.id, JobState.succeeded, outputs={**stage_job.outputs})
        return
    next_stage, field, output = PIPELINE_WIRING[stage_job.stage]
    if output not in stage_job.outputs:
        finish_job(r, parent.id, JobState.failed, error=f"stage {stage_job.stage} did not report its {output!r} output")
        return
    spec = dict(parent.spec[next_stage])
    spec[field] = stage_job.outputs[output]
    try:
        _start_stage(r, parent, next_stage, spec)
    except ValueError as exc:
        finish_job(r, parent.id, JobState.failed, error=f"stage {next_stage} spec invalid: {exc}")
