"""Distillation from the target's distribution: the loss equals its direct computation (alone and mixed with
the cross-entropy, every family, a pruned vocabulary), the teacher's logits are the target's own."""

from __future__ import annotations

import asyncio

import pytest
import torch
from dfp_shared.hidden_states import InProcessTarget
from dfp_shared.specs.train import TrainSpec
from dfp_trainer.drafter.batch import Batch
from dfp_trainer.drafter.distill import check_teacher_target, teacher_layer_ids, teacher_logits
from dfp_trainer.drafter.objective import block_targets, dflash_loss, sample_anchors
from dfp_trainer.drafter.target_parts import load_target_parts

from tests.trainer.drafter_support import block_hidden, one_thread, small_drafter

H, T = 32, 20
PRUNED = torch.tensor([0, 3, 5, 8, 13, 21, 34, 55, 60, 61, 62, 70, 77, 80, 90, 99])
FAMILIES = {
    "dflash": {},
    "dflash-pruned": {"draft_ids": PRUNED},
    "dspark-pruned": {"draft_ids": PRUNED, "markov_rank": 4, "confidence_head": False},
    "dflash2": {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3},
}


@pytest.fixture(autouse=True)
def single_thread():
    with one_thread():
        yield


def _drafter(family: str):
    drafter = small_drafter(0, **FAMILIES[family])
    with torch.no_grad():  # a target head far from the drafter's start: a KL well away from 0
        drafter.target_lm_head.weight.normal_(0.0, 1.0)
        if drafter.config.pruned:
            drafter.lm_head.weight.copy_(drafter.target_lm_head.weight[PRUNED])
    return drafter


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 99, (2, T), generator=g)
    loss_mask = torch.ones(2, T)
    loss_mask[:, :4] = 0
    loss_mask[0, 11] = 0
    feats = torch.randn(2, T, 2 * H, generator=g)  # the drafter's two target layers
    teacher = torch.randn(2, T, H, generator=g)  # the target's last layer, after its final norm
    return ids, loss_mask, feats, teacher, torch.tensor([T, T - 5])


def _direct(drafter, ids, loss_mask, feats, teacher, lengths, anchors, valid, gamma):
    """The cross-entropy and the distillation loss written out position by position."""
    cfg = drafter.config
    b = cfg.block_size
    labels, weights = block_targets(ids, loss_mask, lengths, anchors, valid, b, gamma)
    s, n = anchors.shape
    hidden = block_hidden(drafter, ids, feats, anchors)  # (S, N, B, H)
    draft_ids = PRUNED if cfg.pruned else torch.arange(cfg.vocab_size)
    ce_sum, kl_sum, w_sum = 0.0, 0.0, 0.0
    for i in range(s):
        for j in range(n):
            for k in range(1, b):
                a = int(anchors[i, j])
                label = int(labels[i, j, k])
                w = float(weights[i, j, k])
                if w == 0 or label not in draft_ids.tolist():
                    continue
                q_logits = drafter.logits(hidden[i, j, k]).float()
                if hasattr(drafter, "markov_head"):
                    q_logits = q_logits + drafter.markov_head(ids[i, a + k - 1])
                log_q = torch.log(torch.softmax(q_logits, -1))
                p = torch.softmax(drafter.target_lm_head(teacher[i, a + k - 1]), -1)[draft_ids]  # p_T on D
                mass = p.sum()
                kl = (p * torch.log(p / mass) - p * log_q).sum()  # m * KL(p_T|D || q)
                ce = -log_q[draft_ids.tolist().index(label)]
                if hasattr(drafter, "candidate_selector"):  # DFlash2's selector cross-entropy, as head_loss has it
                    ce = drafter.head_loss(hidden[i, j, k][None], torch.tensor([label]), ids[i, a + k - 1][None])[0][0]
                ce_sum, kl_sum, w_sum = ce_sum + w * ce, kl_sum + w * kl, w_sum + w
    return ce_sum / w_sum, kl_sum / w_sum


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_the_loss_is_the_weighted_forward_kl_from_the_target_mixed_with_the_cross_entropy(family, weight):
    if family == "dflash2" and weight == 1.0:
        pytest.skip("a DFlash2 drafter keeps a share of the cross-entropy (its selector learns from it)")
    drafter = _drafter(family)
    ids, loss_mask, feats, teacher, lengths = _batch()
    batch = Batch(ids, loss_mask, lengths, target_hidden=torch.cat([feats, teacher], -1))
    loss, metrics = dflash_loss(drafter, batch, max_anchors=5, gamma=3.0, generator=torch.Generator().manual_seed(1),
                                logits_chunk=7, distill_weight=weight)
    anchors, valid = sample_anchors(loss_mask, lengths, 5, torch.Generator().manual_seed(1))
    with torch.no_grad():
        ce, kl = (float(x) for x in _direct(drafter, ids, loss_mask, feats, teacher, lengths, anchors, valid, 3.0))
    assert loss.item() == pytest.approx((1 - weight) * ce + weight * kl, rel=1e-5)
    assert metrics["distill_kl"] == pytest.approx(kl, rel=1e-5) and kl > 0.1
    grads = torch.autograd.grad(loss, drafter.trainable_parameters(), allow_unused=True)

    # one chunk: the same loss and gradients
    whole, _ = dflash_loss(drafter, batch, max_anchors=5, gamma=3.0, generator=torch.Generator().manual_seed(1),
                           logits_chunk=10_000, distill_weight=weight)
    torch.testing.assert_close(whole, loss)
    for a, b in zip(grads, torch.autograd.grad(whole, drafter.trainable_parameters(), allow_unused=True)):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_batch_with_the_teacher_trains_as_without_it_when_not_distilling():
    drafter = _drafter("dflash")
    ids, loss_mask, feats, teacher, lengths = _batch()
    plain, _ = dflash_loss(drafter, Batch(ids, loss_mask, lengths, target_hidden=feats), max_anchors=5,
                           generator=torch.Generator().manual_seed(1), noise_std=0.1)
    wide, metrics = dflash_loss(drafter, Batch(ids, loss_mask, lengths, target_hidden=torch.cat([feats, teacher], -1)),
                                max_anchors=5, generator=torch.Generator().manual_seed(1), noise_std=0.1)
    assert plain.item() == wide.item() and "distill_kl" not in metrics
    with pytest.raises(ValueError, match="needs the target's last layer"):
        dflash_loss(drafter, Batch(ids, loss_mask, lengths, target_hidden=feats), distill_weight=0.5)
    with pytest.raises(ValueError, match=r"distill_weight must be in \[0, 1\]"):
        dflash_loss(drafter, Batch(ids, loss_mask, lengths, target_hidden=feats), distill_weight=1.5)


