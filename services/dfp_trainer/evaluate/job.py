"""An ``evaluate`` job: τ of an exported drafter on the user's prompt sets, beside n-gram speculation.

For each prompt set (the first ``max_prompts`` readable prompts of its files, rendered with the
target's chat template in the spec's thinking mode), every prompt is decoded twice by greedy
speculative decoding against the target in the one harness (:func:`.decode.verify_decode`):
with the DFlash drafter (B-1 drafts per step) and with n-gram lookup (:mod:`.ngram`, at most B-1
drafts). Blocks are verified whole, as vLLM drafts them. Both outputs are the target's greedy output.
``batch_size`` prompts are decoded at once (:mod:`.batched`: outputs and counts equal to decoding
one at a time; ``recomputed`` counts the prompts a near tie sent back to be decoded alone).

The report, ``<output>/evaluation.json``: the drafter, target and settings, and per set ``dflash``
and ``ngram`` figures (:func:`.tau.tau_figures`: ``tau``, ``tau_vllm``, the histogram of accepted
drafts per step, the acceptance of each draft position; plus ``tokens_per_s`` and ``seconds``), the
τ of each prompt, the counts of prompts evaluated and skipped, and the unreadable lines (file, line,
reason; the first 100 in full, all counted). A bad line never fails the job; a bad drafter or
target does (:class:`EvaluateError`). Progress: the job record's ``prompts`` counter against its
total, per batch. ``should_stop`` is asked between batches and before every decoding step (both
methods, :mod:`.batched`), so a stop ends the evaluation within one step; no report is written then.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from dfp_shared.models.loading import load_causal_lm, local_model_dir
from dfp_shared.models.stop_tokens import stop_token_ids
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_shared.records.prompts import PromptError, iter_prompts, resolve_prompt_set
from dfp_shared.specs.evaluate import EvaluateSpec
from dfp_shared.storage.store import NotFound, StorageError, open_store

from ..drafter.load import load_exported
from ..settings import scratch_dir
from .batched import ngram_decode_batch, speculative_decode_batch
from .decode import DecodeStopped, chat_prompt_ids
from .replay import replay_decode
from .tau import tau_figures

log = logging.getLogger(__name__)

REPORT_NAME = "evaluation.json"
MAX_LISTED_ERRORS = 100


class EvaluateError(ValueError):
    """The evaluation cannot run: bad drafter, target or prompt set (the message says which and why)."""


@dataclass
class PromptSet:
    uri: str
    prompts: list[tuple[str, list[int]]] = field(default_factory=list)  # (id, prompt token ids)
    bad_lines: int = 0
    skipped: int = 0
    errors: list[dict] = field(default_factory=list)

    def refuse(self, file: str, line: int, reason: str, bad_line: bool = True) -> None:
        if bad_line:
            self.bad_lines += 1
        else:
            self.skipped += 1
        if len(self.errors) < MAX_LISTED_ERRORS:
            self.errors.append({"file": file, "line": line, "reason": reason})


def read_prompt_set(uri: str, tokenizer, spec: EvaluateSpec, max_tokens: int, endpoint_url: str | None) -> PromptSet:
    """The first ``spec.max_prompts`` prompts of a set as token ids; unreadable lines and prompts over
    ``max_tokens`` are counted with their file, line and reason."""
    out = PromptSet(uri)
    try:
        source = resolve_prompt_set(uri, endpoint_url)
    except NotFound as exc:
        raise EvaluateError(f"prompts: {exc}") from None
    store = open_store(source.root, endpoint_url=endpoint_url)
    for key in source.keys:
        try:
            items = iter_prompts(store, key)
            for item in items:
                if len(out.prompts) >= spec.max_prompts:
                    return out
                if isinstance(item, PromptError):
                    out.refuse(item.file, item.line, item.reason)
                    continue
                try:
                    ids = chat_prompt_ids(tokenizer, item.messages, spec.enable_thinking)
                except Exception as exc:  # noqa: BLE001 - the template refused this record: a counted bad line
                    out.refuse(store.url(key), item.line, f"chat template: {type(exc).__name__}: {exc}")
                    continue
                if len(ids) > max_tokens:
                    out.refuse(store.url(key), item.line, f"prompt has {len(ids)} tokens; at most {max_tokens} fit "
                               "(max_prompt_tokens, and the target's positions less max_new_tokens and a block)",
                               bad_line=False)
                    continue
                out.prompts.append((item.id, ids))
        except StorageError as exc:  # e.g. a corrupt gzip file: the whole file is one counted reason
            out.refuse(store.url(key), 0, str(exc))
    return out


def _drafter_dir(uri: str, tmp: str, endpoint_url: str | None) -> Path:
    """A local directory holding the drafter's export (downloaded into ``tmp`` from object storage)."""
    if not uri.startswith("s3://"):
        try:
            return local_model_dir(uri)
        except FileNotFoundError as exc:
            raise EvaluateError(f"drafter: {exc}") from None
    store = open_store(uri, endpoint_url=endpoint_url)
    keys = [k for k in ("config.json", "model.safetensors") if store.exists(k)]
    if len(keys) < 2:
        raise EvaluateError(f"drafter: {uri} lacks config.json or model.safetensors (a drafter export has both)")
    store.download_many(keys, Path(tmp))
    return Path(tmp)


