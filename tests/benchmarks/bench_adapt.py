"""Benchmark: one adaptation cycle end to end, on a real target served by the real vLLM (CPU build).

1. The served drafter: SmolLM2-135M-Instruct's DFlash drafter trained on ShareGPT's own answers by
   ``bench_quality_real.py --curve`` (the cached one under its ``--work`` when present, else trained with its
   functions), promoted as version 1 of a fresh served store (:mod:`dfp_adapt.served_store`).
2. The domain: Python code. Each request gives a documented function of the running interpreter's standard library
   cut after its docstring ("Complete this Python function ..."), picked by a hash across the library. It is on
   every machine (no download), it is a domain a code assistant's traffic is full of, and ShareGPT's first chat
   turns, which the served drafter saw, hold little of it: its answers are prose; here the target writes indented
   code, whose tokens (indentation runs, ``self.``, ``return``) that drafter rarely had to predict.
3. vLLM serves SmolLM2 with version 1 (``num_speculative_tokens`` = block size - 1) behind ``dflash-pipeline
   capture serve`` (capture on for all traffic, a ``file://`` prefix): ``--requests`` chat completions of the
   domain, greedy (temperature 0), go through the capture, the first ones ``--concurrency`` at a time, then the
   newest ``--heldout-share`` one by one: that last slice is the held-out traffic, and its τ as it was served is
   τ before.
4. One ``dflash-pipeline adapt run`` through the real services (``api serve`` and the generation, tokenizer and
   trainer workers as their own processes over a private Redis): the window's greedy records trained on as they
   are, the candidate warm-started from version 1 for ``--steps`` steps, both evaluated by the evaluate job on
   the newest slice (the same held-out requests), promoted or refused by the promotion rule.
5. vLLM serves the candidate on the held-out prompts (τ after, when promoted; otherwise version 1 stays served
   and τ after is τ before), then vLLM's own ``ngram`` speculation at the same draft length (prompt lookup 1..4,
   as the evaluate job's n-gram). Every answer is compared token for token with the target's greedy output (the
   evaluate job's n-gram decoding, which emits exactly it).

τ: the target's tokens per verify step, from vLLM's counters read around each request (see :mod:`adapt_stack`).
``noise``: the standard error of the mean per-prompt τ difference (candidate - version 1, served by vLLM) on the
held-out prompts; the rule's own evidence (the evaluate job's per-prompt τ) is reported beside it. Project: τ
after; baseline: τ before; limit: the block size.
Run: ``python tests/benchmarks/bench_adapt.py [--requests 96] [--heldout-share 0.25] [--steps 60]
[--max-tokens 64]``; last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _common  # noqa: F401 - import path
import adapt_stack as parts
from _common import report

NAME = "smollm2"
CURVE_WORK = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash-pipeline" / "bench-quality-real"


def recipe_of(name: str) -> dict:
    import bench_quality_real as real

    if name != "base" and name not in real.LEVERS:
        raise SystemExit(f"--recipe: {name!r} is not base nor one of {list(real.LEVERS)}")
    return real.BASE_RECIPE if name == "base" else {**real.BASE_RECIPE, **real.LEVERS[name]}


def sharegpt_drafter(work: Path, model: Path, recipe: str, size: int, epochs: float) -> Path:
    """The drafter ``bench_quality_real.py --curve SIZE`` trains on ShareGPT's own answers: the cached one, else
    trained here by its stages (cached there too)."""
    found = [p for p in work.glob(f"train-curve.{recipe}.{size}-*")
             if (p / "stage.json").is_file() and (p / "drafter" / "config.json").is_file()]
    if found:
        run = max(found, key=lambda p: (p / "stage.json").stat().st_mtime)
        print(f"  served drafter: cached {run}", flush=True)
        return run / "drafter"
    import bench_quality_real as real
    import quality_curve
    from bench_quality import Stages, digest
    from dfp_dev.prompt_sets import sharegpt_file

    stages = Stages(work)
    records, _ = quality_curve.own_answers(sharegpt_file(), real.HELD_OUT_ONE_IN, real.MAX_PROMPT_CHARS, size)
    chosen = records[:size]
    key = digest(model.name, chosen, quality_curve.SAMPLE_MAX_TOKENS)
    answers = stages.run(f"answers.{size}", key, lambda out: quality_curve.write_completions(chosen, out))
    dataset = stages.run(f"tokenize-answers.{size}", key, lambda out: real.tokenize(
        model, answers, out, max_length=quality_curve.SAMPLE_MAX_TOKENS))
    tokens, _ = quality_curve.dataset_tokens(dataset, quality_curve.SAMPLE_MAX_TOKENS)
    steps = max(20, math.ceil(epochs * tokens / real.TOKENS_PER_STEP))
    spec = recipe_of(recipe)
    run = stages.run(f"train-curve.{recipe}.{size}", digest(key, spec, steps),
                     lambda out: real.train(model, dataset, spec, steps, out))
    return run / "drafter"


def serve_version_1(store: Path, drafter: Path):
    """A fresh served store holding ``drafter`` as version 1, claimed (as the operator would) for the principal of
    the key the adapt run uses, so the run may write there."""
    from dfp_adapt.served_store import ServedDrafters
    from dfp_shared.storage.ownership import OutputClaims
    from dfp_shared.storage.roots import StorageRoots

    served = ServedDrafters(f"file://{store}/served", NAME)
    OutputClaims(StorageRoots([f"file://{store}"])).claim(served.uri, parts.PRINCIPAL, "serve-version-1",
                                                          "adapt served location")
    served.promote(drafter.as_uri() + "/", {"by": "operator", "trained_on": f"ShareGPT answers ({drafter.parent})"})
    return served


def heldout_count(n: int, share: float) -> int:
    """How many of ``n`` records the adapt run holds out (as :func:`dfp_adapt.source.prepare_source`)."""
    return max(1, round(n * share))


def stage_specs(args, model: Path, recipe: dict) -> dict:
    """The adapt run's stage fields: the candidate is built as version 1 was, so it can start from it."""
    target = f"file://{model}"
    train = {**recipe, **({"lr": args.lr} if args.lr else {}), "target": target, "steps": args.steps, "tokens_per_batch": 1024, "max_length": 512,
             "warmup_ratio": 0.05, "checkpoint_every": args.steps, "eval_prompts": 0, "seed": 0,
             "exports": ["zlab"], "enable_thinking": False}
    return {"tokenize": {"tokenizer": target, "max_length": 1024, "truncation": "truncate", "thinking": False},
            "train": train,
            "evaluate": {"target": target, "max_new_tokens": args.max_tokens, "enable_thinking": False,
                         "batch_size": args.eval_batch, "include_outputs": True, "dflash_method": args.eval_method}}


