"""Draft layers started from the target's own decoder layers (train spec ``init: target_layers``).

A draft layer has a target layer's exact shapes (q/k/v/o projections, Qwen3's per-head ``q_norm``/``k_norm``,
the SiLU MLP, the input and post-attention RMSNorms), so the weights copy one to one. The start:

- **layers**: draft layer ``j`` of N is target layer ``L - N + j`` (the last N): the layers that turn residual
  states into what the final norm and the LM head read, the drafter's very job;
- **final norm**: the target's final norm, the one the LM head was trained behind;
- **fc**: zero but for the block of the deepest context layer ``t`` (the largest of ``target_layer_ids``), the
  identity; **hidden_norm**: the first copied layer's input RMSNorm. The context keys and values of the first
  draft layer are then ``k_proj(input_layernorm(h_t))``: exactly what target layer ``L - N`` computes over the
  context when ``t = L - N - 1`` (the default layers of a two-layer drafter: spread over 1..L-3). The other
  blocks of ``fc`` start at zero and learn (their gradient is the features times the output's).

So the drafter starts as "the target's last layers over its own deepest features". What differs from the target
(the copied weights still apply, on other inputs): the block's residual stream starts from token embeddings (the
anchor's, then the mask token's), not from the target's residual at depth L - N; the keys and values of every
draft layer's context are the same ``hidden_norm(fc(features))``, where the target's layer ``i`` reads its own
norm of its own input; a block attends to its context strictly before the anchor and to its whole own block, not
causally (later mask tokens are visible, the target's own states of the block are not); and a Llama target's
attention has no ``q_norm``/``k_norm``, so the drafter's stay at ones and RMS-normalise each head's queries and
keys, which changes the attention logits' scale. Each family's own modules (DSpark's heads, DFlash2's
convolutions, which start as the identity) keep their initialisation.

Only the tensors named here are read from the target's safetensors (no code; a remote target's directory as the
trainer downloaded it). A target whose layers are not these tensors (biases, other norms, linear attention, MoE)
is refused, naming what differs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .target_parts import _load, _tensor_files, read_target_config

# the target's decoder layers and final norm, by checkpoint layout (plain, multimodal)
LAYER_PREFIXES = ("model.layers.", "model.language_model.layers.", "language_model.model.layers.", "layers.")
NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight",
              "norm.weight")
# a draft layer's tensors (names under ``layers.{j}.``) every copied target layer holds with the same shape
LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # Qwen3's; a Llama target has none
# targets whose decoder layers are these tensors with ``w * x / rms(x)`` norms and a SiLU MLP, as a Qwen3 layer's
# (Gemma and Qwen3.5 scale by ``1 + w``: their norms would not mean the same)
MODEL_TYPES = ("qwen3", "llama", "mistral")
INIT_CHOICES = ("random", "unit_logits", "target_layers")


@dataclass
class TargetLayerInit:
    """What :func:`init_from_target_layers` did."""

    layer_ids: list[int]  # the target layer each draft layer was copied from
    feature_layer: int  # the target layer whose feature block ``fc`` starts as the identity on
    copied: list[str]  # the drafter's tensors set from the target (state_dict names)
    kept: list[str]  # the draft layers' tensors the target has none of, left at their initialisation


def init_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers the draft layers start from: the last ``num_draft_layers``, in order."""
    if not 1 <= num_draft_layers <= num_target_layers:
        raise ValueError(f"init target_layers copies one target layer into each draft layer: {num_draft_layers} "
                         f"draft layers need at most the target's {num_target_layers}")
    return list(range(num_target_layers - num_draft_layers, num_target_layers))