def load_models(spec: EvaluateSpec, device: str | None, tmp: str, endpoint_url: str | None):
    """(target, tokenizer, drafter), checked against each other."""
    try:
        model_dir = local_model_dir(spec.target, endpoint_url=endpoint_url)
    except FileNotFoundError as exc:
        raise EvaluateError(f"target: {exc}") from None
    tokenizer = load_tokenizer(model_dir)
    target = load_causal_lm(str(model_dir), device=device)
    try:
        drafter = load_exported(_drafter_dir(spec.drafter, tmp, endpoint_url), target.get_input_embeddings(),
                                       target.get_output_embeddings(), device=target.device,
                                       target_config=target.config)
    except (FileNotFoundError, ValueError, KeyError, TypeError, OverflowError, RuntimeError) as exc:
        raise EvaluateError(f"drafter {spec.drafter}: {exc}") from None
    cfg, tcfg = drafter.config, target.config.get_text_config()
    if cfg.hidden_size != tcfg.hidden_size or cfg.num_target_layers != tcfg.num_hidden_layers:
        raise EvaluateError(f"drafter {spec.drafter} was built for a target with {cfg.num_target_layers} layers x "
                            f"{cfg.hidden_size} hidden; {spec.target} has {tcfg.num_hidden_layers} x {tcfg.hidden_size}")
    if not 0 <= cfg.mask_token_id < tcfg.vocab_size:
        raise EvaluateError(f"drafter {spec.drafter}: mask token id {cfg.mask_token_id} is outside the target's "
                            f"vocabulary ({tcfg.vocab_size})")
    drafter.to(target.dtype).eval()
    return target, tokenizer, drafter


def _method(runs: list[dict], seconds: float, draft_len: int) -> dict:
    figures = tau_figures(runs, draft_len)
    return {**figures, "seconds": seconds, "tokens_per_s": figures["new_tokens"] / seconds if seconds > 0 else 0.0}


def _prompt_row(pid: str, ids: list[int], dflash: dict, ngram: dict, draft_len: int, include_outputs: bool) -> dict:
    row = {"id": pid, "prompt_tokens": len(ids), "new_tokens": len(dflash["new_ids"]),
           "tau_dflash": tau_figures([dflash], draft_len)["tau"], "tau_ngram": tau_figures([ngram], draft_len)["tau"],
           "outputs_equal": dflash["new_ids"] == ngram["new_ids"]}
    if include_outputs:
        row.update(dflash_ids=dflash["new_ids"], ngram_ids=ngram["new_ids"])
    return row


def _decode_batch(spec: EvaluateSpec, drafter, target, prompts: list[torch.Tensor], draft_len: int, stops,
                  should_stop: Callable[[], bool]) -> tuple[tuple, tuple]:
    """``(runs, recomputed rows, seconds)`` of the drafter and of n-gram speculation on one batch of prompts; the
    drafter's by decoding, or (``dflash_method: replay``) by replay on the greedy outputs n-gram's decoding gave."""
    began = time.perf_counter()
    ngram, ngram_again = ngram_decode_batch(target, prompts, draft_len=draft_len, max_new_tokens=spec.max_new_tokens,
                                            min_n=spec.ngram_min, max_n=spec.ngram_max, batch_size=spec.batch_size,
                                            stop_token_ids=stops, should_stop=should_stop)
    mid = time.perf_counter()
    if spec.dflash_method == "replay":
        dflash, again = replay_decode(drafter, target, prompts, [r["new_ids"] for r in ngram],
                                      max_new_tokens=spec.max_new_tokens, stop_token_ids=stops,
                                      should_stop=should_stop), 0
    else:
        dflash, again = speculative_decode_batch(drafter, target, prompts, max_new_tokens=spec.max_new_tokens,
                                                 batch_size=spec.batch_size, stop_token_ids=stops, whole_blocks=True,
                                                 should_stop=should_stop)
    return (dflash, again, time.perf_counter() - mid), (ngram, ngram_again, mid - began)


