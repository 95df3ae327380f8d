"""Prompt-set reading, shard planning and the thinking split (no servers needed)."""

from __future__ import annotations

import json

import pytest
from dfp_generation.engines.base import derive_seed
from dfp_generation.engines.openai_engine import parse_retry_after
from dfp_generation.plan import plan_shards
from dfp_shared.records.prompts import (
    Prompt,
    PromptError,
    PromptFileError,
    iter_prompts,
    parse_line,
    resolve_prompt_set,
)
from dfp_shared.specs.generate import GenerateSpec
from dfp_shared.storage.store import NotFound, open_store

from .conftest import write_jsonl


def test_accepts_the_common_shapes():
    msgs = parse_line(json.dumps({"id": 7, "messages": [{"role": "system", "content": "s"},
                                                        {"role": "user", "content": "u"}]}), "f.jsonl", 1)
    assert msgs == Prompt("7", [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "f.jsonl", 1)
    share = parse_line(json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}),
                       "f.jsonl", 2)
    assert share.messages == [{"role": "user", "content": "q"}]  # trailing assistant turn dropped
    assert share.id == "f.jsonl:2"
    rc = parse_line(json.dumps({"conversations": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
                    "f.jsonl", 3)
    assert rc.messages == [{"role": "user", "content": "hi"}]
    plain = parse_line(json.dumps({"prompt": "p", "system": "be brief"}), "f.jsonl", 4)
    assert plain.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "p"}]
    assert parse_line("   ", "f.jsonl", 5) is None


@pytest.mark.parametrize("line, reason", [
    ("{not json", "invalid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"text": "x"}', "no 'messages', 'conversations' or 'prompt' field"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role: unknown role 'wizard'"),
    ('{"messages": [{"role": "user", "content": 3}]}', "messages[0].content: expected a string"),
    ('{"messages": [{"role": "assistant", "content": "only"}]}', "no user message"),
    ('{"prompt": 5}', "prompt: expected a string"),
    (b'{"prompt": "\xff"}', "not UTF-8"),
])
def test_unreadable_lines_name_file_line_and_reason(line, reason):
    err = parse_line(line, "p.jsonl", 12, "s3://b/p.jsonl")
    assert isinstance(err, PromptError)
    assert (err.file, err.line) == ("s3://b/p.jsonl", 12)
    assert reason in err.reason
    assert err.to_record()["kind"] == "unreadable_prompt"


def test_plan_covers_every_line_once_and_counts(tmp_path):
    rows_a = [{"prompt": f"a{i}"} for i in range(5)] + ["{bad", ""] + [{"prompt": "a5"}]
    rows_b = [{"prompt": f"b{i}"} for i in range(4)] + ["also bad"]
    write_jsonl(tmp_path / "set" / "a.jsonl", rows_a)
    write_jsonl(tmp_path / "set" / "sub" / "b.jsonl", rows_b)
    (tmp_path / "set" / "notes.txt").write_text("ignored")
    plan = plan_shards(str(tmp_path / "set"), shard_size=4)
    assert plan.prompts == 10 and plan.bad_lines == 2
    assert [s.prompts for s in plan.shards] == [4, 4, 2]
    assert [s.key for s in plan.shards] == ["shard-00000", "shard-00001", "shard-00002"]
    store = open_store(plan.source.root)
    seen_prompts, seen_errors = [], []
    for shard in plan.shards:
        for seg in shard.segments:
            for item in iter_prompts(store, seg["file"], seg["start"], seg["end"]):
                (seen_prompts if isinstance(item, Prompt) else seen_errors).append(item)
    assert sorted(p.messages[0]["content"] for p in seen_prompts) == sorted(
        [f"a{i}" for i in range(6)] + [f"b{i}" for i in range(4)])
    assert sorted((e.file.rsplit("/", 1)[-1], e.line) for e in seen_errors) == [("a.jsonl", 6), ("b.jsonl", 5)]
    assert sum(s.bad_lines for s in plan.shards) == 2