def test_the_teacher_logits_are_the_targets_own(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32).eval()
    last = target.config.num_hidden_layers - 1
    ids = torch.randint(0, target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    source = InProcessTarget(tiny_qwen3_dir, device="cpu")
    states = source.compute([ids[0]], [last])[0]  # (12, H): what the source and the cache give the trainer
    head = load_target_parts(tiny_qwen3_dir).lm_head
    with torch.no_grad():
        own = target(ids).logits[0].float()
    torch.testing.assert_close(teacher_logits(head, states), own, rtol=1e-5, atol=1e-5)
    asyncio.run(source.close())


def test_the_spec_bounds_the_weight_and_refuses_what_cannot_be_distilled():
    base = dict(dataset="file:///d", target="file:///t")
    assert TrainSpec.model_validate(base).distill_weight == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="distill_weight"):
            TrainSpec.model_validate({**base, "distill_weight": bad})
    with pytest.raises(ValueError, match="selector learns from the cross-entropy"):
        TrainSpec.model_validate({**base, "family": "dflash2", "distill_weight": 1.0})
    check_teacher_target({"final_logit_softcapping": None})
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        check_teacher_target({"final_logit_softcapping": 30.0})
    assert teacher_layer_ids(8, True, [1, 4]) == [7] and teacher_layer_ids(8, False, [1, 7]) == []
    with pytest.raises(ValueError, match=r"reads the target's last layer \(7\)"):
        teacher_layer_ids(8, True, [1, 7])  # a source serves each layer once a request


def test_a_distilling_run_whose_drafter_reads_the_last_layer_is_refused_before_training(tmp_path, tiny_qwen3_dir,
                                                                                      tiny_dataset):
    from dfp_trainer.components.distributed import DistInfo
    from dfp_trainer.loop.prepare import TrainError
    from dfp_trainer.run import train

    from tests.trainer.train_support import run_config, tiny_spec

    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out", distill_weight=0.5, target_layer_ids=[7])
    with pytest.raises(TrainError, match="reads the target's last layer"):
        train(run_config(spec), DistInfo())


