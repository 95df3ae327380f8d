"""The files both export layouts write.

``model.safetensors``, the drafter's ``state_dict`` (``layers.{i}.self_attn.*``,
``layers.{i}.mlp.*``, norms, ``norm``, ``fc``, ``hidden_norm``), no embeddings; no LM head, except a pruned vocabulary's own (``lm_head.weight``) with its
``d2t`` (int64, kept so: only floating tensors take the export's dtype).
Every file is written beside itself first and renamed into place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_weights(model: nn.Module, out_dir: str | os.PathLike, dtype: torch.dtype | None) -> tuple[Path, torch.dtype]:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    dtype = dtype or next(t.dtype for t in state.values() if t.is_floating_point())
    tensors = {name: t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
               for name, t in state.items()}
    tmp = out / "model.safetensors.part"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    return out, dtype


def write_json(path: Path, data: dict) -> None:
    write(path, (json.dumps(data, indent=2) + "\n").encode())


def write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)
