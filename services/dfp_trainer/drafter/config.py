"""The drafter's configuration: shape and DFlash settings (:class:`DrafterConfig`), sized to a target
(:meth:`DrafterConfig.for_target`), written as and read back from the exported ``config.json``
(:meth:`DrafterConfig.to_config_dict`, :meth:`DrafterConfig.from_config_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from transformers import Qwen3Config

from .attention import FULL, SLIDING
from .bounds import (
    DEFAULT_POSITIONS,
    check_config_dict,
    check_counts,
    check_layer_list,
    check_layer_types,
    check_shape,
    check_target_layer_ids,
)
from .family import FAMILIES, family, family_of_architectures, family_of_fields

ARCHITECTURE = "DFlashDraftModel"
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
    # the drafter family (:mod:`.families`, one registered :class:`~.family.DrafterFamily` each); None: the family
    # whose own fields are set (a config built before the family was stored), stored as its name from then on
    family: str | None = None

    def __post_init__(self) -> None:
        self._check_sizes()  # before anything is built from them: a layer list, a RoPE config
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.rope_parameters = _qwen3_rope(self.rope_parameters, self.rope_theta, self.max_position_embeddings)
        if self.draft_vocab_size is not None and int(self.draft_vocab_size) == self.vocab_size:
            self.draft_vocab_size = None  # every row: the target's own head, no mapping
        if self.family is None:
            self.family = family_of_fields(self)
        self.validate()

    def _check_sizes(self) -> None:
        """The fields that size something within a train spec's bounds (:mod:`.bounds`), the per-layer lists'
        lengths included, checked before a list is built or copied from them."""
        check_shape(self)
        check_counts(self.num_hidden_layers, self.block_size)
        check_layer_list("layer_types", self.layer_types)
        check_layer_list("target_layer_ids", self.target_layer_ids)

    def validate(self) -> None:
        # a config read from storage asks for no more than a train spec could
        self._check_sizes()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        if self.mask_token_id is None or not 0 <= int(self.mask_token_id) < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is not a token of the target's vocabulary "
                             f"(size {self.vocab_size}); add the mask token to the target's tokenizer")
        if self.draft_vocab_size is not None and not 1 <= int(self.draft_vocab_size) <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} asks for more rows than the target's "
                             f"vocabulary has ({self.vocab_size}); ask for at most {self.vocab_size}")
        self._validate_family()
        check_layer_types(self.layer_types, self.num_hidden_layers)
        if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"{SLIDING} layers need a positive sliding_window")
        if float(self.rope_parameters["rope_theta"]) != float(self.rope_theta):
            raise ValueError(f"rope_parameters.rope_theta {self.rope_parameters['rope_theta']} differs from "
                             f"rope_theta {self.rope_theta}")

    def _validate_family(self) -> None:
        """The family's own fields set by it alone, then its own checks (see :class:`~.family.DrafterFamily`)."""
        own = family(self.family)
        for other in FAMILIES.values():
            foreign = [name for name in other.config_fields if name not in own.config_fields and self.field_is_set(name)]
            if other is not own and foreign:
                raise ValueError(f"{', '.join(foreign)} set for a {own.name} drafter: a drafter is {own.name} or "
                                 f"{other.name}, not both")
        own.validate(self)

    def field_is_set(self, name: str) -> bool:
        """Whether a field differs from its default (a family's own field: whether the drafter has it)."""
        return getattr(self, name) != _DEFAULTS[name]

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def serving_method(self) -> str:
        """vLLM's speculative method: ``dspark`` for DSpark; ``dflash`` for DFlash and DFlash2 (vLLM tells DFlash2
        by its architecture)."""
        return family(self.family).serving_method

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
        own = family(self.family)
        fields, dflash_fields = own.config_json(self)  # the family's beyond DFlash's
        dflash.update(dflash_fields)
        return {"architectures": [own.architecture], "model_type": "qwen3",
                **{name: getattr(qwen3, name) for name in _QWEN3_KEYS},
                "rope_theta": self.rope_theta, **causality, "block_size": self.block_size,
                **({"draft_vocab_size": self.draft_vocab_size} if self.pruned else {}),
                "num_target_layers": self.num_target_layers, "dflash_config": dflash, **fields, "dtype": dtype}

    @classmethod
    def from_config_dict(cls, data: Mapping[str, Any], source: str = "config.json") -> DrafterConfig:
        """The inverse of :meth:`to_config_dict`: a drafter's config from its ``config.json`` dict, whose sizing
        fields are bounded first, on the dict itself (:func:`~.bounds.check_config_dict`), before anything is read
        from them. A stored drafter's file is read by :func:`~.stored.read_drafter_config`."""
        check_config_dict(data, source)
        own = family_of_architectures(data.get("architectures") or [], source)
        dflash = data.get("dflash_config") or {}
        own_fields = own.read_config(data, dflash, source)
        for name in ("mask_token_id", "target_layer_ids"):
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
                      draft_vocab_size=data.get("draft_vocab_size"), family=own.name, **own_fields)
        try:
            return cls(**fields)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def for_target(cls, target_config: Any, num_layers: int = 1, block_size: int = 16, mask_token_id: int | None = None,
                   target_layer_ids: list[int] | None = None, layer_types: list[str] | None = None,
                   sliding_window: int | None = None, draft_vocab_size: int | None = None,
                   markov_rank: int | None = None, confidence_head: bool = False,
                   dflash2: Mapping[str, int] | None = None, family: str | None = None,
                   **family_fields: Any) -> DrafterConfig:
        """A drafter config sized to a target (a HF config object or its ``config.json`` dict), with its RoPE, of
        ``family`` with its own ``family_fields`` (:attr:`~.family.DrafterFamily.config_fields`); ``markov_rank``,
        ``confidence_head`` and ``dflash2`` (the DFlash2 fields) as before families were registered."""
        cfg = _ConfigView(target_config, "target config")
        num_target_layers = int(cfg.get("num_hidden_layers"))
        if mask_token_id is None:
            raise ValueError("no mask token id: the target's tokenizer needs the DFlash mask token "
                             "(<|MASK|>) and its id must be passed as mask_token_id")
        if target_layer_ids is None:
            from dfp_shared.models.loading import default_target_layer_ids

            if num_layers > 1 and num_target_layers - 3 < 1 + (num_layers - 1):
                raise ValueError(f"a target with {num_target_layers} layers is too shallow for {num_layers} draft "
                                 f"layers (their context layers are spread over 1..L-3)")
            target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
        return cls(**_shape_fields(cfg), num_hidden_layers=num_layers, num_target_layers=num_target_layers,
                   target_layer_ids=list(target_layer_ids), mask_token_id=int(mask_token_id), block_size=block_size,
                   layer_types=list(layer_types or []), sliding_window=sliding_window,
                   draft_vocab_size=draft_vocab_size, markov_rank=markov_rank, confidence_head=confidence_head,
                   family=family, **dict(dflash2 or {}), **family_fields)


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
                max_position_embeddings=int(cfg.get("max_position_embeddings", DEFAULT_POSITIONS)),
                vocab_size=int(cfg.get("vocab_size")))


def _qwen3_rope(params: Mapping[str, Any] | None, theta: float, max_positions: int) -> dict[str, Any]:
    """RoPE parameters as transformers' Qwen3 config holds them (type, theta, original length, ...)."""
    params = {k: v for k, v in (params or {}).items() if k not in _NOT_QWEN3_ROPE}
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", theta)
    return dict(Qwen3Config(rope_parameters=params, max_position_embeddings=max_positions).rope_parameters)


_DEFAULTS = {f.name: f.default for f in fields(DrafterConfig)}  # a family's own fields default to "no such part"
