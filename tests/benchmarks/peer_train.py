"""Trains vLLM speculators' DFlash drafter (0.9.0) on prepared samples; run by the peer environment's interpreter.

``python peer_train.py DATA_DIR OUT_DIR``. ``DATA_DIR`` (written by :mod:`peer_speculators`) holds
``samples.safetensors`` (flat ``input_ids``, ``loss_mask``, ``offsets``, and per token the target's ``aux``
layers side by side and its ``last`` layer before the final norm) and ``settings.json``. The peer's own pieces
do the work: its draft-layer config from the target (:func:`create_transformer_layer_config`), its vocabulary
mapping from the trained tokens' frequencies, ``DFlashDraftModel.from_training_args``, its packing sampler and
collate function, its ``Trainer`` (AdamW, scheduler, clipping, loss) and its checkpointer, whose last
checkpoint is the export served by vLLM. What changes for this machine, at run time only:

* the device is the CPU (its trainer moves batches to ``local_rank``, an accelerator index);
* attention is ``sdpa`` over the dense boolean mask of its own mask function (its default, flex attention
  with a compiled block mask, needs a GPU), and the loss is its ``eager`` implementation (the fused one
  needs Triton);
* hidden states and training are float32 (its autocast dtype is bfloat16 on a GPU);
* no validation split (its loaders always hold one out; here every sample trains, as ours does), and the
  epochs run until the step budget, not a fixed epoch count.

Writes ``OUT_DIR/figures.json`` (steps, tokens/s, losses, accuracies) and ``OUT_DIR/export`` (the checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch


def patch_for_cpu() -> None:
    """Point the peer's trainer at the CPU and let its step timer run without an accelerator."""
    import speculators.train.trainer as trainer_mod

    trainer_mod.get_local_rank = lambda: "cpu"
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda *args, **kwargs: None


class Samples:
    """The prepared samples as the peer's dataset returns them: per sample ``hidden_states`` (the auxiliary layers
    side by side), ``input_ids``, ``verifier_last_hidden_states`` and ``loss_mask``."""

    def __init__(self, path: Path):
        from safetensors.torch import load_file

        t = load_file(str(path))
        self.ids, self.mask, self.offsets = t["input_ids"], t["loss_mask"], t["offsets"]
        self.aux, self.last = t["aux"], t["last"]

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def sample(self, i: int) -> dict:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {"hidden_states": self.aux[a:b], "input_ids": self.ids[a:b].long(),
                "verifier_last_hidden_states": self.last[a:b], "loss_mask": self.mask[a:b].long()}


def make_dataset(samples: Samples, max_len: int):
    from speculators.train.data import BaseDataset

    class PreparedDataset(BaseDataset):
        def _compute_approx_lengths(self):
            return (samples.offsets[1:] - samples.offsets[:-1]).tolist()

        def _get_raw_data(self, index: int):
            return samples.sample(index)

        def __len__(self) -> int:
            return len(samples)

    return PreparedDataset(max_len, hidden_states_dtype=torch.float32)


class MetricsTap(logging.Handler):
    """Collects the dicts the peer's trainer logs to ``speculators.metrics`` once a step."""

    def __init__(self):
        super().__init__()
        self.rows: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.rows.append(record.msg)


def build_model(s: dict, token_freq: dict[int, int]):
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    target = s["target"]
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=target, num_layers=s["num_layers"], draft_arch="qwen3", hidden_act=None,
        sliding_window=s["sliding_window"], full_attention_indices=list(range(s["num_layers"])))
    t2d = d2t = None
    draft_vocab = layer_config.vocab_size
    if s["draft_vocab_size"]:
        d2t, t2d = build_vocab_mappings_from_distribution(token_freq, s["draft_vocab_size"], layer_config.vocab_size)
        draft_vocab = s["draft_vocab_size"]
    return DFlashDraftModel.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=target,
        target_layer_ids=s["aux_layer_ids"], draft_attn_impl="sdpa", block_size=s["block_size"],
        draft_vocab_size=draft_vocab, mask_token_id=s["mask_token_id"],
        sliding_window_non_causal=s.get("sliding_window_non_causal", True))


