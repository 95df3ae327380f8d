"""One export per drafter family pinned on a fixed seed, split by what a CPU can change.

Byte-identical everywhere (SHA-256 constants): each layout's ``config.json`` (recorded before the trainer's layout was
moved, the target's path stated as ``TARGET``), and ``model.safetensors`` of a fixed state: the drafter the run builds
for the spec, every floating tensor filled with a pattern computed in integers and scaled by a power of two, so no
float kernel takes part; it pins the names, order, shapes, dtypes and header the export writes. A seeded init is not
such a state: ``nn.init.normal_`` draws through a vectorised path on AVX2 and a scalar one elsewhere, which round
differently.

What a few training steps compute follows the CPU's float kernels, so a tiny drafter trained three steps on the tiny
random target is pinned within a tolerance another CPU meets (each step's loss and the norm of each exported tensor's
change from the run's start against values recorded here, rtol 1e-3; the scalar path of ATen and of the BLAS kernels,
forced on the recording machine, moved none by more than 6e-5), and exactly against a second computation on the same
machine: the exported weights equal the run's last checkpoint tensor for tensor, and every layout of a family holds
the same bytes.
A refactor that changes a byte of a fixed state's export, or what a run trains, fails here."""

from __future__ import annotations

import hashlib
import math
from types import SimpleNamespace

import pytest
import torch
from dfp_shared.models.tokenizer_assets import choose_mask_token, load_tokenizer
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage.store import open_store
from dfp_trainer.drafter.families import build_drafter
from dfp_trainer.drafter.target_parts import load_target_parts
from dfp_trainer.report import EXPORT_PREFIXES, export_layouts
from dfp_trainer.run import run_local
from dfp_trainer.run_config import RunConfig
from dfp_trainer.settings import TrainerSettings
from safetensors.torch import load_file

from tests.trainer.train_support import final_weights, tiny_spec, torch_threads

FIELDS = {"dflash": {}, "dspark": dict(markov_rank=8, confidence_loss_weight=0.5),
          "dflash2": dict(conv_kernel_size=3, conv_group_size=32, selector_rank=8, selector_top_k=4)}
