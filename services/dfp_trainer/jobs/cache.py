"""The ``cache`` job: a hidden-state cache filled offline, on the trainer workers, with the target's source.

One task (the plan task, on the ``train`` stream) fills the whole cache under the spec's ``output``:
the target's features of every sample of the dataset for the drafter's layers, shard by shard, each
written whole (:mod:`..components.data.hidden_cache`), so a train job with ``hidden_states: offline`` then runs
without a target. Admitted as every job task is (:class:`~dfp_shared.jobs.worker.JobHandler`: spec validated,
storage URIs checked, the cache prefix claimed for the job's owner). A stop (SIGTERM) or a cancel ends
the fill before the next forward request, inside a shard too (:meth:`~dfp_shared.jobs.worker.TaskContext.stop_check`: the
cancel flag read at most every half second); the shard in progress is dropped, whole shards stay. A stop
gives the task back and the next delivery computes only the shards still missing; a cancel ends the job
cancelled.
The job record counts ``shards`` (done of total), ``cached_shards``, ``missing_shards`` and ``cache_bytes``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dfp_shared.hidden_states import CacheError
from dfp_shared.jobs.flow import finish_job
from dfp_shared.jobs.queue import Task
from dfp_shared.jobs.store import JobState
from dfp_shared.jobs.worker import TaskCancelled, TaskContext, TaskReleased
from dfp_shared.models.loading import (
    default_target_layer_ids,
    local_model_dir,
    model_fingerprint,
    pick_device,
    text_config,
)
from dfp_shared.records.token_shards import DatasetError, load_dataset
from dfp_shared.specs.cache import CacheSpec

from ..components.data.hidden_cache import complete, open_cache, run_key
from ..components.distributed import DistInfo
from ..drafter.distill import teacher_layer_ids
from ..loop.prepare import TrainError, check_source, open_source
from ..settings import TrainerSettings
from .base import JobRunner

log = logging.getLogger(__name__)


class CacheJobError(ValueError):
    """The cache cannot be filled as asked (dataset, target, key, quota); retrying cannot help."""


def fill_cache(spec: CacheSpec, settings: TrainerSettings, *, counters: Callable[[dict], None] | None = None,
               should_stop: Callable[[], bool] | None = None) -> dict:
    """Fill the cache of ``spec``; returns its counts (``missing_shards`` > 0: stopped before the end)."""
    from transformers import AutoConfig

    endpoint = settings.s3_endpoint_url
    try:
        model_dir = local_model_dir(spec.target, endpoint_url=endpoint)
        dataset = load_dataset(spec.dataset, endpoint_url=endpoint)
    except (FileNotFoundError, DatasetError) as exc:
        raise CacheJobError(str(exc)) from None
    config = text_config(AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False))
    num_layers, hidden = int(config.num_hidden_layers), int(config.hidden_size)
    try:
        layer_ids = list(spec.target_layer_ids or default_target_layer_ids(num_layers, spec.num_draft_layers))
        layer_ids += teacher_layer_ids(num_layers, spec.distill, layer_ids)
    except ValueError as exc:
        raise CacheJobError(f"target {spec.target}: {exc}") from None
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise CacheJobError(f"target_layer_ids {bad} do not exist in the target, which has {num_layers} layers")
    try:
        address = settings.target_address(spec.target_endpoint)
    except ValueError as exc:
        raise CacheJobError(str(exc)) from None
    device = pick_device(None if settings.device == "auto" else settings.device)
    source = open_source(address, model_dir, DistInfo(device=device))
    try:
        check_source(source, spec, model_dir, num_layers, hidden, layer_ids)
        minfo = source.model_info()
        key = run_key(dataset, model_fingerprint(model_dir), layer_ids, str(minfo.dtype), hidden, num_layers)
        cache = open_cache(spec.output, key, dataset, settings, create=True)
        log.info("filling hidden-state cache", extra={"cache": spec.output, "layer_ids": layer_ids,
                                                      "shards": len(cache.shards), "size_bytes": cache.size_bytes()})
        return complete(cache, source, dataset, DistInfo(device=device), settings,
                        max_tokens_per_request=int(minfo.max_tokens_per_request or 0) or None, counters=counters,
                        should_stop=should_stop)
    except (CacheError, TrainError) as exc:
        raise CacheJobError(str(exc)) from None
    finally:
        asyncio.run(source.close())


class CacheHandler(JobRunner):
    """Runs an admitted task of a cache job."""

    def __call__(self, task: Task, ctx: TaskContext) -> None:
        spec: CacheSpec = ctx.spec
        log.info("cache job claimed", extra={"job_id": task.job_id, "deliveries": task.deliveries})

        def counters(values: dict) -> None:
            total = values.get("cached_shards", 0) + values.get("missing_shards", 0)
            if total:
                ctx.jobs.set_totals(task.job_id, shards=total)
            ctx.jobs.set_counters(task.job_id, **values,
                                  **({"shards": values["cached_shards"]} if "cached_shards" in values else {}))

        try:
            counts = fill_cache(spec, self.settings, counters=counters,
                                should_stop=ctx.stop_check())
        except CacheJobError as exc:
            log.error("cache cannot be filled", extra={"job_id": task.job_id, "error": str(exc)})
            finish_job(self.r, task.job_id, JobState.failed, error=str(exc))
            return
        if ctx.cancelled():
            raise TaskCancelled(task.job_id)
        if counts["missing_shards"]:
            raise TaskReleased(task.job_id)
        ctx.jobs.complete_task(task.job_id, task.key)
        finish_job(self.r, task.job_id, JobState.succeeded, outputs={"cache": spec.output})
