"""Every numeric, list and string field of the job specs has bounds a real job never reaches but that
keep a worker safe; they are Field constraints, so the OpenAPI schema states what validation enforces."""

from __future__ import annotations

import json
import math

import pytest
from dfp_shared.specs import CacheSpec, GenerateSpec, ImportGGUFSpec, TokenizeSpec, TrainSpec
from pydantic import BaseModel, ValidationError

GEN = {"prompts": "file:///data/prompts.jsonl", "output": "file:///data/out", "model": "file:///models/tiny"}
TOK = {"input": "file:///data/out/completions/", "output": "file:///data/tokens", "tokenizer": "file:///models/tok"}
TRAIN = {"dataset": "file:///data/tokens", "target": "file:///models/tiny", "output": "file:///data/drafter"}
BASE = {GenerateSpec: GEN, TokenizeSpec: TOK, TrainSpec: TRAIN}

# fields whose rules are kept elsewhere (storage locations, endpoints, chat templates)
NOT_HERE = {"prompts", "output", "model", "input", "tokenizer", "dataset", "target", "openai_base_url", "target_url",
            "chat_template", "template_kwargs", "hidden_state_cache", "source", "init_from"}


def _errors(model: type[BaseModel], **fields) -> dict[tuple, str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate({**BASE[model], **fields})
    return {tuple(e["loc"]): e["msg"] for e in info.value.errors()}


@pytest.mark.parametrize(("model", "field", "value"), [
    # reproduced: all of these were accepted
    (TrainSpec, "steps", 2 ** 63),
    (TrainSpec, "block_size", 10 ** 9),
    (TrainSpec, "num_draft_layers", 10 ** 6),
    (TrainSpec, "epochs", 1e308),
    (TrainSpec, "epochs", math.inf),
    (TrainSpec, "epochs", math.nan),
    # and the rest of the train spec
    (TrainSpec, "steps", 10 ** 8),
    (TrainSpec, "tokens_per_batch", 10 ** 12),
    (TrainSpec, "max_length", 10 ** 9),
    (TrainSpec, "grad_accum", 10 ** 6),
    (TrainSpec, "lr", 1e308),
    (TrainSpec, "lr", math.inf),
    (TrainSpec, "weight_decay", 1e300),
    (TrainSpec, "adam_beta2", 1.0),
    (TrainSpec, "adam_beta2", 0.0),
    (TrainSpec, "loss_norm", "tokens"),
    (TrainSpec, "anchor_spread", "row"),
    (TrainSpec, "labels", "argmax"),
    (TrainSpec, "grad_clip", math.inf),
    (TrainSpec, "seed", 2 ** 63),
    (TrainSpec, "seed", -1),
    (TrainSpec, "sliding_window", 10 ** 9),
    (TrainSpec, "mask_token", "m" * 1000),
    (TrainSpec, "max_anchors", 10 ** 9),
    (TrainSpec, "gamma", 1e308),
    (TrainSpec, "gamma", math.nan),
    (TrainSpec, "dpace_alpha", 0.0),
    (TrainSpec, "dpace_alpha", 2.0),
    (TrainSpec, "loss", "focal"),
    (TrainSpec, "distill_weight", 1.5),
    (TrainSpec, "distill_weight", -0.5),
    (TrainSpec, "noise_std", 1e308),
    (TrainSpec, "checkpoint_every", 10 ** 12),
    (TrainSpec, "keep_checkpoints", 10 ** 9),
    (TrainSpec, "eval_prompts", 10 ** 9),
    (TrainSpec, "eval_max_new_tokens", 10 ** 9),
    (TrainSpec, "warmup_ratio", math.nan),
    (TrainSpec, "min_lr_ratio", math.nan),
    # generate
    (GenerateSpec, "seed", 2 ** 63),
    (GenerateSpec, "temperature", math.nan),
    (GenerateSpec, "top_p", math.nan),
    (GenerateSpec, "request_timeout_s", math.inf),
    (GenerateSpec, "request_timeout_s", 1e308),
    (GenerateSpec, "openai_model", ""),
    (GenerateSpec, "openai_model", "m" * 10_000),
    # tokenize
    (TokenizeSpec, "max_length", 10 ** 12),
])
def test_out_of_bounds_value_is_rejected_naming_the_field(model, field, value):
    errors = _errors(model, **{field: value})
    assert list(errors) == [(field,)], errors


def test_target_layer_ids_are_layer_indexes_and_few():
    errors = _errors(TrainSpec, target_layer_ids=[-1, 10 ** 9])
    assert set(errors) == {("target_layer_ids", 0), ("target_layer_ids", 1)}, errors
    assert list(_errors(TrainSpec, target_layer_ids=list(range(65)))) == [("target_layer_ids",)]
    assert list(_errors(TrainSpec, target_layer_ids=[])) == [("target_layer_ids",)]


def test_layer_types_list_is_bounded_and_still_one_per_layer():
    assert ("layer_types",) in _errors(TrainSpec, num_draft_layers=65, layer_types=["full_attention"] * 65)
    # the cross-field rules still hold
    assert "num_draft_layers is 5" in _errors(TrainSpec, layer_types=["full_attention"] * 4)[("layer_types",)]
    assert "is required" in _errors(TrainSpec, num_draft_layers=1, layer_types=["sliding_attention"])[
        ("sliding_window",)]
    assert "is set but" in _errors(TrainSpec, num_draft_layers=1, layer_types=["full_attention"],
                                   sliding_window=128)[("sliding_window",)]


def test_non_finite_numbers_from_json_text_are_refused_as_not_finite():
    """``Infinity`` and ``NaN`` are what Python's JSON parser (the API's) reads into floats."""
    body = json.loads('{"epochs": Infinity, "lr": NaN}')
    errors = _errors(TrainSpec, **body)
    assert set(errors) == {("epochs",), ("lr",)}
    assert all("finite" in msg for msg in errors.values()), errors


def test_values_a_real_job_uses_are_accepted():
    TrainSpec.model_validate({**TRAIN, "steps": 2_000_000, "epochs": 1000, "tokens_per_batch": 1 << 20,
                              "max_length": 131072, "grad_accum": 64, "lr": 1.0, "weight_decay": 1.0, "grad_clip": 100.0,
                              "seed": 2 ** 63 - 1, "num_draft_layers": 64, "block_size": 64,
                              "layer_types": ["sliding_attention", "full_attention"] * 32, "sliding_window": 65536,
                              "mask_token": "<|MASK|>", "target_layer_ids": list(range(0, 1024, 16)),
                              "max_anchors": 65536, "gamma": 1000.0, "noise_std": 1.0, "checkpoint_every": 10 ** 6,
                              "keep_checkpoints": 100, "eval_prompts": 10_000, "eval_max_new_tokens": 4096})
    TrainSpec.model_validate({**TRAIN, "num_draft_layers": 1, "block_size": 2, "target_layer_ids": [1023]})
    GenerateSpec.model_validate({**GEN, "seed": 2 ** 63 - 1, "temperature": 0.0, "request_timeout_s": 3600.0,
                                 "openai_model": "Qwen/Qwen3-8B", "max_new_tokens": 32768})
    TokenizeSpec.model_validate({**TOK, "max_length": 131072})


def _bounded(prop: dict, schema: dict) -> list[str]:
    """What a property's JSON schema lacks: both numeric bounds, maxItems (and bounded items), maxLength."""
    if "$ref" in prop:
        return _bounded(schema["$defs"][prop["$ref"].split("/")[-1]], schema)
    if "anyOf" in prop:
        return [m for p in prop["anyOf"] if p.get("type") != "null" for m in _bounded(p, schema)]
    kind, missing = prop.get("type"), []
    if kind in ("integer", "number"):
        if not {"minimum", "exclusiveMinimum"} & set(prop):
            missing.append("minimum")
        if not {"maximum", "exclusiveMaximum"} & set(prop):
            missing.append("maximum")
    elif kind == "array":
        missing += [] if "maxItems" in prop else ["maxItems"]
        missing += [f"items.{m}" for m in _bounded(prop.get("items", {}), schema)]
    elif kind == "string" and "enum" not in prop and "const" not in prop:
        missing += [] if "maxLength" in prop else ["maxLength"]
    return missing


@pytest.mark.parametrize("model", [GenerateSpec, TokenizeSpec, TrainSpec, CacheSpec, ImportGGUFSpec])
def test_schema_states_a_bound_for_every_field(model):
    schema = model.model_json_schema()
    gaps = {name: m for name, prop in schema["properties"].items()
            if name not in NOT_HERE and (m := _bounded(prop, schema))}
    assert gaps == {}
