"""Task handlers of a tokenize job: plan -> one task per input file -> finalize.

* ``plan`` lists the input files, writes ``parts/_plan.json``, sets the totals and queues one
  task per file (key = the file's key, so a redelivery overwrites instead of duplicating).
* a file task downloads the file, tokenizes it, uploads ``shards/<name>.safetensors``,
  ``errors/<name>.jsonl`` (if any line was bad) and ``parts/<name>.json`` (manifest entry and
  statistics), then counts the file exactly once; the worker that counts the last file queues
  ``finalize``.
* ``finalize`` merges the parts into ``stats.json`` and ``manifest.json`` (written last: its
  presence means the dataset is complete) and finishes the job.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path

from dfp_shared.config import CommonSettings, load_settings
from dfp_shared.jobs.flow import finish_job
from dfp_shared.jobs.queue import Task, TaskQueue
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import PLAN_KEY
from dfp_shared.jobs.worker import JobHandler, TaskContext, Worker
from dfp_shared.models.tokenizer_assets import default_cache_dir, load_tokenizer
from dfp_shared.records.token_shards import MANIFEST, build_manifest
from dfp_shared.specs.tokenize import TokenizeSpec
from dfp_shared.storage.ownership import OutputClaims
from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import NotFound, ObjectStore, local_dir_confined, open_store, split_uri, visible
from prometheus_client import Counter

from .encoder import SampleEncoder
from .files import HIST_EDGES, INPUT_SUFFIXES, errors_jsonl, listed_inputs, shard_name, tokenize_input
from .limits import EncodeLimits, TemplateUnavailable

log = logging.getLogger(__name__)

FILES_DONE = Counter("dfp_tokenizer_files_total", "Input files tokenized")
SAMPLES = Counter("dfp_tokenizer_samples_total", "Samples written to token shards")
TOKENS = Counter("dfp_tokenizer_tokens_total", "Tokens written to token shards", ["trained"])
BAD_LINES = Counter("dfp_tokenizer_bad_lines_total", "Input lines rejected, by reason", ["reason"])

FINALIZE_KEY = "finalize"
PLAN_FILE = "parts/_plan.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "config.json",
                   "tokenizer.model", "generation_config.json")


class EncoderCache:
    """Tokenizers and encoders of this process, loaded once on first use (after fork)."""

    def __init__(self, endpoint_url: str | None = None, cache_dir: str | None = None,
                 limits: EncodeLimits | None = None):
        self.endpoint_url = endpoint_url
        self.limits = limits or EncodeLimits()
        self.cache_dir = (Path(cache_dir) if cache_dir else default_cache_dir()) / "tokenizers"
        self._tokenizers: dict[str, object] = {}
        self._encoders: dict[str, SampleEncoder] = {}
        self._lock = threading.Lock()

    def tokenizer_dir(self, uri: str) -> Path:
        if not uri.startswith("s3://"):
            return local_dir_confined(uri[len("file://"):] if uri.startswith("file://") else uri, uri)
        dest = self.cache_dir / hashlib.sha1(uri.encode()).hexdigest()[:16]
        store = open_store(uri, endpoint_url=self.endpoint_url)
        keys = [k for k in store.list("") if "/" not in k and k in TOKENIZER_FILES]
        if "tokenizer.json" not in keys and "tokenizer_config.json" not in keys:
            raise NotFound(f"{uri}: no tokenizer.json / tokenizer_config.json (not a Hugging Face tokenizer directory)")
        store.download_many(keys, dest)
        return dest

    def encoder(self, spec: TokenizeSpec) -> SampleEncoder:
        key = spec.model_dump_json(exclude={"input", "output", "samples_per_batch"})
        with self._lock:
            if key not in self._encoders:
                if spec.tokenizer not in self._tokenizers:
                    path = self.tokenizer_dir(spec.tokenizer)
                    try:
                        self._tokenizers[spec.tokenizer] = load_tokenizer(path)
                    except Exception as exc:  # noqa: BLE001 - name the directory in the error
                        raise ValueError(f"{spec.tokenizer}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None
                self._encoders[key] = SampleEncoder(self._tokenizers[spec.tokenizer], spec, self.limits)
            return self._encoders[key]


class TokenizeHandler(JobHandler):
    """``handler(task, ctx)`` for the shared :class:`~dfp_shared.jobs.worker.Worker` loop."""

    def __init__(self, r, encoders: EncoderCache, endpoint_url: str | None = None, roots: StorageRoots | None = None):
        self.r = r
        self.jobs = JobStore(r)
        self.encoders = encoders
        self.endpoint_url = endpoint_url
        self.roots = roots or StorageRoots.from_settings(load_settings(CommonSettings))
        self.claims = OutputClaims(self.roots, endpoint_url)

    def handle(self, task: Task, ctx: TaskContext) -> None:
        spec: TokenizeSpec = ctx.spec
        if task.key == PLAN_KEY:
            self.plan(task, spec, ctx.queue)
        elif task.key == FINALIZE_KEY:
            self.finalize(task, spec)
        else:
            self.file(task, spec, ctx)

    def _store(self, uri: str) -> ObjectStore:
        return open_store(uri, endpoint_url=self.endpoint_url)

    # plan

    def list_inputs(self, uri: str) -> list[tuple[str, str]]:
        """(file URI, key relative to the input prefix) of every input file, sorted."""
        if uri.endswith(INPUT_SUFFIXES):
            root, key = split_uri(uri)
            if self._store(root).exists(key):
                return [(uri, key.rsplit("/", 1)[-1])]
        store = self._store(uri)
        return [(store.url(k), k) for k in listed_inputs(store, list(visible(store.list(""))))]

    def plan(self, task: Task, spec: TokenizeSpec, queue: TaskQueue) -> None:
        inputs = self.list_inputs(spec.input)
        if not inputs:
            finish_job(self.r, task.job_id, "failed",
                       error=f"no input files ({', '.join(INPUT_SUFFIXES)}) under {spec.input}")
            return
        try:  # fail early on a tokenizer that does not load or has no template
            self.encoders.encoder(spec)
        except TemplateUnavailable as exc:  # the same on every delivery: fail the job at once
            finish_job(self.r, task.job_id, "failed", error=str(exc))
            return
        files = [{"file": uri, "rel": rel, "name": shard_name(rel)} for uri, rel in inputs]
        names = [f["name"] for f in files]
        if len(set(names)) != len(names):
            raise ValueError("two input files map to the same shard name")
        self._store(spec.output).put(PLAN_FILE, json.dumps({"files": files}, indent=1).encode())
        self.jobs.set_totals(task.job_id, files=len(files), tasks=len(files) + 2)
        queue.enqueue_many(task.job_id, [(f["rel"], f) for f in files])
        self.jobs.complete_task(task.job_id, PLAN_KEY)
        self.jobs.emit(task.job_id, "planned", {"files": len(files)})
        log.info("tokenize job planned", extra={"job_id": task.job_id, "files": len(files)})

    # one file

    def file(self, task: Task, spec: TokenizeSpec, ctx: TaskContext) -> None:
        encoder = self.encoders.encoder(spec)
        uri, name = task.payload["file"], task.payload["name"]
        self.roots.check_inside(uri, spec.input, "task.file")
        self.roots.check_reserved(uri, ctx.job.owner, "task.file")
        root, key = split_uri(uri)
        res = tokenize_input(self._store(root), key, uri, f"shards/{name}.safetensors", encoder,
                             id_prefix=task.payload["rel"], check=ctx.check)
        out = self._store(spec.output)
        uploads = [(f"shards/{name}.safetensors", res.shard)]
        if res.errors:
            uploads.append((f"errors/{name}.jsonl", errors_jsonl(res.errors)))
        out.put_many(uploads, max_workers=2)
        part = {"file": uri, "name": name, "entry": res.entry, "stats": res.stats.to_dict()}
        out.put(f"parts/{name}.json", json.dumps(part).encode())  # last: the file is done
        s = res.stats
        FILES_DONE.inc()
        SAMPLES.inc(s.samples)
        TOKENS.labels("yes").inc(s.trained_tokens)
        TOKENS.labels("no").inc(s.tokens - s.trained_tokens)
        for reason, n in s.errors.items():
            BAD_LINES.labels(reason).inc(n)
        self.jobs.complete_task(task.job_id, task.key, files=1, samples=s.samples, tokens=s.tokens,
                                trained_tokens=s.trained_tokens, bad_lines=sum(s.errors.values()))
        if res.errors:
            self.jobs.emit(task.job_id, "bad_lines", {"file": uri, "errors": dict(s.errors)})
        self.maybe_finalize(task.job_id, ctx.queue)

    def maybe_finalize(self, job_id: str, queue: TaskQueue) -> None:
        """Queue ``finalize`` once every file is counted (a second one is skipped as done)."""
        rec = self.jobs.get(job_id)
        if rec.counters.get("files", 0) >= rec.totals.get("files", float("inf")) and not rec.state.terminal:
            queue.enqueue(job_id, FINALIZE_KEY, {})

    # finalize

    def finalize(self, task: Task, spec: TokenizeSpec) -> None:
        out = self._store(spec.output)
        files = json.loads(out.get(PLAN_FILE))["files"]
        parts = [json.loads(data) for _, data in out.get_many([f"parts/{f['name']}.json" for f in files])]
        manifest = build_manifest([p["entry"] for p in parts], extra={"thinking": spec.thinking})
        stats = merge_stats(parts, manifest)
        out.put("stats.json", json.dumps(stats, indent=1).encode())
        if manifest["num_samples"] == 0 and stats["lines"]:  # lines, none usable: no dataset (no manifest)
            self.jobs.complete_task(task.job_id, FINALIZE_KEY)
            finish_job(self.r, task.job_id, "failed", outputs={"stats": out.url("stats.json")},
                       error=f"no usable samples in {len(files)} files ({stats['bad_lines']} bad lines; "
                             f"see {out.url('errors/')})")
            return
        # empty input files make an empty dataset
        out.put(MANIFEST, json.dumps(manifest, indent=1).encode())
        self.jobs.complete_task(task.job_id, FINALIZE_KEY)
        finish_job(self.r, task.job_id, "succeeded", outputs={
            "dataset": out.uri, "manifest": out.url(MANIFEST), "stats": out.url("stats.json"),
            "samples": manifest["num_samples"], "tokens": manifest["num_tokens"], "bad_lines": stats["bad_lines"]})
        log.info("tokenize job finished", extra={"job_id": task.job_id, "samples": manifest["num_samples"],
                                                 "tokens": manifest["num_tokens"], "bad_lines": stats["bad_lines"]})


class TokenizeWorker(Worker):
    """The shared worker loop, plus: a file task redelivered after it was counted (its worker died
    between counting it and queueing ``finalize``) still gets the finalize check."""

    def process(self, task: Task) -> None:
        if (task.key not in (PLAN_KEY, FINALIZE_KEY) and isinstance(self.handler, TokenizeHandler)
                and self.jobs.is_task_done(task.job_id, task.key)):
            self.handler.maybe_finalize(task.job_id, self.queue)
        super().process(task)


def merge_stats(parts: list[dict], manifest: dict) -> dict:
    """Dataset statistics from the per-file parts."""
    hist = [0] * (len(HIST_EDGES) - 1)
    errors: dict[str, int] = {}
    totals = {"lines": 0, "truncated": 0, "bad_lines": 0, "duplicate_ids": 0}
    for p in parts:
        s = p["stats"]
        hist = [a + b for a, b in zip(hist, s["length_histogram"])]
        for reason, n in s["errors"].items():
            errors[reason] = errors.get(reason, 0) + n
        for k in totals:
            totals[k] += s.get(k, 0)
    return {
        "files": len(parts), "samples": manifest["num_samples"], "tokens": manifest["num_tokens"],
        "trained_tokens": manifest["num_trained_tokens"], **totals, "errors_by_reason": errors,
        "max_length": max((p["stats"]["max_length"] for p in parts), default=0),
        "mean_length": manifest["num_tokens"] / manifest["num_samples"] if manifest["num_samples"] else 0.0,
        "length_histogram": [{"min": HIST_EDGES[i], "max": HIST_EDGES[i + 1], "count": c}
                             for i, c in enumerate(hist) if c],
        "error_files": sorted(f"errors/{p['name']}.jsonl" for p in parts if p["stats"]["bad_lines"]),
        "tokenizer_fingerprint": manifest["tokenizer_fingerprint"],
        "chat_template_fingerprint": manifest["chat_template_fingerprint"],
    }
