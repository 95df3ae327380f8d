"""What every job type's handler is: built once per worker as ``(settings, redis_client, roots)``, then called
with each admitted task of its type (the train stream's :class:`~dfp_trainer.worker.TrainHandler` admits it:
spec validated, storage URIs checked, output prefix claimed)."""

from __future__ import annotations

from dfp_shared.jobs.queue import Task
from dfp_shared.jobs.worker import TaskContext
from dfp_shared.storage.roots import StorageRoots

from ..settings import TrainerSettings


class JobRunner:
    """Runs the admitted tasks of one job type (subclasses: ``__call__``)."""

    def __init__(self, settings: TrainerSettings, redis_client, roots: StorageRoots | None = None):
        self.settings, self.r, self.roots = settings, redis_client, roots

    def __call__(self, task: Task, ctx: TaskContext) -> None:
        raise NotImplementedError
