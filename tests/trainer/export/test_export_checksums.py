"""One export per drafter family byte-identical on a fixed seed: a tiny drafter trained a few steps on the tiny
random target, exported (the z-lab layout, and the speculators layout where the family has it), and the SHA-256 of
``config.json`` and ``model.safetensors`` checked against constants recorded before the trainer's layout was moved
(a refactor that changes a byte of any export fails here). The weights' bytes follow the CPU's float kernels (a
few steps of training on another vendor's vector units round differently), so each family's weights have one
recorded checksum per kind of machine the suite runs on; the config's is the same everywhere."""

from __future__ import annotations

import hashlib

import pytest
from dfp_shared.specs.train import TrainSpec
from dfp_trainer.run import run_local
from dfp_trainer.settings import TrainerSettings

from tests.trainer.train_support import tiny_spec, torch_threads

FIELDS = {"dflash": {}, "dspark": dict(markov_rank=8, confidence_loss_weight=0.5),
          "dflash2": dict(conv_kernel_size=3, conv_group_size=32, selector_rank=8, selector_top_k=4)}
CHECKSUMS = {  # recorded on the trainer before the family registry and the jobs table (commit 0250f8e)
    "dflash": {
        "zlab": {"config.json": "1aeb65c34da68cab7b7a6fb152bb4334ae2ab5367f6f15cd422c3eae0b5505b6",
                 "model.safetensors": "747adaf55c89fbceb5bbc38f8f9a6314f5853e9c1910d998130230ce6fba49bc"},
        "speculators": {"config.json": "80656166df25c107dd5d03ce0d2c552eff2d6d0b6eb34243f5896662454119bb",
                        "model.safetensors": "747adaf55c89fbceb5bbc38f8f9a6314f5853e9c1910d998130230ce6fba49bc"},
    },
    "dspark": {
        "zlab": {"config.json": "b3a62fa76f87494a21487cbb9e52615fa449e2581cd362d7d8fc7056e1e3096e",
                 "model.safetensors": "0b0ddeec5122ad48870ec1ca8d3c1d02ee7b069778e33effa426db4d1b8ad63d"},
    },
    "dflash2": {
        "zlab": {"config.json": "85d9debbd03f0e84723fab7aa9774eda514ac5e8a66e533db0bc03da11df0304",
                 "model.safetensors": "954f3639706a96dc564ba0bfd4088b82c95e9760978c2f4626d871e42873e671"},
    },
}


def checksums(directory, target) -> dict[str, str]:
    """The files' SHA-256, the target's path (the speculators layout names its verifier) stated as ``TARGET``."""
    files = {name: (directory / name).read_bytes() for name in ("config.json", "model.safetensors")}
    files["config.json"] = files["config.json"].replace(str(target).encode(), b"TARGET")
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


@pytest.mark.parametrize("family", sorted(FIELDS))
def test_an_export_per_family_is_byte_identical_on_a_fixed_seed(family, tmp_path, tiny_qwen3_dir, tiny_dataset):
    spec = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out", family=family,
                                              steps=3, lr=1e-2, seed=7, optimizer="adamw", **FIELDS[family]))
    with torch_threads(1):
        result = run_local(spec, TrainerSettings(device="cpu", work_dir=str(tmp_path / "work")), resume=False)
    assert result.completed
    layouts = {"zlab": "drafter", "speculators": "drafter-speculators"}
    got = {layout: checksums(tmp_path / "out" / folder, tiny_qwen3_dir) for layout, folder in layouts.items()
           if (tmp_path / "out" / folder).is_dir()}
    weights = {layout: files.pop("model.safetensors") for layout, files in got.items()}
    assert got == {layout: {"config.json": files["config.json"]} for layout, files in CHECKSUMS[family].items()}
    assert set(weights) == set(CHECKSUMS[family])
    assert len(set(weights.values())) == 1, weights  # the same weights in every layout of a family
    assert next(iter(weights.values())) in MACHINE_WEIGHTS[family], weights


# the weights' checksum of each family on a second kind of machine (AMD EPYC with AVX-512; the constants above: the
# machine they were recorded on)
MACHINE_WEIGHTS = {family: {files["model.safetensors"] for files in layouts.values()}
                   for family, layouts in CHECKSUMS.items()}
MACHINE_WEIGHTS["dflash"].add("325cfe79fbd660a7e885e1e124822da109eca44d056ec27ccd7b278d0d309aa2")
MACHINE_WEIGHTS["dspark"].add("95f26889bea2825c392fbcfe400fbb3973d56375529e73d613912da844beb919")
MACHINE_WEIGHTS["dflash2"].add("916160a80c56348b465dd4713004163f82d5e997041ca54c8a6ab508b101515f")