def stream(args, server, env: dict, logs: Path, store: Path, prompts: list[dict], times: dict) -> list:
    """The domain's requests through the capture in front of ``server``; returns the held-out slice's answers, sent
    one by one after the rest (a second apart, so they are the newest records), with their counters."""
    import httpx
    from dfp_dev.local.processes import ProcessGroup

    group = ProcessGroup(logs / "capture")
    try:
        url = parts.start_capture(group, env, server.base_url, f"file://{store}/capture")
        held = heldout_count(len(prompts), args.heldout_share)
        model = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        began = time.perf_counter()
        with httpx.Client(base_url=url, timeout=900) as client, ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(lambda p: parts.chat(client, model, p["messages"], args.max_tokens),
                                    prompts[:-held]))
        times["stream"] = round(time.perf_counter() - began, 1)
        tokens = sum(a["usage"]["completion_tokens"] for a in answers)
        print(f"  stream: {len(answers)} requests, {tokens} tokens in {times['stream']:.0f} s "
              f"({args.concurrency} at a time)", flush=True)
        time.sleep(1.5)
        began = time.perf_counter()
        before = parts.serve_one_by_one(server, url, model, prompts[-held:], args.max_tokens)
        times["heldout_version_1"] = round(time.perf_counter() - began, 1)
    finally:
        group.stop_all(timeout=30)  # the capture writes what it holds as it stops
    times["stream_tokens_per_s"] = round(tokens / times["stream"], 1)
    return before