def check_layer_kind(config: dict[str, Any]) -> None:
    """Refuse a target whose decoder layers are not the draft layers' kind (by its config)."""
    model_type = str(config.get("model_type", ""))
    if model_type not in MODEL_TYPES:
        raise ValueError(f"init target_layers: a {model_type or 'untyped'} target's decoder layers are not Qwen3-style "
                         f"layers (supported: {', '.join(MODEL_TYPES)}); use init random")
    if config.get("hidden_act", "silu") != "silu" or config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("init target_layers: the target's layers have biases or a non-SiLU MLP, which the draft "
                         "layers have not; use init random")


def _layer_prefix(names: dict[str, Path], layer_id: int) -> str:
    for prefix in LAYER_PREFIXES:
        if f"{prefix}{layer_id}.{LAYER_TENSORS[0]}" in names:
            return prefix
    raise ValueError(f"init target_layers: no tensor {LAYER_TENSORS[0]} of target layer {layer_id} (looked under "
                     f"{', '.join(LAYER_PREFIXES)})")


def read_target_layers(model_dir: str | os.PathLike, layer_ids: list[int]) -> dict[str, torch.Tensor]:
    """The target's tensors a target-layer start needs, under the drafter's names for the copied layer ids'
    order (``layers.{j}.<name>``) and ``norm.weight``; only these are read."""
    model_dir = Path(model_dir)
    files = _tensor_files(model_dir)
    out: dict[str, torch.Tensor] = {}
    for j, layer_id in enumerate(layer_ids):
        prefix = f"{_layer_prefix(files, layer_id)}{layer_id}."
        extra = sorted(n for n in files if n.startswith(prefix) and n[len(prefix):] not in LAYER_TENSORS + QK_NORMS)
        if extra:
            raise ValueError(f"init target_layers: target layer {layer_id} holds tensors a draft layer has no place "
                             f"for: {', '.join(extra[:4])}; use init random")
        for name in LAYER_TENSORS + QK_NORMS:
            tensor = _load(files, (prefix + name,))
            if tensor is None and name not in QK_NORMS:
                raise ValueError(f"init target_layers: {model_dir}: tensor {prefix + name} missing")
            if tensor is not None:
                out[f"layers.{j}.{name}"] = tensor
    norm = _load(files, NORM_NAMES)
    if norm is None:
        raise ValueError(f"init target_layers: {model_dir}: no final norm (looked for {', '.join(NORM_NAMES)})")
    out["norm.weight"] = norm
    return out


@torch.no_grad()
def init_from_target_layers(drafter: nn.Module, model_dir: str | os.PathLike) -> TargetLayerInit:
    """Set ``drafter``'s draft layers, final norm, ``fc`` and ``hidden_norm`` from the target at ``model_dir`` as
    the module docstring says; the family's other modules are left as they are. Raises ValueError (naming the
    tensor or field) when the target's layers are not the draft layers' kind or shapes."""
    config = read_target_config(model_dir)
    check_layer_kind(config)
    cfg = drafter.config
    layer_ids = init_layer_ids(int(config["num_hidden_layers"]), cfg.num_hidden_layers)
    tensors = read_target_layers(model_dir, layer_ids)
    params = dict(drafter.named_parameters())
    for name, tensor in tensors.items():
        if params[name].shape != tensor.shape:
            raise ValueError(f"init target_layers: target tensor for {name} has shape {tuple(tensor.shape)}, the "
                             f"drafter's {tuple(params[name].shape)}")
        params[name].copy_(tensor)
    drafter.hidden_norm.weight.copy_(tensors["layers.0.input_layernorm.weight"])
    feature_layer = max(cfg.target_layer_ids)
    block = cfg.target_layer_ids.index(feature_layer)
    hidden = cfg.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, block * hidden:(block + 1) * hidden] = torch.eye(hidden, device=drafter.fc.weight.device)  # (H, K*H): block `block` = I
    kept = [f"layers.{j}.{name}" for j in range(cfg.num_hidden_layers) for name in QK_NORMS
            if f"layers.{j}.{name}" not in tensors]
    return TargetLayerInit(layer_ids, feature_layer, sorted(tensors) + ["fc.weight", "hidden_norm.weight"], kept)
