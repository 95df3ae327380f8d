"""vLLM speculators' DFlash trainer (PyPI ``speculators`` 0.9.0) on our samples, shape and budget: the peer drafter.

Three parts, each usable alone:

* :func:`ensure_peer_env`: a virtual environment of its own (``speculators-<hash>`` under the cache directory,
  the hash that of the pins below) with the CPU build of torch, speculators and the packages its trainer
  imports. speculators declares torchvision and torchaudio, which its training never imports (and whose wheels
  here are CUDA builds), so it and its own connector package are installed without dependencies and the rest by
  name. A stamp file written last marks a finished install; a lock file keeps concurrent first uses apart.
* :func:`prepare`: our tokenized samples (the ``tokenize`` stage: token ids and loss mask per sample, the first
  ``max_length`` tokens of each sample our trainer trains on) and the learnable target's hidden states at the
  layers our drafter reads (its ``target_layer_ids`` i: Hugging Face ``hidden_states[i + 1]``, which the peer
  and vLLM's speculators loader call auxiliary layer i + 1), with its last layer's output before the final norm
  (the peer derives its labels from it), written for ``peer_train.py``.
* :func:`train_peer`: ``peer_train.py`` in that environment: the peer's own model, sampler, trainer, loss and
  checkpoint; its last checkpoint is the export vLLM serves.

:data:`UNMATCHED` lists what of our base recipe the peer's trainer cannot take as we do.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from dfp_dev import cached_env
from dfp_shared.models.tokenizer_assets import default_cache_dir

PEER = "speculators==0.9.0"
TORCH = "torch==2.13.0"  # the CPU build of the machine's index, installed first so nothing pulls another
NO_DEPS = (PEER, "hs-connectors==0.9.0")  # their declared torchvision / torchaudio are never imported in training
DEPENDENCIES = ("transformers==5.19.0", "datasets==5.1.0", "loguru==0.7.3", "numpy<=2.5.4", "pydantic",
                "pydantic-settings", "safetensors", "tqdm<=4.70.1", "rich", "openai>=2.0.0", "httpx", "aiohttp",
                "click", "typer", "psutil", "protobuf", "huggingface-hub", "packaging")
HERE = Path(__file__).resolve().parent

# what of the base recipe the peer cannot take as ours does (read from speculators 0.9.0's code); all else matches:
# samples, draft layers, block size, target layers, mask token, draft vocabulary size, steps, tokens a step,
# anchors a step, AdamW at lr 3e-3 with weight decay 0, cosine to 0 with 5 % warmup, clipping at 1.0,
# cross-entropy with exponential position decay (fixed-exp-decay, gamma 4), the LM head frozen at the target's rows
# of the draft vocabulary, the mask token's embedding the target's, float32 training
UNMATCHED = {
    "adam_betas": "torch's default (0.9, 0.999); ours (0.9, 0.95): its build_optimizers passes no betas",
    "loss_norm": "its loss divides the decayed sum by the trained positions; ours by the sum of the decay weights",
    "anchors": "a step's anchors drawn uniformly over the trained positions of its packed row (max_anchors a "
               "row, set to our mean anchors a step); ours up to 8 in each sequence",
    "anchor_positions": "any trained position whose block fits in the row (a sequence's last trained token too); "
                        "ours need the next token trained",
    "batching": "whole samples packed into one row of at most total_seq_len (1,024) tokens, every token real (its "
                "multipack sampler); ours length-bucketed batches padded to tokens_per_batch (1,024): about 950 "
                "real tokens a step for ours, 964 for the peer",
    "labels": "the target's argmax at each position (from its last layer); ours the data's token",
    "init": "every linear N(0, 0.02) (transformers' init); ours scales o_proj and down_proj by 1/sqrt(2 layers)",
    "warmup": "linear from 0 (transformers' get_cosine_schedule_with_warmup); ours from 1/warmup",
    "draft_vocab": "its own mapping, the most frequent trained tokens (ties by id) padded with the lowest ids; "
                   "ours its own choice of the same size (both hold every trained token of this target)",
    "export_dtype": "its checkpoint is bfloat16 (its checkpointer's save); ours float32",
    "attention": "sdpa over its dense mask on the CPU (flex attention with a compiled block mask on a GPU)",
    "loss_implementation": "eager (its fused losses need Triton)",
    "validation": "none: every sample trains (its loaders always hold a share out)",
    "sliding_window_non_causal": "set true: its full-attention layers attend both ways in training whatever the "
                                 "flag, but vLLM 0.32 reads the flag's default as causal attention for every layer",
}


class PeerInstallError(cached_env.EnvInstallError):
    """The peer environment could not be created; the message names the step and the log."""


def pins_hash() -> str:
    key = "\n".join([TORCH, *(f"nodeps:{p}" for p in NO_DEPS), *DEPENDENCIES,
                     f"py{sys.version_info[0]}.{sys.version_info[1]}"])
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def env_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"speculators-{pins_hash()}"


def env_python(cache_dir: str | os.PathLike | None = None) -> Path | None:
    return cached_env.ready_python(env_dir(cache_dir))


def ensure_peer_env(cache_dir: str | os.PathLike | None = None, echo=print) -> Path:
    """The interpreter of the peer environment, installing it first when missing (about two minutes)."""
    def install(python: Path, run) -> None:
        pip = [str(python), "-m", "pip", "install", "--no-input"]
        run([*pip, TORCH], f"installing {TORCH}")
        run([*pip, *DEPENDENCIES], "installing the trainer's imports")
        run([*pip, "--no-deps", *NO_DEPS], f"installing {', '.join(NO_DEPS)} without dependencies")
        run([str(python), "-c", "import speculators.train.trainer, speculators.models.dflash, torch; "
             "print(torch.__version__)"], "importing speculators")

    return cached_env.ensure(env_dir(cache_dir), install, "\n".join([TORCH, *NO_DEPS, *DEPENDENCIES]),
                             what=f"{PEER} and a CPU torch", echo=echo, error=PeerInstallError)


def select_samples(input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor, keep: torch.Tensor,
                   max_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The samples ``keep`` (indices) as our trainer reads them, each cut to its first ``max_length`` tokens:
    flat ids (int64), flat loss mask (uint8) and the (S + 1,) offsets of the result."""
    starts = offsets[:-1][keep]
    lengths = (offsets[1:] - offsets[:-1])[keep].clamp(max=max_length)
    index = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(starts, lengths)]) if keep.numel() \
        else torch.zeros(0, dtype=torch.int64)
    out_offsets = torch.zeros(keep.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=out_offsets[1:])
    return input_ids[index].to(torch.int64), loss_mask[index].to(torch.uint8), out_offsets