def test_plan_only_bad_lines_still_makes_a_shard_that_reports_them(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", ["nope", "{}"])
    plan = plan_shards(str(tmp_path / "p.jsonl"), shard_size=8)
    assert plan.prompts == 0 and plan.bad_lines == 2 and len(plan.shards) == 1


def test_duplicate_ids_in_a_shard_are_reported(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", [{"id": "x", "prompt": "1"}, {"id": "x", "prompt": "2"}, {"id": "y", "prompt": "3"}])
    plan = plan_shards(str(tmp_path / "p.jsonl"), shard_size=8)
    assert plan.prompts == 2 and plan.bad_lines == 1


def test_resolve_prompt_set(tmp_path, s3_bucket, s3_server):
    with pytest.raises(NotFound, match="no prompt files"):
        resolve_prompt_set(str(tmp_path))
    with pytest.raises(NotFound, match="does not exist"):
        resolve_prompt_set(str(tmp_path / "missing.jsonl"))
    store = open_store(s3_bucket, endpoint_url=s3_server.endpoint_url)
    store.put("prompts/x.jsonl", b'{"prompt": "hi"}\n')
    store.put("prompts/y.jsonl", b'{"prompt": "yo"}\n')
    src = resolve_prompt_set(s3_bucket + "/prompts", endpoint_url=s3_server.endpoint_url)
    assert src.keys == ["x.jsonl", "y.jsonl"]
    one = resolve_prompt_set(s3_bucket + "/prompts/y.jsonl", endpoint_url=s3_server.endpoint_url)
    assert (one.root, one.keys) == (s3_bucket + "/prompts", ["y.jsonl"])  # the file's own folder, as on disk


def test_a_shard_of_one_s3_prompt_file_under_a_key_prefix_root_is_admitted(s3_bucket, s3_server):
    """One prompt file on S3 under a storage root that is a key prefix (the chart's default): the planned shards'
    root is the file's folder, inside the spec's, so the worker admits them (it refused every one when the root
    was the bucket)."""
    from dfp_generation.tasks import GenerationHandler
    from dfp_shared.jobs.queue import Task
    from dfp_shared.storage.roots import StorageRoots

    open_store(s3_bucket, endpoint_url=s3_server.endpoint_url).put("data/sets/p.jsonl", b'{"prompt": "hi"}\n')
    spec = GenerateSpec(prompts=f"{s3_bucket}/data/sets/p.jsonl", model=f"{s3_bucket}/data/m",
                        output=f"{s3_bucket}/data/out/")
    plan = plan_shards(spec.prompts, 8, endpoint_url=s3_server.endpoint_url)
    handler = GenerationHandler.__new__(GenerationHandler)
    handler.roots = StorageRoots([f"{s3_bucket}/data"])
    (shard,) = plan.shards
    handler.confine_task(Task(id="1-0", job_id="j", key=shard.key,
                              payload={"prompts_root": plan.source.root, **shard.to_payload()}), spec, "alice")


def test_seeds_and_retry_after():
    assert derive_seed(0, "a", 0) == derive_seed(0, "a", 0) != derive_seed(0, "a", 1)
    assert 0 <= derive_seed(5, "b", 3) < 2**31
    assert parse_retry_after("3") == 3.0 and parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0


def test_spec_validation():
    with pytest.raises(ValueError, match="model: required"):
        GenerateSpec(prompts="/p", output="/o")
    with pytest.raises(ValueError, match="openai_base_url: no longer accepted.*openai_endpoint"):
        GenerateSpec(prompts="/p", output="/o", engine="openai", openai_base_url="http://localhost:8000/v1")
    with pytest.raises(ValueError, match="openai_endpoint"):
        GenerateSpec(prompts="/p", output="/o", engine="openai", openai_endpoint="localhost:8000")
    spec = GenerateSpec(prompts="/p", output="/o", engine="openai")
    assert spec.thinking and spec.samples_per_prompt == 1


def test_gzipped_prompt_files(tmp_path):
    import gzip

    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "a.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "x"}\r\n{"prompt": "y"}\nbad\n'))
    plan = plan_shards(str(tmp_path / "set"), shard_size=1)
    assert plan.prompts == 2 and plan.bad_lines == 1 and len(plan.shards) == 2
    store = open_store(plan.source.root)
    items = [i for seg in plan.shards[1].segments for i in iter_prompts(store, seg["file"], seg["start"], seg["end"])]
    assert [type(i).__name__ for i in items] == ["Prompt", "PromptError"]  # the trailing bad line joins the last shard
    (tmp_path / "set" / "b.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(PromptFileError, match="b.jsonl.gz: not a readable gzip file"):
        plan_shards(str(tmp_path / "set"), shard_size=1)
