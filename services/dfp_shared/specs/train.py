"""Spec of a ``train`` job (owned by the trainer service)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from dfp_shared.models.tokenizer_assets import AUTO_MASK_TOKEN, MASK_TOKEN
from dfp_shared.specs._common import StorageUri
from dfp_shared.specs._names import endpoint_name, removed_address
from dfp_shared.specs.families import DFLASH2_FIELDS, FAMILY_FIELDS, LAYOUTS

LayerType = Literal["full_attention", "sliding_attention"]
"""The draft layers' attention kinds: the one list of their names (others read it with ``typing.get_args``)."""
FULL, SLIDING = get_args(LayerType)
ExportLayout = Literal["zlab", "speculators"]
"""Layouts of the drafter export: the DFlash reference's (``drafter/``) and vLLM's speculators (``drafter-speculators/``)."""
DrafterFamily = Literal["dflash", "dspark", "dflash2"]
"""Drafter families the trainer builds: DFlash, DSpark (DFlash plus a sequential Markov head and an optional
confidence head) and DFlash2 (DFlash plus in-block grouped convolutions and a top-k candidate selector)."""
LossKind = Literal["decay", "dpace"]
LabelSource = Literal["data", "target_argmax"]
"""What a draft position is trained toward: the dataset's next token, or the target's greedy next token."""
"""Position weightings of the block cross-entropy: fixed exp(-(k-1)/gamma) decay, or D-PACE (the trainer's objective)."""
TargetEndpointName = endpoint_name("hidden-state target")
LayerId = Annotated[int, Field(ge=0, le=1023)]
HiddenStatesMode = Literal["online", "cache", "offline"]
"""Where a run's target features come from: the target at every step, a cache the run completes first, or
a cache an offline job filled (no target at all)."""

# Bounds: far beyond any real run, near enough that no value can make a worker allocate, loop or
# overflow without end. MAX_STEPS keeps checkpoint directories at eight digits (step-NNNNNNNN).
MAX_STEPS = 99_999_999
MAX_LAYERS = 64
MAX_BLOCK_SIZE = 64
MAX_SEQ_TOKENS = 1 << 20
MAX_VOCAB = 1 << 20  # rows of a draft vocabulary (the largest public vocabularies hold about 2^18)
MAX_MARKOV_RANK = 1024  # a rank-r Markov head is two V x r matrices: beyond this it outweighs the draft layers
MAX_SELECTOR_RANK = 1024  # DFlash2's candidate selector is two V x r codebooks, bounded as the Markov head
MAX_SELECTOR_TOP_K = 256  # DFlash2's walk scores top_k x top_k edges per drafted position
MAX_CONV_GROUP = 1 << 16  # channels per group of DFlash2's convolutions (at most a hidden size)


__all__ = ["DFLASH2_FIELDS", "TrainSpec"]  # DFLASH2_FIELDS: declared with its family in .families


def _shown(n: int | float) -> str:
    return f"2^{int(n).bit_length() - 1}" if isinstance(n, int) and n > 1 << 16 and not n & (n - 1) else str(n)


def _within(default: Any, low: int | float, high: int | float, text: str, **extra: Any) -> Any:
    """A field bounded to low..high (inclusive) whose description states that range where ``text`` has ``{}``."""
    return Field(default, ge=low, le=high, description=text.format(f"{_shown(low)}..{_shown(high)}"), **extra)


class TrainSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dataset: StorageUri = Field(description="Tokenized dataset prefix (with its manifest).")
    target: StorageUri = Field(description="Target model directory (local or object storage).")
    output: StorageUri | None = Field(
        None, description="Prefix for checkpoints, the drafter export and the eval report; unset: a prefix of the job's own under the storage "
                          "root (<root>/jobs/<job id>/). It must be new or created by the same principal.")

    steps: int | None = _within(None, 1, MAX_STEPS, "Optimiser steps to train ({}); unset: `epochs` passes over the data.")
    epochs: float = Field(3.0, gt=0, le=1000, description="Passes over the dataset when `steps` is unset (at most 1000).")
    tokens_per_batch: int = _within(16384, 16, 1 << 24, "Padded tokens per optimiser step, all ranks together ({}).")
    max_length: int = _within(3072, 8, MAX_SEQ_TOKENS, "Samples longer than this many tokens are cut to it ({}).")
    grad_accum: int = _within(1, 1, 1024, "Micro-batches per rank per optimiser step ({}).")
    lr: float = Field(6e-4, gt=0, le=10, description="Peak learning rate (AdamW), at most 10.")
    warmup_ratio: float = Field(0.04, ge=0, lt=1, description="Share of the steps with linear learning-rate warmup.")
    decay: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="Learning-rate decay after warmup: `cosine`, `linear`, `constant`, or `wsd` "
                              "(warmup-stable-decay: the peak held, then a linear decay over the last `wsd_decay_ratio`).")
    wsd_decay_ratio: float = Field(0.2, gt=0, le=1, description="Share of the run the `wsd` schedule decays over, "
                                                                 "in (0, 1].")
    optimizer: Literal["adamw", "muon"] = Field(
        "muon", description="`muon` (the default): torch's Muon for the weight matrices of the draft layers and `fc` "
                            "at `muon_lr`, AdamW at `lr` for norms, a family's per-token tables and the rest; or "
                            "`adamw` for every parameter.")
    muon_lr: float = Field(0.02, gt=0, le=10, description="Muon's learning rate for the matrices (the `muon` optimizer).")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate as a share of the peak.")
    weight_decay: float = _within(0.0, 0, 10, "AdamW weight decay ({}).")
    adam_beta2: float = Field(0.95, gt=0, lt=1, description="AdamW's second-moment decay (beta1 is 0.9), in (0, 1).")
    grad_clip: float = Field(1.0, gt=0, le=1e6, description="Global gradient-norm clip (at most 10^6).")
    seed: int = Field(0, ge=0, lt=1 << 63,
                      description="Seed of initialisation, shuffling, anchor sampling and noise (0..2^63-1).")
    family: DrafterFamily = Field("dflash", description="Drafter family: `dflash`; `dspark`: the DFlash drafter plus a "
                                                        "low-rank Markov head (the previous draft token's rank-r "
                                                        "embedding projected to a bias on the next position's logits, "
                                                        "applied left to right when drafting) and an optional "
                                                        "confidence head, served by vLLM as method `dspark`; or "
                                                        "`dflash2`: the DFlash drafter with grouped convolutions over "
                                                        "the earlier tokens of its block around each layer's attention "
                                                        "and MLP, and a low-rank selector that drafts each position "
                                                        "among its top-k tokens given the token drafted before it; "
                                                        "served by vLLM as `DFlash2DraftModel` with method `dflash`.")
    markov_rank: int = _within(32, 1, MAX_MARKOV_RANK, "Rank of the DSpark Markov head ({}); `dspark` only.")
    confidence_head: bool = Field(True, description="Whether a DSpark drafter has a confidence head (each position's "
                                                    "probability that its draft is right, trained by binary "
                                                    "cross-entropy); `dspark` only.")
    confidence_loss_weight: float = _within(0.1, 0, 100, "Weight of the confidence head's binary cross-entropy beside "
                                            "the block cross-entropy ({}); `dspark` with `confidence_head` only.")
    conv_kernel_size: int = _within(4, 1, 64, "Taps of the DFlash2 convolutions ({}): each block token reads "
                                    "itself and up to taps-1 tokens before it in its block; `dflash2` only.")
    conv_group_size: int = _within(64, 1, MAX_CONV_GROUP, "Channels per group of the DFlash2 convolutions ({}; must "
                                   "divide the target's hidden size); `dflash2` only.")
    selector_rank: int = _within(64, 1, MAX_SELECTOR_RANK, "Rank of the DFlash2 candidate selector's codebooks ({}); "
                                 "`dflash2` only.")
    selector_top_k: int = _within(8, 1, MAX_SELECTOR_TOP_K, "Candidates per drafted position among which the DFlash2 "
                                  "selector chooses ({}); `dflash2` only.")
    init: Literal["random", "unit_logits", "target_layers"] = Field(
        "random", description="How the draft layers start: `random` (normal, std 0.02); `unit_logits`: random, with the "
                              "final norm's weights scaled so the drafting LM head's first logits have unit standard "
                              "deviation (a random start's logits otherwise have the spread of the head's row norms, "
                              "and the loss starts far above log(vocabulary)); or `target_layers`: copied from "
                              "the target's last num_draft_layers decoder layers, the final norm from the target's, "
                              "`fc` the identity on the deepest target layer's features (Qwen3, Llama and Mistral "
                              "targets).")
    init_from: StorageUri | None = Field(
        None, description="Prefix of a drafter to start from instead (`config.json` and `model.safetensors`): a train "
                          "job's `drafter/` or `drafter-speculators/` export, or a drafter published in the z-lab or "
                          "speculators layout. It must be the drafter this spec builds for this target (family, "
                          "shapes, layers, target layer ids, block size, mask token, draft vocabulary), else the run "
                          "is refused naming what differs; its trainable weights are loaded, the optimiser starts "
                          "fresh at step 0. Not with `init: target_layers`.")
    num_draft_layers: int = _within(5, 1, MAX_LAYERS, "Draft decoder layers (one target layer feeds each), {}.")
    block_size: int = _within(16, 2, MAX_BLOCK_SIZE, "Tokens per draft block (anchor + block_size-1 masks), {}.")
    layer_types: list[LayerType] | None = Field(
        None, max_length=MAX_LAYERS, description=f"Attention of each draft layer, one entry per layer (`{FULL}` or "
                                                 f"`{SLIDING}`); unset: all full attention.")
    sliding_window: int | None = _within(None, 1, MAX_SEQ_TOKENS, f"Window in tokens of the `{SLIDING}` layers, {{}} "
                                         "(required when there is one).", validate_default=True)
    mask_token: str = Field(AUTO_MASK_TOKEN, min_length=1, max_length=128,
                            description="Token filling block positions 1..B-1: one of the target's tokens, or `auto`: "
                                        f"`{MASK_TOKEN}` when the tokenizer has it, else a special token the chat "
                                        "template never renders (recorded in the export as `mask_token_id`).")
    draft_vocab_size: int | None = _within(
        None, 1, MAX_VOCAB, "Tokens the drafter can draft ({}, at most the target's vocabulary): its own LM head of "
        "the target's rows of the most frequent trained tokens of the dataset, the chat template's special tokens "
        "always kept, exported with `d2t`; unset: the target's whole vocabulary.")
    target_layer_ids: list[LayerId] | None = Field(
        None, min_length=1, max_length=MAX_LAYERS,
        description="Target layers read (1..64 indexes, each 0..1023, and below the target's layer count); unset: "
                    "spread over 1..L-3.")
    max_anchors: int = _within(512, 1, 1 << 16, "Anchor positions sampled per sequence per step ({}).")
    anchor_spread: Literal["sequence", "batch"] = Field(
        "sequence", description="`sequence`: up to `max_anchors` anchors in each sequence; `batch`: up to `max_anchors` "
                                "times the sequences, drawn uniformly over the batch's anchor positions.")
    loss_norm: Literal["weights", "positions"] = Field(
        "weights", description="Divisor of the `decay` loss's weighted sum: the sum of the weights, or the number of "
                               "trained positions.")
    loss: LossKind = Field("decay", description="Weights of the block positions' cross-entropy: `decay`, fixed "
                                                 "exp(-(k-1)/gamma); `dpace`, D-PACE, from the drafter's own current "
                                                 "confidence, the derivative of the block's expected accepted length.")
    gamma: float = Field(7.0, gt=0, le=1e6, description="Decay of the loss weight over block positions, exp(-(k-1)/gamma) "
                                                         "(the `decay` loss, and the held-out loss of every run).")
    dpace_alpha: float = Field(0.5, gt=0, le=1, description="Smoothing of the `dpace` loss's confidences, "
                                                            "(1-alpha) q + alpha, in (0, 1].")
    distill_weight: float = _within(0.0, 0, 1, "Share of the loss that is distillation from the target's own "
                                    "distribution ({}): each block position's forward KL(p_T || q) at temperature 1 "
                                    "against the target's next-token distribution there (its LM head on its last "
                                    "layer, which the run then also reads from the target or the cache), weighted "
                                    "as the cross-entropy; (1 - w) CE + w KL; 0: cross-entropy only.")
    labels: LabelSource = Field(
        "data", description="What each draft position is trained toward: `data`, the dataset's next token; "
                            "`target_argmax`, the target's own greedy next token there (its LM head on its last layer, "
                            "read as distillation's teacher is): what greedy verification accepts, on answers the "
                            "target did not write (a prompt set's own answers).")
    noise_std: float = _within(0.0, 0, 100, "Std of Gaussian noise added to target features in training ({}).")
    checkpoint_every: int = Field(500, ge=1, le=MAX_STEPS, description="Steps between checkpoints (one is also written at SIGTERM).")
    keep_checkpoints: int = _within(3, 1, 1000, "Most recent checkpoints kept ({}).")
    target_endpoint: TargetEndpointName | None = Field(
        None, description="Name of a hidden-state source the operator configured on the trainers "
                          "(DFLASH_TARGET_ENDPOINTS; `default` is DFLASH_TARGET_URL); unset: `default`. A name, never "
                          "an address: a job's tokens go only to configured targets.")
    hidden_states: HiddenStatesMode = Field(
        "online", description="Where the target's hidden states come from: `online`, computed by the target at "
                              "every step; `cache`, read from `hidden_state_cache`, whose missing shards the run "
                              "computes first with the target and keeps for the next epoch and the next run; "
                              "`offline`, read from a cache a `cache` job filled (no target is used).")
    hidden_state_cache: StorageUri | None = Field(
        None, description="Prefix of the hidden-state cache (`cache` and `offline`): keyed by the target, the layer "
                          "ids, the dataset and the dtype; a cache built for others is refused. It must be new or "
                          "created by the same principal.")
    eval_prompts: int = Field(8, ge=0, le=100_000, description="Held-out samples (not trained on): their prompts measure acceptance "
                                                   "length τ, and the samples held-out loss and accuracy, trained vs "
                                                   "untrained drafter (0: skip; at most 100000).")
    eval_max_new_tokens: int = _within(64, 1, 1 << 16, "Tokens generated per evaluation prompt ({}).")
    log_every: int = _within(10, 1, MAX_STEPS, "Steps between live metric points (TensorBoard, MLflow, the job's metric "
                                               "history), {}; the last step is always logged.")
    eval_every: int | None = _within(None, 1, MAX_STEPS, "Steps between mid-training evaluations (held-out loss and "
                                                         "accuracy, and τ with an in-process target, on at most 4 held-out "
                                                         "samples), {}; unset: only "
                                                         "the final one. Needs eval_prompts > 0.")
    exports: list[ExportLayout] | None = Field(
        None, min_length=1, max_length=2,
        description="Export layouts: `zlab` (drafter/, always written: the DFlash reference's, for vLLM, SGLang "
                    "and transformers' AutoModel) and `speculators` (drafter-speculators/: vLLM's native format, "
                    "all-full or all-sliding drafters only); unset: every layout the layer types allow.")
    enable_thinking: bool = Field(True, description="Thinking mode the drafter serves in; must match the mode the "
                                                    "dataset was tokenized in (its manifest's `thinking`).")

    _no_free_address = removed_address("target_url", "target_endpoint",
                                       "the trainers send a job's tokens only to targets the operator configured")

    @model_validator(mode="after")
    def _eval_every_needs_samples(self) -> TrainSpec:
        if self.eval_every is not None and not self.eval_prompts:
            raise ValueError("eval_every needs held-out samples: set eval_prompts > 0")
        return self

    @model_validator(mode="after")
    def _one_start(self) -> TrainSpec:
        if self.init_from is not None and self.init != "random":
            raise ValueError(f"init_from and init {self.init!r} both say how the drafter starts: the weights of "
                             "init_from replace every trainable tensor; leave init at 'random' or unset init_from")
        return self

    @model_validator(mode="after")
    def _cache_where_needed(self) -> TrainSpec:
        if self.hidden_states != "online" and self.hidden_state_cache is None:
            raise ValueError(f"hidden_states {self.hidden_states!r} needs hidden_state_cache: the prefix of the cache")
        if self.hidden_states == "online" and self.hidden_state_cache is not None:
            raise ValueError("hidden_state_cache is set but hidden_states is 'online': choose 'cache' or 'offline' "
                             "to use it, or leave it unset")
        return self

    @model_validator(mode="after")
    def _family_fields(self) -> TrainSpec:
        # a value other than the default (a normalised spec carries every field, at its default when unset)
        for name, family in FAMILY_FIELDS.items():
            foreign = [f for f in family.fields if getattr(self, f) != type(self).model_fields[f].default]
            if self.family != name and foreign:
                raise ValueError(f"{', '.join(foreign)} set for family {self.family!r}: only `{name}` drafters have "
                                 f"{family.heads}")
        own = FAMILY_FIELDS[self.family]
        if own.check is not None:
            own.check(self)
        if self.exports and set(self.exports) - set(own.layouts):
            raise ValueError(f"exports: vLLM reads {self.family} drafters from the zlab layout only; export only zlab")
        return self

    @model_validator(mode="after")
    def _distill_keeps_the_selector(self) -> TrainSpec:
        if self.family == "dflash2" and self.distill_weight == 1:
            raise ValueError("distill_weight 1 with family 'dflash2': its candidate selector learns from the "
                             "cross-entropy only; keep a share of it (distill_weight below 1)")
        return self

    @model_validator(mode="after")
    def _exports_serve_the_layout(self) -> TrainSpec:
        if self.exports and "speculators" in self.exports and len(set(self.layer_types or [FULL])) > 1:
            raise ValueError("exports: the speculators layout cannot serve a drafter that mixes full and sliding "
                             "layers (vLLM reads one causality flag for every layer); export only zlab")
        return self

    def export_layouts(self) -> list[str]:
        """The layouts to export: the spec's, or every one the layer types allow."""
        if self.exports:
            return list(dict.fromkeys(self.exports))
        uniform = len(set(self.layer_types or [FULL])) == 1  # the speculators layout serves one kind of layer
        return [layout for layout in LAYOUTS
                if layout in FAMILY_FIELDS[self.family].layouts and (layout == "zlab" or uniform)]

    @field_validator("layer_types")
    @classmethod
    def _layer_count(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        layers = info.data.get("num_draft_layers")
        if value is not None and layers is not None and len(value) != layers:
            raise ValueError(f"gives {len(value)} layer types but num_draft_layers is {layers}; give one per draft layer")
        return value

    @field_validator("sliding_window")
    @classmethod
    def _window_needed(cls, value: int | None, info: ValidationInfo) -> int | None:
        sliding = SLIDING in (info.data.get("layer_types") or [])
        if sliding and value is None:
            raise ValueError(f"is required: layer_types has {SLIDING} layers")
        if value is not None and not sliding and "layer_types" in info.data:
            raise ValueError(f"is set but no draft layer is {SLIDING} (see layer_types)")
        return value
