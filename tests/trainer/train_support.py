"""Helpers of the training-system tests: tiny run specs, subprocess commands, reading checkpoints."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage.store import open_store
from dfp_trainer.run_config import RunConfig
from dfp_trainer.settings import TrainerSettings
from safetensors.torch import load as st_load

ROOT = Path(__file__).resolve().parents[2]


def tiny_spec(dataset: str, target, output: str, **over) -> dict:
    """A training run small enough for two CPU cores (151k-vocab LM head, so few anchors)."""
    spec = dict(dataset=dataset, target=str(target), output=output, steps=6, tokens_per_batch=128, max_length=64,
                num_draft_layers=1, block_size=4, max_anchors=4, checkpoint_every=100, keep_checkpoints=2,
                eval_prompts=0, seed=0, warmup_ratio=0.2)
    spec.update(over)
    return spec


def run_config(spec: TrainSpec | dict, *, evaluate: bool = False, **settings) -> RunConfig:
    """The run of ``spec`` on a trainer with the default settings but ``settings`` (no evaluation unless asked)."""
    spec = spec if isinstance(spec, TrainSpec) else TrainSpec.model_validate(spec)
    return RunConfig.compose(spec, TrainerSettings(**settings), evaluate=evaluate)


def subprocess_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "services"), str(ROOT), env.get("PYTHONPATH", "")])
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DFLASH_DEVICE": "cpu", "DFLASH_LOG_JSON": "true",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "lo"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "dfp_cli.main", *args]


def final_weights(output: str, endpoint_url: str | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, trainable weights) of the latest checkpoint under ``output``."""
    store = open_store(output.rstrip("/") + "/checkpoints", endpoint_url=endpoint_url)
    latest = json.loads(store.get("latest.json"))
    return latest["step"], st_load(store.get(f"{latest['dir']}/model.safetensors"))


@contextlib.contextmanager
def torch_threads(n: int):
    """Fewer intra-op threads: on a shared 2-core machine oversubscription slows tiny models tenfold."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