def adapt_cycle(args, store: Path, model: Path, recipe: dict, logs: Path, times: dict) -> tuple[dict, dict]:
    """``dflash-pipeline adapt run`` against the services started for it; returns its event and its jobs' times."""
    env = parts.service_env(store, model)
    began = time.perf_counter()
    stack = parts.start_stack(env, logs / "stack")
    times["services_start"] = round(time.perf_counter() - began, 1)
    spec_file = logs / "adapt-spec.json"
    spec_file.write_text(json.dumps(stage_specs(args, model, recipe), indent=1))
    run_env = {**stack.env, "DFLASH_API_URL": stack.api_url, "DFLASH_API_KEY": stack.api_key, "OMP_NUM_THREADS": "1",
               "DFLASH_ADAPT_NAME": NAME, "DFLASH_ADAPT_SPEC": str(spec_file), "DFLASH_ADAPT_WINDOW_HOURS": "1",
               "DFLASH_ADAPT_HELDOUT_SHARE": str(args.heldout_share), "DFLASH_ADAPT_THRESHOLD": str(args.threshold),
               "DFLASH_ADAPT_Z": str(args.z), "DFLASH_ADAPT_POLL_S": "1"}
    try:
        began = time.perf_counter()
        with open(logs / "adapt-run.log", "wb") as log:
            done = subprocess.run(parts.cli("adapt", "run"), env=run_env, stdout=subprocess.PIPE, stderr=log,
                                  stdin=subprocess.DEVNULL)
        times["cycle"] = round(time.perf_counter() - began, 1)
        if done.returncode:
            raise RuntimeError(f"adapt run exited {done.returncode}: {done.stdout.decode()[-2000:]}; "
                               f"log {logs / 'adapt-run.log'}")
        out = done.stdout.decode()
        event = json.loads(out[out.index("{"):])
        jobs = parts.job_seconds(stack)
    finally:
        stack.stop()
    return event, jobs


def served_by(python: Path, model: Path, logs: Path, name: str, prompts: list[dict], args, times: dict, *,
              drafter: Path | None = None, draft_len: int) -> list:
    """vLLM started for the target with ``drafter`` (None: its ``ngram`` method), the prompts sent one by one."""
    import httpx
    from dfp_dev.serving.vllm_server import VllmServer

    class NgramServer(VllmServer):
        def command(self) -> list[str]:
            return super().command() + ["--speculative-config", json.dumps({
                "method": "ngram", "num_speculative_tokens": draft_len, "prompt_lookup_min": 1,
                "prompt_lookup_max": 4})]

    server = (VllmServer(python, model, logs, drafter_dir=drafter, num_speculative_tokens=draft_len, name=name)
              if drafter is not None else NgramServer(python, model, logs, name=name))
    began = time.perf_counter()
    server.start()
    try:
        times[f"vllm_start_{name}"] = round(time.perf_counter() - began, 1)
        model_id = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        began = time.perf_counter()
        rows = parts.serve_one_by_one(server, server.base_url, model_id, prompts, args.max_tokens)
        times[f"heldout_{name}"] = round(time.perf_counter() - began, 1)
        return rows
    finally:
        server.stop()


def greedy_check(model: Path, event: dict, tail: list[dict], served: dict[str, list]) -> dict:
    """Whether the run held out exactly the stream's last requests, and every served answer equals the target's
    greedy output (the evaluate job's n-gram decoding) token for token."""
    from dfp_shared.models.stop_tokens import stop_token_ids
    from dfp_shared.models.tokenizer_assets import load_tokenizer

    run = Path(event["run"].removeprefix("file://"))
    held = [json.loads(line) for line in (run / "heldout" / "prompts.jsonl").read_text().splitlines() if line.strip()]
    by_text = {p["messages"][-1]["content"]: p["id"] for p in tail}
    ids = {h["id"]: by_text.get(h["messages"][-1]["content"]) for h in held}
    rows = json.loads((run / "eval-candidate" / "evaluation.json").read_text())["sets"][0]["per_prompt"]
    greedy = {ids[r["id"]]: r["ngram_ids"] for r in rows if ids.get(r["id"])}
    stops = set(stop_token_ids(load_tokenizer(model)))
    equal = {name: sum(parts.trimmed(r.token_ids, stops) == parts.trimmed(greedy[r.id], stops)
                       for r in rs if r.id in greedy) for name, rs in served.items()}
    return {"heldout_matches": sorted(i for i in ids.values() if i) == sorted(by_text.values()),
            "compared": len(greedy), "equal": equal,
            "outputs_equal": bool(greedy) and all(n == len(greedy) for n in equal.values())}


