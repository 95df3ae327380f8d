"""Prompt sets in the shapes users bring: JSON arrays, MT-Bench turns, Parquet files, save_to_disk
directories. Every unreadable record is one PromptError at its place."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dfp_shared.records.prompts import (
    Prompt,
    PromptError,
    iter_prompts,
    parse_prompt,
    read_prompt_set,
    resolve_prompt_set,
)
from dfp_shared.storage.store import open_store


def sharegpt(i: int) -> dict:
    return {"id": f"s{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}


def test_mt_bench_turns_give_the_first_turn_and_the_question_id():
    p = parse_prompt({"question_id": 81, "category": "writing", "turns": ["first", "second"]}, "q.jsonl", 1)
    assert p == Prompt("81", [{"role": "user", "content": "first"}], "q.jsonl", 1)
    assert parse_prompt({"turns": ["only"]}, "q.jsonl", 4).id == "q.jsonl:4"
    with pytest.raises(ValueError, match="turns: expected a list of strings"):
        parse_prompt({"question_id": 1, "turns": []}, "q.jsonl", 2)
    with pytest.raises(ValueError, match="turns"):
        parse_prompt({"question_id": 1, "turns": [{"x": 1}]}, "q.jsonl", 3)
    # a record with an id of its own keeps it; question_id names only turns records
    assert parse_prompt({"id": "x", "question_id": 5, "turns": ["t"]}, "f", 1).id == "x"
    assert parse_prompt({"question_id": 5, "prompt": "p"}, "f", 2).id == "f:2"


def test_array_prompts_and_errors_name_the_record_index(tmp_path):
    rows = [sharegpt(0), {"prompt": "p1"}, {"conversations": "oops"}, "not an object", {"question_id": 9, "turns": ["t"]}]
    (tmp_path / "set.json").write_text(json.dumps(rows, indent=1))
    store = open_store(str(tmp_path))
    items = list(iter_prompts(store, "set.json"))
    prompts = [i for i in items if isinstance(i, Prompt)]
    errors = [i for i in items if isinstance(i, PromptError)]
    assert [(p.id, p.line, p.unit) for p in prompts] == [("s0", 0, "record"), ("set.json#1", 1, "record"),
                                                         ("9", 4, "record")]
    assert prompts[0].messages == [{"role": "user", "content": "q0"}]
    assert prompts[0].place() == {"file": "set.json", "record": 0}
    assert [(e.line, e.unit) for e in errors] == [(2, "record"), (3, "record")]
    assert errors[0].to_record() == {"file": store.url("set.json"), "record": 2, "kind": "unreadable_prompt",
                                     "error": "conversations: expected a list of messages"}


def test_truncated_array_prompts_and_one_error_with_the_byte_offset(tmp_path):
    data = json.dumps([sharegpt(i) for i in range(6)], indent=2).encode()
    cut = data[: data.rindex(b'"from": "gpt"')]
    (tmp_path / "cut.json").write_bytes(cut)
    prompts, errors = read_prompt_set(str(tmp_path / "cut.json"))
    assert [p.id for p in prompts] == [f"s{i}" for i in range(5)]
    assert len(errors) == 1 and errors[0].line == 5 and f"ends at byte {len(cut)} mid-record" in errors[0].reason


def test_parquet_prompts_with_a_bad_row(tmp_path):
    rows = [{"id": "a", "messages": [{"role": "user", "content": "x"}], "prompt": None},
            {"id": "b", "messages": [{"role": "wizard", "content": "y"}], "prompt": None},
            {"id": None, "messages": None, "prompt": "plain"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet", row_group_size=2)
    prompts, errors = read_prompt_set(str(tmp_path / "p.parquet"))
    assert [(p.id, p.line, p.unit) for p in prompts] == [("a", 0, "row"), ("p.parquet#2", 2, "row")]
    assert [(e.line, e.unit) for e in errors] == [(1, "row")] and "unknown role 'wizard'" in errors[0].reason


def test_corrupt_parquet_file_is_one_counted_error(tmp_path):
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "bad.parquet").write_bytes(b"not parquet")
    (tmp_path / "set" / "good.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    prompts, errors = read_prompt_set(str(tmp_path / "set"))
    assert [p.messages[0]["content"] for p in prompts] == ["x"]
    assert len(errors) == 1 and errors[0].file.endswith("bad.parquet") and "Parquet" in errors[0].reason


def test_save_to_disk_directory_is_a_prompt_set(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"question_id": i, "category": "c", "turns": [f"t{i}", "then"]} for i in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "mt"), num_shards=2)
    source = resolve_prompt_set(str(tmp_path / "mt"))
    assert all(k.startswith("data-") and k.endswith(".arrow") for k in source.keys) and len(source.keys) == 2
    prompts, errors = read_prompt_set(str(tmp_path / "mt"))
    assert [p.id for p in prompts] == [str(i) for i in range(5)] and not errors
    assert prompts[0].messages == [{"role": "user", "content": "t0"}]


def test_jsonl_is_read_as_before(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"prompt": "a"}) + "\n\n{bad\n")
    prompts, errors = read_prompt_set(str(tmp_path / "p.json"))
    assert [(p.id, p.line, p.unit) for p in prompts] == [("p.json:1", 1, "line")]
    assert [(e.line, e.unit) for e in errors] == [(3, "line")]
    assert set(errors[0].to_record()) == {"file", "line", "error", "kind"}
