"""Spec bounds through the API: the reproduced values are 422s naming the field, and the served
schema states the bounds."""

from __future__ import annotations

import json
import math

from .test_jobs import PIPE_SPEC, TRAIN_SPEC


def test_api_rejects_the_reproduced_values_and_serves_the_bounds(api):
    for field, value in [("steps", 2 ** 63), ("block_size", 10 ** 9), ("num_draft_layers", 10 ** 6),
                         ("epochs", 1e308)]:
        resp = api.post("/v1/jobs", json={"type": "train", "spec": {**TRAIN_SPEC, field: value}})
        assert resp.status_code == 422, resp.text
        assert [f["field"] for f in resp.json()["fields"]] == [f"spec.{field}"]
    body = json.dumps({"type": "train", "spec": {**TRAIN_SPEC, "epochs": math.inf}})  # JSON text: Infinity
    assert "Infinity" in body
    resp = api.post("/v1/jobs", content=body.encode(),
                    headers={"Content-Type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert [f["field"] for f in resp.json()["fields"]] == ["spec.epochs"]
    train = api.get("/openapi.json").json()["components"]["schemas"]["TrainSpec"]["properties"]
    assert train["block_size"]["maximum"] == 64 and train["epochs"]["maximum"] == 1000
    assert train["target_layer_ids"]["anyOf"][0]["items"]["maximum"] == 1023


def test_pipeline_stages_carry_the_bounds(api):
    spec = {**PIPE_SPEC, "train": {**PIPE_SPEC["train"], "block_size": 10 ** 9, "epochs": math.inf}}
    resp = api.post("/v1/jobs", content=json.dumps({"type": "pipeline", "spec": spec}).encode(),
                    headers={"Content-Type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert {f["field"] for f in resp.json()["fields"]} == {"spec.train.block_size", "spec.train.epochs"}
