"""Export the drafter in the format the public DFlash reference implementation (and vLLM / SGLang) loads.

``config.json``: :meth:`DrafterConfig.to_config_dict` (the draft layers' transformers Qwen3 config,
``rope_parameters`` as the target's, plus ``architectures: ["DFlashDraftModel"]``, ``block_size``,
``num_target_layers``, ``dflash_config: {mask_token_id, target_layer_ids, block_size}``,
``is_causal: false``). ``model.safetensors``: the drafter's ``state_dict`` (``layers.{i}.self_attn.*``,
``layers.{i}.mlp.*``, norms, ``norm``, ``fc``, ``hidden_norm``), no embeddings, no LM head.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from .config_json import read_config_json
from .distributed import unwrap
from .model import DFlashDrafter, DrafterConfig

_MISSING = "missing from the exported drafter"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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
    tmp.write_text(json.dumps(model.config.to_config_dict(_DTYPE_NAMES.get(dtype, "float32")), indent=2) + "\n")
    os.replace(tmp, out / "config.json")
    return out


def load_exported(out_dir: str | os.PathLike, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                  device: str | torch.device | None = None) -> DFlashDrafter:
    """Load an exported drafter over the target's embedding and LM head; tensor names must match exactly."""
    from safetensors.torch import load_file

    out = Path(out_dir)
    cfg_path, weights = out / "config.json", out / "model.safetensors"
    data = read_config_json(cfg_path, _MISSING)
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: {_MISSING}")
    drafter = DFlashDrafter(DrafterConfig.from_config_dict(data, str(cfg_path)), embed_tokens, lm_head)
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
