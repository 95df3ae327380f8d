"""The training loop: setup with checks, the step under DDP, progress, checkpoints, resume, finish.

Read top to bottom: :func:`prepare` loads and checks everything (dataset, tokenizer, target parts,
drafter, hidden-state source) and fails with a clear error before any step runs; :func:`train`
runs the input pipeline (:mod:`.stages`) into the optimiser step, writes checkpoints every N steps
and when asked to stop, reports progress, and at the end hands over to :mod:`.report` for the
evaluation, the plots and the export.
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
from .data import (
    BatchSampler,
    collate,
    load_training_data,
    micro_batches,
    rank_share,
    step_seed,
    trainable_samples,
)
from .distributed import DistInfo, barrier, broadcast_flag, reduce_metrics, unwrap, wrap_model
from .stages import DeviceCopier, Pipeline, WaitMeter, fetch_hidden

log = logging.getLogger(__name__)


class TrainError(ValueError):
    """The run cannot start: bad dataset, target or settings (the message says which and why)."""


@dataclass
class RunOptions:
    """How one training run executes (from the service settings, not the job spec)."""

    target_url: str = "inprocess"  # hidden states from `inprocess` or gRPC address(es)
    endpoint_url: str | None = None  # S3 endpoint of the dataset / output / model URIs
    fetch_inflight: int = 4  # hidden-state requests in flight per rank
    prefetch_batches: int = 4  # capacity of each pipeline queue
    resume: bool = True  # continue from the latest checkpoint under the output prefix, if any
    progress_every_s: float = 2.0  # seconds between progress callbacks
    evaluate: bool = True  # run the acceptance-length evaluation and write the report at the end
    work_dir: str = ""  # local scratch (export staging); empty: the system temporary directory


@dataclass
class Hooks:
    """Callbacks of a run: progress to the job record, and a stop request (SIGTERM or cancel)."""

    progress: Callable[[dict], None] | None = None
    should_stop: Callable[[], bool] | None = None


@dataclass
class TrainResult:
    step: int
    total_steps: int
    completed: bool  # False: stopped early (checkpoint written); resume continues it
    outputs: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)


@dataclass
class Setup:
    spec: TrainSpec
    model_dir: Any
    tokenizer: Any
    dataset: Any
    drafter: torch.nn.Module
    initial_state: dict
    source: Any
    layer_ids: list[int]
    eval_index: torch.Tensor
    train_pool: torch.Tensor
    max_tokens_per_request: int | None


def output_uri(spec: TrainSpec, part: str) -> str:
    return spec.output.rstrip("/") + "/" + part


def prepare(spec: TrainSpec, opts: RunOptions, info: DistInfo, source=None) -> Setup:
    """Load and check the run's inputs; every problem raises :class:`TrainError` before training."""
    from dfp_shared.models import local_model_dir, model_fingerprint
    from dfp_shared.tokenizer_assets import chat_template_fingerprint, load_tokenizer, tokenizer_fingerprint

    from .model import DFlashDrafter, DrafterConfig
    from .target_parts import load_target_parts

    try:
        model_dir = local_model_dir(spec.target, endpoint_url=opts.endpoint_url)
    except FileNotFoundError as exc:
        raise TrainError(f"target: {exc}") from None
    tokenizer = load_tokenizer(model_dir)
    mask_token = spec.mask_token
    if mask_token not in tokenizer.get_vocab():
        raise TrainError(f"target {spec.target}: its tokenizer has no mask token {mask_token!r}; DFlash fills block "
                         f"positions with it (add it as a special token and resize the embeddings)")
    mask_id = tokenizer.convert_tokens_to_ids(mask_token)
    dataset = load_training_data(spec.dataset, endpoint_url=opts.endpoint_url,
                                 tokenizer_fingerprint=_fingerprints(tokenizer, tokenizer_fingerprint, mask_token),
                                 chat_template_fingerprint=chat_template_fingerprint(tokenizer))
    check_thinking_mode(dataset, spec)
    try:
        parts = load_target_parts(model_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise TrainError(f"target: {exc}") from None
    target_config, embed, lm_head, num_layers = parts.config, parts.embed_tokens, parts.lm_head, parts.num_layers
    if spec.target_layer_ids is not None:
        bad = [i for i in spec.target_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise TrainError(f"target_layer_ids {bad} do not exist in the target, which has {num_layers} layers "
                             f"(0..{num_layers - 1})")
    try:
        config = DrafterConfig.for_target(target_config, num_layers=spec.num_draft_layers, block_size=spec.block_size,
                                          mask_token_id=mask_id, target_layer_ids=spec.target_layer_ids,
                                          layer_types=spec.layer_types, sliding_window=spec.sliding_window)
    except ValueError as exc:
        raise TrainError(f"target {spec.target}: {exc}") from None
    if mask_id >= embed.weight.shape[0]:
        raise TrainError(f"mask token id {mask_id} is outside the target's embedding ({embed.weight.shape[0]} rows)")
    torch.manual_seed(spec.seed)
    drafter = DFlashDrafter(config, embed, lm_head).to(info.device)
    initial = {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()}

    eligible = trainable_samples(dataset)
    pool = torch.nonzero(eligible).flatten()
    n_eval = min(spec.eval_prompts, pool.numel() // 4) if opts.evaluate else 0
    perm = pool[torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(spec.seed))]
    eval_index, train_pool = perm[:n_eval].sort().values, perm[n_eval:].sort().values

    if source is None:
        source = open_source(opts.target_url, model_dir, info)
    layer_ids = list(config.target_layer_ids)
    minfo = source.model_info()
    if int(minfo.num_layers) != num_layers or int(minfo.hidden_size) != config.hidden_size:
        raise TrainError(f"hidden-state source serves a model with {minfo.num_layers} layers x {minfo.hidden_size} "
                         f"hidden, but the target {spec.target} has {num_layers} x {config.hidden_size}")
    served_fp = getattr(minfo, "fingerprint", "") or ""
    if served_fp and served_fp != model_fingerprint(model_dir):
        raise TrainError(f"the hidden-state source serves model {getattr(minfo, 'model_id', '?')!r} with fingerprint "
                         f"{served_fp!r}, but the target {spec.target} has {model_fingerprint(model_dir)!r}: point "
                         "the job's target_endpoint (or the trainer's DFLASH_TARGET_URL) at a service running the "
                         "same checkpoint")
    served = list(getattr(minfo, "layer_ids", None) or [])
    if served and not set(layer_ids) <= set(served):
        raise TrainError(f"hidden-state source serves layers {served}; the drafter needs {layer_ids}")
    return Setup(spec, model_dir, tokenizer, dataset, drafter, initial, source, layer_ids, eval_index, train_pool,
                 int(getattr(minfo, "max_tokens_per_request", 0) or 0) or None)


def check_thinking_mode(dataset, spec: TrainSpec) -> None:
    """The dataset must be tokenized in the thinking mode the drafter will serve in (manifests written
    before the mode was recorded carry none and are not checked)."""
    thinking = dataset.thinking
    if thinking is None:
        log.warning("dataset manifest does not record its thinking mode; not checked",
                    extra={"dataset": spec.dataset, "enable_thinking": spec.enable_thinking})
        return
    if bool(thinking) != spec.enable_thinking:
        manifest = spec.dataset.rstrip("/") + "/manifest.json"
        raise TrainError(f"{manifest}: the dataset was tokenized with thinking={str(thinking).lower()}, but the "
                         f"train spec has enable_thinking={str(spec.enable_thinking).lower()}: the drafter must train "
                         "in the thinking mode it serves in; re-tokenize, or set enable_thinking to match")


def _fingerprints(tokenizer, fingerprint, mask_token: str) -> tuple[str, ...]:
    """The target tokenizer's fingerprint, with and without the added mask token (same text encoding)."""

    class _WithoutMask:
        @staticmethod
        def get_vocab():
            return {k: v for k, v in tokenizer.get_vocab().items() if k != mask_token}

    return fingerprint(tokenizer), fingerprint(_WithoutMask())


def open_source(target_url: str, model_dir, info: DistInfo):
    """The hidden-state source named by ``target_url``: ``inprocess`` (the target loaded on this rank's
    device) or a client of the comma-separated gRPC addresses."""
    from dfp_shared.hidden_states import open_hidden_state_source

    if target_url.strip().lower() == "inprocess":
        return open_hidden_state_source(target_url, str(model_dir), device=str(info.device))
    return open_hidden_state_source(target_url)


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
    step: int
    micro: int
    shard: int
    last: bool
    sampler_state: dict
    tensors: dict
    event: Any = None


def train(spec: TrainSpec, opts: RunOptions, info: DistInfo, hooks: Hooks | None = None, source=None,
          setup: Setup | None = None) -> TrainResult:
    """Train (or resume) the drafter described by ``spec``; returns when done or asked to stop."""
    from .objective import dflash_loss

    hooks = hooks or Hooks()
    owns_source = source is None and setup is None
    s = setup or prepare(spec, opts, info, source)
    try:
        return _train(spec, opts, info, hooks, s, dflash_loss)
    finally:
        if owns_source and hasattr(s.source, "close"):
            try:
                asyncio.run(s.source.close())
            except Exception as exc:  # noqa: BLE001 - closing must not hide the run's own outcome
                log.warning("closing the hidden-state source failed", extra={"error": str(exc)})


def _train(spec: TrainSpec, opts: RunOptions, info: DistInfo, hooks: Hooks, s: Setup, dflash_loss) -> TrainResult:
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
    ckpts = CheckpointManager(open_store(output_uri(spec, "checkpoints"), endpoint_url=opts.endpoint_url),
                              keep=spec.keep_checkpoints)
    step, history = 0, []
    try:
        pointer = ckpts.latest() if opts.resume else None
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
            raise TrainError(f"checkpoint under {output_uri(spec, 'checkpoints/')}: {exc}") from None
        log.info("resumed", extra={"step": step, "total_steps": total})

    def items():
        for global_step, (idx, after) in enumerate(sampler, start=step):
            if global_step >= total:
                return
            parts = micro_batches(rank_share(idx, info.rank, world), accum)
            for k, part in enumerate(parts):
                batch = collate(s.dataset, part, spec.max_length, pin=info.device.type == "cuda")
                yield _Item(global_step, k, info.rank + world * k, k == accum - 1, after,
                            {"input_ids": batch.input_ids, "loss_mask": batch.loss_mask, "lengths": batch.lengths})

    async def fetch(item: _Item) -> _Item:
        ids, lens = item.tensors["input_ids"], item.tensors["lengths"]
        seqs = [ids[i, : int(n)] for i, n in enumerate(lens.tolist())]
        item.tensors["target_hidden"] = await fetch_hidden(s.source, seqs, s.layer_ids, s.max_tokens_per_request,
                                                           pin=info.device.type == "cuda")
        return item

    copier = DeviceCopier(info.device)

    def copy(item: _Item) -> _Item:
        item.tensors, item.event = copier(item.tensors)
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
    pipeline = Pipeline(items(), fetch, copy, inflight=opts.fetch_inflight, queue_size=opts.prefetch_batches)
    model.train()
    try:
        wait_mark = 0.0
        for item in pipeline:
            DeviceCopier.wait(item.event, item.tensors)
            t = item.tensors
            gen = torch.Generator().manual_seed(step_seed(spec.seed, item.step, item.shard))
            sync = contextlib.nullcontext() if item.last or world == 1 else model.no_sync()
            with sync:
                loss, metrics = dflash_loss(model, t["input_ids"], t["loss_mask"], t["target_hidden"], t["lengths"],
                                            max_anchors=spec.max_anchors, gamma=spec.gamma,
                                            noise_std=spec.noise_std, generator=gen)
                (loss / accum).backward()
            _accumulate(acc, metrics, tokens=int(t["lengths"].sum()))
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
            history.append(row)
            acc = {}
            if step % spec.checkpoint_every == 0 or step == total:
                save(step, last_state)
            if hooks.progress and info.is_main and (now - last_report >= opts.progress_every_s or step == total):
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
    summary = summarise(history, pipeline)
    result = TrainResult(step, total, completed=not stopped and step >= total, history=history, summary=summary,
                         outputs={"checkpoints": output_uri(spec, "checkpoints/")})
    if result.completed and info.is_main:
        from .report import finish_run

        result.outputs.update(finish_run(s, unwrap(model), history, summary, opts))
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
