"""The parts of the target the drafter borrows: its config, ``embed_tokens`` and ``lm_head``.

Only those two tensors are read from the checkpoint's safetensors files (a 27B target's other
weights are never loaded); both come back frozen. Handles single-file and sharded checkpoints
(``model.safetensors.index.json``), multimodal layouts (``model.language_model.*``) and tied
embeddings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from dfp_shared.models.tokenizer_assets import AUTO_MASK_TOKEN, choose_mask_token
from torch import nn

from .config_json import read_config_json

EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight", "embed_tokens.weight")
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


@dataclass
class TargetParts:
    config: dict[str, Any]  # the target's config.json (the text sub-config for multimodal targets)
    embed_tokens: nn.Embedding  # frozen
    lm_head: nn.Linear  # frozen

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])


def read_target_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    config = read_config_json(path, "target config.json not found")
    text = config.get("text_config")
    if text:
        text = dict(text)
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
        config = text
    for name in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "intermediate_size"):
        if name not in config:
            raise ValueError(f"{path}: field {name!r} missing")
    return config


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            out.update({name: f for name in handle.keys()})
    return out


def _load(files: dict[str, Path], names: tuple[str, ...]) -> torch.Tensor | None:
    from safetensors import safe_open

    for name in names:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as handle:
                return handle.get_tensor(name)
    return None


def load_target_parts(model_dir: str | os.PathLike, device: str | torch.device | None = None,
                      dtype: torch.dtype | None = None) -> TargetParts:
    """Read the target's config and its frozen embedding and LM head from its checkpoint directory."""
    model_dir = Path(model_dir)
    config = read_target_config(model_dir)
    files = _tensor_files(model_dir)
    embed = _load(files, EMBED_NAMES)
    if embed is None:
        raise ValueError(f"{model_dir}: no embedding tensor (looked for {', '.join(EMBED_NAMES)})")
    head = _load(files, HEAD_NAMES)
    if head is None:
        if not config.get("tie_word_embeddings", False):
            raise ValueError(f"{model_dir}: no LM head tensor (looked for {', '.join(HEAD_NAMES)}) and the "
                             f"embeddings are not tied")
        head = embed
    if embed.shape[1] != config["hidden_size"] or head.shape[1] != config["hidden_size"]:
        raise ValueError(f"{model_dir}: embedding {tuple(embed.shape)} / lm_head {tuple(head.shape)} do not match "
                         f"hidden_size {config['hidden_size']}")
    dtype = dtype or embed.dtype
    embed_tokens = nn.Embedding(embed.shape[0], embed.shape[1], device="meta")
    embed_tokens.weight = nn.Parameter(embed.to(device=device, dtype=dtype), requires_grad=False)
    lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta")
    lm_head.weight = nn.Parameter(head.to(device=device, dtype=dtype), requires_grad=False)
    return TargetParts(config=config, embed_tokens=embed_tokens, lm_head=lm_head)


def mask_token_id(tokenizer, mask_token: str = AUTO_MASK_TOKEN) -> int:
    """Id of the DFlash mask token in the target's tokenizer (:func:`~dfp_shared.models.tokenizer_assets.choose_mask_token`
    picks it for ``auto``); a clear error when it is missing."""
    return int(tokenizer.get_vocab()[choose_mask_token(tokenizer, mask_token)])