def evaluate_job(spec: EvaluateSpec, *, device: str | None = None, endpoint_url: str | None = None,
                 work_dir: str | None = None, progress: Callable[[int, int], None] = lambda done, total: None,
                 should_stop: Callable[[], bool] = lambda: False) -> dict | None:
    """Run the evaluation and write its report; returns the report (None when ``should_stop`` ended it)."""
    try:
        return _evaluate(spec, device=device, endpoint_url=endpoint_url, work_dir=work_dir, progress=progress,
                         should_stop=should_stop)
    except DecodeStopped:
        return None


def _evaluate(spec: EvaluateSpec, *, device: str | None, endpoint_url: str | None, work_dir: str | None,
              progress: Callable[[int, int], None], should_stop: Callable[[], bool]) -> dict | None:
    with scratch_dir(work_dir, "dflash-eval-") as tmp:
        target, tokenizer, drafter = load_models(spec, device, tmp, endpoint_url)
    draft_len = drafter.config.block_size - 1
    positions = int(getattr(target.config.get_text_config(), "max_position_embeddings", 0) or 1 << 30)
    max_tokens = min(spec.max_prompt_tokens, positions - spec.max_new_tokens - draft_len - 1)
    if max_tokens < 1:
        raise EvaluateError(f"max_new_tokens {spec.max_new_tokens} and a block of {draft_len + 1} leave no room for a "
                            f"prompt in the target's {positions} positions")
    sets = []
    for uri in spec.prompts:  # up to 16 sets of 10,000 prompts, each rendered: a stop is asked between sets
        if should_stop():
            return None
        sets.append(read_prompt_set(uri, tokenizer, spec, max_tokens, endpoint_url))
    total, done = sum(len(s.prompts) for s in sets), 0
    progress(0, total)
    stops = stop_token_ids(tokenizer)
    dev = target.device
    report_sets = []
    for pset in sets:
        runs: dict[str, list[dict]] = {"dflash": [], "ngram": []}
        seconds = {"dflash": 0.0, "ngram": 0.0}
        recomputed = {"dflash": 0, "ngram": 0}
        per_prompt = []
        for b in range(0, len(pset.prompts), spec.batch_size):
            if should_stop():
                return None
            batch = pset.prompts[b : b + spec.batch_size]
            prompts = [torch.tensor(ids, dtype=torch.long, device=dev) for _, ids in batch]
            (dflash, again, took), (ngram, ngram_again, ngram_took) = _decode_batch(
                spec, drafter, target, prompts, draft_len, stops, should_stop)
            seconds["dflash"] += took
            seconds["ngram"] += ngram_took
            recomputed["dflash"] += again
            recomputed["ngram"] += ngram_again
            runs["dflash"] += dflash
            runs["ngram"] += ngram
            per_prompt += [_prompt_row(pid, ids, d, n, draft_len, spec.include_outputs)
                           for (pid, ids), d, n in zip(batch, dflash, ngram)]
            done += len(batch)
            progress(done, total)
        report_sets.append({
            "prompts": pset.uri, "evaluated": len(pset.prompts), "bad_lines": pset.bad_lines,
            "skipped": pset.skipped, "errors": pset.errors,
            "dflash": {**_method(runs["dflash"], seconds["dflash"], draft_len), "recomputed": recomputed["dflash"]},
            "ngram": {**_method(runs["ngram"], seconds["ngram"], draft_len), "recomputed": recomputed["ngram"]},
            "per_prompt": per_prompt})
    report = {"drafter": spec.drafter, "target": spec.target, "enable_thinking": spec.enable_thinking,
              "block_size": draft_len + 1, "draft_length": draft_len, "max_new_tokens": spec.max_new_tokens,
              "batch_size": spec.batch_size, "dflash_method": spec.dflash_method,
              "ngram": {"min": spec.ngram_min, "max": spec.ngram_max}, "device": str(dev),
              "tau_counting": {"tau": "tokens emitted per target verify step (cut at the budget and at a stop token)",
                               "tau_vllm": "1 + accepted drafts per drafting step, whole verified blocks (vLLM's "
                                           "mean acceptance length)"},
              "sets": report_sets}
    open_store(spec.output, endpoint_url=endpoint_url).put(REPORT_NAME, (json.dumps(report, indent=1) + "\n").encode())
    log.info("evaluation written", extra={"output": spec.output, "prompts": total,
                                          "tau": [s["dflash"]["tau"] for s in report_sets],
                                          "tau_ngram": [s["ngram"]["tau"] for s in report_sets]})
    return report
