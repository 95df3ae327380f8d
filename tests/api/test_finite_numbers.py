"""Non-finite numbers (NaN, Infinity) anywhere in a spec are refused with 422, never stored as null."""

from __future__ import annotations

import pytest

from .conftest import WRITE_KEY, auth

TOKENIZE = '{"type": "tokenize", "spec": {"input": "s3://bucket/in/", "output": "s3://bucket/out", ' \
           '"tokenizer": "file:///models/tiny", "template_kwargs": %s}}'
PIPELINE = ('{"type": "pipeline", "spec": {"generate": {"prompts": "s3://bucket/p/", "model": "file:///models/tiny"},'
            ' "tokenize": {"tokenizer": "file:///models/tiny", "template_kwargs": {"a": {"b": %s}}}, '
            '"train": {"target": "file:///models/tiny"}}}')


@pytest.mark.parametrize("body", [
    TOKENIZE % '{"x": NaN}',
    TOKENIZE % '{"x": Infinity}',
    TOKENIZE % '{"x": [1, {"y": -Infinity}]}',
    TOKENIZE % '{"x": 1e999}',
    PIPELINE % "NaN",
    PIPELINE % "-Infinity",
])
def test_non_finite_numbers_in_a_spec_are_422(api, body):
    resp = api.post("/v1/jobs", content=body, headers={**auth(WRITE_KEY), "Content-Type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert api.get("/v1/jobs").json()["total"] == 0


def test_finite_template_kwargs_are_kept(api):
    resp = api.post("/v1/jobs", content=TOKENIZE % '{"x": [1.5, {"y": -2}], "z": null}',
                    headers={**auth(WRITE_KEY), "Content-Type": "application/json"})
    assert resp.status_code == 201, resp.text
    assert resp.json()["spec"]["template_kwargs"] == {"x": [1.5, {"y": -2}], "z": None}