CONFIGS = {  # recorded on the trainer before the family registry and the jobs table (commit 0250f8e)
    "dflash": {"zlab": "1aeb65c34da68cab7b7a6fb152bb4334ae2ab5367f6f15cd422c3eae0b5505b6",
               "speculators": "80656166df25c107dd5d03ce0d2c552eff2d6d0b6eb34243f5896662454119bb"},
    "dspark": {"zlab": "b3a62fa76f87494a21487cbb9e52615fa449e2581cd362d7d8fc7056e1e3096e"},
    "dflash2": {"zlab": "85d9debbd03f0e84723fab7aa9774eda514ac5e8a66e533db0bc03da11df0304"},
}
FILLED_WEIGHTS = {  # model.safetensors of the filled state (:func:`filled`), every layout alike
    "dflash": "910ea31aade3cb4fa86912ce49afec685ce9159640c32a90553a7a4cc9a0f902",
    "dspark": "f5b0913be9504e311e75e782bf9dfb5d06f2c4bf95f86ee044e756e357785024",
    "dflash2": "8657b2caaa2b915e0e533379bfed2766471096ea5902ccce644cb5fd80a5e4a9",
}
TRAINED = {  # three steps: each step's loss, the L2 norm of each exported tensor's change from the run's start
    "dflash": {"loss": [19.5042, 11.96741, 13.73218], "change": {
        "fc.weight": 1.189855, "hidden_norm.weight": 0.1326324, "layers.0.input_layernorm.weight": 0.144965,
        "layers.0.mlp.down_proj.weight": 1.570401, "layers.0.mlp.gate_proj.weight": 1.551423,
        "layers.0.mlp.up_proj.weight": 1.566689, "layers.0.post_attention_layernorm.weight": 0.1381439,
        "layers.0.self_attn.k_norm.weight": 0.07766733, "layers.0.self_attn.k_proj.weight": 0.816909,
        "layers.0.self_attn.o_proj.weight": 1.096718, "layers.0.self_attn.q_norm.weight": 0.0753047,
        "layers.0.self_attn.q_proj.weight": 1.214579, "layers.0.self_attn.v_proj.weight": 0.7907259,
        "norm.weight": 0.1392399}},
    "dspark": {"loss": [19.85098, 12.28587, 13.74212], "change": {
        "confidence_head.proj.bias": 0.02467082, "confidence_head.proj.weight": 0.1454881, "fc.weight": 1.19055,
        "hidden_norm.weight": 0.1323808, "layers.0.input_layernorm.weight": 0.1449167,
        "layers.0.mlp.down_proj.weight": 1.570188, "layers.0.mlp.gate_proj.weight": 1.551186,
        "layers.0.mlp.up_proj.weight": 1.566118, "layers.0.post_attention_layernorm.weight": 0.1380646,
        "layers.0.self_attn.k_norm.weight": 0.07699222, "layers.0.self_attn.k_proj.weight": 0.8163978,
        "layers.0.self_attn.o_proj.weight": 1.096508, "layers.0.self_attn.q_norm.weight": 0.07496545,
        "layers.0.self_attn.q_proj.weight": 1.214302, "layers.0.self_attn.v_proj.weight": 0.7904672,
        "markov_head.markov_w1.weight": 0.261993, "markov_head.markov_w2.weight": 1.041721, "norm.weight": 0.1393967}},
    "dflash2": {"loss": [20.83539, 14.05029, 17.39325], "change": {
        "candidate_selector.hidden_projection.weight": 0, "candidate_selector.predecessor_codebook": 0,
        "candidate_selector.successor_codebook": 0, "fc.weight": 1.224473, "hidden_norm.weight": 0.1114484,
        "layers.0.attention_conv.base_kernel": 0.3160376,
        "layers.0.attention_conv.kernel_projection.weight": 0.4304503, "layers.0.input_layernorm.weight": 0.1251006,
        "layers.0.mlp.down_proj.weight": 1.461285, "layers.0.mlp.gate_proj.weight": 1.490572,
        "layers.0.mlp.up_proj.weight": 1.486483, "layers.0.mlp_conv.base_kernel": 0.2895623,
        "layers.0.mlp_conv.kernel_projection.weight": 0.3939806,
        "layers.0.post_attention_layernorm.weight": 0.1247282, "layers.0.self_attn.k_norm.weight": 0.06441385,
        "layers.0.self_attn.k_proj.weight": 0.7971875, "layers.0.self_attn.o_proj.weight": 1.121773,
        "layers.0.self_attn.q_norm.weight": 0.06154499, "layers.0.self_attn.q_proj.weight": 1.119901,
        "layers.0.self_attn.v_proj.weight": 0.7865273, "norm.weight": 0.1549026}},
}
RTOL = 1e-3


def family_spec(family: str, dataset: str, target, output: str) -> TrainSpec:
    return TrainSpec.model_validate(tiny_spec(dataset, target, output, family=family, steps=3, lr=1e-2, seed=7,
                                              optimizer="adamw", **FIELDS[family]))


def checksums(directory, target) -> dict[str, str]:
    """The files' SHA-256, the target's path (the speculators layout names its verifier) stated as ``TARGET``."""
    files = {name: (directory / name).read_bytes() for name in ("config.json", "model.safetensors")}
    files["config.json"] = files["config.json"].replace(str(target).encode(), b"TARGET")
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def exported(root, target) -> dict[str, dict[str, str]]:
    """layout -> its files' checksums, for each layout written under ``root``."""
    return {layout: checksums(root / prefix, target) for layout, prefix in EXPORT_PREFIXES.items()
            if (root / prefix).is_dir()}


