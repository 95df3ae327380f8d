"""The train worker: claims the tasks of the ``train`` stream and runs each by its job type's handler, looked up
in the trainer's one table of job types (:data:`~.jobs.JOBS`: ``train``, ``evaluate``, ``cache``,
``import_gguf``, one module each under :mod:`.jobs`).

With ``nodes > 1`` this pod is one member of a trainer group (see :mod:`.group`): member 0 runs this handler, the
others :func:`~.jobs.launch.follow` the group's current run (re-exported here for the CLI).
"""

from __future__ import annotations

from dfp_shared.jobs.queue import Task
from dfp_shared.jobs.types import TRAIN
from dfp_shared.jobs.worker import JobHandler, TaskContext
from dfp_shared.storage.ownership import OutputClaims
from dfp_shared.storage.roots import StorageRoots

from .jobs import JOBS
from .jobs.launch import child_env, follow, launch
from .settings import TrainerSettings

__all__ = ["TrainHandler", "child_env", "follow", "launch"]


class TrainHandler(JobHandler):
    """``handler(task, ctx)`` of the shared worker loop for the ``train`` stream: each job type's handler of
    :data:`~.jobs.JOBS` (``train`` jobs to :class:`~.jobs.train.TrainJob`, ``evaluate`` ones to
    :class:`~.jobs.evaluate.EvaluateHandler`, ...)."""

    def __init__(self, settings: TrainerSettings, redis_client):
        self.settings = settings
        self.r = redis_client
        self.roots = StorageRoots.from_settings(settings)
        self.claims = OutputClaims(self.roots, settings.s3_endpoint_url)
        self.jobs = {name: make(settings, redis_client, self.roots) for name, make in JOBS.items()}

    def admit(self, task: Task, ctx: TaskContext) -> bool:
        """As every job task; a train job's hidden-state cache is claimed for its owner too, like an output."""
        if not super().admit(task, ctx):
            return False
        cache = getattr(ctx.spec, "hidden_state_cache", None)
        if ctx.job_type is TRAIN and cache is not None:
            self.claims.claim(cache, ctx.job.owner, task.job_id, field="spec.hidden_state_cache",
                              parent_id=ctx.job.parent_id)
        return True

    def handle(self, task: Task, ctx: TaskContext) -> None:
        self.jobs[ctx.job_type.name](task, ctx)
