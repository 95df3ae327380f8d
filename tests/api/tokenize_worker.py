"""The tokenizer service's own worker, run in a thread for API tests, and completion files for it.

``gate``, when given, holds every file task until it is set (so a test can cancel a job while a
task is in hand); plan and finalize tasks pass straight through.
"""

from __future__ import annotations

import json
import threading

import redis
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import PLAN_KEY
from dfp_shared.jobs.types import TOKENIZE
from dfp_shared.jobs.worker import Worker
from dfp_tokenizer.tasks import FINALIZE_KEY, EncoderCache, TokenizeHandler


def start_worker(r: redis.Redis, encoders: EncoderCache,
                 gate: threading.Event | None = None) -> tuple[Worker, threading.Thread]:
    """A tokenize worker thread; ``encoders`` is shared across tests so the tokenizer loads once."""
    handler = TokenizeHandler(r, encoders)

    def gated(task, ctx):
        if gate is not None and task.key not in (PLAN_KEY, FINALIZE_KEY):
            gate.wait(30)
        return handler(task, ctx)

    worker = Worker(TaskQueue(r, TOKENIZE.stream), JobStore(r), gated, block_ms=200)
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
