"""A pipeline without generate: it starts at tokenize, on a prompt set's own answers."""

from __future__ import annotations

import httpx
import pytest
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job, validate_spec
from dfp_shared.specs import PipelineSpec
from dfp_shared.storage.roots import OutsideRoots, StorageRoots


def _spec(tmp_path, **tokenize) -> dict:
    return {"tokenize": {"output": (tmp_path / "tokens").as_uri(), "tokenizer": "/models/tiny", **tokenize},
            "train": {"target": "/models/tiny", "output": (tmp_path / "drafter").as_uri()}}


def _roots(tmp_path) -> StorageRoots:
    return StorageRoots([tmp_path.as_uri(), "file:///models"])


def test_the_stages_are_those_the_spec_has(tmp_path):
    answers = _spec(tmp_path, input=(tmp_path / "answers.jsonl").as_uri())
    assert PipelineSpec.stages_of(answers) == ("tokenize", "train")
    assert PipelineSpec.stages_of(validate_spec("pipeline", answers)) == ("tokenize", "train")
    full = {**answers, "generate": {"prompts": "file:///data/p.jsonl", "model": "/models/tiny"}}
    assert PipelineSpec.stages_of(full) == PipelineSpec.STAGES == ("generate", "tokenize", "train")


def test_without_generate_tokenize_must_name_its_input(tmp_path):
    with pytest.raises(ValueError, match=r"tokenize\.input: required in a pipeline without a generate stage"):
        validate_spec("pipeline", _spec(tmp_path))


def test_without_generate_the_pipeline_starts_at_tokenize(redis_client, tmp_path):
    answers = (tmp_path / "answers.jsonl").as_uri()
    job, created = queue_job(redis_client, "pipeline", _spec(tmp_path, input=answers), roots=_roots(tmp_path))
    assert created and job.state.value == "running" and job.totals == {"stages": 2}
    assert set(job.outputs) == {"tokenize_job"}
    stage = JobStore(redis_client).get(job.outputs["tokenize_job"])
    assert stage.stage == "tokenize" and stage.parent_id == job.id and stage.spec["input"] == answers


def test_with_generate_the_pipeline_still_starts_there(redis_client, tmp_path):
    spec = {**_spec(tmp_path), "generate": {"prompts": (tmp_path / "p.jsonl").as_uri(), "model": "/models/tiny"}}
    job, _ = queue_job(redis_client, "pipeline", spec, roots=_roots(tmp_path))
    assert job.totals == {"stages": 3} and set(job.outputs) == {"generate_job"}


def test_the_tokenize_input_must_lie_inside_the_roots(redis_client, tmp_path):
    spec = _spec(tmp_path, input="file:///etc/answers.jsonl")
    with pytest.raises(OutsideRoots, match=r"^spec\.tokenize\.input: file:///etc/answers\.jsonl is outside"):
        queue_job(redis_client, "pipeline", spec, roots=_roots(tmp_path))
    assert not JobStore(redis_client).list(offset=0, limit=10, spec=False)[0]


def test_the_client_submits_a_pipeline_without_generate_from_flags(monkeypatch):
    from click.testing import CliRunner
    from dfp_cli import client

    sent = []

    def call(self, method, path, **kw):
        sent.append(kw["json"])
        return httpx.Response(201, json={"id": "p1", "type": "pipeline", "state": "running"})

    monkeypatch.setattr(client.Api, "call", call)
    result = CliRunner().invoke(client.submit, ["pipeline", "--tokenize", "input=file:///data/sharegpt.json",
                                                "--tokenize", "tokenizer=/models/t", "--train", "target=/models/t"])
    assert result.exit_code == 0, result.output
    assert sent == [{"type": "pipeline", "spec": {"tokenize": {"input": "file:///data/sharegpt.json",
                                                                "tokenizer": "/models/t"},
                                                   "train": {"target": "/models/t"}}}]
