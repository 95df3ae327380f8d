"""Bounds on what a drafter's ``config.json`` (a :class:`.config.DrafterConfig`, which calls these checks) and
weights file may ask for, checked before anything is built.

A stored drafter (an ``evaluate`` job's, the serving reference's, a run's ``init_from``) is a user's file: every
field that sizes a tensor or a list is bounded before a module, a list or even the config object is made, so a
config that states ``intermediate_size: 4000000`` over a hidden size of 128, or ``num_hidden_layers: 200000000``
with no ``layer_types`` (a list of that many entries), is refused by name instead of asking for gigabytes.
:func:`check_config_dict` holds the dict read from ``config.json`` to these bounds (the one check of every loader,
:meth:`DrafterConfig.from_config_dict` runs it first); :func:`check_shape`, :func:`check_counts`,
:func:`check_target_layer_ids` and :func:`check_layer_types` are the same rules for a config object, which
:class:`DrafterConfig` applies before it builds anything from its fields. Together they hold a config to what a
train spec could make of some target (widths in proportion to the hidden size, the spec's layer, block and
vocabulary bounds, each family's own fields within the spec's); :func:`check_fits_target` holds it to the target
it drafts for (the target's own widths, heads and vocabulary: a train spec copies them);
:func:`check_weights_header` compares a safetensors file's tensor names and shapes, read from its header, with
the drafter's before a byte is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, get_args

from dfp_shared.specs.train import MAX_BLOCK_SIZE, MAX_LAYERS, MAX_SEQ_TOKENS, MAX_VOCAB, LayerType

from .family import family_of_architectures

LAYER_TYPES = get_args(LayerType)
MAX_HIDDEN = 1 << 16  # wider than any public model's hidden size (about 2^14)
MAX_HEAD_DIM = 1024
MAX_HEADS = 1024
MAX_TARGET_LAYERS = 1024  # a target layer id is at most 1023 (the train spec's bound)
MAX_POSITIONS = 1 << 24
MLP_FACTOR = 16  # an MLP at most this many times the hidden size (public models: 2 to 8)
ATTENTION_FACTOR = 8  # query heads x head_dim at most this many times the hidden size (public models: 1 to 2)
DEFAULT_POSITIONS = 32768  # max_position_embeddings of a config.json that does not state it
# fields of a config.json without a default: missing (or null) is refused by name
_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "num_target_layers",
             "num_hidden_layers")


def check_shape(cfg: Any) -> None:
    """Every width of ``cfg`` within what a train spec could ask for (the layer count, the block and the
    families' own fields are bounded beside it, :func:`check_counts`); ValueError naming the field."""
    _check_widths(lambda name: getattr(cfg, name))


def _check_widths(get: Callable[[str], Any]) -> None:
    """The width rules, on fields read by ``get`` (a config object's attributes or a ``config.json``'s values)."""
    hidden = _within("hidden_size", get("hidden_size"), 1, MAX_HIDDEN)
    _within("vocab_size", get("vocab_size"), 1, MAX_VOCAB)
    _within("num_target_layers", get("num_target_layers"), 1, MAX_TARGET_LAYERS)
    _within("intermediate_size", get("intermediate_size"), 1, MLP_FACTOR * hidden, f"{MLP_FACTOR} x hidden_size")
    heads = _within("num_attention_heads", get("num_attention_heads"), 1, MAX_HEADS)
    _within("num_key_value_heads", get("num_key_value_heads"), 1, heads, "num_attention_heads")
    head_dim = _within("head_dim", get("head_dim"), 1, MAX_HEAD_DIM)
    if heads * head_dim > ATTENTION_FACTOR * hidden:
        raise ValueError(f"num_attention_heads x head_dim = {heads * head_dim:,} is over the limit of "
                         f"{ATTENTION_FACTOR} x hidden_size = {ATTENTION_FACTOR * hidden:,}")
    _within("max_position_embeddings", get("max_position_embeddings"), 1, MAX_POSITIONS)
    if get("sliding_window") is not None:
        _within("sliding_window", get("sliding_window"), 1, MAX_SEQ_TOKENS)


def check_counts(num_hidden_layers: Any, block_size: Any) -> None:
    """The draft layers and the block within a train spec's bounds; ValueError naming the field."""
    _range("num_hidden_layers", num_hidden_layers, 1, MAX_LAYERS)
    _range("block_size", block_size, 2, MAX_BLOCK_SIZE, " (anchor + at least one draft)")


def check_layer_list(name: str, values: Any) -> None:
    """A per-layer list (``layer_types``, ``target_layer_ids``) no longer than a train spec's bound, checked
    before a single entry is read or copied; ValueError naming the field."""
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {_shown(values)}")
    if len(values) > MAX_LAYERS:
        raise ValueError(f"{name} has {len(values):,} entries, more than the limit of {MAX_LAYERS}")


def check_target_layer_ids(ids: Any, num_target_layers: int) -> None:
    """1..MAX_LAYERS target layer ids, each a layer of a target with ``num_target_layers``; ValueError."""
    check_layer_list("target_layer_ids", ids)
    if not ids:
        raise ValueError("target_layer_ids is empty: the drafter needs at least one target layer")
    not_ids = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)]
    if not_ids:
        raise ValueError(f"target_layer_ids {_shown(not_ids)} are not layer ids (integers)")
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} do not exist in a target with {num_target_layers} "
                         f"layers (valid ids: 0..{num_target_layers - 1})")


