"""The completion record and its manifest: what generation writes is what the tokenizer reads."""

from __future__ import annotations

import json

import pytest
from dfp_shared.records.completions import (
    FORMAT,
    MANIFEST,
    ManifestError,
    build_manifest,
    completion_record,
    encode_records,
    read_manifest,
    record_id,
    record_messages,
    shard_entry,
    write_manifest,
)
from dfp_shared.storage.store import LocalStore, NotFound
from dfp_tokenizer.records import parse_line

PROMPT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]


def test_record_round_trip_through_the_tokenizer_reader():
    with_reasoning = completion_record("p1#0", PROMPT, "answer", "plan", {"model": "m"})
    without = completion_record("p2", PROMPT, "answer", None, {})
    assert with_reasoning["messages"][-1] == {"role": "assistant", "content": "answer", "reasoning_content": "plan"}
    assert "reasoning_content" not in without["messages"][-1]
    lines = encode_records([with_reasoning, without]).decode().splitlines()
    assert [json.loads(line) for line in lines] == [with_reasoning, without]
    sample = parse_line(lines[0], "f:1")
    assert sample.id == "p1#0"
    assert sample.messages[-1] == {"role": "assistant", "content": "answer", "reasoning": "plan"}
    assert parse_line(lines[1], "f:2").messages[-1]["reasoning"] is None


def test_record_fields():
    assert record_id({"id": 7}, "d") == "7"
    assert record_id({"id": ""}, "d") == record_id({}, "d") == "d"
    assert record_messages({"messages": [1], "conversations": [2]}) == [1]
    assert record_messages({"conversations": [2]}) == [2]
    assert record_messages({"conversation": [3]}) == [3]
    assert record_messages({"messages": None, "conversations": [2]}) is None
    assert record_messages({}) is None


def test_manifest_write_and_read(tmp_path):
    store = LocalStore(tmp_path)
    with pytest.raises(NotFound):
        read_manifest(store)
    counts = {"prompts": 2, "completions": 3, "errors": 1, "unreadable": 0, "truncated": 1, "output_tokens": 40,
              "shards": 1}
    clean = dict(counts, errors=0)
    shards = [shard_entry("shard-00000", counts), shard_entry("shard-00001", clean)]
    assert shards[0] == {"key": "completions/shard-00000.jsonl", "prompts": 2, "completions": 3, "errors": 1,
                         "unreadable": 0, "truncated": 1, "output_tokens": 40,
                         "errors_key": "errors/shard-00000.jsonl"}
    assert "errors_key" not in shards[1]
    manifest = build_manifest({"model": "m"}, shards, job_id="j1")
    assert manifest["format"] == FORMAT and manifest["job_id"] == "j1" and manifest["completions"] == 6
    assert "job_id" not in build_manifest({}, shards)
    write_manifest(store, manifest)
    assert read_manifest(store) == manifest
    store.put(MANIFEST, b'{"format": "other"}')
    with pytest.raises(ManifestError, match="format 'other'"):
        read_manifest(store)
    store.put(MANIFEST, b"{nope")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(store)