def main(data_dir: Path, out: Path) -> None:
    s = json.loads((data_dir / "settings.json").read_text())
    torch.set_num_threads(int(s.get("threads") or os.cpu_count() or 1))
    patch_for_cpu()
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import Trainer, TrainerConfig

    seed = int(s["seed"])
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 - as the peer's set_seed
    torch.manual_seed(seed)
    samples = Samples(data_dir / "samples.safetensors")
    trained = samples.ids[samples.mask.bool()]
    ids, counts = trained.unique(return_counts=True)
    token_freq = dict(zip(ids.tolist(), counts.tolist()))  # as its save_token_frequency_distribution counts
    model = build_model(s, token_freq)
    loader = _setup_dataloader(make_dataset(samples, s["total_seq_len"]), s["total_seq_len"],
                               model.config.transformer_layer_config.hidden_size, num_workers=0,
                               num_target_layers=len(s["aux_layer_ids"]), prefetch_factor=None, seed=seed)
    train_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(
        loss_fn="ce", loss_implementation="eager", dflash_decay_gamma=s["gamma"], max_anchors=s["max_anchors"],
        per_position_loss_weight="fixed-exp-decay")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    config = TrainerConfig(
        lr=s["lr"], num_epochs=1 + s["steps"] // max(1, len(loader)), save_path=str(out / "checkpoints"),
        train_call_kwargs=train_kwargs, val_call_kwargs=train_kwargs, optimizer=s.get("optimizer", "adamw"),
        # its Muon as ours runs torch's: the same rate, no decoupled decay, torch's own rate adjustment
        muon_lr=s.get("muon_lr", 0.02), muon_weight_decay=s["weight_decay"], muon_adjust_lr_fn="original",
        weight_decay=s["weight_decay"], scheduler_type="cosine", scheduler_warmup_ratio=s["warmup_ratio"],
        checkpoint_freq=1, hidden_states_dtype=torch.float32, log_freq=1, max_steps=s["steps"])
    tap = MetricsTap()
    logging.getLogger("speculators.metrics").addHandler(tap)
    logging.getLogger("speculators.metrics").setLevel(logging.INFO)
    trainer = Trainer(model, config, loader, None)
    began, epoch = time.perf_counter(), 0
    while trainer.global_step < s["steps"]:  # whole epochs until the budget; its loop stops at max_steps
        trainer.train_epoch(epoch)
        epoch += 1
    seconds = time.perf_counter() - began
    trainer.maybe_save_checkpoint(epoch - 1)
    export = out / "export"
    shutil.rmtree(export, ignore_errors=True)
    shutil.copytree(out / "checkpoints" / str(epoch - 1), export)
    (export / "optimizer_state_dict.pt").unlink(missing_ok=True)
    (out / "figures.json").write_text(json.dumps(summarise(tap.rows, seconds, epoch, len(loader), model), indent=1))


def summarise(rows: list[dict], seconds: float, epochs: int, batches_per_epoch: int, model) -> dict:
    def mean(key: str, last: int = 50) -> float | None:
        vals = [r["train"][key] for r in rows[-last:] if key in r["train"]]
        return round(sum(vals) / len(vals), 4) if vals else None

    tokens = sum(r["profile"]["tokens_per_s"] * r["profile"]["step_ms"] / 1000 for r in rows if r.get("profile"))
    step_s = sum(r["profile"]["step_ms"] for r in rows if r.get("profile")) / 1000
    block = model.block_size
    rates = [r["profile"]["tokens_per_s"] for r in rows if r.get("profile")]
    # the mean of the steps' rates, as our trainer's report counts its tokens/s; and the whole loop's
    return {"steps": len(rows), "epochs": epochs, "batches_per_epoch": batches_per_epoch,
            "train_tokens": round(tokens), "train_seconds": round(seconds, 1),
            "train_tokens_per_s": round(sum(rates) / len(rates), 1) if rates else None,
            "wall_tokens_per_s": round(tokens / seconds, 1) if seconds else None,
            "step_tokens_per_s": round(tokens / step_s, 1) if step_s else None,
            "first_loss": round(rows[0]["train"]["loss"], 4) if rows else None, "last50_loss": mean("loss"),
            "last50_full_acc": mean("full_acc"), "last50_eal": mean("eal"),
            "last50_position_acc": [mean(f"position_{p}_acc") for p in range(1, block)],
            "lr_trace": [rows[i]["lr"] for i in (0, len(rows) // 20, len(rows) // 2, len(rows) - 1)] if rows else [],
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "torch": torch.__version__}


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
