"""Setup of a training run: load and check the dataset, tokenizer, target parts, drafter and hidden-state
source, failing with a clear :class:`TrainError` before any step runs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from dfp_shared.hidden_states import CacheError, open_hidden_state_source
from dfp_shared.models.loading import local_model_dir, model_fingerprint
from dfp_shared.models.tokenizer_assets import (
    chat_template_fingerprint,
    choose_mask_token,
    load_tokenizer,
    tokenizer_fingerprint,
)
from dfp_shared.specs.train import TrainSpec

from ..components.data.dataset import load_training_data, trainable_samples
from ..components.data.draft_vocab import (
    VocabError,
    choose_draft_vocab,
    coverage,
    required_token_ids,
    trained_token_counts,
)
from ..components.data.hidden_cache import cached_source
from ..components.distributed import DistInfo
from ..drafter.distill import check_teacher_target, teacher_layer_ids
from ..drafter.families import build_drafter
from ..drafter.init_from_target import init_from_target_layers
from ..drafter.target_parts import load_target_parts
from ..drafter.warm_start import warm_start
from ..run_config import RunConfig

log = logging.getLogger(__name__)


class TrainError(ValueError):
    """The run cannot start: bad dataset, target or settings (the message says which and why)."""


@dataclass
class Setup:
    config: RunConfig
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
    draft_vocab: dict | None = None  # a pruned vocabulary's coverage of the trained tokens (:func:`~..components.data.draft_vocab.coverage`)
    teacher_layer_ids: list[int] = field(default_factory=list)  # the target's last layer when the run distils
    init_from: dict | None = None  # the stored drafter the run started from (:func:`start_from_drafter`)

    @property
    def fetched_layer_ids(self) -> list[int]:
        """The layers read from the hidden-state source: the drafter's, then the teacher's (:mod:`..drafter.distill`)."""
        return self.layer_ids + self.teacher_layer_ids

    @property
    def spec(self) -> TrainSpec:
        return self.config.spec


def prepare(config: RunConfig, info: DistInfo, source=None, *, counters: Callable[[dict], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> Setup:
    """Load and check the run's inputs; every problem raises :class:`TrainError` before training.

    With ``hidden_states`` ``cache`` or ``offline`` the source is the cache
    (:mod:`..components.data.hidden_cache`), completed here for ``cache``; ``counters`` gets its counts (cached
    and missing shards, bytes) for the job record, and ``should_stop`` can end its filling before any forward
    request (a shard stopped part-way is not written)."""
    spec, endpoint_url = config.spec, config.settings.s3_endpoint_url
    try:
        model_dir = local_model_dir(spec.target, endpoint_url=endpoint_url)
    except FileNotFoundError as exc:
        raise TrainError(f"target: {exc}") from None
    tokenizer = load_tokenizer(model_dir)
    try:
        mask_token = choose_mask_token(tokenizer, spec.mask_token)
    except ValueError as exc:
        raise TrainError(f"target {spec.target}: {exc}") from None
    mask_id = tokenizer.convert_tokens_to_ids(mask_token)
    dataset = load_training_data(spec.dataset, endpoint_url=endpoint_url,
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
        drafter_config = config.drafter_config(target_config, mask_id)
    except ValueError as exc:
        raise TrainError(f"target {spec.target}: {exc}") from None
    if mask_id >= embed.weight.shape[0]:
        raise TrainError(f"mask token id {mask_id} is outside the target's embedding ({embed.weight.shape[0]} rows)")
    teacher = distill_layers(spec, target_config, num_layers, list(drafter_config.target_layer_ids))
    eligible = trainable_samples(dataset)
    pool = torch.nonzero(eligible).flatten()
    n_eval = min(spec.eval_prompts, pool.numel() // 4) if config.evaluate else 0
    perm = pool[torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(spec.seed))]
    eval_index, train_pool = perm[:n_eval].sort().values, perm[n_eval:].sort().values
    draft_ids, draft_vocab = None, None
    if drafter_config.pruned:
        draft_ids, draft_vocab = choose_vocab(spec, tokenizer, dataset, train_pool, drafter_config.vocab_size)
    torch.manual_seed(spec.seed)
    drafter = build_drafter(drafter_config, embed, lm_head, draft_ids).to(info.device)
    initialise(spec, drafter, model_dir)
    started = start_from_drafter(drafter, spec.init_from, endpoint_url) if spec.init_from else None
    initial = {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()}

    offline = spec.hidden_states == "offline"
    opened = source is None and not offline
    if offline:
        source = None  # no target at all: every feature comes from the cache
    elif source is None:
        source = open_source(config.target_address, model_dir, info)
    layer_ids = list(drafter_config.target_layer_ids)
    max_tokens = None
    if source is not None:
        check_source(source, spec, model_dir, num_layers, drafter_config.hidden_size, layer_ids + teacher)
        max_tokens = int(getattr(source.model_info(), "max_tokens_per_request", 0) or 0) or None
    if spec.hidden_states != "online":
        try:
            source = cached_source(config, info, dataset, online=source, target_fingerprint=model_fingerprint(model_dir),
                                   layer_ids=layer_ids + teacher, hidden_size=drafter_config.hidden_size, num_layers=num_layers,
                                   max_tokens_per_request=max_tokens, counters=counters, should_stop=should_stop)
        except CacheError as exc:
            if opened:
                _close(source)
            raise TrainError(str(exc)) from None
    return Setup(config, model_dir, tokenizer, dataset, drafter, initial, source, layer_ids, eval_index, train_pool,
                 max_tokens, draft_vocab, teacher, started)


def distill_layers(spec: TrainSpec, target_config: dict, num_layers: int, layer_ids: list[int]) -> list[int]:
    """The teacher's layers the run reads after the drafter's (:mod:`..drafter.distill`); :class:`TrainError` when
    the target cannot be distilled so."""
    try:
        teacher = spec.distill_weight > 0 or spec.labels == "target_argmax"
        if teacher:
            check_teacher_target(target_config)
        return teacher_layer_ids(num_layers, teacher, layer_ids)
    except ValueError as exc:
        raise TrainError(f"target {spec.target}: {exc}") from None


def initialise(spec: TrainSpec, drafter: torch.nn.Module, model_dir) -> None:
    """The spec's ``init`` beyond the random start: the target's layers, or the final norm scaled for unit-spread
    first logits."""
    if spec.init == "target_layers":
        init_from_target(drafter, model_dir)
    elif spec.init == "unit_logits":
        try:
            scale = drafter.scale_norm_to_unit_logits()
        except ValueError as exc:
            raise TrainError(f"target {spec.target}: {exc}") from None
        log.info("final norm scaled for unit-variance first logits", extra={"norm_scale": round(scale, 6)})


def init_from_target(drafter: torch.nn.Module, model_dir) -> None:
    """Start the draft layers from the target's (:mod:`..drafter.init_from_target`); :class:`TrainError` if it cannot."""
    try:
        done = init_from_target_layers(drafter, model_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise TrainError(f"target: {exc}") from None
    log.info("draft layers copied from the target's", extra={"target_layers": done.layer_ids,
                                                             "fc_identity_on_layer": done.feature_layer,
                                                             "left_at_init": done.kept})


def start_from_drafter(drafter: torch.nn.Module, uri: str, endpoint_url: str | None) -> dict:
    """Load the stored drafter at ``uri`` into the run's (:mod:`..drafter.warm_start`); :class:`TrainError` naming
    what does not fit. Returns what the run report records."""
    try:
        done = warm_start(drafter, local_model_dir(uri, endpoint_url=endpoint_url))
    except (FileNotFoundError, ValueError) as exc:
        raise TrainError(f"init_from {uri}: {exc}") from None
    record = done.record(uri)
    log.info("drafter started from a stored drafter", extra=record)
    return record


def choose_vocab(spec: TrainSpec, tokenizer, dataset, train_pool: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, dict]:
    """The pruned draft vocabulary of the run (:mod:`..components.data.draft_vocab`): its target ids and its
    coverage of the training samples' trained tokens; :class:`TrainError` when it cannot be built."""
    try:
        counts = trained_token_counts(dataset.input_ids, dataset.loss_mask, dataset.offsets, train_pool, vocab_size,
                                      spec.max_length)
        required = required_token_ids(tokenizer, spec.enable_thinking)
        ids = choose_draft_vocab(counts, spec.draft_vocab_size, [i for i in required if i < vocab_size])
    except VocabError as exc:
        raise TrainError(f"target {spec.target}: {exc}") from None
    return ids, {**coverage(counts, ids), "required_token_ids": required}


def _close(source) -> None:
    import asyncio

    try:
        asyncio.run(source.close())
    except Exception as exc:  # noqa: BLE001 - the refusal is what the caller must see
        log.warning("closing the hidden-state source failed", extra={"error": str(exc)})


def check_source(source, spec: TrainSpec, model_dir, num_layers: int, hidden_size: int, layer_ids: list[int]) -> None:
    """The hidden-state source must serve the run's target (shape, fingerprint) and the drafter's layers."""
    minfo = source.model_info()
    if int(minfo.num_layers) != num_layers or int(minfo.hidden_size) != hidden_size:
        raise TrainError(f"hidden-state source serves a model with {minfo.num_layers} layers x {minfo.hidden_size} "
                         f"hidden, but the target {spec.target} has {num_layers} x {hidden_size}")
    served_fp = getattr(minfo, "fingerprint", "") or ""
    if served_fp and served_fp != model_fingerprint(model_dir):
        raise TrainError(f"the hidden-state source serves model {getattr(minfo, 'model_id', '?')!r} with fingerprint "
                         f"{served_fp!r}, but the target {spec.target} has {model_fingerprint(model_dir)!r}: point "
                         "the job's target_endpoint (or the trainer's DFLASH_TARGET_URL) at a service running the "
                         "same checkpoint")
    served = list(getattr(minfo, "layer_ids", None) or [])
    if served and not set(layer_ids) <= set(served):
        raise TrainError(f"hidden-state source serves layers {served}; the drafter needs {layer_ids}")


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


def open_source(target_address: str, model_dir, info: DistInfo):
    """The hidden-state source at ``target_address``: ``inprocess`` (the target loaded on this rank's
    device) or a client of the comma-separated gRPC addresses."""
    if target_address.strip().lower() == "inprocess":
        return open_hidden_state_source(target_address, str(model_dir), device=str(info.device))
    return open_hidden_state_source(target_address)