def test_a_distilling_run_from_the_cache_trains_evaluates_and_exports(tmp_path, tiny_qwen3_dir, tiny_dataset):
    import json

    from dfp_shared.storage.store import open_store
    from dfp_trainer.run import run_local
    from dfp_trainer.settings import TrainerSettings

    from tests.trainer.train_support import tiny_spec

    # DSpark over a pruned vocabulary, the held-out evaluation reading the teacher's layer from the cache too
    spec = TrainSpec.model_validate(tiny_spec(
        tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out", family="dspark", draft_vocab_size=256,
        distill_weight=0.5, steps=4, eval_prompts=2, eval_max_new_tokens=8, hidden_states="cache",
        hidden_state_cache=f"file://{tmp_path}/cache"))
    result = run_local(spec, TrainerSettings(device="cpu", work_dir=str(tmp_path / "work")), resume=False)
    assert result.completed and all(r["loss"] > 0 for r in result.history)
    report = json.loads(open_store(f"file://{tmp_path}/out").get("report.json"))
    assert report["target_layer_ids"] == [4]  # the drafter's layers: the teacher is the run's, not the drafter's
    assert report["evaluation"]["tau_trained"] >= 1.0 and "heldout_trained" in report["evaluation"]
    config = json.loads((tmp_path / "out" / "drafter" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [4]  # served as any drafter


def test_target_argmax_labels_train_toward_the_targets_greedy_token():
    drafter = _drafter("dflash")
    ids, loss_mask, feats, teacher, lengths = _batch()
    batch = Batch(ids, loss_mask, lengths, target_hidden=torch.cat([feats, teacher], -1))
    loss, metrics = dflash_loss(drafter, batch, max_anchors=5, gamma=3.0, generator=torch.Generator().manual_seed(1),
                                logits_chunk=7, label_source="target_argmax")
    anchors, valid = sample_anchors(loss_mask, lengths, 5, torch.Generator().manual_seed(1))
    _, weights = block_targets(ids, loss_mask, lengths, anchors, valid, drafter.config.block_size, 3.0)
    with torch.no_grad():
        hidden = block_hidden(drafter, ids, feats, anchors)
        ce_sum = w_sum = correct = scored = 0.0
        for (i, j, k) in (weights > 0).nonzero().tolist():
            a = int(anchors[i, j])
            label = int(drafter.target_lm_head(teacher[i, a + k - 1]).argmax())  # the target's greedy next token
            log_q = torch.log_softmax(drafter.logits(hidden[i, j, k]).float(), -1)
            w = float(weights[i, j, k])
            ce_sum, w_sum = ce_sum + w * float(-log_q[label]), w_sum + w
            correct, scored = correct + float(int(log_q.argmax()) == label), scored + 1
    assert loss.item() == pytest.approx(ce_sum / w_sum, rel=1e-5)
    assert metrics["correct_sum"] == correct and metrics["num_trained_tokens"] == scored
    data_loss, _ = dflash_loss(drafter, batch, max_anchors=5, gamma=3.0, generator=torch.Generator().manual_seed(1))
    assert data_loss.item() != pytest.approx(loss.item(), rel=1e-3)  # the random data is not the target's choice
    with pytest.raises(ValueError, match=r"target's labels \(target_argmax\) needs the target's last layer"):
        dflash_loss(drafter, Batch(ids, loss_mask, lengths, target_hidden=feats), label_source="target_argmax")
    with pytest.raises(ValueError, match="label_source one of"):
        dflash_loss(drafter, batch, label_source="argmax")


def test_a_run_on_the_targets_labels_reads_the_teacher_and_trains(tmp_path, tiny_qwen3_dir, tiny_dataset):
    import json

    from dfp_shared.storage.store import open_store
    from dfp_trainer.run import run_local
    from dfp_trainer.settings import TrainerSettings

    from tests.trainer.train_support import tiny_spec

    assert TrainSpec.model_validate(dict(dataset="file:///d", target="file:///t")).labels == "data"
    with pytest.raises(ValueError, match="labels"):
        TrainSpec.model_validate(dict(dataset="file:///d", target="file:///t", labels="argmax"))
    spec = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out",
                                              labels="target_argmax", steps=3, eval_prompts=0))
    result = run_local(spec, TrainerSettings(device="cpu", work_dir=str(tmp_path / "work")), resume=False)
    assert result.completed and all(r["loss"] > 0 for r in result.history)
    report = json.loads(open_store(f"file://{tmp_path}/out").get("report.json"))
    assert report["spec"]["labels"] == "target_argmax" and report["target_layer_ids"] == [4]
