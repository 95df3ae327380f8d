"""The ``import_gguf`` job: a GGUF file in storage imported as a Hugging Face model directory, on the trainer
workers (they hold torch, transformers and gguf).

One task (the plan task, on the ``train`` stream) runs the whole import, admitted as every job task is
(:class:`~dfp_shared.jobs.worker.JobHandler`: spec validated, both URIs checked against the storage roots, the
output prefix claimed for the job's owner); then :func:`dfp_shared.models.gguf_import.import_claimed`, the import
the ``models import-gguf`` command runs too, checks the file's size (DFLASH_GGUF_MAX_BYTES) before reading it,
its header before parsing it, and writes safetensors, config and tokenizer. A file that cannot be imported
(too large, not GGUF, malformed, an architecture transformers has no model for, missing) fails the job at once
(:class:`~dfp_shared.jobs.failures.CannotSucceed`), naming the file; a storage hiccup is retried like any task error.
The job record counts ``phases`` (fetched, converted, written: 3), ``source_bytes``, ``files`` and
``output_bytes``, and its outputs name the ``model`` directory.
"""

from __future__ import annotations

import logging

from dfp_shared.jobs.failures import CannotSucceed
from dfp_shared.jobs.flow import finish_job
from dfp_shared.jobs.queue import Task
from dfp_shared.jobs.store import JobState
from dfp_shared.jobs.worker import TaskCancelled, TaskContext, TaskReleased
from dfp_shared.models.gguf_import import PHASES, GGUFError, import_claimed
from dfp_shared.specs.import_gguf import ImportGGUFSpec
from prometheus_client import Counter

from .base import JobRunner

log = logging.getLogger(__name__)

IMPORTS = Counter("dfp_trainer_gguf_imports_total", "GGUF import jobs finished, by outcome", ["outcome"])
IMPORTED_BYTES = Counter("dfp_trainer_gguf_imported_bytes_total", "Bytes of GGUF files imported")


class ImportGGUFHandler(JobRunner):
    """Runs an admitted task of an import_gguf job."""

    def __call__(self, task: Task, ctx: TaskContext) -> None:
        spec: ImportGGUFSpec = ctx.spec
        log.info("GGUF import claimed", extra={"job_id": task.job_id, "source": spec.source, "output": spec.output,
                                               "deliveries": task.deliveries})
        ctx.jobs.set_totals(task.job_id, phases=len(PHASES))
        read: dict[str, float] = {}

        def progress(phase: str, **counts: float) -> None:
            read.update(counts)
            ctx.jobs.set_counters(task.job_id, phases=PHASES.index(phase) + 1, **counts)
            ctx.jobs.emit(task.job_id, "phase", {"phase": phase, **counts})
            ctx.check()  # a cancel (or a second signal) ends the import between phases

        def check() -> None:  # polled while the file is parsed: a cancel ends it, and so does a rollout's SIGTERM
            ctx.check()
            if ctx.stopping.is_set():  # (given back: another worker imports it from the start)
                raise TaskReleased(task.job_id)

        try:
            keys = import_claimed(spec.source, spec.output, self.roots, endpoint_url=self.settings.s3_endpoint_url,
                                  max_bytes=self.settings.gguf_max_bytes, work_dir=self.settings.work_dir or None,
                                  progress=progress, limits=self.settings.gguf_limits(), check=check)
        except GGUFError as exc:  # the file, not the moment: no retry can import it
            IMPORTS.labels("refused").inc()
            raise CannotSucceed(str(exc)) from None
        except TaskCancelled:
            IMPORTS.labels("cancelled").inc()
            raise
        IMPORTS.labels("ok").inc()
        IMPORTED_BYTES.inc(read.get("source_bytes", 0))
        log.info("GGUF import done", extra={"job_id": task.job_id, "output": spec.output, "files": len(keys)})
        ctx.jobs.complete_task(task.job_id, task.key)
        finish_job(self.r, task.job_id, JobState.succeeded, outputs={"model": spec.output})
