"""The worker pool over moto's S3: 2 processes, one SIGKILLed while it holds a file task.

The job must still complete with every input sample exactly once, and each sample's tokens must
equal what Hugging Face's ``apply_chat_template(tokenize=True)`` gives for it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
from dfp_shared.jobs.queue import GROUP, stream_name
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_shared.records.token_shards import load_dataset
from dfp_shared.storage.store import open_store

from tests.support.cli import cli_cmd, cli_env

from .corpus import jsonl, records

FILES, PER_FILE = 8, 40


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def holder_of_a_file_task(r, pids: list[int]) -> int | None:
    """A pool process that has a file task in hand right now."""
    for row in r.xpending_range(stream_name("tokenize"), GROUP, "-", "+", 50):
        pid = int(row["consumer"].rsplit("-", 2)[-2])
        fields = r.xrange(stream_name("tokenize"), row["message_id"], row["message_id"])
        if pid in pids and fields and fields[0][1].get("key", "").endswith(".jsonl"):
            return pid
    return None


def sha(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int32).tobytes()).hexdigest()


def test_sigkill_mid_job_every_sample_exactly_once(redis_server, redis_client, s3_server, s3_bucket, tmp_path,
                                                  qwen3_tokenizer_dir):
    store = open_store(s3_bucket, endpoint_url=s3_server.endpoint_url)
    recs = records(FILES * PER_FILE, seed=7)
    for f in range(FILES):
        store.put(f"in/part-{f:03d}.jsonl", jsonl(recs[f * PER_FILE:(f + 1) * PER_FILE]))
    for f in qwen3_tokenizer_dir.iterdir():
        store.put(f"tok/{f.name}", f.read_bytes())
    job, _ = queue_job(redis_client, "tokenize", {"input": f"{s3_bucket}/in/", "output": f"{s3_bucket}/out",
                                                  "tokenizer": f"{s3_bucket}/tok", "samples_per_batch": 16})
    env = cli_env(DFLASH_REDIS_URL=redis_server.url, DFLASH_S3_ENDPOINT_URL=s3_server.endpoint_url,
                  DFLASH_LEASE_MS="1500", DFLASH_CACHE_DIR=str(tmp_path / "cache"), DFLASH_LOG_LEVEL="WARNING",
                  DFLASH_RESTART_DELAY_S="0.2", AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    log = open(tmp_path / "pool.log", "wb")
    pool = subprocess.Popen(cli_cmd("tokenizer", "worker", "--processes", "2", "--threads", "1"), env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    jobs = JobStore(redis_client)
    try:
        killed = None
        deadline = time.monotonic() + 240
        while killed is None and time.monotonic() < deadline:
            assert pool.poll() is None, (tmp_path / "pool.log").read_text()[-3000:]
            rec = jobs.get(job.id)
            assert not rec.state.terminal, "the job finished before a worker could be killed"
            victim = holder_of_a_file_task(redis_client, children(pool.pid))
            if victim is not None and rec.counters.get("files", 0) >= 1:
                os.kill(victim, signal.SIGKILL)
                killed = victim
            time.sleep(0.02)
        assert killed, "no worker process ever held a file task"
        while not jobs.get(job.id).state.terminal and time.monotonic() < deadline:
            time.sleep(0.2)
        rec = jobs.get(job.id)
        assert rec.state.value == "succeeded", (rec.error, (tmp_path / "pool.log").read_text()[-3000:])
        assert killed not in children(pool.pid)
    finally:
        pool.send_signal(signal.SIGTERM)
        try:
            pool.wait(60)
        except subprocess.TimeoutExpired:
            pool.kill()
        log.close()

    assert rec.counters["files"] == FILES and rec.counters["samples"] == FILES * PER_FILE
    ds = load_dataset(f"{s3_bucket}/out", endpoint_url=s3_server.endpoint_url)
    assert len(ds.sample_ids) == len(set(ds.sample_ids)) == FILES * PER_FILE
    assert set(ds.sample_ids) == {r["id"] for r in recs}
    tok = load_tokenizer(qwen3_tokenizer_dir)
    want = {r["id"]: sha(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=False)) for r in recs}
    got = {sid: sha(ds.input_ids[int(ds.offsets[i]):int(ds.offsets[i + 1])]) for i, sid in enumerate(ds.sample_ids)}
    assert got == want
