"""The DSpark drafter: its objective (teacher-forced Markov head, confidence head), training, sequential drafting,
the spec's family fields and the export vLLM reads."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from dfp_shared.specs.train import TrainSpec
from dfp_trainer.drafter.attention import decode_masks, training_masks
from dfp_trainer.drafter.batch import Batch
from dfp_trainer.drafter.families.dspark.model import DSparkDrafter
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.objective import block_targets, dflash_loss, sample_anchors
from dfp_trainer.export.serving import serving_commands
from dfp_trainer.export.zlab import export_drafter
from pydantic import ValidationError
from safetensors import safe_open

from tests.trainer.drafter_support import one_thread, small_drafter

DRAFT_IDS = torch.tensor([2, 5, 6, 7, 11, 17, 30, 31, 40, 57, 63, 80, 98])


def _dspark(seed=0, draft_ids=None, confidence_head=True, **overrides) -> DSparkDrafter:
    drafter = small_drafter(seed, draft_ids, markov_rank=4, confidence_head=confidence_head, **overrides)
    assert isinstance(drafter, DSparkDrafter)
    return drafter


def _chain_batch(seed=0, t=24, rows=4) -> Batch:
    """Sequences where each token follows from the one before (t_{i+1} = 3 t_i + 1 mod 97): a Markov head's data."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(rows, t, dtype=torch.long)
    ids[:, 0] = torch.randint(0, 97, (rows,), generator=g)
    for i in range(1, t):
        ids[:, i] = (3 * ids[:, i - 1] + 1) % 97
    loss_mask = torch.ones(rows, t)
    loss_mask[:, :2] = 0
    return Batch(ids, loss_mask, torch.full((rows,), t), target_hidden=torch.randn(rows, t, 64, generator=g))


def test_the_loss_is_the_teacher_forced_markov_cross_entropy_plus_the_weighted_confidence_bce():
    drafter = _dspark()
    batch = _chain_batch()
    gen = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    loss, metrics = dflash_loss(drafter, batch, max_anchors=5, gamma=3.0, generator=gen(), logits_chunk=7,
                                confidence_weight=0.5)
    ids, b, cfg = batch.input_ids, drafter.config.block_size, drafter.config
    anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, 5, gen())
    labels, weights = block_targets(ids, batch.loss_mask, batch.lengths, anchors, valid, b, 3.0)
    s, n = anchors.shape
    block = torch.full((s, n, b), cfg.mask_token_id)
    block[:, :, 0] = torch.gather(ids, 1, anchors)
    pos = anchors[:, :, None] + torch.arange(b)
    masks = training_masks(anchors, b, ids.shape[1], cfg.layer_types, cfg.sliding_window, "sdpa")
    hidden = drafter(block.view(s, -1), pos.view(s, -1), batch.target_hidden, torch.arange(ids.shape[1]), masks)
    prev = torch.gather(ids, 1, (pos - 1).clamp(min=0).view(s, -1))  # the true token before each position
    logits = drafter.logits(hidden) + drafter.markov_head(prev)
    ce = F.cross_entropy(logits.reshape(-1, 100), labels.reshape(-1), reduction="none")
    w = weights.reshape(-1)
    rows = w > 0
    right = (logits.reshape(-1, 100).argmax(-1) == labels.reshape(-1)).float()
    conf = drafter.confidence_head(hidden.reshape(-1, 32))
    bce = F.binary_cross_entropy_with_logits(conf[rows], right[rows])
    torch.testing.assert_close(loss, (ce * w).sum() / w.sum() + 0.5 * bce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(metrics["confidence_bce"]), bce.detach(), rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(loss, [drafter.markov_head.markov_w2.weight, drafter.confidence_head.proj.weight])
    assert all(bool(g.abs().sum() > 0) for g in grads)  # both heads are trained


def train_on_chains(drafter, steps: int, **loss_fields) -> list[dict]:
    """``steps`` AdamW steps of the objective on :func:`_chain_batch` (one thread); each step's loss and metrics."""
    with one_thread():
        batch = _chain_batch(2)
        optim = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-2)
        history = []
        for step in range(steps):
            loss, metrics = dflash_loss(drafter, batch, max_anchors=8, gamma=4.0,
                                        generator=torch.Generator().manual_seed(step), **loss_fields)
            optim.zero_grad()
            loss.backward()
            optim.step()
            history.append({**metrics, "loss": float(loss.detach())})
    return history


