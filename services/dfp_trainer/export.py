"""Export the drafter in the layouts the serving engines load.

``zlab`` (the public DFlash reference's layout; vLLM and SGLang load it as ``--speculative-config``
``model``): ``config.json`` is :meth:`DrafterConfig.to_config_dict` (the draft layers' transformers Qwen3
config, ``rope_parameters`` as the target's, ``architectures: ["DFlashDraftModel"]``, ``block_size``,
``num_target_layers``, ``dflash_config: {mask_token_id, target_layer_ids, block_size, ...}``, the
causality fields of :meth:`DrafterConfig.causality_fields`, and ``auto_map``); ``modeling_dflash.py``
beside it, so ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` builds the drafter.

``speculators`` (vLLM's native speculators layout, ``vllm serve DIR`` serves the verifier it names with
the drafter): ``speculators_model_type: "dflash"``, the Qwen3 config as ``transformer_layer_config``,
``aux_hidden_state_layer_ids``: vLLM maps them to ``dflash_config.target_layer_ids = ids - 1`` (its
capture points precede a layer), so they are the project's ``target_layer_ids + 1``;
``sliding_window_non_causal`` becomes ``dflash_config.causal`` for every layer at once, so this layout
serves all-full drafters (non-causal) and all-sliding ones (causal), not a mix.

Both: ``model.safetensors``, the drafter's ``state_dict`` (``layers.{i}.self_attn.*``,
``layers.{i}.mlp.*``, norms, ``norm``, ``fc``, ``hidden_norm``), no embeddings, no LM head.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from . import modeling_dflash
from .config_json import read_config_json
from .distributed import unwrap
from .model import DFlashDrafter, DrafterConfig

_MISSING = "missing from the exported drafter"
MODELING_FILE = "modeling_dflash.py"
# z-lab config.json keys that are not the draft layers' transformers config (the speculators layout states them apart)
_NOT_LAYER_CONFIG = ("architectures", "auto_map", "is_causal", "block_size", "num_target_layers", "dflash_config",
                     "dtype")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def export_drafter(drafter: nn.Module, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """The z-lab layout in ``out_dir``: ``config.json``, ``model.safetensors``, ``modeling_dflash.py``."""
    model = unwrap(drafter)
    out, dtype = _write_weights(model, out_dir, dtype)
    _write(out / MODELING_FILE, Path(modeling_dflash.__file__).read_bytes())
    _write_json(out / "config.json", model.config.to_config_dict(_DTYPE_NAMES.get(dtype, "float32")))
    return out


def export_speculators(drafter: nn.Module, out_dir: str | os.PathLike, verifier: str,
                       verifier_architectures: list[str] | None = None, dtype: torch.dtype | None = None) -> Path:
    """The speculators layout in ``out_dir`` (``config.json``, ``model.safetensors``); ``verifier`` is the
    target model as the serving machine names it (a local directory or a hub id)."""
    model = unwrap(drafter)
    config = speculators_config(model.config, verifier, verifier_architectures)  # refuses a mixed layout first
    out, dtype = _write_weights(model, out_dir, dtype)
    _write_json(out / "config.json", {**config, "dtype": _DTYPE_NAMES.get(dtype, "float32")})
    return out


def speculators_config(config: DrafterConfig, verifier: str, verifier_architectures: list[str] | None = None) -> dict:
    """vLLM's speculators ``config.json`` for a drafter (see the module docstring for the layer ids)."""
    kinds = set(config.layer_types)
    if len(kinds) > 1:
        raise ValueError(f"the speculators layout cannot serve layer_types {config.layer_types}: vLLM applies its "
                         f"one causality flag to every layer, and full layers attend to their whole block while "
                         f"sliding layers are causal; export the zlab layout for a mixed drafter")
    zlab = config.to_config_dict()
    layer_config = {k: v for k, v in zlab.items() if k not in _NOT_LAYER_CONFIG}
    return {"speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"],
            "transformer_layer_config": layer_config,
            "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
            "mask_token_id": config.mask_token_id, "block_size": config.block_size,
            "target_hidden_size": config.hidden_size, "draft_vocab_size": config.vocab_size,
            "num_target_layers": config.num_target_layers,
            "sliding_window_non_causal": kinds != {modeling_dflash.SLIDING_ATTENTION},
            "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": config.block_size - 1}],
                                   "verifier": {"name_or_path": verifier,
                                                "architectures": list(verifier_architectures or [])}}}


def _write_weights(model: nn.Module, out_dir: str | os.PathLike, dtype: torch.dtype | None) -> tuple[Path, torch.dtype]:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    dtype = dtype or next(iter(state.values())).dtype
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in state.items()}
    tmp = out / "model.safetensors.part"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    return out, dtype


def _write_json(path: Path, data: dict) -> None:
    _write(path, (json.dumps(data, indent=2) + "\n").encode())


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)


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
