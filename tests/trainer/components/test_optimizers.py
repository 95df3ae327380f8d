"""The recipe's optimiser and schedule levers: warmup-stable-decay, and Muon for the matrices with AdamW for the
rest, whose state resumes from a checkpoint bit for bit."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from dfp_shared.specs.train import TrainSpec
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.components.optimizer import MuonAdamW, lr_lambda, make_optimizer, muon_matrices
from dfp_trainer.run import train

from tests.trainer.drafter_support import small_drafter
from tests.trainer.train_support import final_weights, run_config, tiny_spec, torch_threads

SPEC = {"dataset": "file:///d", "target": "file:///t", "output": "file:///o"}


def test_wsd_holds_the_peak_then_decays_linearly():
    spec = TrainSpec.model_validate({**SPEC, "decay": "wsd", "wsd_decay_ratio": 0.25, "warmup_ratio": 0.1,
                                     "min_lr_ratio": 0.0})
    f = lr_lambda(spec, 100)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)  # warmup
    assert all(f(s) == 1.0 for s in range(10, 76))  # stable
    assert f(80) == pytest.approx(0.8) and f(99) == pytest.approx(0.04)  # decay over the last quarter


def test_muon_takes_the_matrices_and_adamw_the_rest():
    spec = TrainSpec.model_validate({**SPEC, "optimizer": "muon", "muon_lr": 0.05, "lr": 1e-3})
    model = torch.nn.Sequential(torch.nn.Linear(6, 6, bias=True), torch.nn.LayerNorm(6))
    optim = make_optimizer(spec, list(model.parameters()))
    assert isinstance(optim, MuonAdamW)
    muon, adamw = optim.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert [p.ndim for g in muon.param_groups for p in g["params"]] == [2]
    assert sorted(p.ndim for g in adamw.param_groups for p in g["params"]) == [1, 1, 1]
    assert [g["lr"] for g in optim.param_groups] == [0.05, 1e-3]


@pytest.mark.parametrize("fields", [{}, {"markov_rank": 4, "confidence_head": True},
                                    {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3}],
                         ids=["dflash", "dspark", "dflash2"])
def test_a_drafters_muon_takes_its_layers_and_fc_matrices_only(fields):
    """Muon orthogonalises hidden-to-hidden maps; a family's per-token tables and one-output heads keep AdamW."""
    drafter = small_drafter(0, **fields)
    names = {id(p): n for n, p in drafter.named_parameters()}
    chosen = sorted(names[id(p)] for p in muon_matrices(drafter))
    expected = sorted(n for n, p in drafter.named_parameters() if p.requires_grad and p.ndim == 2
                      and (n.startswith("layers.") or n == "fc.weight"))
    assert chosen == expected and "fc.weight" in chosen
    assert {n.rsplit(".", 2)[-2] for n in chosen if n.startswith("layers.")} >= {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    others = {n for n, p in drafter.named_parameters() if p.requires_grad and p.ndim >= 2 and n not in chosen}
    assert others == {"dflash": set(), "dspark": {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                                                   "confidence_head.proj.weight"},
                      "dflash2": {"candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                                  "candidate_selector.successor_codebook", *(f"layers.{i}.{conv}_conv.base_kernel"
                                                                             for i in (0, 1) for conv in ("attention", "mlp"))},
                      }[drafter.config.family]
    spec = TrainSpec.model_validate({**SPEC, "optimizer": "muon"})
    optim = make_optimizer(spec, drafter.trainable_parameters(), muon_matrices(drafter))
    muon, adamw = optim.parts
    assert {id(p) for g in muon.param_groups for p in g["params"]} == {id(p) for p in muon_matrices(drafter)}
    assert len([p for g in adamw.param_groups for p in g["params"]]) == len(drafter.trainable_parameters()) - len(chosen)


def test_a_run_without_an_optimizer_trains_with_muon():
    """Muon is the default: with AdamW everywhere at equal data, shape and budget our drafter learned less than the
    peer trainer's (0.92-0.94 of its served acceptance); with Muon for the draft layers it is past the peer's."""
    spec = TrainSpec.model_validate(SPEC)
    drafter = small_drafter(0)
    optim = make_optimizer(spec, drafter.trainable_parameters(), muon_matrices(drafter))
    assert spec.optimizer == "muon" and spec.muon_lr == 0.02 and isinstance(optim, MuonAdamW)


def test_a_muon_wsd_run_resumes_from_its_checkpoint_bit_for_bit(tmp_path, tiny_qwen3_dir, tiny_dataset):
    lever = {"optimizer": "muon", "decay": "wsd", "wsd_decay_ratio": 0.5, "steps": 6, "checkpoint_every": 3}
    with torch_threads(1):
        ref = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/ref", **lever)
        assert train(run_config(ref), DistInfo()).completed
        # a second run starts from the reference's step-3 checkpoint, as a stopped run would
        ckpts = tmp_path / "cut" / "checkpoints"
        shutil.copytree(tmp_path / "ref" / "checkpoints" / "step-00000003", ckpts / "step-00000003")
        files = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in (ckpts / "step-00000003").iterdir()}
        (ckpts / "latest.json").write_text(json.dumps({"step": 3, "dir": "step-00000003", "files": files}))
        cut = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/cut", **lever)
        assert train(run_config(cut), DistInfo()).completed
    ref_step, ref_w = final_weights(ref["output"])
    cut_step, cut_w = final_weights(cut["output"])
    assert ref_step == cut_step == 6 and ref_w.keys() == cut_w.keys()
    for name in ref_w:
        assert torch.equal(ref_w[name], cut_w[name]), name


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_adamw_takes_the_specs_beta2(optimizer):
    params = [torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(3))]
    for fields, betas in (({}, (0.9, 0.95)), ({"adam_beta2": 0.999}, (0.9, 0.999))):
        optim = make_optimizer(TrainSpec.model_validate({**SPEC, "optimizer": optimizer, **fields}), params)
        adamw = optim.parts[1] if optimizer == "muon" else optim
        assert adamw.param_groups[0]["betas"] == betas
