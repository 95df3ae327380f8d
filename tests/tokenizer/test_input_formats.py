"""Training records in the shapes users bring: a ShareGPT JSON array (with its ``gpt`` answers),
Parquet files and save_to_disk directories, streamed; each bad record counted at its place."""

from __future__ import annotations

import json
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.records.token_shards import load_dataset
from dfp_shared.storage.store import open_store
from dfp_tokenizer.encoder import SampleEncoder
from dfp_tokenizer.files import tokenize_input

from .test_job import run_until_idle
from .test_masking import encoder_for


def sharegpt(i: int) -> dict:
    return {"id": f"s{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                             {"from": "gpt", "value": f"answer {i}"}]}


def tokenize(store, key: str, encoder: SampleEncoder):
    res = tokenize_input(store, key, store.url(key), "shards/x.safetensors", encoder, id_prefix=key)
    s = res.stats
    assert s.lines == s.samples + sum(s.errors.values())  # every record accounted for
    return res


def test_sharegpt_array_with_bad_records_and_a_cut_end(tmp_path, qwen3_tokenizer):
    rows = [sharegpt(0), {"id": "q", "conversations": [{"from": "human", "value": "no answer"}]}, 42,
            {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y" * 3000}]}, sharegpt(4),
            sharegpt(5)]
    data = json.dumps(rows, indent=1).encode()
    cut = data[: data.rindex(b"answer 5")]
    (tmp_path / "sharegpt.json").write_bytes(cut)
    store = open_store(str(tmp_path))
    small = SampleEncoder(qwen3_tokenizer, encoder_for(qwen3_tokenizer).spec,
                          replace(encoder_for(qwen3_tokenizer).limits, max_line_bytes=2048))
    res = tokenize(store, "sharegpt.json", small)
    assert res.stats.samples == 2 and res.stats.lines == 6
    by_record = {e["record"]: e for e in res.errors}
    assert {r: e["reason"] for r, e in by_record.items()} == {
        1: "no_assistant_turn", 2: "not_an_object", 3: "record_too_long", 5: "truncated_file"}
    assert f"ends at byte {len(cut)} mid-record" in by_record[5]["detail"]
    assert all("line" not in e for e in res.errors)


def test_parquet_and_arrow_training_records(tmp_path, qwen3_tokenizer):
    datasets = pytest.importorskip("datasets")
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                         {"role": "assistant" if i != 2 else "wizard", "content": f"a{i}"}]}
            for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet", row_group_size=2)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    store = open_store(str(tmp_path))
    enc = encoder_for(qwen3_tokenizer)
    res = tokenize(store, "t.parquet", enc)
    assert res.stats.samples == 4 and [(e["row"], e["reason"]) for e in res.errors] == [(2, "unknown_role")]
    arrow = next(k for k in store.list("hf/") if k.endswith(".arrow"))
    res = tokenize(store, arrow, enc)
    assert res.stats.samples == 4 and [(e["row"], e["reason"]) for e in res.errors] == [(2, "unknown_role")]
    (tmp_path / "bad.parquet").write_bytes(b"garbage")
    res = tokenize(store, "bad.parquet", enc)
    assert res.stats.samples == 0 and [(e["row"], e["reason"]) for e in res.errors] == [(0, "unreadable_file")]


def test_job_over_an_array_a_parquet_file_and_a_jsonl_file(redis_client, tmp_path, qwen3_tokenizer_dir):
    src = tmp_path / "in"
    src.mkdir()
    (src / "sharegpt.json").write_text(json.dumps([sharegpt(i) for i in range(3)]))
    pq.write_table(pa.Table.from_pylist([sharegpt(i + 10) for i in range(2)]), src / "more.parquet")
    (src / "c.jsonl").write_text(json.dumps(sharegpt(20)) + "\n")
    (src / "manifest.json").write_text(json.dumps({"not": "records"}))  # a plain JSON file is not an input
    out = tmp_path / "out"
    job, _ = queue_job(redis_client, "tokenize", {"input": str(src), "output": str(out),
                                                   "tokenizer": str(qwen3_tokenizer_dir)})
    run_until_idle(redis_client)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "succeeded", rec.error
    assert rec.totals["files"] == 3 and rec.outputs["samples"] == 6 and rec.outputs["bad_lines"] == 0
    ids = sorted(load_dataset(str(out)).sample_ids)
    assert ids == sorted(["s0", "s1", "s2", "s10", "s11", "s20"])