def print_table(fig: dict, event: dict, args, held: int) -> None:
    print(f"\nheld-out traffic: {held} Python prompts (the newest of {args.requests}), at most {args.max_tokens} "
          "tokens each, greedy, served by vLLM one at a time")
    print(f"{'served':>34}  {'τ':>6}  {'vLLM acceptance length':>22}")
    for label, key in (("version 1 (ShareGPT), before", "version_1"), ("candidate (this cycle's)", "candidate"),
                       ("n-gram (vLLM ngram, 1..4)", "ngram")):
        print(f"{label:>34}  {fig[key]['tau']:6.3f}  {fig[key]['acceptance_length']:22.3f}")
    print(f"paired τ gain of the candidate: {fig['gain']:+.3f} ± {fig['noise']:.3f} (standard error, "
          f"{fig['paired']} prompts)")
    print(f"decision: {event['action']} ({event['reason']}); evaluate job: candidate {event['tau_candidate']:.3f}, "
          f"served {event['tau_baseline']:.3f}, n-gram {event['tau_ngram']:.3f}")


def run(args, work: Path, times: dict) -> dict:
    """The whole benchmark under ``work``; returns the figures."""
    from dfp_dev.serving.vllm_env import ensure_env
    from dfp_dev.serving.vllm_server import VllmServer
    from dfp_dev.targets.smollm2 import smollm2_dir
    model, store, logs = smollm2_dir(), work / "store", work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    drafter = sharegpt_drafter(args.curve_work, model, args.recipe, args.size, args.epochs)
    times["served_drafter"] = round(time.perf_counter() - began, 1)
    served = serve_version_1(store, drafter)
    draft_len = json.loads((drafter / "config.json").read_text())["dflash_config"]["block_size"] - 1
    python = ensure_env()
    prompts = parts.domain_prompts(args.requests, seed=args.seed)
    tail = prompts[-heldout_count(len(prompts), args.heldout_share):]
    began = time.perf_counter()
    server = VllmServer(python, model, logs, drafter_dir=Path(served.current().uri.removeprefix("file://")),
                        num_speculative_tokens=draft_len, name="version_1").start()
    times["vllm_start_version_1"] = round(time.perf_counter() - began, 1)
    try:
        before = stream(args, server, parts.service_env(store, model), logs, store, prompts, times)
    finally:
        server.stop()
    event, times["jobs"] = adapt_cycle(args, store, model, recipe_of(args.recipe), logs, times)
    candidate = Path(event["candidate"].removeprefix("file://"))
    after = served_by(python, model, logs, "candidate", tail, args, times, drafter=candidate, draft_len=draft_len)
    ngram = served_by(python, model, logs, "ngram", tail, args, times, draft_len=draft_len)
    fig = {k: parts.tau_figures(rows) for k, rows in (("version_1", before), ("candidate", after), ("ngram", ngram))}
    fig["gain"], fig["noise"], fig["paired"] = parts.paired_noise(fig["candidate"]["per_prompt"],
                                                                  fig["version_1"]["per_prompt"])
    fig["check"] = greedy_check(model, event, tail, {"version_1": before, "candidate": after, "ngram": ngram})
    print_table(fig, event, args, len(tail))
    return {"fig": fig, "event": event, "draft_len": draft_len, "drafter": drafter, "held": len(tail)}


