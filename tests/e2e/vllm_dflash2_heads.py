"""Run with the vLLM environment's Python (never the project's): vLLM's own DFlash2 convolutions, candidates and
candidate selector, in-process on the CPU, over an exported DFlash2 drafter.

``python vllm_dflash2_heads.py IN.safetensors DRAFTER_DIR OUT.safetensors``: IN holds ``hidden`` (m, n, H), the
backbone's final hidden states of the n draft positions of m blocks, ``anchor`` (m,), each block's anchor,
``target_lm_head`` (V, H) (vLLM shares the target's head with a drafter that has none), and ``probe`` and
``probe_out`` (Q, H), rows of blocks of ``dflash_config.block_size`` side by side for the convolutions.

``DFlash2Qwen3ForCausalLM.load_weights`` (its own ``model.`` prefix) loads the convolutions of every layer and the
candidate selector into vLLM's ``DFlashGroupedConv`` and ``CandidateSelector`` modules; ``compute_candidates``
(the LM head's top-k through vLLM's ``LogitsProcessor.get_top_k_tokens``) and the selector's ``forward`` score
every edge as ``DFlash2Speculator._score_candidates`` does. The walk over those scores is
``_selector_walk_kernel``'s at temperature 0, transcribed here because its Triton kernel has no CPU backend in this
build: ``previous = 0``; per step, the argmax over ``scores[step, previous]``, its candidate drafted, ``previous``
its index. OUT: the drafts (m, n), each layer's ``prepare``/``finish`` outputs of both convolutions on the probe,
and the names vLLM loaded.
"""

from __future__ import annotations

import json
import sys
import tempfile
import types

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen3_dflash2 import (
    CandidateSelector,
    DFlash2Qwen3ForCausalLM,
    DFlashGroupedConv,
)

PART_NAMES = ("attention_conv.", "mlp_conv.", "candidate_selector.")


def heads_model(config: dict, target_lm_head: torch.Tensor) -> DFlash2Qwen3ForCausalLM:
    """vLLM's DFlash2 model class with its convolutions, selector and candidate head built as its constructors
    build them (``block_size`` = 1 + ``num_speculative_tokens``), without attention and MLPs (DFlash's)."""
    vocab, hidden = target_lm_head.shape
    draft = config["dflash_config"]
    model = DFlash2Qwen3ForCausalLM.__new__(DFlash2Qwen3ForCausalLM)
    nn.Module.__init__(model)
    model.config = types.SimpleNamespace(vocab_size=config["vocab_size"], draft_vocab_size=config["vocab_size"])
    model.draft_model_config = types.SimpleNamespace(model=None, revision=None)
    inner = nn.Module()
    inner.layers = nn.ModuleList()
    for i in range(config["num_hidden_layers"]):
        layer = nn.Module()
        for name in ("attention_conv", "mlp_conv"):
            setattr(layer, name, DFlashGroupedConv(
                hidden_size=hidden, taps=int(draft["conv_kernel_size"]), group_size=int(draft["conv_group_size"]),
                block_size=int(draft["block_size"]), params_dtype=torch.float32, prefix=f"model.layers.{i}.{name}"))
        inner.layers.append(layer)
    inner.candidate_selector = CandidateSelector(hidden_size=hidden, vocab_size=config["vocab_size"],
                                                 rank=int(draft["selector_rank"]), top_k=int(draft["selector_top_k"]),
                                                 params_dtype=torch.float32, prefix="model.candidate_selector")
    inner.use_aux_hidden_state, inner.has_separate_mask_embedding, inner.mask_token_id = False, False, None
    inner._build_fused_kv_buffers = lambda: None  # the backbone's, absent here
    model.model = inner
    model.lm_head = ParallelLMHead(vocab, hidden, prefix="lm_head")
    model.lm_head.weight_loader(model.lm_head.weight, target_lm_head)  # the target's head, as vLLM shares it
    softcap = float(draft.get("final_logit_softcapping") or 0.0)
    model.candidate_logits_processor = LogitsProcessor(vocab, scale=float(draft.get("output_multiplier", 1.0)),
                                                       soft_cap=softcap if softcap > 0 else None)
    model.draft_id_to_target_id = None
    return model


def walk(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """``_selector_walk_kernel`` at temperature 0: scores (m, n, k, k), candidates (m, n, k) -> drafts (m, n)."""
    m, n, _ = candidates.shape
    drafts = torch.zeros(m, n, dtype=torch.long)
    for row in range(m):
        previous = 0
        for step in range(n):
            index = int(torch.argmax(scores[row, step, previous]))
            drafts[row, step] = candidates[row, step, index]
            previous = index
    return drafts


def main(inputs: str, drafter_dir: str, out: str) -> None:
    config = json.loads(open(f"{drafter_dir}/config.json").read())
    data = load_file(inputs)
    weights = load_file(f"{drafter_dir}/model.safetensors")
    parts = {name: t for name, t in weights.items() if any(p in name for p in PART_NAMES)}
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="file://" + tempfile.mktemp())
        initialize_model_parallel(1, 1)
        model = heads_model(config, data["target_lm_head"])
        model.load_weights(parts.items())
        for module in model.modules():
            quant = getattr(module, "quant_method", None)
            if quant is not None:
                quant.process_weights_after_loading(module)
        hidden, anchor = data["hidden"].float(), data["anchor"].long()
        m, n, _ = hidden.shape
        with torch.inference_mode():
            candidates, unary = model.compute_candidates(hidden.flatten(0, 1))
            k = candidates.shape[-1]
            candidates, unary = candidates.view(m, n, k), unary.view(m, n, k)
            scores = model.model.candidate_selector(candidates, unary, hidden, anchor)  # (m, n, k, k)
            result = {"drafts": walk(scores, candidates)}
            for i, layer in enumerate(model.model.layers):
                for name in ("attention_conv", "mlp_conv"):
                    conv = getattr(layer, name)
                    prepared, coefficients = conv.prepare(data["probe"])
                    result[f"{i}.{name}.prepare"] = prepared
                    result[f"{i}.{name}.finish"] = conv.finish(data["probe_out"], coefficients)
    save_file({key: t.contiguous() for key, t in result.items()}, out,
              metadata={"loaded": json.dumps(sorted(parts))})


if __name__ == "__main__":
    main(*sys.argv[1:4])