def anchors_a_step(ids_mask_offsets: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batches: list[torch.Tensor],
                   max_anchors: int) -> float:
    """Our anchors a step: in each sequence of a batch up to ``max_anchors`` of its positions whose token and next
    token are both trained (:func:`dfp_trainer.drafter.objective.sample_anchors`), averaged over ``batches``."""
    _, mask, offsets = ids_mask_offsets
    ok = torch.zeros(mask.numel(), dtype=torch.int64)
    ok[:-1] = (mask[:-1].bool() & mask[1:].bool()).to(torch.int64)
    csum = torch.zeros(ok.numel() + 1, dtype=torch.int64)
    torch.cumsum(ok, 0, out=csum[1:])
    per_sample = (csum[(offsets[1:] - 1).clamp(min=0)] - csum[offsets[:-1]]).clamp(max=max_anchors)
    return float(sum(int(per_sample[b].sum()) for b in batches) / max(1, len(batches)))


def peer_layer_ids(target_layer_ids: list[int]) -> list[int]:
    """The peer's (and vLLM's speculators loader's) auxiliary layer ids for our ``target_layer_ids``: i + 1."""
    return [int(i) + 1 for i in target_layer_ids]


def target_states(model_dir: Path, ids: torch.Tensor, offsets: torch.Tensor, layer_ids: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the target's outputs of ``layer_ids`` side by side (N, K*H) and its last layer's output before
    the final norm (N, H), float32, one sample a forward."""
    from dfp_shared.hidden_states.forward import decoder_of
    from dfp_shared.models.loading import load_causal_lm

    model = load_causal_lm(str(model_dir), device="cpu", dtype="float32")
    layers = decoder_of(model).layers
    wanted = sorted(set(layer_ids) | {len(layers) - 1})
    captured: dict[int, torch.Tensor] = {}
    hooks = [layers[i].register_forward_hook(
        lambda _m, _a, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in wanted]
    aux, last = [], []
    try:
        with torch.inference_mode():
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
                decoder_of(model)(input_ids=ids[a:b][None], use_cache=False)
                aux.append(torch.cat([captured[i][0] for i in layer_ids], dim=-1).float())
                last.append(captured[len(layers) - 1][0].float())
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(aux), torch.cat(last)


def prepare(model_dir: Path, dataset_dir: Path, ours: dict, settings: dict, out: Path) -> dict:
    """Write ``samples.safetensors`` and ``settings.json`` for ``peer_train.py`` under ``out``.

    ``ours``: our drafter's shape (``target_layer_ids``, ``mask_token_id``, ``block_size``, ``num_layers``,
    ``draft_vocab_size``) and recipe (``max_length``, ``tokens_per_batch``, ``max_anchors``, ``seed``, ``steps``);
    ``settings``: the peer's own (``lr``, ``warmup_ratio``, ``weight_decay``, ``gamma``, ``seed``, ...)."""
    from dfp_shared.records.token_shards import load_dataset
    from dfp_trainer.components.data.dataset import BatchSampler, trainable_samples
    from safetensors.torch import save_file

    ds = load_dataset(f"file://{dataset_dir}")
    keep = torch.nonzero(trainable_samples(ds)).flatten()
    flat = select_samples(ds.input_ids, ds.loss_mask, ds.offsets, keep, ours["max_length"])
    # our trainer's batches over the budget (its sampler, over the kept samples, re-indexed into them)
    lengths = torch.zeros(ds.num_samples, dtype=torch.int64)
    lengths[keep] = ds.lengths[keep].clamp(max=ours["max_length"])
    where = torch.full((ds.num_samples,), -1, dtype=torch.int64)
    where[keep] = torch.arange(keep.numel())
    sampler, batches = BatchSampler(lengths, ours["tokens_per_batch"], seed=ours["seed"]), []
    for idx, _ in sampler:
        batches.append(where[idx])
        if len(batches) == ours["steps"]:
            break
    anchors = anchors_a_step(flat, batches, ours["max_anchors"])
    aux, last = target_states(model_dir, flat[0], flat[2], ours["target_layer_ids"])
    out.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": flat[0], "loss_mask": flat[1], "offsets": flat[2], "aux": aux.contiguous(),
               "last": last.contiguous()}, str(out / "samples.safetensors"))
    full = {"target": str(model_dir), "num_layers": ours["num_layers"], "block_size": ours["block_size"],
            "aux_layer_ids": peer_layer_ids(ours["target_layer_ids"]), "mask_token_id": ours["mask_token_id"],
            "draft_vocab_size": ours.get("draft_vocab_size"), "steps": ours["steps"],
            "max_anchors": max(1, round(anchors)), "sliding_window": 2048, **settings}
    (out / "settings.json").write_text(json.dumps(full, indent=1))
    sizes = flat[2][1:] - flat[2][:-1]
    return {"samples": int(keep.numel()), "tokens": int(flat[0].numel()), "trained_tokens": int(flat[1].sum()),
            "our_anchors_a_step": round(anchors, 1),
            "our_samples_a_step": round(sum(b.numel() for b in batches) / max(1, len(batches)), 2),
            "our_tokens_a_step": round(sum(int(sizes[b].sum()) for b in batches) / max(1, len(batches)), 1), **full}


def train_peer(python: Path, data_dir: Path, out: Path, log_path: Path) -> dict:
    """Run ``peer_train.py`` in the peer environment; its figures (``figures.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "DISABLE_TQDM": "1"})
    with open(log_path, "wb") as log:
        code = subprocess.call([str(python), str(HERE / "peer_train.py"), str(data_dir), str(out)], stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=str(out))
    if code:
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"peer training failed (exit {code}); log {log_path}:\n" + "\n".join(tail))
    return json.loads((out / "figures.json").read_text())
