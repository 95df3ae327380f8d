"""Running one shard: read its prompt lines, generate, write the completion and error files.

Outputs (under the job's output prefix, each written whole with one put, so a reader never sees
half a file and a rerun overwrites instead of appending):

* ``completions/shard-NNNNN.jsonl``: completion records (the project's completion format);
* ``errors/shard-NNNNN.jsonl``: unreadable prompt lines (file, line, reason) and prompts that
  failed after retries (id, reason); absent when there were none;
* ``done/shard-NNNNN.json``: the shard's counts and fingerprint; a rerun with the same
  fingerprint skips the shard;
* ``partial/shard-NNNNN.jsonl``: finished results checkpointed while the shard runs, so a
  worker that dies mid-shard loses little; removed when the shard is done.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from dfp_shared.record_sources import LINES
from dfp_shared.records.completions import completion_record, encode_records, errors_key, records_key
from dfp_shared.records.prompts import Prompt, PromptError, iter_prompts
from dfp_shared.specs.generate import GenerateSpec
from dfp_shared.storage.store import NotFound, ObjectStore, open_store
from prometheus_client import Counter

from .engines import Engine, GenRequest, GenResult, SamplingParams
from .engines.base import derive_seed
from .plan import ShardPlan

log = logging.getLogger(__name__)

COMPLETIONS = Counter("dfp_generation_completions_total", "Completions written", ["engine"])
FAILED = Counter("dfp_generation_failed_prompts_total", "Prompts that failed after retries", ["engine"])
OUTPUT_TOKENS = Counter("dfp_generation_output_tokens_total", "Generated tokens", ["engine"])

# spec fields that change what a shard contains (not where it goes or how fast it is made)
CONTENT_FIELDS = ("prompts", "model", "temperature", "top_p", "max_new_tokens", "seed", "thinking",
                  "samples_per_prompt", "engine", "openai_model")


@dataclass
class ShardOutcome:
    key: str
    prompts: int = 0
    completions: int = 0
    errors: int = 0
    """Prompts the engine failed on for good (after its retries)."""
    unreadable: int = 0
    """Prompt records that could not be read (each one a line of the errors file)."""
    truncated: int = 0
    """Completions cut at max_new_tokens."""
    output_tokens: int = 0
    skipped: bool = False
    """The shard was already done by an earlier run with the same fingerprint."""
    stopped: bool = False
    """Interrupted (cancel or shutdown) before it finished; progress is checkpointed."""

    def counters(self) -> dict:
        return {"prompts": self.prompts, "completions": self.completions, "errors": self.errors,
                "unreadable": self.unreadable, "truncated": self.truncated, "output_tokens": self.output_tokens,
                "shards": 1}


def shard_fingerprint(spec: GenerateSpec, shard: ShardPlan) -> str:
    doc = {f: getattr(spec, f) for f in CONTENT_FIELDS}
    doc["segments"] = shard.segments
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:20]


def sampling_params(spec: GenerateSpec) -> SamplingParams:
    return SamplingParams(temperature=spec.temperature, top_p=spec.top_p, max_new_tokens=spec.max_new_tokens,
                          thinking=spec.thinking)


def completion_meta(prompt: Prompt, sample: int, req: GenRequest, res: GenResult, spec: GenerateSpec,
                    engine: Engine) -> dict:
    return {
        "model": engine.model_name,
        "engine": engine.name,
        "sampling": {"temperature": spec.temperature, "top_p": spec.top_p, "max_new_tokens": spec.max_new_tokens,
                     "seed": req.seed, "thinking": spec.thinking},
        "finish_reason": res.finish_reason,
        "truncated": res.truncated,
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "prompt_id": prompt.id,
        "sample_index": sample,
        "source": prompt.place(),
    }


def prune_stale(out: ObjectStore, shard_keys: list[str]) -> list[str]:
    """Delete shard files an earlier run into the same output left behind (a different shard size
    makes other shard names); without this a reader of ``completions/`` would see records twice."""
    keep = set(shard_keys)
    stale = [key for prefix in ("completions/", "errors/", "done/", "partial/") for key in out.list(prefix)
             if key.rsplit("/", 1)[-1].split(".", 1)[0] not in keep]
    for key in stale:
        out.delete(key)
    if stale:
        log.warning("removed shard files of an earlier run", extra={"count": len(stale), "first": stale[0]})
    return stale


class ShardRunner:
    """Runs shards of one job against one engine, writing to the job's output prefix."""

    def __init__(self, spec: GenerateSpec, engine: Engine, *, endpoint_url: str | None = None,
                 checkpoint_interval_s: float = 30.0):
        self.spec = spec
        self.engine = engine
        self.endpoint_url = endpoint_url
        self.out: ObjectStore = open_store(spec.output, endpoint_url=endpoint_url)
        self.checkpoint_interval_s = checkpoint_interval_s

    def run(self, prompts_root: str, shard: ShardPlan, *, on_result: Callable[[GenResult], None] | None = None,
            should_stop: Callable[[], bool] | None = None,
            on_resume: Callable[[list[GenResult]], None] | None = None) -> ShardOutcome:
        """Run (or skip, or resume) one shard. ``on_resume`` sees the results restored from the shard's
        checkpoint (possibly none) before any request starts; ``on_result`` each result as it finishes."""
        key = shard.key
        fingerprint = shard_fingerprint(self.spec, shard)
        done = self._read_json(f"done/{key}.json")
        if done and done.get("fingerprint") == fingerprint:
            log.info("shard already done; skipping", extra={"shard": key})
            return ShardOutcome(key, **{k: done["counts"][k] for k in ShardOutcome.__dataclass_fields__
                                        if k in done["counts"]}, skipped=True)

        prompts, unreadable = self._read_prompts(prompts_root, shard)
        requests: list[tuple[Prompt, int, GenRequest]] = []
        for prompt in prompts:
            for sample in range(self.spec.samples_per_prompt):
                rid = prompt.id if self.spec.samples_per_prompt == 1 else f"{prompt.id}#{sample}"
                requests.append((prompt, sample, GenRequest(rid, prompt.messages,
                                                            derive_seed(self.spec.seed, prompt.id, sample))))
        finished = self._load_partial(key, fingerprint)
        todo = [req for _, _, req in requests if req.id not in finished]
        if finished:
            log.info("resuming shard from checkpoint", extra={"shard": key, "done": len(finished), "todo": len(todo)})
        if on_resume:
            on_resume(list(finished.values()))

        last_checkpoint = time.monotonic()

        def collect(res: GenResult) -> None:
            nonlocal last_checkpoint
            if res.ok:
                finished[res.id] = res
            if on_result:
                on_result(res)
            if time.monotonic() - last_checkpoint >= self.checkpoint_interval_s:
                self._checkpoint(key, fingerprint, finished)
                last_checkpoint = time.monotonic()

        results = self.engine.generate(todo, sampling_params(self.spec), on_result=collect, should_stop=should_stop)
        failed = {r.id: r for r in results if not r.ok}
        if len(finished) + len(failed) < len(requests):
            self._checkpoint(key, fingerprint, finished)
            return ShardOutcome(key, stopped=True)

        outcome = ShardOutcome(key, prompts=len(prompts), unreadable=len(unreadable))
        records, errors = [], [e.to_record() for e in unreadable]
        for prompt, sample, req in requests:
            res = finished.get(req.id) or failed[req.id]
            if res.ok:
                rec = completion_record(req.id, prompt.messages, res.content, res.reasoning,
                                        completion_meta(prompt, sample, req, res, self.spec, self.engine))
                records.append(rec)
                outcome.truncated += rec["meta"]["truncated"]
                outcome.output_tokens += res.completion_tokens
            else:
                errors.append({"id": req.id, "prompt_id": prompt.id, **prompt.place(), "error": res.error, "attempts": res.attempts, "kind": "generation_failed"})
        outcome.completions = len(records)
        outcome.errors = len(errors) - len(unreadable)
        self.out.put(records_key(key), encode_records(records))
        if errors:
            self.out.put(errors_key(key), encode_records(errors))
        else:
            self.out.delete(errors_key(key))
        counts = {k: v for k, v in asdict(outcome).items() if k not in ("key", "skipped", "stopped")}
        self.out.put(f"done/{key}.json", json.dumps({"fingerprint": fingerprint, "counts": counts}).encode())
        self.out.delete(f"partial/{key}.jsonl")
        COMPLETIONS.labels(self.engine.name).inc(outcome.completions)
        FAILED.labels(self.engine.name).inc(outcome.errors)
        OUTPUT_TOKENS.labels(self.engine.name).inc(outcome.output_tokens)
        return outcome

    def _read_prompts(self, prompts_root: str, shard: ShardPlan) -> tuple[list[Prompt], list[PromptError]]:
        store = open_store(prompts_root, endpoint_url=self.endpoint_url)
        prompts, bad, seen = [], [], {}
        for seg in shard.segments:
            for item in iter_prompts(store, seg["file"], seg["start"], seg["end"], fmt=seg.get("format", LINES)):
                if isinstance(item, PromptError):
                    bad.append(item)
                elif item.id in seen:
                    first = seen[item.id]
                    bad.append(PromptError(store.url(item.file), item.line,
                                           f"id: duplicate prompt id {item.id!r} (first at {first.unit} {first.line} "
                                           f"of {first.file})", item.unit))
                else:
                    seen[item.id] = item
                    prompts.append(item)
        return prompts, bad

    def _read_json(self, key: str) -> dict | None:
        try:
            return json.loads(self.out.get(key))
        except NotFound:
            return None
        except ValueError:
            log.warning("unreadable marker file; ignoring it", extra={"key": key})
            return None

    def _checkpoint(self, key: str, fingerprint: str, finished: dict[str, GenResult]) -> None:
        rows = [{"fingerprint": fingerprint}] + [r.to_dict() for r in finished.values()]
        self.out.put(f"partial/{key}.jsonl", encode_records(rows))

    def _load_partial(self, key: str, fingerprint: str) -> dict[str, GenResult]:
        try:
            lines = self.out.get(f"partial/{key}.jsonl").decode().splitlines()
        except NotFound:
            return {}
        try:
            if not lines or json.loads(lines[0]).get("fingerprint") != fingerprint:
                return {}
            out = {}
            for line in lines[1:]:
                res = GenResult(**json.loads(line))
                out[res.id] = res
            return out
        except (ValueError, TypeError):
            log.warning("unreadable checkpoint; regenerating the shard", extra={"shard": key})
            return {}
