"""The drafter's configuration: shape and DFlash settings (:class:`DrafterConfig`), sized to a target
(:meth:`DrafterConfig.for_target`), written as and read back from the exported ``config.json``
(:meth:`DrafterConfig.to_config_dict`, :meth:`DrafterConfig.from_config_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from dfp_shared.specs.train import (
    DFLASH2_FIELDS,
    MAX_BLOCK_SIZE,
    MAX_CONV_GROUP,
    MAX_LAYERS,
    MAX_MARKOV_RANK,
    MAX_SELECTOR_RANK,
    MAX_SELECTOR_TOP_K,
    LayerType,
)
from transformers import Qwen3Config

from .attention import FULL, SLIDING
from .bounds import check_shape

LAYER_TYPES = get_args(LayerType)
ARCHITECTURE = "DFlashDraftModel"
DSPARK_ARCHITECTURE = "Qwen3DSparkModel"  # vLLM's Qwen3 DSpark drafter (served as method ``dspark``)
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"  # vLLM's DFlash2Qwen3ForCausalLM (served as method ``dflash``)
# dflash_config keys vLLM's DFlash2 reads with a default; the project drafts at these values only
_DFLASH2_FIXED = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": 0.0}
AUTO_MODEL = "modeling_dflash.DFlashDraftModel"  # the modeling file's class, for AutoModel with trust_remote_code
# rope keys of targets whose attention a Qwen3 layer does not have (partial rotary, multimodal sections)
_NOT_QWEN3_ROPE = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
# config.json keys that are the draft layers' transformers Qwen3 config, written as it holds them
_QWEN3_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "hidden_act", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size",
               "attention_bias", "attention_dropout", "tie_word_embeddings", "layer_types", "use_sliding_window",
               "sliding_window", "max_window_layers", "use_cache")


@dataclass
class DrafterConfig:
    """Shape and DFlash settings of a drafter (sizes other than the layer count follow the target)."""

    hidden_size: int  # width of every draft layer; equals the target's hidden size
    intermediate_size: int  # MLP inner width
    num_hidden_layers: int  # number of draft layers
    num_attention_heads: int  # query heads per layer
    num_key_value_heads: int  # key/value heads per layer (grouped-query attention)
    head_dim: int  # width of one attention head
    rms_norm_eps: float  # epsilon of every RMSNorm
    rope_theta: float  # rotary embedding base
    max_position_embeddings: int  # longest position the drafter is meant for
    vocab_size: int  # rows of the target's embedding / LM head
    num_target_layers: int  # decoder layers of the target
    target_layer_ids: list[int]  # target layers whose outputs (HF hidden_states[i + 1]) are the context
    mask_token_id: int  # id of the mask token filling block positions 1..B-1
    block_size: int = 16  # tokens per draft block (anchor + B-1 drafts)
    layer_types: list[str] = field(default_factory=list)  # per layer, one of LAYER_TYPES
    sliding_window: int | None = None  # window (tokens) of sliding-attention layers
    attention_bias: bool = False  # bias on q/k/v/o projections
    rope_parameters: dict[str, Any] | None = None  # the target's RoPE (transformers 5 naming); unset: default RoPE
    draft_vocab_size: int | None = None  # rows of the drafter's own LM head (a pruned vocabulary); None: the target's
    markov_rank: int | None = None  # DSpark: rank of the Markov head (see :mod:`.dspark`); None: a DFlash drafter
    confidence_head: bool = False  # DSpark: whether the drafter has a confidence head
    conv_kernel_size: int | None = None  # DFlash2: taps of the in-block convolutions (see :mod:`.dflash2`)
    conv_group_size: int | None = None  # DFlash2: channels per convolution group
    selector_rank: int | None = None  # DFlash2: rank of the candidate selector's codebooks
    selector_top_k: int | None = None  # DFlash2: candidates per drafted position

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.rope_parameters = _qwen3_rope(self.rope_parameters, self.rope_theta, self.max_position_embeddings)
        if self.draft_vocab_size is not None and int(self.draft_vocab_size) == self.vocab_size:
            self.draft_vocab_size = None  # every row: the target's own head, no mapping
        self.validate()

    def validate(self) -> None:
        # a config read from storage asks for no more than a train spec could
        check_shape(self)
        if not 1 <= self.num_hidden_layers <= MAX_LAYERS:
            raise ValueError(f"num_hidden_layers must be 1..{MAX_LAYERS}, got {self.num_hidden_layers}")
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be 2..{MAX_BLOCK_SIZE} (anchor + at least one draft), got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: the drafter needs at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} do not exist in a target with {self.num_target_layers} "
                             f"layers (valid ids: 0..{self.num_target_layers - 1})")
        if self.mask_token_id is None or not 0 <= int(self.mask_token_id) < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is not a token of the target's vocabulary "
                             f"(size {self.vocab_size}); add the mask token to the target's tokenizer")
        if self.draft_vocab_size is not None and not 1 <= int(self.draft_vocab_size) <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} asks for more rows than the target's "
                             f"vocabulary has ({self.vocab_size}); ask for at most {self.vocab_size}")
        if self.markov_rank is not None and not 1 <= int(self.markov_rank) <= MAX_MARKOV_RANK:
            raise ValueError(f"markov_rank must be 1..{MAX_MARKOV_RANK}, got {self.markov_rank}")
        if self.confidence_head and self.markov_rank is None:
            raise ValueError("a confidence head is a DSpark drafter's: set markov_rank")
        self._validate_dflash2()
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unknown layer_types {unknown}; expected one of {list(LAYER_TYPES)}")
        if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"{SLIDING} layers need a positive sliding_window")
        if float(self.rope_parameters["rope_theta"]) != float(self.rope_theta):
            raise ValueError(f"rope_parameters.rope_theta {self.rope_parameters['rope_theta']} differs from "
                             f"rope_theta {self.rope_theta}")

    def _validate_dflash2(self) -> None:
        given = [getattr(self, name) is not None for name in DFLASH2_FIELDS]
        if not any(given):
            return
        if not all(given):
            raise ValueError(f"a DFlash2 drafter needs all of {', '.join(DFLASH2_FIELDS)}")
        if self.markov_rank is not None:
            raise ValueError("a drafter is DSpark (markov_rank) or DFlash2 (conv_kernel_size), not both")
        if self.pruned:
            raise ValueError("a DFlash2 drafter drafts the target's whole vocabulary: vLLM takes its candidates' ids "
                             "from the LM head's rows without mapping them by d2t")
        for name, low, high in (("conv_kernel_size", 1, self.block_size), ("conv_group_size", 1, MAX_CONV_GROUP),
                                ("selector_rank", 1, MAX_SELECTOR_RANK),
                                ("selector_top_k", 1, min(MAX_SELECTOR_TOP_K, self.vocab_size))):
            if not low <= int(getattr(self, name)) <= high:
                raise ValueError(f"{name} must be {low}..{high}, got {getattr(self, name)}")
        if self.hidden_size % int(self.conv_group_size):
            raise ValueError(f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}")
        coefficients = 2 * int(self.conv_kernel_size) * (self.hidden_size // int(self.conv_group_size))
        if coefficients > self.hidden_size:  # each convolution's coefficient projection at most H x H
            raise ValueError(f"conv_kernel_size {self.conv_kernel_size} with conv_group_size {self.conv_group_size} "
                             f"gives {coefficients} coefficients per token, more than hidden_size {self.hidden_size}: "
                             f"use fewer taps or larger groups")

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def family(self) -> str:
        """``dspark`` with a Markov head, ``dflash2`` with convolutions, else ``dflash``: the drafter module."""
        if self.markov_rank is not None:
            return "dspark"
        return "dflash" if self.conv_kernel_size is None else "dflash2"

    @property
    def serving_method(self) -> str:
        """vLLM's speculative method: ``dspark`` for DSpark; ``dflash`` for DFlash and DFlash2 (vLLM tells DFlash2
        by its architecture)."""
        return "dspark" if self.family == "dspark" else "dflash"

    @property
    def pruned(self) -> bool:
        """Whether the drafter drafts over a pruned vocabulary with its own LM head (see :mod:`.vocab`)."""
        return self.draft_vocab_size is not None

    def qwen3_config(self) -> Qwen3Config:
        """The transformers config of the draft layers (what the Qwen3 modules read and ``config.json`` states)."""
        sliding = SLIDING in self.layer_types
        return Qwen3Config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps, rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size,
            attention_bias=self.attention_bias, attention_dropout=0.0, tie_word_embeddings=False,
            layer_types=list(self.layer_types), use_sliding_window=sliding,
            sliding_window=self.sliding_window if sliding else None, max_window_layers=self.num_hidden_layers,
            use_cache=False, **({"draft_vocab_size": self.draft_vocab_size} if self.pruned else {}))

    def causality_fields(self) -> dict[str, Any]:
        """The ``config.json`` fields that make vLLM and SGLang attend as :func:`~dfp_trainer.drafter.modeling_dflash.visible`.

        All full layers: ``is_causal: false`` (vLLM reads it before anything else). With sliding layers no
        causality field at all: vLLM then makes exactly the sliding layers causal, with
        ``dflash_config.swa_window_size`` (or ``sliding_window``) as their window, and SGLang reads
        ``layer_types`` and ``sliding_window`` the same way; ``use_swa`` is stated when every layer slides.
        """
        if SLIDING not in self.layer_types:
            return {"is_causal": False}
        return {"dflash_config": {"swa_window_size": self.sliding_window,
                                  **({"use_swa": True} if set(self.layer_types) == {SLIDING} else {})}}

    def to_config_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """The reference-format ``config.json`` (z-lab layout): the Qwen3 config plus the DFlash fields,
        and the ``auto_map`` that lets ``AutoModel`` build the modeling file the export places beside it."""
        qwen3 = self.qwen3_config()
        causality = self.causality_fields()
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                  "block_size": self.block_size, **causality.pop("dflash_config", {})}
        if self.family == "dflash2":  # vLLM reads them from dflash_config; no AutoModel class (DFlash's file)
            dflash.update({name: int(getattr(self, name)) for name in DFLASH2_FIELDS}, **_DFLASH2_FIXED)
        family = self._dspark_fields() if self.family == "dspark" else {"architectures": [DFLASH2_ARCHITECTURE]} \
            if self.family == "dflash2" else {"architectures": [ARCHITECTURE], "auto_map": {"AutoModel": AUTO_MODEL}}
        return {"architectures": family.pop("architectures"), "model_type": "qwen3",
                **{name: getattr(qwen3, name) for name in _QWEN3_KEYS},
                "rope_theta": self.rope_theta, **causality, "block_size": self.block_size,
                **({"draft_vocab_size": self.draft_vocab_size} if self.pruned else {}),
                "num_target_layers": self.num_target_layers, "dflash_config": dflash, **family, "dtype": dtype}

    def _dspark_fields(self) -> dict[str, Any]:
        """The ``config.json`` fields vLLM's Qwen3 DSpark drafter reads beyond DFlash's: the Markov rank, the
        confidence head (fed the hidden state only), and ``sample_from_anchor: false``: the DFlash block (anchor,
        then masks that predict their own positions), as trained here. No ``auto_map``: the modeling file is
        DFlash's."""
        return {"architectures": [DSPARK_ARCHITECTURE], "markov_rank": self.markov_rank,
                "enable_confidence_head": self.confidence_head, "confidence_head_with_markov": False,
                "sample_from_anchor": False}

    @classmethod
    def from_config_dict(cls, data: Mapping[str, Any], source: str = "config.json") -> DrafterConfig:
        """The inverse of :meth:`to_config_dict`: a drafter's config from its ``config.json`` dict."""
        architectures = data.get("architectures") or []
        dspark, dflash2 = DSPARK_ARCHITECTURE in architectures, DFLASH2_ARCHITECTURE in architectures
        if ARCHITECTURE not in architectures and not dspark and not dflash2:
            raise ValueError(f"{source}: architectures {architectures} names none of {ARCHITECTURE}, "
                             f"{DSPARK_ARCHITECTURE}, {DFLASH2_ARCHITECTURE}")
        if dspark and (data.get("sample_from_anchor", True) or data.get("confidence_head_with_markov")):
            raise ValueError(f"{source}: a DSpark drafter here drafts from the DFlash block with a confidence head of "
                             f"the hidden state (sample_from_anchor and confidence_head_with_markov false)")
        dflash = data.get("dflash_config") or {}
        if dflash2:
            for name, value in _DFLASH2_FIXED.items():
                if dflash.get(name) is not None and float(dflash[name]) != value:
                    raise ValueError(f"{source}: dflash_config.{name} {dflash[name]}: the project drafts DFlash2 "
                                     f"with {value} only")
        for name in ("mask_token_id", "target_layer_ids", *(DFLASH2_FIELDS if dflash2 else ())):
            if dflash.get(name) is None:
                raise ValueError(f"{source}: field dflash_config.{name} missing")
        for name, value in (("is_causal", data.get("is_causal")), ("dflash_config.causal", dflash.get("causal"))):
            if value:
                raise ValueError(f"{source}: field {name} is true: the engines would make every layer causal, "
                                 f"and this drafter's full-attention layers attend to their whole block")
        cfg = _ConfigView(data, source)
        fields = dict(_shape_fields(cfg), num_hidden_layers=cfg.get("num_hidden_layers"),
                      num_target_layers=cfg.get("num_target_layers"), target_layer_ids=dflash["target_layer_ids"],
                      mask_token_id=dflash["mask_token_id"],
                      block_size=int(dflash.get("block_size", data.get("block_size", 16))),
                      layer_types=data.get("layer_types") or [], sliding_window=data.get("sliding_window"),
                      attention_bias=bool(data.get("attention_bias", False)),
                      draft_vocab_size=data.get("draft_vocab_size"),
                      markov_rank=int(cfg.get("markov_rank")) if dspark else None,
                      confidence_head=bool(data.get("enable_confidence_head", False)) and dspark,
                      **{name: int(dflash[name]) if dflash2 else None for name in DFLASH2_FIELDS})
        try:
            return cls(**fields)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def for_target(cls, target_config: Any, num_layers: int = 1, block_size: int = 16, mask_token_id: int | None = None,
                   target_layer_ids: list[int] | None = None, layer_types: list[str] | None = None,
                   sliding_window: int | None = None, draft_vocab_size: int | None = None,
                   markov_rank: int | None = None, confidence_head: bool = False,
                   dflash2: Mapping[str, int] | None = None) -> DrafterConfig:
        """A drafter config sized to a target (a HF config object or its ``config.json`` dict), with its RoPE;
        ``dflash2``: the DFlash2 fields (:data:`~dfp_shared.specs.train.DFLASH2_FIELDS`) of a DFlash2 drafter."""
        cfg = _ConfigView(target_config, "target config")
        num_target_layers = int(cfg.get("num_hidden_layers"))
        if mask_token_id is None:
            raise ValueError("no mask token id: the target's tokenizer needs the DFlash mask token "
                             "(<|MASK|>) and its id must be passed as mask_token_id")
        if target_layer_ids is None:
            from dfp_shared.models import default_target_layer_ids

            if num_layers > 1 and num_target_layers - 3 < 1 + (num_layers - 1):
                raise ValueError(f"a target with {num_target_layers} layers is too shallow for {num_layers} draft "
                                 f"layers (their context layers are spread over 1..L-3)")
            target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
        return cls(**_shape_fields(cfg), num_hidden_layers=num_layers, num_target_layers=num_target_layers,
                   target_layer_ids=list(target_layer_ids), mask_token_id=int(mask_token_id), block_size=block_size,
                   layer_types=list(layer_types or []), sliding_window=sliding_window,
                   draft_vocab_size=draft_vocab_size, markov_rank=markov_rank, confidence_head=confidence_head,
                   **dict(dflash2 or {}))


