"""A DFlash2 drafter trained by the project, against the real vLLM (the CPU build the serving check installs).

That build cannot serve DFlash2: its V1 model runner refuses it (``Model Runner V1 does not support: DFlash candidate-head
drafts``: V1's DFlash proposer never calls the selector) and the V2 runner, whose ``DFlash2Speculator`` drafts it,
does not start on the CPU (``Value error, Model Runner V2 requires Triton.``). The serving check shows that error.
So the export is proven against vLLM's own DFlash2 modules run in-process on the CPU
(:mod:`tests.e2e.vllm_dflash2_heads`): ``DFlash2Qwen3ForCausalLM.load_weights`` loads every layer's convolutions
and the candidate selector; on probe rows vLLM's convolutions compute what the project's do; and from the backbone's
hidden states of every block the project's decoder drafted while decoding held-out prompts, vLLM's candidates,
edge scores and walk draft what the project's decoder drafted, token for token.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from dfp_dev.serving.check import drafter_method, drafter_needs_v2_runner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.e2e.test_vllm_dspark import _recorded_blocks, serve_check_refuses
from tests.e2e.test_vllm_serve import _train_drafter
from tests.trainer.train_support import subprocess_env

pytestmark = pytest.mark.timeout(1800)  # may be the first to install vLLM's environment
HEADS_SCRIPT = Path(__file__).with_name("vllm_dflash2_heads.py")
FIELDS = dict(family="dflash2", conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4)


@pytest.fixture(scope="module")
def dflash2_drafter(tmp_path_factory, servable_target, servable_dataset):
    return _train_drafter(tmp_path_factory.mktemp("dflash2-drafter"), servable_target, servable_dataset, **FIELDS)


def _vllm_run(vllm_python, drafter_dir: Path, tensors: dict, tmp_path) -> tuple[dict, list[str]]:
    inputs, out = tmp_path / "blocks.safetensors", tmp_path / "vllm.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(inputs))
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(vllm_python), str(HEADS_SCRIPT), str(inputs), str(drafter_dir), str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with safe_open(str(out), framework="pt") as f:
        loaded = json.loads(f.metadata()["loaded"])
    return load_file(str(out)), loaded


def test_vllms_own_dflash2_modules_compute_and_draft_what_the_project_does(dflash2_drafter, vllm_python,
                                                                          servable_target, tmp_path):
    config = json.loads((dflash2_drafter / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 4
    assert drafter_method(dflash2_drafter) == "dflash" and drafter_needs_v2_runner(dflash2_drafter)
    drafter, parts, hidden, anchors, drafts = _recorded_blocks(servable_target, dflash2_drafter)
    assert hidden.shape[0] >= 8
    g = torch.Generator().manual_seed(0)
    b, width = drafter.config.block_size, drafter.config.hidden_size
    probe, probe_out = torch.randn(3 * b, width, generator=g), torch.randn(3 * b, width, generator=g)
    result, loaded = _vllm_run(vllm_python, dflash2_drafter, {
        "hidden": hidden.float(), "anchor": anchors.long(), "target_lm_head": parts.lm_head.weight.detach().float(),
        "probe": probe, "probe_out": probe_out}, tmp_path)
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.mlp_conv.base_kernel",
            "layers.0.attention_conv.kernel_projection.weight"} <= set(loaded)
    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            for name in ("attention_conv", "mlp_conv"):
                prepared, coefficients = getattr(layer, name).prepare(probe)
                torch.testing.assert_close(result[f"{i}.{name}.prepare"], prepared, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(result[f"{i}.{name}.finish"],
                                           getattr(layer, name).finish(probe_out, coefficients), rtol=1e-5, atol=1e-5)
        plain = drafter.to_target(drafter.logits(hidden).argmax(-1))  # the LM head's argmax, without the selector
    assert result["drafts"].tolist() == drafts.tolist()  # vLLM's candidates, scores and walk draft the project's
    print(f"{drafts.numel()} drafts in {drafts.shape[0]} blocks equal vLLM's; the trained selector changed "
          f"{int((plain != drafts).sum())} of them from the LM head's argmax")

    # a selector that forces a chain from each block's anchor: vLLM and the project both follow it, so both walk
    # left to right from the anchor over the candidates (a selector carried and not used would leave the drafts be)
    sel = drafter.candidate_selector
    with torch.no_grad():
        ids, _ = drafter.candidates(hidden[0])
        chain = [int(anchors[0])]
        for i in range(ids.shape[0]):
            chain.append(next(int(t) for t in reversed(ids[i].tolist()) if t not in chain))
        sel.predecessor_codebook.zero_()
        sel.successor_codebook.zero_()
        for k, (prev, nxt) in enumerate(zip(chain, chain[1:])):  # an edge prev -> nxt in rank k, read by position k
            sel.hidden_projection.weight[k] = hidden[0, k] / hidden[0, k].norm() ** 2
            sel.predecessor_codebook[prev, k] = 1e4
            sel.successor_codebook[nxt, k] = 1.0
        forced = torch.stack([drafter.draft(h, a) for h, a in zip(hidden, anchors)])
    from dfp_trainer.export.zlab import export_drafter

    forced_dir = export_drafter(drafter, tmp_path / "forced")
    result, _ = _vllm_run(vllm_python, forced_dir, {
        "hidden": hidden.float(), "anchor": anchors.long(), "target_lm_head": parts.lm_head.weight.detach().float(),
        "probe": probe, "probe_out": probe_out}, tmp_path)
    assert forced[0].tolist() == chain[1:] and not torch.equal(forced, drafts)
    assert result["drafts"].tolist() == forced.tolist()


def test_serve_check_takes_a_dflash2_drafter_and_shows_why_the_cpu_build_cannot_serve_it(
        servable_target, dflash2_drafter, vllm_python, tmp_path):
    serve_check_refuses(servable_target, dflash2_drafter, "dflash2", vllm_python, tmp_path)
