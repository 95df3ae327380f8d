"""How jobs end: ``finish_job`` moves a job to a terminal state and, when the job is a pipeline stage,
``advance_pipeline`` starts the next stage with this one's output (see
:attr:`dfp_shared.jobs.types.JobType.feeds`) or ends the pipeline.
"""

from __future__ import annotations

import redis

from dfp_shared.jobs.store import IllegalTransition, JobRecord, JobState, JobStore
from dfp_shared.jobs.submit import start_stage
from dfp_shared.jobs.types import JOB_TYPES


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
    stage = JOB_TYPES.get(stage_job.stage)
    feeds = stage.feeds if stage is not None else None
    if feeds is None:
        finish_job(r, parent.id, JobState.succeeded, outputs={**stage_job.outputs})
        return
    if feeds.output not in stage_job.outputs:
        finish_job(r, parent.id, JobState.failed,
                   error=f"stage {stage_job.stage} did not report its {feeds.output!r} output")
        return
    spec = dict(parent.spec[feeds.stage])
    spec[feeds.field] = stage_job.outputs[feeds.output]
    try:
        start_stage(r, parent, feeds.stage, spec)
    except ValueError as exc:
        finish_job(r, parent.id, JobState.failed, error=f"stage {feeds.stage} spec invalid: {exc}")
