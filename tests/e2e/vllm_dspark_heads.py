"""Run with the vLLM environment's Python (never the project's): vLLM's own Qwen3 DSpark heads and sequential
drafting, in-process on the CPU, over an exported DSpark drafter.

``python vllm_dspark_heads.py IN.safetensors DRAFTER_DIR OUT.json``: IN holds ``hidden`` (m, n, H), the backbone's
final hidden states of the n draft positions of m blocks, ``anchor`` (m,), each block's anchor (a target id),
and ``target_lm_head`` (V, H), the target's LM head (vLLM shares it when the drafter has none of its own).
vLLM's ``Qwen3DSparkForCausalLM.load_weights`` loads the drafter's head tensors (its own name mapping: ``model.``
prefix, ``d2t`` to ``draft_id_to_target_id``, ``t2d`` skipped), and ``DSparkSpeculator._sample_sequential`` drafts
greedily (its Markov loop from the anchor, draft ids mapped to target ids, the confidence head). OUT: the drafted
target ids (m, n), the confidences (m, n), and the names vLLM loaded.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
import types

import torch
from safetensors.torch import load_file
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen3_dspark import (
    DSparkConfidenceHead,
    DSparkMarkovHead,
    Qwen3DSparkForCausalLM,
)
from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

HEAD_NAMES = ("markov_head.", "confidence_head.", "lm_head.", "d2t", "t2d")


def heads_model(config: dict, target_lm_head: torch.Tensor) -> Qwen3DSparkForCausalLM:
    """vLLM's DSpark model class with its heads built as its constructor builds them, without the backbone
    (the DFlash backbone vLLM serves is the DFlash drafter's)."""
    vocab, hidden = target_lm_head.shape
    draft_rows = config.get("draft_vocab_size") or config["vocab_size"]
    model = Qwen3DSparkForCausalLM.__new__(Qwen3DSparkForCausalLM)
    nn.Module.__init__(model)
    model.config = types.SimpleNamespace(vocab_size=config["vocab_size"], draft_vocab_size=draft_rows)
    model.target_vocab_size = vocab
    inner = nn.Module()
    inner.markov_head = DSparkMarkovHead(config["vocab_size"], draft_rows, config["markov_rank"],
                                         prefix="model.markov_head")
    inner.confidence_head = (DSparkConfidenceHead(hidden, prefix="model.confidence_head", bias=True,
                                                  with_markov=config.get("confidence_head_with_markov", False))
                             if config.get("enable_confidence_head") else None)
    inner._build_fused_kv_buffers = lambda: None  # the backbone's, absent here
    model.model = inner
    model.lm_head = ParallelLMHead(draft_rows, hidden, prefix="lm_head")
    model.logits_processor = LogitsProcessor(draft_rows, scale=1.0)
    model.draft_id_to_target_id = (nn.Parameter(torch.zeros(draft_rows, dtype=torch.long), requires_grad=False)
                                   if draft_rows < vocab else None)
    return model


def main(inputs: str, drafter_dir: str, out: str) -> None:
    config = json.loads(open(f"{drafter_dir}/config.json").read())
    data = load_file(inputs)
    weights = load_file(f"{drafter_dir}/model.safetensors")
    heads = {name: t for name, t in weights.items() if name.startswith(HEAD_NAMES)}
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="file://" + tempfile.mktemp())
        initialize_model_parallel(1, 1)
        model = heads_model(config, data["target_lm_head"])
        if "lm_head.weight" not in heads:  # a full-vocabulary drafter drafts with the target's head, as vLLM shares it
            model.lm_head.weight_loader(model.lm_head.weight, data["target_lm_head"])
        model.load_weights(heads.items())
        for module in model.modules():
            quant = getattr(module, "quant_method", None)
            if quant is not None:
                quant.process_weights_after_loading(module)
    hidden, anchor = data["hidden"], data["anchor"].long()
    m, n = hidden.shape[:2]  # requests (one block each) ordered (request, step), as the speculator's buffers
    spec = types.SimpleNamespace(
        _draft_topk=None, num_speculative_steps=n, model=model, sample_indices=torch.arange(m * n),
        sample_idx_mapping=torch.arange(m).repeat_interleave(n), sample_pos=torch.arange(n).repeat(m),
        use_confidence_head=model.model.confidence_head is not None, draft_logits=None, acceptance_estimator=None,
        input_buffers=types.SimpleNamespace(input_ids=anchor), _anchor_idx=torch.arange(m),
        _step_cols=torch.arange(n), draft_tokens=torch.zeros(m, n, dtype=torch.long),
        draft_token_confidence_probs=torch.zeros(m, n))
    spec._sample_logits = functools.partial(DSparkSpeculator._sample_logits, spec)
    spec._maybe_predict_acceptance = functools.partial(DSparkSpeculator._maybe_predict_acceptance, spec)
    with torch.inference_mode():
        DSparkSpeculator._sample_sequential(spec, m, hidden.flatten(0, 1).to(torch.float32))
    result = {"drafts": spec.draft_tokens.tolist(), "loaded": sorted(heads),
              "confidence": spec.draft_token_confidence_probs.tolist() if spec.use_confidence_head else None}
    open(out, "w").write(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])
