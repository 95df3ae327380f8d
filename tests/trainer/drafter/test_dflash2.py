"""The DFlash2 drafter: its in-block convolutions, its objective (DFlash's plus the teacher-forced selector's),
training, the selector's walk, the spec's and config's fields and the export vLLM reads."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.families.dflash2.model import DFlash2Drafter, grouped_conv
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.objective import dflash_loss
from dfp_trainer.export.serving import serving_commands
from dfp_trainer.export.zlab import export_drafter
from safetensors import safe_open

from tests.trainer.drafter.test_dspark import _block, _chain_batch, train_on_chains
from tests.trainer.drafter_support import small_drafter

FIELDS = dict(conv_kernel_size=3, conv_group_size=8, selector_rank=4, selector_top_k=5)


def _dflash2(seed=0, **overrides) -> DFlash2Drafter:
    drafter = small_drafter(seed, **{**FIELDS, **overrides})
    assert isinstance(drafter, DFlash2Drafter)
    return drafter


def _perturb(drafter, std=0.3, seed=5):
    """Convolutions and a selector that matter (the initial ones are the identity and zero edges)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "hidden_projection" in name:
                p.add_(torch.randn(p.shape, generator=g) * std)
    return drafter


def test_the_convolution_reads_each_token_and_the_earlier_ones_of_its_own_block_only():
    g = torch.Generator().manual_seed(0)
    q, h, taps, groups, b = 10, 8, 3, 2, 4  # blocks [0..3], [4..7], [8, 9] side by side
    x, delta, base = torch.randn(q, h, generator=g), torch.randn(q, taps, groups, generator=g), torch.randn(taps, h,
                                                                                                     generator=g)
    want = torch.zeros(q, h)
    for t in range(q):
        for tap in range(taps):
            if t % b >= tap:  # the earlier token is in the same block
                coefficient = base[tap] + delta[t, tap].repeat_interleave(h // groups)  # the row's own coefficients
                want[t] += coefficient * x[t - tap]
    torch.testing.assert_close(grouped_conv(x, delta, base, b), want)
    torch.testing.assert_close(grouped_conv(x[None], delta[None], base, b)[0], want)  # batched rows alike


def test_an_untrained_dflash2_drafter_computes_what_the_dflash_drafter_does():
    plain, dflash2 = small_drafter(0), _dflash2(0)
    missing, unexpected = dflash2.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all("conv" in name or "candidate_selector" in name for name in missing)
    torch.testing.assert_close(_block(dflash2)[0], _block(plain)[0])
    hidden, anchor = _block(dflash2)
    assert torch.equal(dflash2.draft(hidden, anchor), plain.draft(hidden, anchor))  # zero edges: the LM head's argmax
    assert not torch.allclose(_block(_perturb(dflash2))[0], _block(plain)[0])  # trained convolutions matter


def test_the_loss_is_dflash_cross_entropy_plus_the_teacher_forced_selector_cross_entropy_and_trains_every_part():
    drafter = _perturb(_dflash2(1))
    rows, hidden = 12, torch.randn(12, 32, generator=torch.Generator().manual_seed(3))
    labels, prev = torch.randint(0, 99, (rows,)), torch.randint(0, 99, (rows,))
    logits = drafter.logits(hidden).float()
    values, ids = logits.topk(5)
    labels[:4] = ids[:4, 2]  # some labels among the candidates (third), the rest most likely not
    ce, correct, extra = drafter.head_loss(hidden, labels, prev)
    sel = drafter.candidate_selector
    scores = values + ((sel.predecessor_codebook[prev] * sel.hidden_projection(hidden))[:, None]
                       * sel.successor_codebook[ids]).sum(-1)
    found = (ids == labels[:, None]).any(-1)
    want = F.cross_entropy(logits, labels, reduction="none") + torch.where(
        found, F.cross_entropy(scores, (ids == labels[:, None]).float().argmax(-1), reduction="none"), 0.0)
    torch.testing.assert_close(ce, want)
    assert bool(found[:4].all()) and float(extra) == 0.0
    assert torch.equal(correct.bool(), found & (ids.gather(1, scores.argmax(-1, keepdim=True))[:, 0] == labels))

    loss, _ = dflash_loss(drafter, _chain_batch(), max_anchors=5, gamma=3.0, generator=torch.Generator().manual_seed(1))
    extras = {n: p for n, p in drafter.named_parameters() if "conv" in n or "candidate_selector" in n}
    grads = torch.autograd.grad(loss, list(extras.values()))
    assert all(bool(g.abs().sum() > 0) for g in grads), [n for n, g in zip(extras, grads) if not g.abs().sum() > 0]


def test_training_lowers_the_loss_and_moves_the_convolutions_and_the_selector():
    drafter = _dflash2(1)
    history = [(h["loss"], h["accuracy"]) for h in train_on_chains(drafter, 60)]
    print(f"DFlash2 loss {history[0][0]:.3f} -> {history[-1][0]:.3f}, accuracy {history[0][1]:.3f} -> "
          f"{history[-1][1]:.3f}")
    assert history[-1][0] < 0.6 * history[0][0] and history[-1][1] > history[0][1]
    assert drafter.candidate_selector.hidden_projection.weight.abs().max() > 0.01
    assert drafter.layers[0].mlp_conv.kernel_projection.weight.abs().max() > 0.01


def test_the_selector_walks_left_to_right_from_the_anchor():
    drafter = _dflash2(0)
    hidden, anchor = _block(drafter)  # block 4: three drafted positions after anchor 5
    ids, _ = drafter.candidates(hidden)
    chain = [int(anchor)]
    for i in range(3):  # each position's lowest candidate not yet in the chain (not its top one)
        chain.append(next(int(t) for t in reversed(ids[i].tolist()) if t not in chain))
    assert all(c != int(ids[i, 0]) for i, c in enumerate(chain[1:]))
    sel = drafter.candidate_selector
    with torch.no_grad():
        sel.predecessor_codebook.zero_()
        sel.successor_codebook.zero_()
        sel.hidden_projection.weight.zero_()
        sel.hidden_projection.weight[:, 0] = 1.0
        probe = torch.sign(sel.hidden_projection(hidden)[:, 0])  # the sign of each position's projection
        for k, (prev, nxt) in enumerate(zip(chain, chain[1:])):
            sel.predecessor_codebook[prev, k] = 1e4 * probe[k]  # an edge prev -> nxt, at position k only
            sel.successor_codebook[nxt, k] = 1.0
            sel.hidden_projection.weight[k, 0] = 1.0
    drafts = drafter.draft(hidden, anchor)
    assert drafts.tolist() == chain[1:]  # each position follows the edge out of the token drafted before it
    with torch.no_grad():
        sel.predecessor_codebook[chain[1]].zero_()  # no edge out of the first draft: the second is its top candidate
    assert drafter.draft(hidden, anchor)[:2].tolist() == [chain[1], int(ids[1, 0])]


def test_the_export_is_what_vllm_reads_for_dflash2_and_loads_back_drafting_the_same(tmp_path):
    drafter = _perturb(_dflash2(3))
    out = export_drafter(drafter, tmp_path / "drafter")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and "auto_map" not in config
    assert not (out / "modeling_dflash.py").exists()
    assert {k: config["dflash_config"][k] for k in (*FIELDS, "input_embedding_scale", "output_multiplier",
                                                    "final_logit_softcapping")} == \
        {**FIELDS, "input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": 0.0}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    groups = 32 // 8
    assert shapes["layers.1.attention_conv.base_kernel"] == (2, 3, 32)
    assert shapes["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 3 * groups, 32)
    assert shapes["candidate_selector.predecessor_codebook"] == shapes["candidate_selector.successor_codebook"] == \
        (100, 4)
    assert shapes["candidate_selector.hidden_projection.weight"] == (4, 32)
    loaded = load_exported(out, drafter.embed_tokens, drafter.target_lm_head)
    assert isinstance(loaded, DFlash2Drafter) and loaded.config == drafter.config
    assert torch.equal(loaded.draft(*_block(loaded)), drafter.draft(*_block(drafter)))
    commands = serving_commands(drafter.config, "/t", str(out))
    assert '"method": "dflash"' in commands["vllm"] and commands["vllm"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 ")
    assert set(commands) == {"vllm"}


def test_a_dflash2_config_the_project_does_not_draft_is_refused():
    good = _dflash2().config.to_config_dict()
    assert DrafterConfig.from_config_dict(good).family == "dflash2"
    dflash = good["dflash_config"]
    for change, message in [({"input_embedding_scale": 2.0}, "input_embedding_scale"),
                            ({"output_multiplier": 0.5}, "output_multiplier"),
                            ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
                            ({"selector_top_k": None}, "selector_top_k"),
                            ({"conv_group_size": 7}, "does not divide hidden_size"),
                            ({"conv_kernel_size": 9}, "conv_kernel_size must be 1..4"),
                            # 2 x 4 taps x 8 groups of 4 = 64 coefficients per token: a projection wider than H (32)
                            ({"conv_kernel_size": 4, "conv_group_size": 4}, "more than hidden_size 32")]:
        with pytest.raises(ValueError, match=message):
            DrafterConfig.from_config_dict({**good, "dflash_config": {**dflash, **change}})
    # a stored config asks for no more than a train spec could: a huge block would size the convolutions
    for change, message in [({"block_size": 10**6, "conv_kernel_size": 10**6}, "block_size must be 2..64"),
                            ({"num_hidden_layers": 10**4}, "num_hidden_layers must be 1..64")]:
        with pytest.raises(ValueError, match=message):
            small_drafter(0, **{**FIELDS, **change})
    for overrides, message in [({"markov_rank": 4}, "not both"), ({"draft_vocab_size": 50}, "d2t"),
                               ({"selector_rank": None}, "needs all of")]:
        with pytest.raises(ValueError, match=message):
            small_drafter(0, **{**FIELDS, **overrides})
