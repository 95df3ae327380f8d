"""A run started from a stored drafter (train spec ``init_from``): the project's own exports in both layouts, a
drafter written as published in the speculators layout, and every drafter that is not the run's refused before a
step, naming what differs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage.roots import OutsideRoots, StorageRoots
from dfp_shared.storage.store import open_store
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.export.zlab import export_drafter
from dfp_trainer.loop.prepare import TrainError, prepare
from dfp_trainer.run import run_local
from dfp_trainer.settings import TrainerSettings
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from tests.trainer.train_support import run_config, tiny_spec, torch_threads

LAYOUTS = {"zlab": "drafter", "speculators": "drafter-speculators"}


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def settings(tmp_path) -> TrainerSettings:
    return TrainerSettings(device="cpu", work_dir=str(tmp_path / "work"), target_url="inprocess")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_qwen3_dir, tiny_dataset):
    """A two-step DFlash run's output prefix, exported in both layouts."""
    out = tmp_path_factory.mktemp("first")
    spec = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{out}/out", steps=2, lr=1e-2))
    with torch_threads(1):
        assert run_local(spec, settings(out), resume=False).completed
    return out / "out"


def trainable(setup) -> dict[str, torch.Tensor]:
    names = {n for n, p in setup.drafter.named_parameters() if p.requires_grad}
    return {n: t for n, t in setup.initial_state.items() if n in names}


def start(tmp_path, tiny_qwen3_dir, tiny_dataset, init_from, **over):
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out", init_from=f"file://{init_from}", **over)
    return prepare(run_config(spec), DistInfo())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_drafter_starts_as_the_export(layout, exported, tmp_path, tiny_qwen3_dir, tiny_dataset):
    setup = start(tmp_path, tiny_qwen3_dir, tiny_dataset, exported / LAYOUTS[layout])
    stored = load_file(str(exported / LAYOUTS[layout] / "model.safetensors"))
    weights = trainable(setup)
    assert weights and set(weights) == set(stored)
    for name, tensor in weights.items():
        assert tensor.dtype == stored[name].dtype and torch.equal(tensor, stored[name]), name
    assert setup.init_from["layout"] == layout and setup.init_from["family"] == "dflash"


def test_a_run_from_the_speculators_export_trains_and_exports(exported, tmp_path, tiny_qwen3_dir, tiny_dataset):
    init_from = f"file://{exported / 'drafter-speculators'}"
    spec = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out", steps=2,
                                              lr=1e-2, init_from=init_from))
    result = run_local(spec, settings(tmp_path), resume=False)
    assert result.completed and len(result.history) == 2
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in result.history)
    report = json.loads(open_store(f"file://{tmp_path}/out").get("report.json"))
    assert report["init_from"]["uri"] == init_from and report["init_from"]["layout"] == "speculators"
    before = load_file(str(exported / "drafter" / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "drafter" / "model.safetensors"))
    assert set(after) == set(before) and not torch.equal(after["fc.weight"], before["fc.weight"])


