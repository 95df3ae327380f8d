"""The trainer workers' handler of ``evaluate`` jobs (their plan task arrives on the ``train`` stream).

One task runs the whole evaluation (:func:`.job.evaluate_job`), admitted as every job task is
(:class:`~dfp_shared.jobs.worker.JobHandler`: spec validated, storage URIs checked, output prefix claimed).
The decoding asks whether to stop before every draft-and-verify step (:meth:`~dfp_shared.jobs.worker.TaskContext.stop_check`:
the worker's stop flag every step, the job's cancel flag at most every half second), so either ends a
running evaluation within about one target forward: a stop (SIGTERM) gives the task back and the next
worker runs it again from the start (the report is written once, at the end); a cancel ends the job
cancelled and the worker takes its next task.
"""

from __future__ import annotations

import logging

from dfp_shared.jobs.flow import finish_job
from dfp_shared.jobs.queue import Task
from dfp_shared.jobs.store import JobState
from dfp_shared.jobs.worker import TaskCancelled, TaskContext, TaskReleased
from dfp_shared.specs.evaluate import EvaluateSpec

from ..evaluate.job import REPORT_NAME, EvaluateError, evaluate_job
from .base import JobRunner

log = logging.getLogger(__name__)


class EvaluateHandler(JobRunner):
    """Runs an admitted task of an evaluate job."""

    def __call__(self, task: Task, ctx: TaskContext) -> None:
        spec: EvaluateSpec = ctx.spec
        log.info("evaluation claimed", extra={"job_id": task.job_id, "deliveries": task.deliveries})

        def progress(done: int, total: int) -> None:
            if done == 0:
                ctx.jobs.set_totals(task.job_id, prompts=total)
            ctx.jobs.set_counters(task.job_id, prompts=done)

        device = None if self.settings.device == "auto" else self.settings.device
        try:
            report = evaluate_job(spec, device=device, endpoint_url=self.settings.s3_endpoint_url,
                                  work_dir=self.settings.work_dir or None, progress=progress,
                                  should_stop=ctx.stop_check())
        except EvaluateError as exc:  # bad input: retrying cannot help
            log.error("evaluation cannot run", extra={"job_id": task.job_id, "error": str(exc)})
            finish_job(self.r, task.job_id, JobState.failed, error=str(exc))
            return
        if ctx.cancelled():
            raise TaskCancelled(task.job_id)
        if report is None:
            raise TaskReleased(task.job_id)
        sets = report["sets"]
        ctx.jobs.set_counters(task.job_id, bad_lines=sum(s["bad_lines"] for s in sets),
                              skipped=sum(s["skipped"] for s in sets), tau=sets[0]["dflash"]["tau"],
                              tau_ngram=sets[0]["ngram"]["tau"])
        ctx.jobs.complete_task(task.job_id, task.key)
        finish_job(self.r, task.job_id, JobState.succeeded,
                   outputs={"report": spec.output.rstrip("/") + "/" + REPORT_NAME})