def finish(args, out: dict, times: dict) -> None:
    fig, event = out["fig"], out["event"]
    promoted = event["action"] == "promoted"
    before, candidate = fig["version_1"]["tau"], fig["candidate"]["tau"]
    after = candidate if promoted else before
    print(f"stage wall times (s): {times}; checks: {fig['check']}")
    r3 = lambda x: round(x, 3) if isinstance(x, float) and math.isfinite(x) else x
    report("adapt", "tokens/step", after, baseline=before, limit=float(out["draft_len"] + 1),
           tau_before=r3(before), tau_after=r3(after), tau_candidate=r3(candidate), tau_ngram=r3(fig["ngram"]["tau"]),
           noise=r3(fig["noise"]), gain=r3(fig["gain"]), promoted=promoted,
           acceptance_length={k: r3(fig[k]["acceptance_length"]) for k in ("version_1", "candidate", "ngram")},
           rule={k: r3(event.get(k)) for k in ("reason", "prompts", "tau_candidate", "tau_baseline", "tau_ngram",
                                               "mean_difference", "standard_error", "threshold", "z")},
           source=event.get("source"), outputs_equal=fig["check"]["outputs_equal"],
           heldout_matches=fig["check"]["heldout_matches"], outputs_compared=fig["check"]["compared"],
           requests=args.requests, heldout=out["held"], heldout_share=args.heldout_share, max_tokens=args.max_tokens,
           steps=args.steps, lr=args.lr, concurrency=args.concurrency, eval_method=args.eval_method,
           served_drafter=str(out["drafter"]), recipe=args.recipe, domain="Python standard library functions",
           stage_seconds=times, cpus=os.cpu_count(), load_average=[round(x, 2) for x in os.getloadavg()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=96, help="Domain requests sent through the capture.")
    ap.add_argument("--heldout-share", type=float, default=0.25, help="Newest share held out (the adapt run's).")
    ap.add_argument("--max-tokens", type=int, default=64, help="Tokens per answer (served and evaluated).")
    ap.add_argument("--steps", type=int, default=60, help="Training steps of the candidate.")
    ap.add_argument("--lr", type=float, default=None, help="Peak learning rate of the candidate's training "
                                                          "[default: the served drafter's recipe's].")
    ap.add_argument("--concurrency", type=int, default=8, help="Requests in flight before the held-out slice.")
    ap.add_argument("--eval-method", choices=("decode", "replay"), default="replay",
                    help="The evaluate jobs' count of the drafters' steps (replay: on the greedy output).")
    ap.add_argument("--eval-batch", type=int, default=16, help="Prompts the evaluate jobs decode at once.")
    ap.add_argument("--threshold", type=float, default=0.05, help="The rule's least mean τ gain.")
    ap.add_argument("--z", type=float, default=1.96, help="The rule's standard errors.")
    ap.add_argument("--recipe", default="base", help="bench_quality_real's recipe of the served drafter.")
    ap.add_argument("--size", type=int, default=128, help="ShareGPT conversations the served drafter trained on.")
    ap.add_argument("--epochs", type=float, default=3.0, help="Its passes over them (when it is trained here).")
    ap.add_argument("--curve-work", type=Path, default=CURVE_WORK, help="bench_quality_real's stage cache.")
    ap.add_argument("--seed", type=int, default=0, help="Which functions of the library are asked for.")
    ap.add_argument("--work", type=Path, default=None, help="Where the store and logs go (default: a temporary "
                                                            "directory, removed unless --keep).")
    ap.add_argument("--keep", action="store_true", help="Keep the work directory.")
    args = ap.parse_args()
    if heldout_count(args.requests, args.heldout_share) >= args.requests:
        ap.error("--requests: too few to hold out a share and train on the rest")
    work = (args.work or Path(tempfile.mkdtemp(prefix="bench-adapt-"))).resolve()
    print(f"work directory {work}", flush=True)
    times: dict = {}
    began = time.perf_counter()
    try:
        out = run(args, work, times)
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    times["total"] = round(time.perf_counter() - began, 1)
    finish(args, out, times)


if __name__ == "__main__":
    main()