def test_a_published_speculators_drafter_loads(tmp_path, tiny_qwen3_dir, tiny_dataset):
    # a drafter as a hub publishes it: config and tensors written here, with the verifier's embedding beside them
    fresh = prepare(run_config(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/fresh")), DistInfo())
    cfg, target = fresh.drafter.config, json.loads((tiny_qwen3_dir / "config.json").read_text())
    layer = {k: target[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings")
             if k in target}
    layer.update(model_type="qwen3", num_hidden_layers=1, hidden_act="silu", rope_parameters=cfg.rope_parameters,
                 tie_word_embeddings=False)
    config = {"speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"],
              "transformer_layer_config": layer, "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
              "mask_token_id": cfg.mask_token_id, "block_size": 4, "draft_vocab_size": target["vocab_size"],
              "speculators_config": {"algorithm": "dflash", "verifier": {"name_or_path": "Qwen/Qwen3-tiny"}}}
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(7)
    tensors = {n: torch.randn(t.shape, generator=gen) for n, t in trainable(fresh).items()}
    embed = load_file(str(next(tiny_qwen3_dir.glob("*.safetensors"))))["model.embed_tokens.weight"]
    save_file({**tensors, "embed_tokens.weight": embed}, str(published / "model.safetensors"))
    setup = start(tmp_path, tiny_qwen3_dir, tiny_dataset, published)
    assert all(torch.equal(trainable(setup)[n], t) for n, t in tensors.items())
    assert setup.init_from["frozen_checked"] == ["embed_tokens.weight"]


@pytest.mark.parametrize("over, reason", [
    (dict(family="dspark", markov_rank=8), "family is 'dflash' in the drafter to start from, but 'dspark'"),
    (dict(target_layer_ids=[2]), "target_layer_ids is"),
    (dict(block_size=8), "block_size is 4 in the drafter to start from, but 8 in this run"),
    (dict(num_draft_layers=2), "num_hidden_layers is 1"),
])
def test_another_drafter_is_refused(over, reason, exported, tmp_path, tiny_qwen3_dir, tiny_dataset):
    with pytest.raises(TrainError, match="init_from") as caught:
        start(tmp_path, tiny_qwen3_dir, tiny_dataset, exported / "drafter", **over)
    assert reason in str(caught.value)


def test_a_drafter_of_another_target_is_refused(exported, tmp_path, tiny_dataset, qwen3_tokenizer_dir):
    from dfp_dev.targets.tiny import build_tiny_qwen3

    wider = build_tiny_qwen3(tmp_path / "wider", qwen3_tokenizer_dir, hidden_size=96)
    with pytest.raises(TrainError, match="hidden_size is 64 in the drafter to start from, but 96 in this run "
                                         r"\(it was trained for another target\)"):
        start(tmp_path, wider, tiny_dataset, exported / "drafter-speculators")


@pytest.mark.parametrize("edit, reason", [
    (lambda t: {**t, "extra.weight": torch.zeros(2)}, r"unexpected \['extra.weight'\]"),
    (lambda t: {k: v for k, v in t.items() if k != "fc.weight"}, r"missing \['fc.weight'\]"),
    (lambda t: {**t, "fc.weight": t["fc.weight"][:, :-1].contiguous()}, "tensor fc.weight has shape"),
])
def test_tensors_not_the_runs_are_refused(edit, reason, exported, tmp_path, tiny_qwen3_dir, tiny_dataset):
    copy = tmp_path / "copy"
    shutil.copytree(exported / "drafter", copy)
    save_file(edit(load_file(str(copy / "model.safetensors"))), str(copy / "model.safetensors"))
    with pytest.raises(TrainError, match=reason):
        start(tmp_path, tiny_qwen3_dir, tiny_dataset, copy)


def test_a_pruned_drafter_starts_only_over_the_same_vocabulary(tmp_path, tiny_qwen3_dir, tiny_dataset):
    pruned = dict(draft_vocab_size=512)
    first = prepare(run_config(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/a", **pruned)), DistInfo())
    export_drafter(first.drafter, tmp_path / "same")
    assert trainable(start(tmp_path, tiny_qwen3_dir, tiny_dataset, tmp_path / "same", **pruned)).keys()
    with pytest.raises(TrainError, match="draft_vocab_size is 512 in the drafter to start from, but 256"):
        start(tmp_path, tiny_qwen3_dir, tiny_dataset, tmp_path / "same", draft_vocab_size=256)
    ids = first.drafter.d2t + torch.arange(512)
    other = torch.cat([ids[:-1], ids[-1:] + 1]) if int(ids[-1]) + 1 < first.drafter.config.vocab_size else ids - 1
    first.drafter.d2t.copy_(other - torch.arange(512))
    export_drafter(first.drafter, tmp_path / "other")
    with pytest.raises(TrainError, match="tensor d2t: the draft vocabulary differs from this run's"):
        start(tmp_path, tiny_qwen3_dir, tiny_dataset, tmp_path / "other", **pruned)


def test_the_spec_takes_one_start(tmp_path, tiny_qwen3_dir, tiny_dataset):
    spec = tiny_spec(tiny_dataset, f"file://{tiny_qwen3_dir}", f"file://{tmp_path}/out", init_from=f"file://{tmp_path}/d")
    assert TrainSpec.model_validate(spec).init_from == f"file://{tmp_path}/d"
    with pytest.raises(ValidationError, match="init_from and init 'target_layers' both say how the drafter starts"):
        TrainSpec.model_validate({**spec, "init": "target_layers"})
    roots = StorageRoots([f"file://{tmp_path}/out", tiny_dataset, f"file://{tiny_qwen3_dir}"])
    with pytest.raises(OutsideRoots, match="spec.init_from"):
        roots.check_spec("train", TrainSpec.model_validate(spec))


@pytest.mark.parametrize("family, fields", [
    ("dspark", dict(markov_rank=8)),
    ("dflash2", dict(conv_kernel_size=3, conv_group_size=32, selector_rank=8, selector_top_k=4)),
])
def test_each_family_starts_from_its_export(family, fields, tmp_path, tiny_qwen3_dir, tiny_dataset):
    over = dict(family=family, seed=1, **fields)
    first = prepare(run_config(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/a", **over)), DistInfo())
    export_drafter(first.drafter, tmp_path / "drafter")
    setup = start(tmp_path, tiny_qwen3_dir, tiny_dataset, tmp_path / "drafter", **{**over, "seed": 2})
    stored = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert set(trainable(setup)) == set(stored)
    assert all(torch.equal(t, stored[n]) for n, t in trainable(setup).items())
    assert setup.init_from["family"] == family
    with pytest.raises(TrainError, match=f"family is '{family}' in the drafter to start from, but 'dflash'"):
        start(tmp_path, tiny_qwen3_dir, tiny_dataset, tmp_path / "drafter")