def check_layer_types(types: Any, num_hidden_layers: int) -> None:
    """One of :data:`LAYER_TYPES` per draft layer; ValueError naming the field."""
    check_layer_list("layer_types", types)
    if len(types) != num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_hidden_layers} layers")
    unknown = [t for t in types if not isinstance(t, str) or t not in LAYER_TYPES]
    if unknown:
        shown = sorted(set(unknown)) if all(isinstance(t, str) for t in unknown) else _shown(unknown)
        raise ValueError(f"unknown layer_types {shown}; expected one of {list(LAYER_TYPES)}")


def check_config_dict(data: Mapping[str, Any], source: str = "config.json") -> None:
    """The dict read from a drafter's ``config.json`` (z-lab layout) within the rules above, checked on its raw
    values before any object, list or tensor is built from them: every sizing field an integer in its range
    (as :meth:`DrafterConfig.from_config_dict` reads it, defaults included), every per-layer list at most
    ``MAX_LAYERS`` long before an entry is read, the family's own fields (its
    :attr:`~.family.DrafterFamily.config_bounds`) within the train spec's. ValueError naming ``source``, the
    field, its value and the bound."""
    architectures = data.get("architectures") or []
    if not isinstance(architectures, list):
        raise ValueError(f"{source}: field architectures must be a list, got {_shown(architectures)}")
    own = family_of_architectures(architectures, source)
    try:
        _check_raw(data, own.config_bounds)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _check_raw(data: Mapping[str, Any], family_bounds: tuple[tuple[str, int, int], ...]) -> None:
    dflash = _object(data, "dflash_config")
    view = _object(data, "text_config") or data  # what the config reads its shape from (a multimodal one's text)
    for name in ("rope_parameters", "rope_scaling"):
        _object(view, name)
    stated = _stated(data, view)
    _check_widths(stated)
    layers = stated("num_hidden_layers")
    _range("num_hidden_layers", layers, 1, MAX_LAYERS)
    for where, fields in (("dflash_config.", dflash), ("", data)):
        if "block_size" in fields:
            _range(f"{where}block_size", fields["block_size"], 2, MAX_BLOCK_SIZE, " (anchor + at least one draft)")
    if dflash.get("target_layer_ids") is not None:
        check_target_layer_ids(dflash["target_layer_ids"], view["num_target_layers"])
    if dflash.get("mask_token_id") is not None:
        _within("dflash_config.mask_token_id", dflash["mask_token_id"], 0, view["vocab_size"] - 1, "vocab_size - 1")
    if data.get("draft_vocab_size") is not None:
        _within("draft_vocab_size", data["draft_vocab_size"], 1, view["vocab_size"], "vocab_size")
    for path, low, high in family_bounds:
        where, _, name = path.rpartition(".")
        value = (dflash if where else data).get(name)
        if value is not None:
            _range(path, value, low, high)
    if data.get("layer_types"):
        check_layer_types(data["layer_types"], layers)