def filled(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every floating tensor of ``state`` filled with integers in [-1019, 1019] times 2**-12 (exact in float32 and
    bfloat16), a different phase per tensor; the others kept."""
    out = {}
    for i, (name, tensor) in enumerate(state.items()):
        if not tensor.is_floating_point():
            out[name] = tensor
            continue
        ints = (torch.arange(tensor.numel(), dtype=torch.int64) * 7919 + 104729 * (i + 1)) % 2039 - 1019
        out[name] = (ints.to(tensor.dtype) * 2.0 ** -12).view(tensor.shape)
    return out


def run_drafter(spec: TrainSpec, settings: TrainerSettings, target, *, fill: bool):
    """The drafter the run of ``spec`` starts from (its config from the target and the mask token, the seeded init
    as the run draws it), or in the filled state."""
    tokenizer = load_tokenizer(target)
    mask_id = tokenizer.convert_tokens_to_ids(choose_mask_token(tokenizer, spec.mask_token))
    parts = load_target_parts(target)
    config = RunConfig.compose(spec, settings)
    torch.manual_seed(spec.seed)
    drafter = build_drafter(config.drafter_config(parts.config, mask_id), parts.embed_tokens, parts.lm_head, None)
    if fill:
        drafter.load_state_dict(filled(drafter.state_dict()))
    return config, drafter


@pytest.mark.parametrize("family", sorted(FIELDS))
def test_a_fixed_state_exports_byte_identical_per_family(family, tmp_path, tiny_qwen3_dir):
    spec = family_spec(family, "file:///unused", tiny_qwen3_dir, f"file://{tmp_path}/out")
    settings = TrainerSettings(device="cpu", work_dir=str(tmp_path / "work"))
    config, drafter = run_drafter(spec, settings, tiny_qwen3_dir, fill=True)
    export_layouts(SimpleNamespace(config=config, model_dir=tiny_qwen3_dir), drafter, open_store(spec.output))
    got = exported(tmp_path / "out", tiny_qwen3_dir)
    assert {layout: files["config.json"] for layout, files in got.items()} == CONFIGS[family]
    assert {layout: files["model.safetensors"] for layout, files in got.items()} == \
        {layout: FILLED_WEIGHTS[family] for layout in CONFIGS[family]}


@pytest.mark.parametrize("family", sorted(FIELDS))
def test_three_training_steps_export_what_they_trained_per_family(family, tmp_path, tiny_qwen3_dir, tiny_dataset):
    spec = family_spec(family, tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out")
    settings = TrainerSettings(device="cpu", work_dir=str(tmp_path / "work"))
    with torch_threads(1):
        result = run_local(spec, settings, resume=False)
    assert result.completed
    got = exported(tmp_path / "out", tiny_qwen3_dir)
    assert {layout: files["config.json"] for layout, files in got.items()} == CONFIGS[family]
    assert len({files["model.safetensors"] for files in got.values()}) == 1, got  # every layout: the same bytes

    weights = load_file(tmp_path / "out" / EXPORT_PREFIXES["zlab"] / "model.safetensors")
    step, checkpoint = final_weights(spec.output)
    assert step == 3
    assert set(weights) <= set(checkpoint), set(weights) - set(checkpoint)
    assert all(torch.equal(weights[name], checkpoint[name]) for name in weights)  # the export is what was trained

    losses = [row["loss"] for row in result.history]
    initial = run_drafter(spec, settings, tiny_qwen3_dir, fill=False)[1].state_dict()
    change = {name: float((tensor.double() - initial[name].double()).norm()) for name, tensor in weights.items()}
    recorded = TRAINED[family]
    assert len(losses) == len(recorded["loss"]) and all(
        math.isclose(a, b, rel_tol=RTOL) for a, b in zip(losses, recorded["loss"])), (losses, recorded["loss"])
    assert set(change) == set(recorded["change"]), set(change) ^ set(recorded["change"])
    off = {name: (change[name], recorded["change"][name]) for name in change
           if not math.isclose(change[name], recorded["change"][name], rel_tol=RTOL, abs_tol=1e-6)}
    assert not off, off
