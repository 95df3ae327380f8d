"""Loading target models (local or object storage): device, dtype, fingerprint and DFlash layer choice."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from dfp_shared.jobs.failures import ModelRefused
from dfp_shared.storage.store import local_dir_confined

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
    from dfp_shared.models.tokenizer_assets import default_cache_dir
    from dfp_shared.storage.store import open_store

    store = open_store(uri, endpoint_url=endpoint_url)
    dest = Path(cache_dir or default_cache_dir()) / "models" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    keys = list(store.list(""))
    if not keys:
        raise FileNotFoundError(f"no model files under {uri}")
    if not (dest / ".complete").exists():
        store.download_many(keys, dest)
        (dest / ".complete").write_text(uri)
    return dest


PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def check_loadable(path: Path, uri: str) -> None:
    """Raise :class:`~dfp_shared.jobs.failures.ModelRefused` for a checkpoint that cannot be loaded here, before
    anything is read: no ``config.json``, or no safetensors weights (pickled weights are never loaded)."""
    if not (path / "config.json").is_file():
        raise ModelRefused(f"model {uri}: no config.json (not a Hugging Face checkpoint)")
    if not any(path.glob("*.safetensors")):
        pickles = sorted({p.name for pattern in PICKLED_WEIGHTS for p in path.glob(pattern)})
        found = f"only pickled weights ({', '.join(pickles[:3])})" if pickles else "no weights"
        raise ModelRefused(f"model {uri}: {found}; the services load safetensors weights only (loading a pickle "
                           "runs code)")


def load_causal_lm(uri: str, device: str | None = None, dtype: str | None = None, endpoint_url: str | None = None):
    """Load a Hugging Face causal LM in eval mode: bf16 on CUDA, fp32 on CPU by default."""
    from transformers import AutoModelForCausalLM

    path = local_model_dir(uri, endpoint_url=endpoint_url)
    check_loadable(path, uri)
    check_sized_by_weights(path, uri)
    dev = pick_device(device)
    # weights only from safetensors (a pickled .bin from storage would run code), and no model code from it
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=pick_dtype(dev, dtype), attn_implementation="sdpa",
                                                 use_safetensors=True, trust_remote_code=False)
    model.to(dev).eval()
    model.requires_grad_(False)
    return model


MAX_LAYERS = 1024  # decoder layers of a target (a target layer id is at most 1023)
MAX_CONFIG_BYTES = 4 << 20  # a config.json (public ones: a few KiB, multimodal ones tens of KiB)


def check_sized_by_weights(path: Path, uri: str) -> None:
    """Refuse (:class:`~dfp_shared.jobs.failures.ModelRefused`) a checkpoint whose ``config.json`` describes more
    parameters than its safetensors files hold at half a byte each (4-bit weights), before anything is allocated: a model is
    built from its config first, and weights the files lack are made in memory, so an empty weights file under
    a config that claims a vast model would otherwise be built at the config's size. The parameters are
    counted on the meta device, once the file's size and its layer count (read as plain JSON) are within
    :data:`MAX_CONFIG_BYTES` and :data:`MAX_LAYERS`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    size = (path / "config.json").stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ModelRefused(f"model {uri}: config.json is {size:,} bytes (at most {MAX_CONFIG_BYTES:,})")
    try:
        raw = json.loads((path / "config.json").read_text())
        layers = (raw.get("text_config") or raw).get("num_hidden_layers", 0)
    except (ValueError, AttributeError) as exc:
        raise ModelRefused(f"model {uri}: config.json is not a JSON object ({exc})") from None
    if isinstance(layers, bool) or not isinstance(layers, int) or not 0 < layers <= MAX_LAYERS:
        raise ModelRefused(f"model {uri}: config.json states num_hidden_layers {layers!r} (1..{MAX_LAYERS})")
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - whatever a malformed config provokes: the model cannot load
        raise ModelRefused(f"model {uri}: config.json cannot be read ({type(exc).__name__}: {exc})") from None
    try:
        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build: the model cannot load
        raise ModelRefused(f"model {uri}: config.json does not describe a model ({type(exc).__name__}: {exc})") \
            from None
    held = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    if params > 2 * held:  # 4-bit quantised weights are the densest the loaders read
        raise ModelRefused(f"model {uri}: config.json describes {params:,} parameters, more than its safetensors "
                           f"files hold ({held:,} bytes, at least half a byte a parameter)")


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
