"""Bounds on what a drafter's ``config.json`` (a :class:`.config.DrafterConfig`, which calls these checks) and
weights file may ask for, checked before anything is built.

A stored drafter (an ``evaluate`` job's, the serving reference's) is a user's file: every field that sizes a
tensor is bounded before a module is made, so a config that states ``intermediate_size: 4000000`` over a
hidden size of 128 is refused by name instead of asking for hundreds of gigabytes. :func:`check_shape` holds
every config to what a train spec could make of some target (widths in proportion to the hidden size, the
spec's layer and vocabulary bounds); :func:`check_fits_target` holds it to the target it drafts for (the
target's own widths, heads and vocabulary: a train spec copies them); :func:`check_weights_header` compares a
safetensors file's tensor names and shapes, read from its header, with the drafter's before a byte is loaded.
"""

from __future__ import annotations

from typing import Any

from dfp_shared.specs.train import MAX_SEQ_TOKENS, MAX_VOCAB

MAX_HIDDEN = 1 << 16  # wider than any public model's hidden size (about 2^14)
MAX_HEAD_DIM = 1024
MAX_HEADS = 1024
MAX_TARGET_LAYERS = 1024  # a target layer id is at most 1023 (the train spec's bound)
MAX_POSITIONS = 1 << 24
MLP_FACTOR = 16  # an MLP at most this many times the hidden size (public models: 2 to 8)
ATTENTION_FACTOR = 8  # query heads x head_dim at most this many times the hidden size (public models: 1 to 2)


def check_shape(cfg: Any) -> None:
    """Every sizing field of ``cfg`` within what a train spec could ask for (the layer count and the families'
    own fields are bounded beside it, in :meth:`DrafterConfig.validate`); ValueError naming the field."""
    hidden = _within("hidden_size", cfg.hidden_size, 1, MAX_HIDDEN)
    _within("vocab_size", cfg.vocab_size, 1, MAX_VOCAB)
    _within("num_target_layers", cfg.num_target_layers, 1, MAX_TARGET_LAYERS)
    _within("intermediate_size", cfg.intermediate_size, 1, MLP_FACTOR * hidden, f"{MLP_FACTOR} x hidden_size")
    heads = _within("num_attention_heads", cfg.num_attention_heads, 1, MAX_HEADS)
    _within("num_key_value_heads", cfg.num_key_value_heads, 1, heads, "num_attention_heads")
    head_dim = _within("head_dim", cfg.head_dim, 1, MAX_HEAD_DIM)
    if heads * head_dim > ATTENTION_FACTOR * hidden:
        raise ValueError(f"num_attention_heads x head_dim = {heads * head_dim:,} is over the limit of "
                         f"{ATTENTION_FACTOR} x hidden_size = {ATTENTION_FACTOR * hidden:,}")
    _within("max_position_embeddings", cfg.max_position_embeddings, 1, MAX_POSITIONS)
    if cfg.sliding_window is not None:
        _within("sliding_window", cfg.sliding_window, 1, MAX_SEQ_TOKENS)


def _within(name: str, value: Any, low: int, high: int, what: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        limit = f"{what} = {high:,}" if what else f"{high:,}"
        raise ValueError(f"{name} {value!r} is outside {low}..{high:,} (the limit: {limit})")
    return value


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
