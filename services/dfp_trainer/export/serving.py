"""How to serve an exported drafter: the vLLM and SGLang command lines and a transformers snippet.

The number of speculative tokens is the block size minus one (the anchor is the verified token; the
other B-1 positions are drafted). Attention backends: the drafter's full layers are not causal, so the
engine needs a backend that serves non-causal attention (vLLM: FLASH_ATTN on GPUs, its CPU backend on
CPUs; SGLang: fa3). A drafter mixing full and sliding layers needs vLLM's V2 model runner
(``VLLM_USE_V2_MODEL_RUNNER=1``).
"""

from __future__ import annotations

import json
import shlex

from ..drafter.attention import SLIDING
from ..drafter.config import DrafterConfig
from ..drafter.family import family


def local_path(uri: str) -> str:
    """What a serving machine opens for a storage URI: the path of a ``file://`` URI, else the URI itself."""
    return uri.removeprefix("file://").rstrip("/") or "/"


def serving_commands(config: DrafterConfig, target: str, drafter: str, speculators: str | None = None) -> dict:
    """Command lines (strings) for ``target`` (model directory) served with the z-lab export at ``drafter``
    (and the speculators export, when given), and a Python snippet that loads the drafter with transformers.
    Every value is quoted for its language (``shlex.quote`` in shell lines, ``repr`` in Python), so a path
    holding quotes, ``$(`` or newlines stays one literal when the text is pasted."""
    target, drafter = local_path(target), local_path(drafter)
    n = config.block_size - 1
    mixed = len(set(config.layer_types)) > 1
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if mixed else ""
    spec = {"method": config.serving_method, "model": drafter, "num_speculative_tokens": n, "attention_backend": "FLASH_ATTN"}
    commands = {
        "vllm": f"{env}vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(spec))}",
        "sglang": " ".join(["python -m sglang.launch_server", "--model-path", shlex.quote(target),
                            "--speculative-algorithm DFLASH", "--speculative-draft-model-path", shlex.quote(drafter),
                            f"--speculative-num-draft-tokens {config.block_size}", "--attention-backend fa3"]),
        "transformers": _TRANSFORMERS_SNIPPET.format(drafter=repr(drafter), target=repr(target)),
    }
    if not family(config.family).reference_route:  # vLLM's DSpark and DFlash2: its V2 model runner only; no SGLang or AutoModel route
        del commands["sglang"], commands["transformers"]
        commands["vllm"] = "VLLM_USE_V2_MODEL_RUNNER=1 " + commands["vllm"].removeprefix(env)
    if speculators:
        commands["vllm_speculators"] = f"{env}vllm serve {shlex.quote(local_path(speculators))}"
    if SLIDING in config.layer_types:
        commands["note"] = (f"sliding layers (window {config.sliding_window}) are causal within the window in "
                            f"training, in vLLM and in SGLang; full layers attend to their whole block")
    if config.pruned:
        commands["vocab_note"] = (f"pruned draft vocabulary: {config.draft_vocab_size} of {config.vocab_size} tokens "
                                  f"(lm_head.weight and d2t in the weights; vLLM reads them, SGLang's reading of them is "
                                  f"not checked here)")
    return commands


_TRANSFORMERS_SNIPPET = """\
import torch
from transformers import AutoModel, AutoModelForCausalLM
drafter = AutoModel.from_pretrained({drafter}, trust_remote_code=True)
target = AutoModelForCausalLM.from_pretrained({target})
# one block after the context: anchor token then mask tokens, the target's layer outputs
# drafter.target_layer_ids (hidden_states[i + 1]) of the context, positions of context then block
block = torch.full((1, drafter.block_size), drafter.mask_token_id)
# block[0, 0] = anchor; features = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], -1)
# hidden = drafter(target.get_input_embeddings()(block), features, positions)
# drafts = drafter.draft_tokens(hidden, target.lm_head)[0, 1:]  # a pruned vocabulary's own head, mapped by d2t
"""
