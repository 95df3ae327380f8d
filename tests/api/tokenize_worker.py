"""A real tokenize worker for API tests: real Qwen3 tokenizer, real files, real token shards.

It follows the task contract (plan -> one task per input file -> finalize -> ``finish_job``) so
the API is exercised against real queue consumption, progress counters and job completion.
``gate``, when given, makes each file task wait for it (a test can cancel the job mid-way).
"""

from __future__ import annotations

import json
import threading

import redis
from dfp_shared.jobs import JobState, JobStore
from dfp_shared.queue import TaskQueue
from dfp_shared.storage import open_store
from dfp_shared.submit import PLAN_KEY, finish_job
from dfp_shared.token_shards import build_manifest, encode_shard, shard_entry
from dfp_shared.tokenizer_assets import chat_template_fingerprint, tokenizer_fingerprint
from dfp_shared.worker import Worker

FINALIZE_KEY = "finalize"


def _shard_name(key: str) -> str:
    return key.rsplit("/", 1)[-1].removesuffix(".jsonl")


class TokenizeHandler:
    def __init__(self, r: redis.Redis, tokenizer, gate: threading.Event | None = None):
        self.r = r
        self.queue = TaskQueue(r, "tokenize")
        self.tok = tokenizer
        self.meta = {"tokenizer_fingerprint": tokenizer_fingerprint(self.tok),
                     "chat_template_fingerprint": chat_template_fingerprint(self.tok)}
        self.gate = gate

    def __call__(self, task, ctx) -> None:
        spec = ctx.jobs.get(task.job_id).spec
        if task.key == PLAN_KEY:
            keys = sorted(k for k in open_store(spec["input"]).list() if k.endswith(".jsonl"))
            ctx.jobs.set_totals(task.job_id, files=len(keys), tasks=len(keys))
            self.queue.enqueue_many(task.job_id, [(k, {"file": k}) for k in keys])
        elif task.key == FINALIZE_KEY:
            out = open_store(spec["output"])
            entries = [shard_entry(k, out.get(k)) for k in sorted(out.list("shards/"))]
            out.put("manifest.json", json.dumps(build_manifest(entries)).encode())
            finish_job(self.r, task.job_id, JobState.succeeded, outputs={"dataset": spec["output"]})
        else:
            self._tokenize_file(task, ctx, spec)

    def _tokenize_file(self, task, ctx, spec) -> None:
        if self.gate is not None:
            self.gate.wait(30)
        ctx.check()
        lines = open_store(spec["input"]).get(task.key).decode().splitlines()
        ids, tokens, masks = [], [], []
        for line in lines:
            rec = json.loads(line)
            prompt = self.tok.apply_chat_template(rec["messages"][:-1], tokenize=False, add_generation_prompt=True)
            full = self.tok.apply_chat_template(rec["messages"], tokenize=False)
            p_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
            f_ids = self.tok(full, add_special_tokens=False)["input_ids"]
            ids.append(rec["id"])
            tokens.append(f_ids)
            masks.append([0] * len(p_ids) + [1] * (len(f_ids) - len(p_ids)))
        data = encode_shard(ids, tokens, masks, {**self.meta, "source": task.key})
        open_store(spec["output"]).put(f"shards/{_shard_name(task.key)}.safetensors", data)
        if ctx.jobs.complete_task(task.job_id, task.key, files=1, samples=len(ids), tokens=sum(map(len, tokens))):
            if ctx.jobs.all_tasks_done(task.job_id):
                self.queue.enqueue(task.job_id, FINALIZE_KEY, {})


def start_worker(r: redis.Redis, tokenizer, gate: threading.Event | None = None) -> tuple[Worker, threading.Thread]:
    """Run a worker thread; ``tokenizer`` is a loaded Hugging Face tokenizer (see :func:`load_tokenizer`)."""
    worker = Worker(TaskQueue(r, "tokenize"), JobStore(r), TokenizeHandler(r, tokenizer, gate), block_ms=200)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


def write_completions(root, files: int, per_file: int) -> str:
    """Completion JSONL files under ``root`` (a local dir); returns its file:// URI."""
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(root / f"part-{f:03d}.jsonl", "w") as fh:
            for i in range(per_file):
                fh.write(json.dumps({"id": f"{f}-{i}", "messages": [
                    {"role": "user", "content": f"What is {i} plus {f}?"},
                    {"role": "assistant", "content": f"{i} plus {f} is {i + f}.",
                     "reasoning_content": f"Adding {i} and {f}."}],
                    "meta": {"model": "tiny", "finish_reason": "stop"}}) + "\n")
    return root.as_uri()
