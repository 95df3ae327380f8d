"""What the demo runs: one dataclass, whose fields with a ``help`` are also the demo command's flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def flag(default, help_text: str, choices: tuple[str, ...] | None = None):
    """A field that ``dflash-pipeline demo`` offers as ``--name`` with this help (and these choices)."""
    return field(default=default, metadata={"help": help_text, **({"choices": choices} if choices else {})})


TARGETS = ("tiny", "learnable", "llama")
LEARNABLE_TARGET_PROMPTS = 128  # of its training split: enough data for a drafter that beats n-gram speculation
RANDOM_TARGET_PROMPTS = 32  # of the 48 built-in prompts; the rest are the random targets' held-out prompts


@dataclass
class DemoConfig:
    """The defaults finish in about six minutes on 2 CPU cores (the learnable target's build included)."""

    out_dir: Path
    target: str = flag("learnable", "The target: `learnable`, a small Qwen3 trained here on the standard library's "
                                    "functions (head size 32, about two minutes the first time, then cached), whose "
                                    "drafter has real structure to learn; `tiny`, random-initialised (built in "
                                    "seconds, its completions mostly noise); `llama`, a tiny random Llama shaped like "
                                    "SmolLM2 (ChatML without thinking mode, no mask token).", TARGETS)
    prompts: int = flag(0, f"Prompts to train on: 0 for {LEARNABLE_TARGET_PROMPTS} of the learnable target's 1,324 "
                           f"training-split prompts, {RANDOM_TARGET_PROMPTS} of the random targets' 48 built-in "
                           "ones.")  # at most the set's size
    max_new_tokens: int = flag(96, "Tokens generated per prompt.")  # greedy, by the tiny target
    train_steps: int = flag(150, "Drafter optimiser steps.")
    head_dim: int = flag(16, "Attention head size of the tiny target (hidden size 64): 16, 32 or 64; "
                             "vLLM's CPU build serves 32 or more (make serve-check).")
    draft_layers: int = 1  # draft decoder layers
    eval_prompts: int = 8  # held-out prompts of the acceptance-length evaluation
    hybrid_target: bool = flag(False, "A Qwen3.5-style hybrid target (linear- and full-attention layers) instead of "
                                      "Qwen3.")
    fresh: bool = flag(False, "Delete the output directory first.")

    def prompt_count(self) -> int:
        """How many prompts the demo trains on (``prompts``, or the target's default)."""
        if self.prompts:
            return self.prompts
        return LEARNABLE_TARGET_PROMPTS if self.target == "learnable" else RANDOM_TARGET_PROMPTS
