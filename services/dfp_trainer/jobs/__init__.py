"""The trainer's job types, one module each, in one table: what the ``train`` stream's worker
(:class:`~dfp_trainer.worker.TrainHandler`) runs for each job type whose tasks go on that stream.

* :mod:`.train` - ``train`` (:class:`~.train.TrainJob`); :mod:`.launch` - torchrun launching and the trainer
  group's follow loop;
* :mod:`.evaluate` - ``evaluate``; :mod:`.cache` - ``cache`` (a hidden-state cache filled offline);
  :mod:`.import_gguf` - ``import_gguf`` (a GGUF file imported as a model directory).

Adding a job type: its :class:`~dfp_shared.jobs.types.JobType` on the ``train`` stream, its module here with a
:class:`~.base.JobRunner` (built as ``(settings, redis_client, roots)``, called as ``handler(task, ctx)``), and its line in :data:`JOBS`.
"""

from __future__ import annotations

from dfp_shared.jobs.types import CACHE, EVALUATE, IMPORT_GGUF, TRAIN

from .base import JobRunner
from .cache import CacheHandler
from .evaluate import EvaluateHandler
from .import_gguf import ImportGGUFHandler
from .train import TrainJob

JOBS: dict[str, type[JobRunner]] = {  # job type -> its handler, built as (settings, redis_client, roots)
    TRAIN.name: TrainJob,
    EVALUATE.name: EvaluateHandler,
    CACHE.name: CacheHandler,
    IMPORT_GGUF.name: ImportGGUFHandler,
}