class _ConfigView:
    """Reads fields of a config given as an object or a dict (text sub-config for multimodal ones)."""

    def __init__(self, config: Any, source: str) -> None:
        text = config.get("text_config") if isinstance(config, Mapping) else getattr(config, "text_config", None)
        self.config, self.source = text or config, source

    def get(self, name: str, default: Any = None) -> Any:
        c = self.config
        value = c.get(name, default) if isinstance(c, Mapping) else getattr(c, name, default)
        if value is None and default is None:
            raise ValueError(f"{self.source}: field {name!r} missing")
        return value


def _shape_fields(cfg: _ConfigView) -> dict[str, Any]:
    """The drafter fields a Qwen3-style config states as they are: a target's, or an exported drafter's."""
    hidden, heads = int(cfg.get("hidden_size")), int(cfg.get("num_attention_heads"))
    rope = dict(cfg.get("rope_parameters", {}) or cfg.get("rope_scaling", {}) or {})
    if isinstance(rope.get(FULL), Mapping):  # one RoPE per layer type: the draft layers take the full layers'
        rope = dict(rope[FULL])
    theta = float(cfg.get("rope_theta", 0) or rope.get("rope_theta") or 10000.0)
    return dict(hidden_size=hidden, intermediate_size=int(cfg.get("intermediate_size")), num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim", hidden // heads)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta, rope_parameters={**rope, "rope_theta": theta},
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                vocab_size=int(cfg.get("vocab_size")))


def _qwen3_rope(params: Mapping[str, Any] | None, theta: float, max_positions: int) -> dict[str, Any]:
    """RoPE parameters as transformers' Qwen3 config holds them (type, theta, original length, ...)."""
    params = {k: v for k, v in (params or {}).items() if k not in _NOT_QWEN3_ROPE}
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", theta)
    return dict(Qwen3Config(rope_parameters=params, max_position_embeddings=max_positions).rope_parameters)
