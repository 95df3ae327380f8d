"""What the demo runs: one dataclass, whose fields with a ``help`` are also the demo command's flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def flag(default, help_text: str, choices: tuple[str, ...] | None = None):
    """A field that ``dflash-pipeline demo`` offers as ``--name`` with this help (and these choices)."""
    return field(default=default, metadata={"help": help_text, **({"choices": choices} if choices else {})})


TARGETS = ("tiny", "learnable", "llama")


@dataclass
class DemoConfig:
    """The defaults finish in a few minutes on 2 CPU cores."""

    out_dir: Path
    target: str = flag("tiny", "The target: `tiny`, random-initialised (built in seconds); `learnable`, a small Qwen3 "
                               "trained here on the standard library's functions (head size 32, about three minutes "
                               "the first time, then cached), whose drafter has real structure to learn; `llama`, a tiny random "
                               "Llama shaped like SmolLM2 (ChatML without thinking mode, no mask token).", TARGETS)
    prompts: int = flag(32, "Prompts from the built-in set (the learnable target's: from its 1,324 training-split "
                            "prompts; 128 or more give its drafter enough data).")  # at most its size
    max_new_tokens: int = flag(96, "Tokens generated per prompt.")  # greedy, by the tiny target
    train_steps: int = flag(150, "Drafter optimiser steps.")
    head_dim: int = flag(16, "Attention head size of the tiny target (hidden size 64): 16, 32 or 64; "
                             "vLLM's CPU build serves 32 or more (make serve-check).")
    draft_layers: int = 1  # draft decoder layers
    eval_prompts: int = 8  # held-out prompts of the acceptance-length evaluation
    hybrid_target: bool = flag(False, "A Qwen3.5-style hybrid target (linear- and full-attention layers) instead of "
                                      "Qwen3.")
    fresh: bool = flag(False, "Delete the output directory first.")
