"""The training loop: the step under DDP, progress, checkpoints, resume, finish.

Read top to bottom: :func:`train` takes the run's checked inputs (:func:`.prepare.prepare`), runs the
input pipeline (:mod:`.stages`) into the optimiser step, writes checkpoints every N steps and when
asked to stop, reports progress, and at the end hands over to :mod:`.report` for the evaluation, the
plots and the export.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage import open_store

from .checkpoint import CheckpointError, CheckpointManager, rng_state, set_rng_state
from .data import Batch, BatchSampler, collate, micro_batches, rank_share, step_seed
from .distributed import DistInfo, barrier, broadcast_flag, node_figures, reduce_metrics, unwrap, wrap_model
from .gauges import set_node_gauges
from .metrics_log import MetricsLog
from .objective import dflash_loss
from .prepare import Setup, TrainError, prepare
from .report import finish_run
from .run_config import RunConfig
from .stages import DeviceCopier, Pipeline, WaitMeter, fetch_hidden

log = logging.getLogger(__name__)


@dataclass
class Hooks:
    """Callbacks of a run: progress and metric points to the job record, and a stop request (SIGTERM or cancel)."""

    progress: Callable[[dict], None] | None = None
    metrics: Callable[[dict], None] | None = None
    should_stop: Callable[[], bool] | None = None


@dataclass
class TrainResult:
    step: int
    total_steps: int
    completed: bool  # False: stopped early (checkpoint written); resume continues it
    outputs: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def lr_lambda(spec: TrainSpec, total_steps: int) -> Callable[[int], float]:
    warmup = int(round(spec.warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if spec.decay == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if spec.decay == "cosine" else 1 - progress
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * shape

    return factor


@dataclass
class _Item:
    """One micro-batch in the pipeline and its place in training."""

    step: int
    micro: int
    shard: int
    last: bool  # the step's last micro-batch: gradients sync, the optimiser steps
    sampler_state: dict  # resumes right after this step's batch
    batch: Batch
    event: Any = None  # the host-to-device copy's CUDA event


def train(config: RunConfig, info: DistInfo, hooks: Hooks | None = None, source=None,
          setup: Setup | None = None) -> TrainResult:
    """Train (or resume) the drafter of ``config``; returns when done or asked to stop."""
    hooks = hooks or Hooks()
    owns_source = source is None and setup is None
    s = setup or prepare(config, info, source)
    try:
        return _train(config, info, hooks, s)
    finally:
        if owns_source and hasattr(s.source, "close"):
            try:
                asyncio.run(s.source.close())
            except Exception as exc:  # noqa: BLE001 - closing must not hide the run's own outcome
                log.warning("closing the hidden-state source failed", extra={"error": str(exc)})


def _train(config: RunConfig, info: DistInfo, hooks: Hooks, s: Setup) -> TrainResult:
    spec, settings = config.spec, config.settings
    world, accum = info.world_size, spec.grad_accum
    lengths = s.dataset.lengths.clamp(max=spec.max_length)
    keep = torch.zeros(s.dataset.num_samples, dtype=torch.bool)
    keep[s.train_pool] = True
    sampler = BatchSampler(lengths, spec.tokens_per_batch, seed=spec.seed, divisor=world * accum, eligible=keep)
    total = spec.steps or max(1, math.ceil(spec.epochs * sampler.batches_per_epoch()))

    model, comm = wrap_model(s.drafter, info)
    params = unwrap(model).trainable_parameters()
    optim = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=spec.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(spec, total))
    ckpts = CheckpointManager(open_store(config.output_uri("checkpoints"), endpoint_url=settings.s3_endpoint_url),
                              keep=spec.keep_checkpoints)
    step, history = 0, []
    try:
        pointer = ckpts.latest() if config.resume else None
    except CheckpointError as exc:
        raise TrainError(str(exc)) from None
    if pointer is not None:
        try:
            state = ckpts.load(unwrap(model), pointer)
            optim.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            sampler.load_state_dict(state["sampler"])
            set_rng_state(state["rng"])
            step, history = int(state["step"]), list(state.get("history", []))
        except (CheckpointError, KeyError, TypeError, ValueError) as exc:  # a checkpoint this run cannot resume from
            raise TrainError(f"checkpoint under {config.output_uri('checkpoints/')}: {exc}") from None
        log.info("resumed", extra={"step": step, "total_steps": total})

    def items():
        for global_step, (idx, after) in enumerate(sampler, start=step):
            if global_step >= total:
                return
            parts = micro_batches(rank_share(idx, info.rank, world), accum)
            for k, part in enumerate(parts):
                batch = collate(s.dataset, part, spec.max_length, pin=info.device.type == "cuda")
                yield _Item(global_step, k, info.rank + world * k, k == accum - 1, after, batch)

    async def fetch(item: _Item) -> _Item:
        item.batch.target_hidden = await fetch_hidden(s.source, item.batch.sequences(), s.layer_ids,
                                                      s.max_tokens_per_request, pin=info.device.type == "cuda")
        return item

    copier = DeviceCopier(info.device)

    def copy(item: _Item) -> _Item:
        item.batch, item.event = copier(item.batch)
        return item

    def save(at_step: int, sampler_state: dict) -> None:
        if info.is_main:
            ckpts.save(at_step, unwrap(model), {
                "optimizer": optim.state_dict(), "scheduler": sched.state_dict(), "sampler": sampler_state,
                "rng": rng_state(), "history": history, "spec": spec.model_dump(mode="json"), "world_size": world})
        barrier(info)

    if hooks.progress and info.is_main:
        hooks.progress({"step": step, "total_steps": total})
    meter = WaitMeter()
    acc: dict[str, Any] = {}
    last_state, stopped = sampler.state_dict(), False
    last_report = last_end = time.perf_counter()
    live = MetricsLog(config, s, info, total, sink=hooks.metrics)
    pipeline = Pipeline(items(), fetch, copy, inflight=settings.fetch_inflight, queue_size=settings.prefetch_batches)
    model.train()
    try:
        wait_mark = 0.0
        for item in pipeline:
            DeviceCopier.wait(item.event, item.batch)
            gen = torch.Generator().manual_seed(step_seed(spec.seed, item.step, item.shard))
            sync = contextlib.nullcontext() if item.last or world == 1 else model.no_sync()
            with sync:
                loss, metrics = dflash_loss(model, item.batch, max_anchors=spec.max_anchors, gamma=spec.gamma,
                                            noise_std=spec.noise_std, generator=gen, loss=spec.loss,
                                            dpace_alpha=spec.dpace_alpha)
                (loss / accum).backward()
            _accumulate(acc, metrics, tokens=item.batch.num_tokens)
            if not item.last:
                continue
            grad_norm = torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step, last_state = item.step + 1, item.sampler_state
            now = time.perf_counter()
            step_s, last_end = now - last_end, now
            waited, wait_mark = pipeline.wait_s - wait_mark, pipeline.wait_s
            meter.add(waited, step_s)
            comm_s = comm.take() if comm is not None else 0.0
            m = reduce_metrics({**{k: v for k, v in acc.items() if not isinstance(v, list)},
                                "grad_norm": float(grad_norm), "data_wait_s": waited, "comm_s": comm_s}, info)
            tokens = m["tokens"] * world
            row = {"step": step, "loss": m["loss_sum"] / max(m["weight_sum"], 1e-12),
                   "accuracy": m["correct_sum"] / max(m["count_sum"], 1e-12), "lr": sched.get_last_lr()[0],
                   "grad_norm": m["grad_norm"], "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
                   "data_wait_fraction": meter.fraction(), "comm_fraction": m["comm_s"] / step_s if step_s else 0.0,
                   "per_position_accuracy": _position_acc(acc, info)}
            nodes = node_figures(info, acc["tokens"], step_s, waited, comm_s) if info.distributed else {}
            if info.local_rank == 0:  # this node's figures on its trainer's Prometheus gauges
                set_node_gauges(nodes.get(info.node) or row, step, row["loss"])
            if len(nodes) > 1:
                row["nodes"] = {str(n): figures for n, figures in nodes.items()}
            history.append(row)
            live.step(row, unwrap(model))
            acc = {}
            if step % spec.checkpoint_every == 0 or step == total:
                save(step, last_state)
            if hooks.progress and info.is_main and (now - last_report >= settings.progress_every_s or step == total):
                last_report = now
                hooks.progress({**row, "total_steps": total})
            if step < total and broadcast_flag(bool(hooks.should_stop and hooks.should_stop()), info):
                stopped = True
                if step % spec.checkpoint_every:
                    save(step, last_state)
                log.info("stopping early: checkpoint written", extra={"step": step, "total_steps": total})
                break
    finally:
        pipeline.close()
        live.flush()
    summary = summarise(history, pipeline)
    result = TrainResult(step, total, completed=not stopped and step >= total, history=history, summary=summary,
                         outputs={"checkpoints": config.output_uri("checkpoints/")})
    if result.completed and info.is_main:
        result.outputs.update(finish_run(s, unwrap(model), history, summary))
    live.close(result.outputs, completed=result.completed)
    barrier(info)
    return result


def _accumulate(acc: dict, metrics: dict, tokens: int) -> None:
    acc["loss_sum"] = acc.get("loss_sum", 0.0) + metrics["loss_sum"]
    acc["weight_sum"] = acc.get("weight_sum", 0.0) + metrics["weight_sum"]
    acc["correct_sum"] = acc.get("correct_sum", 0.0) + metrics["correct_sum"]
    acc["count_sum"] = acc.get("count_sum", 0.0) + metrics["num_trained_tokens"]
    acc["tokens"] = acc.get("tokens", 0) + tokens
    for key in ("per_position_correct", "per_position_count"):
        prev = acc.get(key)
        acc[key] = list(metrics[key]) if prev is None else [a + b for a, b in zip(prev, metrics[key], strict=True)]


def _position_acc(acc: dict, info: DistInfo) -> list[float]:
    correct, count = acc.get("per_position_correct", []), acc.get("per_position_count", [])
    if info.distributed and correct:
        both = reduce_metrics({f"c{i}": v for i, v in enumerate(correct)} |
                              {f"n{i}": v for i, v in enumerate(count)}, info, op="sum")
        correct = [both[f"c{i}"] for i in range(len(correct))]
        count = [both[f"n{i}"] for i in range(len(count))]
    return [c / n if n else 0.0 for c, n in zip(correct, count, strict=True)]


def summarise(history: list[dict], pipeline: Pipeline) -> dict:
    if not history:
        return {}
    tail = history[-max(1, len(history) // 10):]
    return {"steps": history[-1]["step"], "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"],
            "final_loss_avg": sum(r["loss"] for r in tail) / len(tail),
            "final_accuracy": sum(r["accuracy"] for r in tail) / len(tail),
            "tokens_per_s": sum(r["tokens_per_s"] for r in history) / len(history),
            "data_wait_fraction": pipeline.data_wait_fraction(),
            "comm_fraction": sum(r["comm_fraction"] for r in history) / len(history),
            "per_position_accuracy": _mean_lists([r["per_position_accuracy"] for r in tail])}


def _mean_lists(rows: list[list[float]]) -> list[float]:
    rows = [r for r in rows if r]
    return [sum(col) / len(col) for col in zip(*rows, strict=True)] if rows else []
