"""``demo --target learnable``: the target comes from the per-machine cache, is linked into the demo's
store (where the services may read it), and the demo's prompts are its training-split prompts."""

from __future__ import annotations

import functools
import json

from dfp_dev.demo import run as demo_run
from dfp_dev.demo.config import DemoConfig
from dfp_dev.targets import learnable as lt
from dfp_shared.records.prompts import read_prompt_set

QUICK = lt.TrainSettings(steps=4, batch_tokens=1024, warmup_steps=1)


def test_the_learnable_target_is_linked_into_the_store_with_training_prompts(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(lt, "default_root", lambda: cache)  # a reduced build: the real builder, few records
    monkeypatch.setattr(lt, "build_learnable_target",
                        functools.partial(lt.build_learnable_target, settings=QUICK, max_records=300))
    cfg = DemoConfig(out_dir=tmp_path / "out", target="learnable", prompts=20)
    store = tmp_path / "out" / "store"
    model_dir, prompt_file = demo_run.prepare_inputs(cfg, store)

    (built,) = list(cache.iterdir())
    assert model_dir == store / "models" / built.name and (model_dir / "config.json").is_file()
    weights = next(model_dir.glob("*.safetensors"))
    assert weights.stat().st_ino == (built / weights.name).stat().st_ino  # linked, not copied
    assert json.loads((model_dir / "config.json").read_text())["head_dim"] == 32  # a head size vLLM serves
    prompts, errors = read_prompt_set(str(prompt_file))
    assert not errors and len(prompts) == 20
    train_ids = {p.id for p in read_prompt_set(str(built / "prompts" / "train.jsonl"))[0]}
    held_out = {p.id for p in read_prompt_set(str(built / "prompts" / "held-out.jsonl"))[0]}
    assert {p.id for p in prompts} <= train_ids and not {p.id for p in prompts} & held_out
    # a second demo in another directory finds the build in the cache
    again, _ = demo_run.prepare_inputs(DemoConfig(out_dir=tmp_path / "out2", target="learnable"), tmp_path / "out2")
    assert again.name == built.name and len(list(cache.iterdir())) == 1
