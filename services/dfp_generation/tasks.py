"""The generation worker's task handler: plan, shard and finalize tasks of ``generate`` jobs.

* ``plan``: split the prompt set into shards, record totals, queue one task per shard
  (deterministic keys ``shard-NNNNN``), save ``plan.json`` under the output prefix.
* ``shard-NNNNN``: run the shard (see :mod:`.shard`) with its progress live in the job record (see
  :mod:`.live`), count it exactly once, and when it was the last one queue ``finalize``.
* ``finalize``: write ``manifest.json`` and finish the job with its outputs.
"""

from __future__ import annotations

import json
import logging
import time

import redis
from dfp_shared.jobs.flow import finish_job
from dfp_shared.jobs.queue import Task, TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import PLAN_KEY
from dfp_shared.jobs.types import GENERATE
from dfp_shared.jobs.worker import JobHandler, TaskCancelled, TaskContext, TaskReleased, Worker
from dfp_shared.records.completions import MANIFEST, SHARD_COUNTS, build_manifest, shard_entry, write_manifest
from dfp_shared.records.prompts import PROMPT_SUFFIXES
from dfp_shared.specs.generate import GenerateSpec
from dfp_shared.storage.ownership import OutputClaims
from dfp_shared.storage.roots import OutsideRoots, StorageRoots, parent_prefix
from dfp_shared.storage.store import StorageError, open_store

from .endpoints import EndpointError
from .endpoints import resolve as resolve_endpoint
from .engines import Engine, GenResult
from .live import ShardProgress
from .plan import ShardPlan, plan_shards
from .settings import GenerationSettings
from .shard import ShardRunner, prune_stale

log = logging.getLogger(__name__)

FINALIZE_KEY = "finalize"
PROGRESS_EVERY_S = 2.0


class SpecError(ValueError):
    """The job cannot run as specified (fails the job at once, without retries)."""


def output_uris(spec: GenerateSpec) -> dict:
    base = spec.output.rstrip("/")
    return {"completions": f"{base}/completions/", "errors": f"{base}/errors/", "manifest": f"{base}/{MANIFEST}"}


def build_engine(spec: GenerateSpec, settings: GenerationSettings) -> Engine:
    """The engine a job asks for, configured from the job spec over the worker's settings."""
    if spec.engine == "openai":
        from .engines.openai_engine import OpenAIEngine

        # only an endpoint the operator configured, with its own token: a spec names it, never a URL
        try:
            endpoint = resolve_endpoint(settings.openai_endpoint_map(), spec.openai_endpoint)
            key = endpoint.token()
        except EndpointError as exc:
            raise SpecError(str(exc)) from None
        model = spec.openai_model or endpoint.model or spec.model
        if not model:
            raise SpecError(f"engine 'openai' needs openai_model in the job spec (endpoint {endpoint.name!r} has no "
                            "model configured; DFLASH_OPENAI_MODEL for 'default')")
        return OpenAIEngine(endpoint.url, model, concurrency=spec.concurrency, timeout_s=spec.request_timeout_s,
                            max_retries=spec.max_retries, api_key=key, backoff_base_s=settings.backoff_base_s,
                            backoff_max_s=settings.backoff_max_s)
    from .engines.transformers_engine import TransformersEngine

    return TransformersEngine(spec.model, device=settings.device, dtype=settings.dtype, batch_size=settings.generation_batch_size,
                              endpoint_url=settings.s3_endpoint_url)


