"""Loading target models (local or object storage), and tiny random-initialised Qwen3 targets.

Tests and the demo build tiny models in code and save them as ordinary Hugging Face checkpoints,
so they are loaded through exactly the same path as a real target.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from .storage import local_dir_confined
from .tokenizer_assets import MASK_TOKEN, load_tokenizer

log = logging.getLogger(__name__)


def pick_device(device: str | None = None) -> torch.device:
    if device and device != "auto":
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(device: torch.device, dtype: str | None = None) -> torch.dtype:
    """bf16 on CUDA, fp32 on CPU unless given."""
    if dtype and dtype != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def local_model_dir(uri: str, cache_dir: str | os.PathLike | None = None, endpoint_url: str | None = None) -> Path:
    """A local directory for a model given as a path, ``file://`` or ``s3://`` URI (downloaded once)."""
    if not uri.startswith("s3://"):
        path = Path(uri[len("file://"):] if uri.startswith("file://") else uri)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {uri} does not exist")
        return local_dir_confined(path, uri)
    from .storage import open_store
    from .tokenizer_assets import default_cache_dir

    store = open_store(uri, endpoint_url=endpoint_url)
    dest = Path(cache_dir or default_cache_dir()) / "models" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    keys = list(store.list(""))
    if not keys:
        raise FileNotFoundError(f"no model files under {uri}")
    if not (dest / ".complete").exists():
        store.download_many(keys, dest)
        (dest / ".complete").write_text(uri)
    return dest


def load_causal_lm(uri: str, device: str | None = None, dtype: str | None = None, endpoint_url: str | None = None):
    """Load a Hugging Face causal LM in eval mode: bf16 on CUDA, fp32 on CPU by default."""
    from transformers import AutoModelForCausalLM

    path = local_model_dir(uri, endpoint_url=endpoint_url)
    dev = pick_device(device)
    # weights only from safetensors (a pickled .bin from storage would run code), and no model code from it
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=pick_dtype(dev, dtype), attn_implementation="sdpa",
                                                 use_safetensors=True, trust_remote_code=False)
    model.to(dev).eval()
    model.requires_grad_(False)
    return model


def model_fingerprint(path: str | os.PathLike) -> str:
    """Hash of a checkpoint's config and weight file sizes/names (cheap, stable across copies)."""
    path = Path(path)
    h = hashlib.sha256()
    cfg = path / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()[:16]


def text_config(config):
    """The text sub-config of multimodal configs (Qwen3.5 / 3.6), else the config itself."""
    return getattr(config, "text_config", None) or config


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's choice of target layers: one per draft layer, spread evenly from 1 to L-3; L//2 for one."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"a target with {num_target_layers} layers is too shallow for {num_draft_layers} draft layers")
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def build_tiny_qwen3(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, *, num_layers: int = 8,
                     hidden_size: int = 64, intermediate_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                     head_dim: int = 16, max_position_embeddings: int = 4096, seed: int = 0,
                     hybrid: bool = False) -> Path:
    """Save a random-initialised tiny Qwen3 (or Qwen3.5-style hybrid) target with the real tokenizer.

    The tokenizer gets the DFlash mask token; the vocabulary is sized to the tokenizer.
    ``hybrid=True`` builds a ``qwen3_5_text`` model mixing linear- and full-attention layers.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    if (out / "config.json").exists() and list(out.glob("*.safetensors")):
        return out
    tok = load_tokenizer(tokenizer_dir, add_mask_token=True)
    vocab = len(tok)
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  head_dim=head_dim, max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                  bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                  eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                  pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    if hybrid:
        from transformers import Qwen3_5TextConfig

        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
        config = Qwen3_5TextConfig(**common, layer_types=layer_types, linear_num_key_heads=2, linear_num_value_heads=4,
                                   linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    else:
        from transformers import Qwen3Config

        config = Qwen3Config(**common)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default init so the tiny model's outputs are not near-uniform
        model.get_output_embeddings().weight.normal_(0, 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "dflash_tiny.json").write_text(json.dumps({"seed": seed, "hybrid": hybrid, "mask_token": MASK_TOKEN}))
    return out