def test_training_lowers_the_loss_and_the_confidence_head_learns():
    drafter = _dspark(1)
    history = [(h["loss"], h["confidence_bce"], h["accuracy"]) for h in train_on_chains(drafter, 80,
                                                                                      confidence_weight=1.0)]
    first, last = history[0], history[-1]
    assert last[0] < 0.6 * first[0] and last[2] > first[2]
    assert last[1] < first[1] == pytest.approx(math.log(2))  # the confidence head moved off its even guess
    assert drafter.markov_head.markov_w2.weight.abs().max() > 0.05  # the Markov head moved from its init


def _block(drafter, seed=7):
    cfg = drafter.config
    g = torch.Generator().manual_seed(seed)
    anchor, ctx = 9, torch.arange(9)
    block = torch.full((1, cfg.block_size), cfg.mask_token_id)
    block[0, 0] = 5
    feats, pos = torch.randn(1, 9, 64, generator=g), (anchor + torch.arange(cfg.block_size))[None]
    with torch.no_grad():
        hidden = drafter(block, pos, feats, ctx, decode_masks(anchor, ctx, cfg.block_size, cfg.layer_types,
                                                                    cfg.sliding_window))
    return hidden[0, 1:], block[0, 0]


@pytest.mark.parametrize("draft_ids", [None, DRAFT_IDS])
def test_the_markov_head_drafts_left_to_right_from_the_anchor_and_changes_the_drafts(draft_ids):
    drafter = _dspark(0, draft_ids)
    hidden, anchor = _block(drafter)
    plain = drafter.to_target(drafter.logits(hidden).argmax(-1))  # what the backbone alone drafts
    with torch.no_grad():
        head = drafter.markov_head
        head.markov_w2.weight.zero_()
        assert torch.equal(drafter.draft(hidden, anchor), plain)  # a zero bias: DFlash's drafts
        # a chain the bias forces: anchor 5 -> 7 -> 11 -> 17 (draft rows of those tokens)
        rows = (lambda t: int(t) if draft_ids is None else int((draft_ids == t).nonzero()))
        head.markov_w1.weight.zero_()
        for k, (prev, nxt) in enumerate([(5, 7), (7, 11), (11, 17)]):
            head.markov_w1.weight[prev, k] = 100.0
            head.markov_w2.weight[rows(nxt), k] = 100.0
        drafts = drafter.draft(hidden, anchor)
    assert drafts.tolist() == [7, 11, 17] and not torch.equal(drafts, plain)
    # the bias at position 2 comes from the token drafted at position 1, not from the backbone's own argmax
    with torch.no_grad():
        head.markov_w1.weight[7].zero_()
        assert drafter.draft(hidden, anchor)[1].item() == plain[1].item()


