"""Export the drafter in the format the public DFlash reference implementation (and vLLM / SGLang) loads.

``config.json``: a Qwen3-style config with ``architectures: ["DFlashDraftModel"]``, ``block_size``,
``num_target_layers``, ``dflash_config: {mask_token_id, target_layer_ids, block_size}``, the
per-layer ``layer_types`` and ``sliding_window``; ``is_causal: false`` (attention inside a block is
bidirectional). ``model.safetensors``: the drafter's ``state_dict`` (``layers.{i}.self_attn.*``,
``layers.{i}.mlp.*``, norms, ``norm``, ``fc``, ``hidden_norm``), no embeddings, no LM head.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from .distributed import unwrap
from .model import DFlashDrafter, DrafterConfig

ARCHITECTURE = "DFlashDraftModel"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(config: DrafterConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The reference-format ``config.json`` of a drafter."""
    sliding = "sliding_attention" in config.layer_types
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "is_causal": False,
        "layer_types": list(config.layer_types),
        "use_sliding_window": sliding,
        "sliding_window": config.sliding_window if sliding else None,
        "max_window_layers": config.num_hidden_layers,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
                          "block_size": config.block_size},
        "dtype": _DTYPE_NAMES.get(dtype, "float32"),
        "use_cache": False,
    }


def config_from_hf(data: dict, source: str = "config.json") -> DrafterConfig:
    """A :class:`DrafterConfig` from a reference-format ``config.json`` dict."""
    if ARCHITECTURE not in (data.get("architectures") or []):
        raise ValueError(f"{source}: architectures {data.get('architectures')} does not name {ARCHITECTURE}")
    dflash = data.get("dflash_config") or {}
    for name in ("mask_token_id", "target_layer_ids"):
        if dflash.get(name) is None:
            raise ValueError(f"{source}: field dflash_config.{name} missing")
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                 "num_target_layers"):
        if name not in data:
            raise ValueError(f"{source}: field {name!r} missing")
    heads = data["num_attention_heads"]
    theta = data.get("rope_theta") or (data.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    try:
        return DrafterConfig(
            hidden_size=data["hidden_size"], intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=data.get("num_key_value_heads", heads),
            head_dim=data.get("head_dim", data["hidden_size"] // heads), rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), max_position_embeddings=data.get("max_position_embeddings", 32768),
            vocab_size=data["vocab_size"], num_target_layers=data["num_target_layers"],
            target_layer_ids=dflash["target_layer_ids"], mask_token_id=dflash["mask_token_id"],
            block_size=int(dflash.get("block_size", data.get("block_size", 16))),
            layer_types=data.get("layer_types") or [], sliding_window=data.get("sliding_window"),
            attention_bias=bool(data.get("attention_bias", False)))
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def export_drafter(drafter: nn.Module, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` to ``out_dir`` (files replaced atomically)."""
    from safetensors.torch import save_file

    model = unwrap(drafter)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    dtype = dtype or next(iter(state.values())).dtype
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in state.items()}
    tmp = out / "model.safetensors.part"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    tmp = out / "config.json.part"
    tmp.write_text(json.dumps(hf_config(model.config, dtype), indent=2) + "\n")
    os.replace(tmp, out / "config.json")
    return out


def load_exported(out_dir: str | os.PathLike, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                  device: str | torch.device | None = None) -> DFlashDrafter:
    """Load an exported drafter over the target's embedding and LM head; tensor names must match exactly."""
    from safetensors.torch import load_file

    out = Path(out_dir)
    cfg_path, weights = out / "config.json", out / "model.safetensors"
    for path in (cfg_path, weights):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing from the exported drafter")
    try:
        data = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_path}: line {exc.lineno}: not valid JSON ({exc.msg})") from None
    drafter = DFlashDrafter(config_from_hf(data, str(cfg_path)), embed_tokens, lm_head)
    state = load_file(str(weights))
    expected = drafter.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{weights}: tensor names do not match the config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{weights}: tensor {name} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(expected[name].shape)}")
    drafter.to(next(iter(state.values())).dtype)
    drafter.load_state_dict(state)
    if device is not None:
        drafter.to(device)
    return drafter