class GenerationHandler(JobHandler):
    """``handler(task, ctx)`` for :class:`dfp_shared.jobs.worker.Worker`; keeps the last engine loaded."""

    def __init__(self, r: redis.Redis, settings: GenerationSettings):
        self.r = r
        self.jobs = JobStore(r)
        self.queue = TaskQueue(r, GENERATE.stream, lease_ms=settings.lease_ms, max_deliveries=settings.max_deliveries)
        self.settings = settings
        self.roots = StorageRoots.from_settings(settings)
        self.claims = OutputClaims(self.roots, settings.s3_endpoint_url)
        self._engine: tuple[tuple, Engine] | None = None

    def confine_task(self, task: Task, spec: GenerateSpec, owner: str | None) -> None:
        if "prompts_root" not in task.payload:
            return
        # a shard reads only the prompt set its spec names: that one file, or files under that prefix
        one_file = spec.prompts.endswith(PROMPT_SUFFIXES)
        root = task.payload["prompts_root"]
        self.roots.check_inside(root, parent_prefix(spec.prompts) if one_file else spec.prompts, "task.prompts_root")
        for i, seg in enumerate(task.payload.get("segments") or []):
            field = f"task.segments.{i}.file"
            uri = f"{root.rstrip('/')}/{seg['file']}"
            if one_file and self.roots.check(uri, field) != self.roots.check(spec.prompts, "spec.prompts"):
                raise OutsideRoots(f"{field}: {uri} is not the spec's prompts file {spec.prompts}")
            self.roots.check_inside(uri, spec.prompts, field)
            self.roots.check_reserved(uri, owner, field)

    def handle(self, task: Task, ctx: TaskContext) -> None:
        spec: GenerateSpec = ctx.spec
        try:
            if task.key == PLAN_KEY:
                self.plan(task, spec)
            elif task.key == FINALIZE_KEY:
                self.finalize(task, spec)
            else:
                self.shard(task, ctx, spec)
        except SpecError as exc:
            log.error("job cannot run", extra={"job_id": task.job_id, "error": str(exc)})
            finish_job(self.r, task.job_id, JobState.failed, error=str(exc))

    def engine(self, spec: GenerateSpec) -> Engine:
        ident = (spec.engine, spec.model, spec.openai_endpoint, spec.openai_model, spec.concurrency,
                 spec.request_timeout_s, spec.max_retries)
        if self._engine is None or self._engine[0] != ident:
            if self._engine is not None:
                self._engine[1].close()
                self._engine = None
            self._engine = (ident, build_engine(spec, self.settings))
        return self._engine[1]

    # plan

    def plan(self, task: Task, spec: GenerateSpec) -> None:
        if spec.engine == "openai":
            self.engine(spec)  # fail fast on an endpoint that is not configured / a missing model name
        try:
            plan = plan_shards(spec.prompts, spec.shard_size, endpoint_url=self.settings.s3_endpoint_url)
        except StorageError as exc:
            raise SpecError(f"prompts: {exc}") from None
        out = open_store(spec.output, endpoint_url=self.settings.s3_endpoint_url)
        out.put("plan.json", json.dumps(plan.to_dict()).encode())
        self.jobs.set_totals(task.job_id, prompts=plan.prompts, completions=plan.prompts * spec.samples_per_prompt,
                             shards=len(plan.shards), unreadable=plan.bad_lines, tasks=len(plan.shards) + 1)
        self.queue.enqueue_many(task.job_id, [(s.key, {"prompts_root": plan.source.root, **s.to_payload()})
                                              for s in plan.shards])
        self.jobs.emit(task.job_id, "planned", {"prompts": plan.prompts, "shards": len(plan.shards),
                                                "files": len(plan.source.keys), "unreadable": plan.bad_lines})
        self.jobs.complete_task(task.job_id, PLAN_KEY)
        log.info("generate job planned", extra={"job_id": task.job_id, "prompts": plan.prompts,
                                                "shards": len(plan.shards), "unreadable_lines": plan.bad_lines})

    # shard

    def shard(self, task: Task, ctx: TaskContext, spec: GenerateSpec) -> None:
        shard = ShardPlan.from_payload(task.payload)
        runner = ShardRunner(spec, self.engine(spec), endpoint_url=self.settings.s3_endpoint_url,
                             checkpoint_interval_s=self.settings.checkpoint_interval_s)
        live = ShardProgress(self.r, task.job_id, shard.key, spec.samples_per_prompt,
                             every_s=self.settings.progress_interval_s)
        started = time.monotonic()
        state = {"done": 0, "tokens": 0, "checked": started, "cancelled": False}

        def on_resume(restored: list[GenResult]) -> None:
            for res in restored:
                live.add(res)
            live.publish()  # takes the shard over from an earlier attempt at once

        def on_result(res: GenResult) -> None:
            state["done"] += 1
            state["tokens"] += res.completion_tokens
            live.add(res)
            live.maybe_publish()
            now = time.monotonic()
            if now - state["checked"] >= PROGRESS_EVERY_S:
                state["checked"] = now
                state["cancelled"] = ctx.cancelled()
                self.jobs.emit(task.job_id, "progress", {"shard": shard.key, "done": state["done"],
                                                         "of": shard.prompts * spec.samples_per_prompt,
                                                         "output_tokens": state["tokens"],
                                                         "tokens_per_s": round(state["tokens"] / (now - started), 2)})

        def should_stop() -> bool:
            return state["cancelled"] or ctx.stopping.is_set()

        outcome = runner.run(task.payload["prompts_root"], shard, on_result=on_result, should_stop=should_stop,
                             on_resume=on_resume)
        if outcome.stopped:
            live.publish()  # the counts so far stay in the record until another attempt takes the shard
            if state["cancelled"] or ctx.cancelled():
                raise TaskCancelled(task.job_id)
            raise TaskReleased(task.key)
        if live.complete(**outcome.counters()):
            self.jobs.emit(task.job_id, "shard_done", {"shard": shard.key, "completions": outcome.completions,
                                                       "errors": outcome.errors, "unreadable": outcome.unreadable,
                                                       "output_tokens": outcome.output_tokens})
        # checked after counting, so of two shards finishing together at least one sees it (a second
        # finalize task is harmless); GenerationWorker covers a worker that died right after counting
        self.maybe_finalize(task.job_id)

    def maybe_finalize(self, job_id: str) -> bool:
        """Queue the job's finalize task if every shard is done and the job is not finished yet."""
        if self.jobs.all_tasks_done(job_id) and not self.jobs.get(job_id).state.terminal:
            self.queue.enqueue(job_id, FINALIZE_KEY, {})
            return True
        return False

    # finalize

    def finalize(self, task: Task, spec: GenerateSpec) -> None:
        if self.jobs.get(task.job_id).state.terminal:
            return  # a duplicate finalize task
        out = open_store(spec.output, endpoint_url=self.settings.s3_endpoint_url)
        plan = json.loads(out.get("plan.json"))
        keys = [ShardPlan.from_payload(s).key for s in plan["shards"]]
        shards = [shard_entry(key, json.loads(out.get(f"done/{key}.json"))["counts"]) for key in keys]
        manifest = build_manifest(spec.model_dump(mode="json"), shards, job_id=task.job_id)
        totals = {k: manifest[k] for k in SHARD_COUNTS}
        prune_stale(out, keys)
        write_manifest(out, manifest)
        outputs = output_uris(spec)
        if totals["completions"] == 0:
            finish_job(self.r, task.job_id, JobState.failed, outputs=outputs,
                       error=f"no completions: {totals['errors']} prompts failed and {totals['unreadable']} lines "
                             f"were unreadable; see {outputs['errors']}")
        else:
            finish_job(self.r, task.job_id, JobState.succeeded, outputs=outputs)
        log.info("generate job finished", extra={"job_id": task.job_id, **totals})


class GenerationWorker(Worker):
    """The shared worker loop, plus one recovery: a shard task redelivered after it was counted (its
    worker died between counting and acking) is skipped by the loop; if it was the last shard, the
    finalize task it never queued is queued here."""

    def __init__(self, handler: GenerationHandler, **kwargs):
        super().__init__(handler.queue, handler.jobs, handler, **kwargs)
        self.gen = handler

    def process(self, task: Task) -> None:
        if task.key not in (PLAN_KEY, FINALIZE_KEY):
            try:
                if self.jobs.is_task_done(task.job_id, task.key):
                    self.gen.maybe_finalize(task.job_id)
            except Exception as exc:  # noqa: BLE001 - the loop below handles the task either way
                log.warning("finalize check failed", extra={"job_id": task.job_id, "error": str(exc)})
        super().process(task)
