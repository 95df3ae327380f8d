"""Tokenization throughput with loss masks, on the real Qwen3 tokenizer, in tokens/s per core.

Corpus: deterministic thinking-mode conversations (some multi-turn; English, code and CJK),
generated in code and serialised as JSONL files, as the generation service writes them.

* project: the tokenizer service's per-file path (``dfp_tokenizer.files.tokenize_file``): parse
  each line, render the chat template, locate the assistant spans, tokenize in batches, build the
  masks, encode the safetensors shard. One process.
* baseline: the usual per-sample script: ``apply_chat_template(tokenize=True)`` per sample, then for
  each assistant turn re-render and re-tokenize the prefix (with the generation prompt) and the
  prefix including the turn to find the mask boundaries; then the same shard encoding.
* limit: the ``tokenizers`` library's ``encode_batch`` alone on the already-rendered texts.

Per-core figures divide tokens by the CPU time of the (single-threaded) process and of its render
process (where chat templates run), best of
interleaved runs, so other work on a shared machine does not skew one side. Also: the project path
in 2 processes at once (each on half of the files), as aggregate tokens/s of wall time and its
scaling over one process (meaningful only when two cores are free). ``--samples`` sets the size.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

from _common import report
from dfp_dev.targets.qwen3_tokenizer import qwen3_tokenizer_dir
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_shared.records.token_shards import encode_shard
from dfp_shared.specs.tokenize import TokenizeSpec
from dfp_tokenizer import render_process
from dfp_tokenizer.encoder import SampleEncoder
from dfp_tokenizer.files import tokenize_file
from dfp_tokenizer.records import parse_line

from tests.tokenizer.corpus import jsonl, records

FILES = 8


def corpus(n: int) -> list[bytes]:
    recs = records(n, seed=1234)
    per = (n + FILES - 1) // FILES
    return [jsonl(recs[i:i + per]) for i in range(0, n, per)]


def make_encoder(tok) -> SampleEncoder:
    """Built once per process, as the service caches it (fingerprints, template probes)."""
    return SampleEncoder(tok, TokenizeSpec(input="/in", output="/out", tokenizer="/tok"))


def run_project(enc: SampleEncoder, files: list[bytes]) -> int:
    return sum(tokenize_file(data, f"file:///in/{i}.jsonl", f"shards/{i}.safetensors", enc, id_prefix=str(i)).stats.tokens
               for i, data in enumerate(files))


def run_baseline(tok, files: list[bytes]) -> int:
    total = 0
    for data in files:
        ids_out, toks, masks = [], [], []
        for line in data.splitlines():
            rec = json.loads(line)
            msgs = rec["messages"]
            ids = list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False))
            mask = [0] * len(ids)
            for i, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                start = len(tok.apply_chat_template(msgs[:i], tokenize=True, add_generation_prompt=True, return_dict=False))
                end = len(tok.apply_chat_template(msgs[:i + 1], tokenize=True, return_dict=False))
                for k in range(start, min(end, len(ids))):
                    mask[k] = 1
            ids_out.append(rec["id"])
            toks.append(ids)
            masks.append(mask)
            total += len(ids)
        encode_shard(ids_out, toks, masks, {"source": "bench"})
    return total


def rendered_texts(enc: SampleEncoder, files: list[bytes]) -> list[str]:
    texts = []
    for data in files:
        samples = [parse_line(line, str(n)) for n, line in enumerate(data.splitlines())]
        texts.extend(p.text for p in enc.prepare_many(samples))
    return texts


def _worker(tok_dir: str, files: list[bytes], ready, go, results) -> None:
    tok = load_tokenizer(tok_dir)  # loaded after fork, as the pool does
    enc = make_encoder(tok)
    ready.release()
    go.wait()
    results.put(run_project(enc, files))


def run_parallel(tok_dir: str, files: list[bytes], procs: int) -> tuple[int, float]:
    ctx = mp.get_context("fork")
    ready, go, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(tok_dir, files[i::procs], ready, go, results)) for i in range(procs)]
    for p in ps:
        p.start()
    for _ in ps:
        assert ready.acquire(timeout=300), "a worker process did not start"
    t0 = time.perf_counter()
    go.set()
    tokens = sum(results.get(timeout=900) for _ in ps)
    elapsed = time.perf_counter() - t0
    for p in ps:
        p.join()
    return tokens, elapsed


def cpu_s() -> float:
    """CPU seconds of this process and of its render processes (where the chat template runs)."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for child in render_process.POOL.children():
        try:
            with open(f"/proc/{child.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def timed(fn, *args) -> tuple[int, float]:
    """(result, CPU seconds of this process and its render processes): per-core cost, unaffected by other
    load on the machine."""
    t0 = cpu_s()
    n = fn(*args)
    return n, cpu_s() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4000, help="conversations in the corpus")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved runs of project, baseline and limit (best kept)")
    ap.add_argument("--baseline-samples", type=int, default=150, help="conversations the (slow) baseline runs on")
    args = ap.parse_args()

    tok_dir = str(qwen3_tokenizer_dir())
    files = corpus(args.samples)
    # two processes first: the parent has not loaded a tokenizer yet (fork-safe, as in the pool)
    par_tokens, par_s = run_parallel(tok_dir, files, 2)

    tok = load_tokenizer(tok_dir)
    enc = make_encoder(tok)
    run_project(enc, files[:1])  # warm-up
    texts = rendered_texts(enc, files)
    backend = tok.backend_tokenizer

    def limit_run() -> None:
        for i in range(0, len(texts), 256):
            backend.encode_batch(texts[i:i + 256], add_special_tokens=False)

    # interleaved, best of `repeats`: a busy machine slows all three alike instead of one of them
    base_files = corpus(args.baseline_samples)
    limit_s = proj_s = base_s = proj_wall_s = float("inf")
    for _ in range(args.repeats):
        limit_s = min(limit_s, timed(lambda: limit_run() or 0)[1])
        w0 = time.perf_counter()
        proj_tokens, t = timed(run_project, enc, files)
        proj_wall_s = min(proj_wall_s, time.perf_counter() - w0)
        proj_s = min(proj_s, t)
        base_tokens, t = timed(run_baseline, tok, base_files)
        base_s = min(base_s, t)
    limit_tokens = proj_tokens  # the same rendered texts: the same tokens

    project, baseline, limit = proj_tokens / proj_s, base_tokens / base_s, limit_tokens / limit_s
    report("tokenize", "tokens/s per core", project, baseline, limit,
           samples=args.samples, repeats=args.repeats, tokens=proj_tokens, baseline_samples=args.baseline_samples,
           one_process_wall_tokens_per_s=round(proj_tokens / proj_wall_s, 1),
           two_process_wall_tokens_per_s=round(par_tokens / par_s, 1),
           two_process_scaling=round((par_tokens / par_s) / (proj_tokens / proj_wall_s), 3))


if __name__ == "__main__":
    main()