def _stated(data: Mapping[str, Any], view: Mapping[str, Any]) -> Callable[[str], Any]:
    """The sizing fields of a ``config.json`` as :meth:`DrafterConfig.from_config_dict` reads them: the Qwen3
    fields from ``view``, with their defaults (key/value heads: the query heads; head_dim: hidden size over
    heads, read once both are bounded), ``sliding_window`` from the top level."""
    def get(name: str) -> Any:
        if name == "sliding_window":
            return data.get(name)
        if view.get(name) is not None or (name in view and name not in _REQUIRED):
            return view[name]
        if name == "num_key_value_heads":
            return view["num_attention_heads"]
        if name == "head_dim":
            return view["hidden_size"] // view["num_attention_heads"]
        if name == "max_position_embeddings":
            return DEFAULT_POSITIONS
        raise ValueError(f"field {name!r} missing")
    return get


def _object(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = data.get(name) or {}
    if not isinstance(value, Mapping):
        raise ValueError(f"field {name} must be an object, got {_shown(value)}")
    return value


def _within(name: str, value: Any, low: int, high: int, what: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        limit = f"{what} = {high:,}" if what else f"{high:,}"
        raise ValueError(f"{name} {_shown(value)} is outside {low}..{high:,} (the limit: {limit})")
    return value


def _range(name: str, value: Any, low: int, high: int, note: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be {low}..{high}{note}, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """A value for an error message: a long list or object by its length, anything else cut to 60 characters."""
    if isinstance(value, (list, tuple, dict)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value):,} entries"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def check_fits_target(cfg: Any, target_config: Any) -> None:
    """``cfg`` drafts for the target whose config is ``target_config`` (a transformers config or its
    ``config.json`` dict; a multimodal one's text part): its hidden size, vocabulary and layer count are the
    target's, and no width or head count is larger than the target's own."""
    t = _fields(target_config)
    t_hidden, t_heads = int(t("hidden_size")), int(t("num_attention_heads"))
    same = {"hidden_size": (cfg.hidden_size, t_hidden), "vocab_size": (cfg.vocab_size, int(t("vocab_size"))),
            "num_target_layers": (cfg.num_target_layers, int(t("num_hidden_layers")))}
    for name, (mine, theirs) in same.items():
        if mine != theirs:
            raise ValueError(f"{name} {mine} differs from the target's {theirs}")
    at_most = {"intermediate_size": int(t("intermediate_size")), "num_attention_heads": t_heads,
               "num_key_value_heads": int(t("num_key_value_heads") or t_heads),
               "head_dim": int(t("head_dim") or t_hidden // t_heads)}
    for name, limit in at_most.items():
        if getattr(cfg, name) > limit:
            raise ValueError(f"{name} {getattr(cfg, name):,} is larger than the target's {limit:,} "
                             f"(a drafter's layers are at most the target's)")


def _fields(config: Any):
    if not isinstance(config, dict):
        config = config.get_text_config().to_dict() if hasattr(config, "get_text_config") else vars(config)
    config = config.get("text_config") or config
    return config.get


def check_weights_header(path: str, expected: dict[str, tuple[int, ...]]) -> None:
    """The safetensors file at ``path`` holds exactly the tensors ``expected`` names, of those shapes, by its
    header (nothing is loaded); ValueError naming the file and the first differences."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as exc:  # noqa: BLE001 - a header safetensors cannot read: the file is not a drafter's
        raise ValueError(f"{path}: not a safetensors file this drafter can load ({exc})") from None
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}: tensor names do not match the config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    for name, shape in shapes.items():
        if shape != tuple(expected[name]):
            raise ValueError(f"{path}: tensor {name} has shape {shape}, expected {tuple(expected[name])}")
