"""A DSpark drafter trained by the project, against the real vLLM (the CPU build the serving check installs).

That build cannot serve DSpark: its V1 model runner refuses the method (``Value error, Model Runner V1 does not
support: dspark speculative decoding``) and the V2 runner, the only one that drafts DSpark, does not start on the
CPU (``Value error, Model Runner V2 requires Triton.``; the build's Triton has no CPU backend). The serving check
shows that error. So the export is proven against vLLM's own DSpark code run in-process on the CPU
(:mod:`tests.e2e.vllm_dspark_heads`, with the vLLM environment's Python): ``Qwen3DSparkForCausalLM.load_weights``
loads the drafter's heads and ``DSparkSpeculator._sample_sequential`` drafts from the backbone's hidden states of
every block the project's decoder drafted while decoding the held-out prompts; its drafts must be the project's,
token for token. The backbone is the DFlash one (``Qwen3DSparkModel`` subclasses vLLM's DFlash model), which
``test_vllm_serve`` serves and checks for the DFlash drafter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dfp_dev.serving.check import drafter_method, load_prompts
from dfp_shared.models.stop_tokens import stop_token_ids
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.target_parts import load_target_parts
from dfp_trainer.evaluate.decode import chat_prompt_ids, speculative_decode
from dfp_trainer.export.zlab import export_drafter
from safetensors.torch import save_file

from tests.e2e.test_vllm_serve import _train_drafter
from tests.trainer.train_support import ROOT, subprocess_env, torch_threads

pytestmark = pytest.mark.timeout(1800)  # may be the first to install vLLM's environment
HEADS_SCRIPT = Path(__file__).with_name("vllm_dspark_heads.py")


@pytest.fixture(scope="module")
def dspark_drafter(tmp_path_factory, servable_target, servable_dataset):
    return _train_drafter(tmp_path_factory.mktemp("dspark-drafter"), servable_target, servable_dataset, family="dspark",
                          markov_rank=16)


@pytest.fixture(scope="module")
def pruned_dspark_drafter(tmp_path_factory, servable_target, servable_dataset):
    return _train_drafter(tmp_path_factory.mktemp("dspark-pruned"), servable_target, servable_dataset, family="dspark",
                          markov_rank=16, draft_vocab_size=512)


def _recorded_blocks(target_dir: Path, drafter_dir: Path, prompts: int = 4):
    """The project's decoder on held-out prompts (thinking off), recording each block it drafted: the backbone's
    hidden states of its draft positions, its anchor, and what the drafter drafted there."""
    from dfp_shared.models.loading import load_causal_lm

    parts = load_target_parts(target_dir)
    drafter = load_exported(drafter_dir, parts.embed_tokens, parts.lm_head).eval()
    target = load_causal_lm(str(target_dir), device="cpu")
    tok = load_tokenizer(target_dir)
    hidden, anchors, drafts, accepted = [], [], [], [0, 0]
    draft = drafter.draft

    def recording(h, anchor):
        out = draft(h, anchor)
        hidden.append(h.clone())
        anchors.append(anchor.reshape(1).clone())
        drafts.append(out.clone())
        return out

    drafter.draft = recording
    messages, _ = load_prompts(None, limit=prompts)
    with torch_threads(1):
        for m in messages:
            ids = torch.tensor(chat_prompt_ids(tok, m, enable_thinking=False))
            out = speculative_decode(drafter, target, ids, max_new_tokens=24, stop_token_ids=stop_token_ids(tok),
                                     whole_blocks=True)
            accepted = [accepted[0] + sum(out["accepted"]), accepted[1] + len(out["accepted"])]
    print(f"project's decoder: {accepted[0]} drafts accepted in {accepted[1]} blocks")
    del drafter.draft
    full = [i for i, h in enumerate(hidden) if h.shape[0] == drafter.config.block_size - 1]
    pick = lambda xs: torch.stack([xs[i] for i in full])  # noqa: E731
    return drafter, parts, pick(hidden), torch.cat([anchors[i] for i in full]), pick(drafts)


def _vllm_drafts(vllm_python, drafter_dir: Path, parts, hidden, anchors, tmp_path) -> dict:
    inputs, out = tmp_path / "blocks.safetensors", tmp_path / "vllm.json"
    save_file({"hidden": hidden.float().contiguous(), "anchor": anchors.long().contiguous(),
               "target_lm_head": parts.lm_head.weight.detach().float().contiguous()}, str(inputs))
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(vllm_python), str(HEADS_SCRIPT), str(inputs), str(drafter_dir), str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("which", ["full", "pruned"])
def test_vllms_own_dspark_code_drafts_what_the_projects_decoder_drafts(which, request, vllm_python,
                                                                       servable_target, tmp_path):
    drafter_dir = request.getfixturevalue("dspark_drafter" if which == "full" else "pruned_dspark_drafter")
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == 16
    assert drafter_method(drafter_dir) == "dspark"
    drafter, parts, hidden, anchors, drafts = _recorded_blocks(servable_target, drafter_dir)
    assert hidden.shape[0] >= 8
    result = _vllm_drafts(vllm_python, drafter_dir, parts, hidden, anchors, tmp_path)
    assert "markov_head.markov_w2.weight" in result["loaded"] and "confidence_head.proj.weight" in result["loaded"]
    assert ("d2t" in result["loaded"]) == (which == "pruned")
    assert result["drafts"] == drafts.tolist()  # vLLM's Markov loop drafts what the project's decoder drafted
    with torch.no_grad():
        plain = drafter.to_target(drafter.logits(hidden).argmax(-1))  # the backbone's drafts without the Markov head
    print(f"{which}: {drafts.numel()} drafts in {drafts.shape[0]} blocks equal vLLM's; the trained Markov head "
          f"changed {int((plain != drafts).sum())} of them")
    with torch.no_grad():
        confidence = drafter.confidence(hidden.flatten(0, 1)).view_as(drafts)
    torch.testing.assert_close(torch.tensor(result["confidence"]), confidence, rtol=1e-4, atol=1e-5)

    # a Markov head that forces a chain from each block's anchor: vLLM and the project both follow it, so both
    # apply it left to right from the anchor (a head that were carried and not used would leave the drafts be)
    chain = [int(anchors[0])] + [int(t) for t in (drafter.to_target(torch.arange(3)) if drafter.config.pruned
                                                  else torch.tensor([11, 12, 13]))]
    rows = drafter.label_map()
    with torch.no_grad():
        head = drafter.markov_head
        head.markov_w1.weight.zero_()
        head.markov_w2.weight.zero_()
        for k, (prev, nxt) in enumerate(zip(chain, chain[1:])):
            head.markov_w1.weight[prev, k] = 100.0
            head.markov_w2.weight[nxt if rows is None else int(rows[nxt]), k] = 100.0
        forced = torch.stack([drafter.draft(h, a) for h, a in zip(hidden, anchors)])
    forced_dir = export_drafter(drafter, tmp_path / "forced")
    result = _vllm_drafts(vllm_python, forced_dir, parts, hidden, anchors, tmp_path)
    assert forced[0].tolist() == chain[1:] and not torch.equal(forced, drafts)
    assert result["drafts"] == forced.tolist()


def serve_check_refuses(target: Path, drafter: Path, kind: str, vllm_python, work: Path) -> None:
    """serve-check starts vLLM with the ``kind`` drafter in the V2 runner, and shows why the CPU build stops."""
    cmd = [sys.executable, "-m", "dfp_cli.main", "serve-check", "--target", str(target), "--drafter",
           str(drafter), "--limit", "1", "--max-new-tokens", "8", "--vllm-python", str(vllm_python),
           "--work-dir", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=600)
    assert f"with the {kind} drafter" in proc.stdout
    assert proc.returncode == 1 and "Model Runner V2 requires Triton." in proc.stderr, proc.stderr[-2000:]


def test_serve_check_takes_a_dspark_drafter_and_shows_why_the_cpu_build_cannot_serve_it(
        servable_target, dspark_drafter, vllm_python, tmp_path):
    serve_check_refuses(servable_target, dspark_drafter, "dspark", vllm_python, tmp_path)