@pytest.mark.parametrize("draft_ids", [None, DRAFT_IDS])
def test_the_export_is_what_vllm_reads_for_dspark_and_loads_back_drafting_the_same(tmp_path, draft_ids):
    drafter = _dspark(3, draft_ids)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0, 3.0)  # a head that matters
    out = export_drafter(drafter, tmp_path / "drafter")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert (config["markov_rank"], config["enable_confidence_head"], config["confidence_head_with_markov"],
            config["sample_from_anchor"]) == (4, True, False, False)
    assert config["dflash_config"]["mask_token_id"] == 99 and config["dflash_config"]["target_layer_ids"] == [1, 4]
    assert "auto_map" not in config and not (out / "modeling_dflash.py").exists()
    rows = 100 if draft_ids is None else 13
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes["markov_head.markov_w1.weight"] == (100, 4)  # indexed by target ids
    assert shapes["markov_head.markov_w2.weight"] == (rows, 4)  # a bias over the draft vocabulary
    assert shapes["confidence_head.proj.weight"] == (1, 32) and shapes["confidence_head.proj.bias"] == (1,)
    loaded = load_exported(out, drafter.embed_tokens, drafter.target_lm_head)
    assert isinstance(loaded, DSparkDrafter) and loaded.config == drafter.config
    hidden, anchor = _block(drafter)
    assert torch.equal(loaded.draft(*_block(loaded)), drafter.draft(hidden, anchor))
    commands = serving_commands(drafter.config, "/t", str(out))
    assert '"method": "dspark"' in commands["vllm"] and commands["vllm"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 ")


def test_a_dspark_drafter_without_a_confidence_head_exports_none():
    drafter = _dspark(0, confidence_head=False)
    assert drafter.confidence_head is None
    assert not any(name.startswith("confidence_head") for name in drafter.state_dict())
    loss, metrics = dflash_loss(drafter, _chain_batch(), max_anchors=4, confidence_weight=1.0)
    assert metrics["confidence_bce"] == 0.0 and torch.isfinite(loss)


def _spec(**fields):
    return TrainSpec(dataset="file:///d", target="file:///t", **fields)


def test_the_spec_family_and_its_bounded_fields():
    assert _spec().family == "dflash"
    # a normalised DFlash spec (every field at its default) validates again, as a worker re-validates it
    assert TrainSpec.model_validate(_spec().model_dump()).family == "dflash"
    spec = _spec(family="dspark", markov_rank=64, confidence_loss_weight=0.2)
    assert spec.export_layouts() == ["zlab"]
    assert TrainSpec.model_validate(spec.model_dump()) == spec  # its DFlash2 fields at their defaults: accepted
    spec = _spec(family="dflash2", conv_kernel_size=3, selector_top_k=4)
    assert spec.export_layouts() == ["zlab"] and TrainSpec.model_validate(spec.model_dump()) == spec
    for bad, message in [({"family": "dspark", "markov_rank": 0}, "markov_rank"),
                         ({"family": "dspark", "markov_rank": 4096}, "markov_rank"),
                         ({"family": "dspark", "confidence_loss_weight": -1}, "confidence_loss_weight"),
                         ({"family": "dspark", "confidence_loss_weight": 1e9}, "confidence_loss_weight"),
                         ({"markov_rank": 8}, "only `dspark` drafters"),
                         ({"family": "dspark", "exports": ["speculators"]}, "zlab layout only"),
                         ({"family": "dflash2", "conv_kernel_size": 0}, "conv_kernel_size"),
                         ({"family": "dflash2", "conv_kernel_size": 65}, "conv_kernel_size"),
                         ({"family": "dflash2", "conv_kernel_size": 20, "block_size": 16}, "more taps than a block"),
                         ({"family": "dflash2", "conv_group_size": 0}, "conv_group_size"),
                         ({"family": "dflash2", "selector_rank": 4096}, "selector_rank"),
                         ({"family": "dflash2", "selector_top_k": 0}, "selector_top_k"),
                         ({"family": "dflash2", "selector_top_k": 257}, "selector_top_k"),
                         ({"selector_rank": 8}, "only `dflash2` drafters"),
                         ({"family": "dspark", "conv_kernel_size": 2}, "only `dflash2` drafters"),
                         ({"family": "dflash2", "markov_rank": 8}, "only `dspark` drafters"),
                         ({"family": "dflash2", "draft_vocab_size": 1000}, "without mapping them to target ids"),
                         ({"family": "dflash2", "exports": ["speculators"]}, "zlab layout only"),
                         ({"family": "medusa"}, "family")]:
        with pytest.raises(ValidationError, match=message):
            _spec(**bad)


def test_a_dspark_config_json_the_project_does_not_draft_as_is_refused():
    from dfp_trainer.drafter.config import DrafterConfig

    good = _dspark().config.to_config_dict()
    assert DrafterConfig.from_config_dict(good).family == "dspark"
    for change, message in [({"sample_from_anchor": True}, "sample_from_anchor"),
                            ({"confidence_head_with_markov": True}, "confidence_head_with_markov"),
                            ({"markov_rank": None}, "markov_rank"),
                            ({"markov_rank": 1 << 20}, "markov_rank must be 1..1024")]:
        with pytest.raises(ValueError, match=message):
            DrafterConfig.from_config_dict({**good, **change})
    missing_anchor = {k: v for k, v in good.items() if k != "sample_from_anchor"}  # vLLM's default: true
    with pytest.raises(ValueError, match="sample_from_anchor"):
        DrafterConfig.from_config_dict(missing_anchor)
