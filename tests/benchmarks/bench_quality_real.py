"""Drafter quality on a real pretrained target: τ of DFlash on MT-Bench and held-out ShareGPT prompts.

The anchors' recipe, each stage the project's own code, on SmolLM2-135M-Instruct (imported from the GGUF
file of its PyPI wheel, :mod:`dfp_dev.targets.smollm2`):

1. prompts: ShareGPT V3's first user turns (its JSON array read by the project's streaming reader, the
   cut-off last record counted), deduplicated, ordered by a hash of their text; a held-out slice (one
   prompt in 20, by that hash) is never trained on; MT-Bench's 80 first turns for the evaluation;
2. generation: the target answers the training prompts greedily through the generation service, by
   default with its OpenAI engine against the real vLLM serving the target (the users' fast path); both
   engines (that one and the in-process transformers engine) answer the same first prompts, and their
   tokens/s are reported side by side;
3. tokenization (the tokenizer pool over a private Redis), with the target's own ChatML template;
4. training for a fixed budget of steps (the trainer, target in process) with a recipe sized for CPUs, the
   target's hidden states computed once into the hidden-state cache and read from it every epoch;
5. evaluation by the evaluate job's code: real greedy speculative decoding on MT-Bench and on the
   held-out slice, trained and untrained (first 8 prompts of each set) DFlash beside n-gram speculation at the same draft length,
   every output equal to the target's greedy one; with ``--vllm`` the real vLLM serves the drafter on
   MT-Bench prompts and its acceptance counts are reported beside the project's.

Project: τ of the trained drafter on MT-Bench. Baseline: n-gram speculation's τ there (goal: 2×).
Limit: the block size. ``--levers`` (or ``--only``) adds one drafter per recipe lever. Stages are
cached under ``--work`` by their inputs.

``--curve SIZES`` is the data-scaling mode (:mod:`quality_curve`): no generation; ShareGPT's own first answers at
each size, every ``--curve-recipes`` recipe trained on them, each drafter evaluated by replay on the target's greedy
answers to MT-Bench and the held-out slice (real decoding beside it for ``--curve-decode-check`` sizes), τ against
trained tokens fitted and plotted.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import _common  # noqa: F401 - import path
import bench_quality
import quality_curve
from _common import report
from bench_quality import Stages, digest, read_records, untrained_export, write_prompts

# SmolLM2's chat template has no thinking mode: every stage runs without it
generate = functools.partial(bench_quality.generate, thinking=False, batch_size=24)
tokenize = functools.partial(bench_quality.tokenize, thinking=False)
evaluate = functools.partial(bench_quality.evaluate, thinking=False)

SEED = 0
HELD_OUT_ONE_IN = 20
TOKENS_PER_STEP = 1024  # the recipes' padded tokens per optimiser step (bench_quality.train)
UNTRAINED_PROMPTS = 8  # per set: the untrained drafter's tau is 1.0 give or take a lucky draft
MAX_PROMPT_CHARS = 1500  # first turns longer than this are left out (CPU budget)
BASE_RECIPE = {"block_size": 8, "gamma": 4.0, "max_anchors": 16, "num_draft_layers": 2, "loss": "decay",
               "lr": 3e-3, "decay": "cosine", "optimizer": "adamw"}
LEVERS = {
    "loss=dpace": {"loss": "dpace"},
    "block_size=16": {"block_size": 16, "gamma": 7.0},
    "layers=1": {"num_draft_layers": 1},
    "layers=3": {"num_draft_layers": 3},
    "anchors=32": {"max_anchors": 32},
    "schedule=wsd": {"decay": "wsd"},
    "optimizer=muon": {"optimizer": "muon"},
    "muon+dpace": {"optimizer": "muon", "loss": "dpace"},  # the two best single levers together
    # what the target itself teaches: its greedy token as the label, its distribution (on answers it did not write)
    "labels=target_argmax": {"labels": "target_argmax"},
    "distill=0.5": {"distill_weight": 0.5},
    "muon+labels=target_argmax": {"optimizer": "muon", "labels": "target_argmax"},
    # a start whose first logits are not a near one-hot on the block's own input token
    "init=unit_logits": {"init": "unit_logits"},
    "muon+init=unit_logits": {"optimizer": "muon", "init": "unit_logits"},
    "muon+init=unit_logits+labels=target_argmax": {"optimizer": "muon", "init": "unit_logits", "labels": "target_argmax"},
    **bench_quality.FAMILY_LEVERS,
    # the families under the default optimizer
    "muon+family=dflash2": {"optimizer": "muon", "family": "dflash2"},
    "muon+family=dspark": {"optimizer": "muon", "family": "dspark"},
}
# the recipe the main mode trains and reports by default: the lever that lifted τ beyond its noise on this target
BEST = "optimizer=muon"


def lever_recipe(name: str) -> dict:
    """A lever of :data:`LEVERS`, or ``+``-joined levers and train-spec ``field=value`` parts
    (``optimizer=muon+seed=1``), as :func:`bench_quality.lever_recipe` reads them."""
    return bench_quality.lever_recipe(name, LEVERS)


def first_turns(prompts) -> list[dict]:
    """First user turns (system messages before them kept), deduplicated, each with a hash of its text."""
    seen, out = set(), []
    for p in prompts:
        upto = next(i for i, m in enumerate(p.messages) if m["role"] == "user")
        # the first user turn and the system messages before it (some conversations open with a model turn:
        # left out, so every trained token is the target's own answer)
        messages = [m for m in p.messages[:upto] if m["role"] == "system"] + [p.messages[upto]]
        text = messages[-1]["content"].strip()
        if not text or len(text) > MAX_PROMPT_CHARS:
            continue
        norm = re.sub(r"\s+", " ", text.lower())
        if norm in seen:
            continue
        seen.add(norm)
        out.append({"id": p.id, "messages": messages, "hash": hashlib.sha256(norm.encode()).hexdigest()})
    return sorted(out, key=lambda r: r["hash"])


def prepare_prompts(work: Path, train_n: int, heldout_n: int) -> dict:
    from dfp_dev.prompt_sets import mtbench_file, sharegpt_file
    from dfp_shared.records.prompts import read_prompt_set

    source = sharegpt_file()
    prompts, errors = read_prompt_set(f"file://{source}")
    turns = first_turns(prompts)
    held = [t for t in turns if int(t["hash"][:8], 16) % HELD_OUT_ONE_IN == 0]
    train = [t for t in turns if int(t["hash"][:8], 16) % HELD_OUT_ONE_IN != 0]
    files = {"train": work / "prompts" / "train.jsonl", "heldout": work / "prompts" / "heldout.jsonl"}
    write_prompts(files["train"], [{"id": t["id"], "messages": t["messages"]} for t in train[:train_n]])
    write_prompts(files["heldout"], [{"id": t["id"], "messages": t["messages"]} for t in held[:heldout_n]])
    print(f"  prompts: ShareGPT {len(prompts)} read, {len(errors)} unreadable (last: {errors[-1].reason if errors else '-'}); "
          f"{len(turns)} distinct first turns, {len(held)} held out; training on {min(train_n, len(train))}",
          flush=True)
    return {**files, "mtbench": mtbench_file(), "sharegpt_errors": len(errors), "first_turns": len(turns)}


def train(model_dir: Path, dataset: Path, recipe: dict, steps: int, out: Path) -> None:
    """A drafter for ``steps`` steps; the target's hidden states are computed once per target layer set and
    read from the run's hidden-state cache after (``hidden_states: cache``), shared by every lever."""
    teacher = recipe.get("distill_weight", 0) > 0 or recipe.get("labels") == "target_argmax"  # the last layer too
    cache = out.parent / f"hidden-cache-{dataset.name}-layers{recipe['num_draft_layers']}{'-teacher' if teacher else ''}"
    bench_quality.train(model_dir, dataset, recipe, steps, out, max_length=1024, hidden_states="cache",
                  hidden_state_cache=f"file://{cache}", enable_thinking=False)


def served(model_dir: Path, drafter: Path, prompts: Path, limit: int, max_new_tokens: int, out: Path) -> None:
    """The real vLLM serving the drafter beside the target (serve-check), on the first MT-Bench prompts."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dfp_cli.main", "serve-check", "--target", str(model_dir), "--drafter", str(drafter),
           "--prompts", f"file://{prompts}", "--limit", str(limit), "--max-new-tokens", str(max_new_tokens),
           "--no-thinking", "--work-dir", str(out / "work"), "--json-out", str(out / "served.json")]
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    if not (out / "served.json").exists():
        raise RuntimeError(f"serve-check failed (exit {done.returncode}); log under {out / 'work'}")


def vllm_generation(model_dir: Path, prompts: Path, max_new_tokens: int, out: Path) -> dict:
    """The OpenAI engine against a real vLLM serving the target (no drafter): the users' fast generation path."""
    from dfp_dev.serving.vllm_env import ensure_env
    from dfp_dev.serving.vllm_server import VllmServer

    server = VllmServer(ensure_env(), model_dir, out)
    server.start()
    try:
        # one shard: every prompt in flight at the concurrency the server's capacity allows (no wave tails)
        return generate(model_dir, prompts, max_new_tokens, out, spec={"engine": "openai", "openai_endpoint": "default",
                                                                       "shard_size": 100_000},
                        openai_base_url=server.base_url + "/v1", openai_model=str(model_dir))
    finally:
        server.stop()


def recipe_figures(stages: Stages, ctx: dict, name: str, recipe: dict, lever: bool = False) -> dict:
    """Train one drafter on the recipe; τ on MT-Bench and the held-out slice, with the untrained drafter beside
    it (a lever: on the first ``lever_eval_prompts`` MT-Bench prompts only, a CPU budget)."""
    key = digest(ctx["dataset_key"], recipe, ctx["steps"])
    print(f"recipe {name}: {recipe}", flush=True)
    run = stages.run(f"train.{name}", key, lambda out: train(ctx["model"], ctx["dataset"], recipe, ctx["steps"], out))
    eval_sets, prompts, eval_key = [ctx["mtbench"], ctx["heldout"]], ctx["eval_prompts"], ctx["eval_key"]
    if lever:
        eval_sets, prompts = [ctx["mtbench"]], ctx["lever_eval_prompts"]
        eval_key = digest(eval_key, "mtbench only", prompts)
    evaluated = stages.run(f"evaluate.{name}", digest(key, eval_key), lambda out: evaluate(
        ctx["model"], run / "drafter", eval_sets, prompts, ctx["eval_new_tokens"], out))
    found = json.loads((evaluated / "evaluation.json").read_text())["sets"]
    mt, held = found[0], (found[1] if len(found) > 1 else None)
    figures = {"tau_mtbench": mt["dflash"]["tau"], "tau_ngram_mtbench": mt["ngram"]["tau"],
               "tau_heldout": held["dflash"]["tau"] if held else None,
               "tau_ngram_heldout": held["ngram"]["tau"] if held else None,
               "tau_vllm_count_mtbench": mt["dflash"]["tau_vllm"], "mtbench_prompts": len(mt["per_prompt"]),
               "position_acceptance_mtbench": [round(p, 3) for p in mt["dflash"]["position_acceptance"]],
               "ngram_position_acceptance_mtbench": [round(p, 3) for p in mt["ngram"]["position_acceptance"]],
               "outputs_equal": all(p["outputs_equal"] for s in found for p in s["per_prompt"]),
               "block_size": recipe["block_size"], "run": run, **bench_quality.train_figures(run)}
    if not lever:
        start_dir = stages.run(f"evaluate-untrained.{name}", digest(key, ctx["eval_key"], "untrained"), lambda out: (
            untrained_export(ctx["model"], run / "drafter", out / "drafter", recipe.get("init", "random")),
            evaluate(ctx["model"], out / "drafter", eval_sets, min(UNTRAINED_PROMPTS, ctx["eval_prompts"]),
                     ctx["eval_new_tokens"], out)))
        figures["tau_untrained"] = json.loads((start_dir / "evaluation.json").read_text())["sets"][0]["dflash"]["tau"]
    return figures


def curve_point(stages: Stages, ctx: dict, size: int, records: list[dict], recipes: dict, epochs: float,
                decode_check: bool) -> list[dict]:
    """One data size of the curve: its own answers tokenized, every recipe trained ``epochs`` passes over them
    (the target's hidden states cached once per size, shared by the recipes), each evaluated by replay on the
    target's greedy answers to MT-Bench and the held-out slice; with ``decode_check`` the base recipe's drafter is
    also evaluated by real decoding, beside its replay."""
    model, chosen = ctx["model"], records[:size]
    answers_key = digest(model.name, chosen, quality_curve.SAMPLE_MAX_TOKENS)
    answers = stages.run(f"answers.{size}", answers_key, lambda out: quality_curve.write_completions(chosen, out))
    dataset = stages.run(f"tokenize-answers.{size}", answers_key, lambda out: tokenize(
        model, answers, out, max_length=quality_curve.SAMPLE_MAX_TOKENS))
    tokens, trained = quality_curve.dataset_tokens(dataset, quality_curve.SAMPLE_MAX_TOKENS)
    steps = max(20, math.ceil(epochs * tokens / TOKENS_PER_STEP))
    points = []
    for name, recipe in recipes.items():
        key = digest(answers_key, recipe, steps)
        run = stages.run(f"train-curve.{name}.{size}", key, lambda out, r=recipe: train(model, dataset, r, steps, out))
        replayed = stages.run(f"replay-curve.{name}.{size}", digest(key, ctx["greedy_key"]), lambda out, run=run: (
            out.mkdir(parents=True, exist_ok=True), (out / "replay.json").write_text(json.dumps({
                which: quality_curve.replay_tau(model, run / "drafter", ctx["greedy"][which], ctx["eval_new_tokens"])
                for which in ("mtbench", "heldout")}))))
        found = json.loads((replayed / "replay.json").read_text())
        mt, held = found["mtbench"], found["heldout"]
        point = {"recipe": name, "conversations": len(chosen), "tokens": tokens, "trained_tokens": trained,
                 "steps": steps, "tau_mtbench": mt["tau"], "tau_ngram_mtbench": ctx["ngram"]["mtbench"]["tau"],
                 "tau_heldout": held["tau"], "tau_ngram_heldout": ctx["ngram"]["heldout"]["tau"],
                 "tau_vllm_count_mtbench": mt["tau_vllm"], "mtbench_prompts": mt["prompts"],
                 "heldout_prompts": held["prompts"],
                 "position_acceptance_mtbench": [round(p, 3) for p in mt["position_acceptance"]],
                 "train_seconds": stages.times[f"train-curve.{name}.{size}"],
                 "eval_seconds": stages.times[f"replay-curve.{name}.{size}"], **bench_quality.train_figures(run),
                 "run": run, "dataset": dataset, "dataset_key": answers_key}
        if decode_check and name == "base":
            evaluated = stages.run(f"evaluate-curve.{name}.{size}", digest(key, ctx["eval_key"], ctx["eval_batch"]),
                                   lambda out, run=run: evaluate(
                model, run / "drafter", [ctx["mtbench"], ctx["heldout"]], ctx["eval_prompts"], ctx["eval_new_tokens"],
                out, batch_size=ctx["eval_batch"]))
            dec_mt, dec_held = json.loads((evaluated / "evaluation.json").read_text())["sets"]
            point.update(decode_check={
                "tau_mtbench": dec_mt["dflash"]["tau"], "tau_heldout": dec_held["dflash"]["tau"],
                "tau_ngram_mtbench": dec_mt["ngram"]["tau"], "tau_ngram_heldout": dec_held["ngram"]["tau"],
                "outputs_equal": all(p["outputs_equal"] for s in (dec_mt, dec_held) for p in s["per_prompt"]),
                "seconds": stages.times[f"evaluate-curve.{name}.{size}"]})
        print(f"  curve {name} @ {size} conversations ({trained:,} trained tokens, {steps} steps): "
              f"MT-Bench {point['tau_mtbench']:.3f} (n-gram {point['tau_ngram_mtbench']:.3f}), held-out "
              f"{point['tau_heldout']:.3f} (n-gram {point['tau_ngram_heldout']:.3f})"
              + (f"; decoded: {point['decode_check']}" if "decode_check" in point else ""), flush=True)
        points.append(point)
    return points


def curve_peer(args, stages: Stages, ctx: dict, points: list[dict], recipes: dict) -> dict:
    """vLLM speculators' DFlash trainer on the curve's largest size (:mod:`peer_compare`): trained on the same
    samples at the shape and budget of each ``--peer-ours`` recipe's drafter, once per seed and per
    ``--peer-optimizer``; ours and the peer's served by the real vLLM on the first ``--served-prompts`` MT-Bench
    first turns (SmolLM2's template has no thinking mode), each output checked against greedy."""
    import peer_compare

    size = max(p["conversations"] for p in points)
    last = {p["recipe"]: p for p in points if p["conversations"] == size}
    names = [n for n in args.peer_ours.split(",") if n]  # run_curve checked they are curve recipes
    first = last[names[0]]
    mtbench = read_records(ctx["mtbench"])[: args.served_prompts]
    peer_ctx = {"model": ctx["model"], "dataset": first["dataset"], "dataset_key": first["dataset_key"],
                "steps": first["steps"], "heldout": ctx["heldout"], "served": ctx["mtbench"], "served_name": "MT-Bench",
                "thinking": False, "eval_prompts": args.served_prompts, "max_new_tokens": args.eval_new_tokens,
                "eval_key": digest(ctx["model"].name, mtbench, args.served_prompts, args.eval_new_tokens, "no thinking")}
    # our trainer cuts samples at 1,024 tokens here (the curve's are at most SAMPLE_MAX_TOKENS): the peer's too
    ours = {n: (last[n]["run"], {**recipes[n], "max_length": 1024}, last[n]) for n in names}
    seeds = [int(x) for x in args.peer_seeds.split(",") if x]
    entries = {}
    for optimizer in (o for o in args.peer_optimizer.split(",") if o):
        entries[optimizer] = peer_compare.compare(stages, peer_ctx, ours, seeds, optimizer)
        peer_compare.print_comparison(entries[optimizer])
    return {"conversations": size, "trained_tokens": first["trained_tokens"], "steps": first["steps"],
            "by_peer_optimizer": entries}


def run_curve(args, stages: Stages, ctx: dict, prompts: dict) -> None:
    """The data-scaling mode: τ against trained tokens for each recipe, fitted, plotted and reported."""
    from dfp_dev.prompt_sets import sharegpt_file

    sizes = sorted({int(n) for n in args.curve.split(",") if n})
    names = [n for n in args.curve_recipes.split(",") if n]
    try:
        recipes = {n: BASE_RECIPE if n == "base" else {**BASE_RECIPE, **lever_recipe(n)} for n in names}
    except ValueError as exc:
        raise SystemExit(f"--curve-recipes: {exc}") from None
    if args.peer:
        import peer_compare

        odd = [o for o in args.peer_optimizer.split(",") if o and o not in peer_compare.OPTIMIZERS]
        if odd or set(n for n in args.peer_ours.split(",") if n) - set(names):
            raise SystemExit(f"--peer: --peer-ours must name curve recipes ({names}) and --peer-optimizer be of "
                             f"{list(peer_compare.OPTIMIZERS)}")
    records, counts = quality_curve.own_answers(sharegpt_file(), HELD_OUT_ONE_IN, MAX_PROMPT_CHARS, max(sizes))
    print(f"  own answers: {counts}; sizes {sizes} of {len(records)} available", flush=True)
    draft_len = BASE_RECIPE["block_size"] - 1
    if any(r["block_size"] - 1 != draft_len for r in recipes.values()):
        raise SystemExit("--curve-recipes: every recipe of a curve drafts the same block (n-gram's τ is shared)")
    greedy = {which: stages.run(f"greedy.{which}", digest(ctx["eval_key"], which, draft_len, args.eval_batch),
                                lambda out, which=which: quality_curve.greedy_outputs(
                                    ctx["model"], ctx[which], args.eval_prompts, args.eval_new_tokens, draft_len,
                                    args.eval_batch, out))
              for which in ("mtbench", "heldout")}
    ctx.update(greedy=greedy, greedy_key=digest(ctx["eval_key"], draft_len, "greedy"), eval_batch=args.eval_batch,
               ngram={w: json.loads((g / "greedy.json").read_text())["ngram"] for w, g in greedy.items()})
    checked = {int(n) for n in args.curve_decode_check.split(",") if n} if args.curve_decode_check is not None \
        else {sizes[0]}
    points = [p for size in sizes if size <= len(records) for p in curve_point(
        stages, ctx, size, records, recipes, args.curve_epochs, decode_check=size in checked)]
    curves = quality_curve.summarise(points)
    peer_entry = curve_peer(args, stages, ctx, points, recipes) if args.peer else None
    picture = quality_curve.plot(curves, Path(args.curve_plot))
    print(f"\n{'recipe':>18}  {'conv':>5}  {'trained tok':>11}  {'steps':>5}  {'MT-Bench':>8}  {'n-gram':>6}  "
          f"{'held-out':>8}  {'n-gram':>6}  per-position (MT-Bench)")
    for p in points:
        print(f"{p['recipe']:>18}  {p['conversations']:5d}  {p['trained_tokens']:11,d}  {p['steps']:5d}  "
              f"{p['tau_mtbench']:8.3f}  {p['tau_ngram_mtbench']:6.3f}  {p['tau_heldout']:8.3f}  "
              f"{p['tau_ngram_heldout']:6.3f}  {p['position_acceptance_mtbench']}")
    for name, c in curves.items():
        for label in ("", "_local"):
            if f"fits{label}" in c:
                print(f"{name}: fit{label} MT-Bench {c[f'fits{label}']['mtbench']}, held-out "
                      f"{c[f'fits{label}']['heldout']}; trained tokens it needs: {c[f'trained_tokens_for{label}']}")
    print(f"plot: {picture}; stage wall times (s): {stages.times}")
    best = max(curves, key=lambda n: curves[n]["points"][-1]["tau_mtbench"])
    last = curves[best]["points"][-1]
    report("quality_curve", "tokens/step", last["tau_mtbench"], last["tau_ngram_mtbench"], float(BASE_RECIPE["block_size"]),
           recipe=best, tau_mtbench=round(last["tau_mtbench"], 3), tau_ngram_mtbench=round(last["tau_ngram_mtbench"], 3),
           tau_heldout=round(last["tau_heldout"], 3), trained_tokens=last["trained_tokens"], target=ctx["model"].name,
           data="ShareGPT answers as they are", epochs=args.curve_epochs, sample_max_tokens=quality_curve.SAMPLE_MAX_TOKENS,
           curves={n: {"points": [{k: p[k] for k in ("conversations", "trained_tokens", "steps", "tau_mtbench",
                                                     "tau_ngram_mtbench", "tau_heldout", "tau_ngram_heldout",
                                                     "decode_check", "train_seconds", "eval_seconds") if k in p}
                                  for p in c["points"]],
                       **{k: v for k, v in c.items() if k.startswith(("fits", "trained_tokens_for"))}}
                   for n, c in curves.items()}, stage_seconds=stages.times, plot=str(picture) if picture else None,
           **({"peer": peer_entry} if peer_entry else {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                    / "dflash-pipeline" / "bench-quality-real", help="Cache of every stage's output.")
    ap.add_argument("--train-prompts", type=int, default=384, help="ShareGPT first turns the target answers.")
    ap.add_argument("--heldout-prompts", type=int, default=24, help="Held-out ShareGPT prompts evaluated.")
    ap.add_argument("--eval-prompts", type=int, default=80, help="Prompts evaluated per set (MT-Bench has 80).")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="Tokens per training completion.")
    ap.add_argument("--eval-new-tokens", type=int, default=64, help="Tokens per evaluated prompt.")
    ap.add_argument("--steps", type=int, default=400, help="Drafter optimiser steps (the fixed training budget).")
    ap.add_argument("--engine", choices=("openai", "transformers"), default="openai",
                    help="Engine answering the training prompts: the OpenAI engine against the real vLLM serving the "
                         "target (fast), or the transformers engine in process.")
    ap.add_argument("--engine-sample", type=int, default=24, help="Prompts both engines answer, for their tokens/s.")
    ap.add_argument("--vllm", action="store_true", help="Also serve the trained drafter with the real vLLM on "
                                                         "MT-Bench prompts (acceptance beside the project's).")
    ap.add_argument("--served-prompts", type=int, default=16, help="MT-Bench prompts the real vLLM serves.")
    ap.add_argument("--recipe", default=BEST, help=f"Recipe of the main drafter (the one served and reported): base or "
                                                   f"a lever's name (default: {BEST}, the best found).")
    ap.add_argument("--levers", action="store_true", help="Also train and evaluate one drafter per recipe lever.")
    ap.add_argument("--lever-eval-prompts", type=int, default=16, help="MT-Bench prompts each lever's drafter is "
                                                                      "evaluated on (the base: --eval-prompts).")
    ap.add_argument("--only", default=None, help=f"Comma-separated levers (of {', '.join(LEVERS)}); implies --levers.")
    ap.add_argument("--curve", default=None, metavar="SIZES",
                    help="Data-scaling mode: comma-separated numbers of ShareGPT conversations whose own first answers "
                         "are trained on (e.g. 128,256,512,1024); τ against trained tokens per recipe, fitted and "
                         "plotted. No generation runs.")
    ap.add_argument("--curve-recipes", default="base", help="Recipes of the curve, comma-separated: base, levers' names, "
                    "or levers and train-spec field=value parts joined by + (optimizer=muon+seed=1).")
    ap.add_argument("--curve-epochs", type=float, default=2.0, help="Passes over each size's data.")
    ap.add_argument("--curve-plot", default="tau_curve.png", help="Where the curve's plot is written (PNG).")
    ap.add_argument("--eval-batch", type=int, default=16, help="Prompts the curve's evaluations decode at once.")
    ap.add_argument("--curve-decode-check", default=None, metavar="SIZES",
                    help="Sizes whose base drafter is also evaluated by real decoding beside its replay (default: the "
                         "smallest).")
    ap.add_argument("--peer", action="store_true", help="Curve mode: also train vLLM speculators' DFlash trainer on "
                    "the largest size's samples at each --peer-ours drafter's shape and budget; the real vLLM serves "
                    "both on the first --served-prompts MT-Bench first turns.")
    ap.add_argument("--peer-ours", default=BEST, help="Comma-separated curve recipes served beside the peer (--peer).")
    ap.add_argument("--peer-seeds", default="0", help="Comma-separated seeds of the peer's runs (--peer).")
    ap.add_argument("--peer-optimizer", default="adamw,muon", help="The peer's optimizers (--peer), comma-separated: "
                    "adamw (its default) and muon (its Muon at our Muon's settings).")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()

    import torch
    from dfp_dev.targets.smollm2 import smollm2_dir
    from dfp_shared.logs import setup_logging

    setup_logging("INFO", service="bench-quality-real")
    torch.set_num_threads(args.threads)
    work = args.work.resolve()
    stages = Stages(work)
    began = time.perf_counter()
    model = smollm2_dir()
    stages.times["target"] = round(time.perf_counter() - began, 1)
    began = time.perf_counter()
    prompts = prepare_prompts(work, args.train_prompts, args.heldout_prompts)
    stages.times["prompts"] = round(time.perf_counter() - began, 1)
    if args.curve:
        return run_curve(args, stages, {
            "model": model, "mtbench": prompts["mtbench"], "heldout": prompts["heldout"], "eval_prompts": args.eval_prompts,
            "eval_new_tokens": args.eval_new_tokens,
            "eval_key": digest(model.name, read_records(prompts["heldout"]), args.eval_prompts, args.eval_new_tokens)},
            prompts)
    train_records = read_records(prompts["train"])

    gen_key = digest(model.name, train_records, args.max_new_tokens, args.engine)
    # both engines answer the same first prompts, for their tokens/s side by side
    sample = train_records[: args.engine_sample]
    write_prompts(work / "prompts" / "engine-sample.jsonl", sample)
    sample_key = digest(model.name, sample, args.max_new_tokens)
    throughput = {name: json.loads((stages.run(f"generate-{name}", sample_key, lambda out, fn=fn: fn(
        model, work / "prompts" / "engine-sample.jsonl", args.max_new_tokens, out)) / "throughput.json").read_text())
        for name, fn in (("transformers", generate), ("openai", vllm_generation))}
    fn = vllm_generation if args.engine == "openai" else generate
    completions = stages.run("generate", gen_key, lambda out: fn(model, prompts["train"], args.max_new_tokens, out))
    dataset = stages.run("tokenize", digest(gen_key), lambda out: tokenize(model, completions, out))
    ctx = {"model": model, "dataset": dataset, "dataset_key": digest(gen_key, "tokens"), "steps": args.steps,
           "mtbench": prompts["mtbench"], "heldout": prompts["heldout"], "eval_prompts": args.eval_prompts,
           "eval_new_tokens": args.eval_new_tokens, "lever_eval_prompts": args.lever_eval_prompts,
           "eval_key": digest(model.name, read_records(prompts["heldout"]), args.eval_prompts, args.eval_new_tokens)}

    if args.recipe != "base" and args.recipe not in LEVERS:
        ap.error(f"--recipe: unknown {args.recipe!r}; choose base or of {list(LEVERS)}")
    recipe = BASE_RECIPE if args.recipe == "base" else {**BASE_RECIPE, **LEVERS[args.recipe]}
    base = recipe_figures(stages, ctx, args.recipe, recipe)
    _, trained_tokens = quality_curve.dataset_tokens(dataset, 1024)  # as bench_quality.train cuts samples
    extra = {}
    if args.vllm:  # before the levers: the base drafter served by the real vLLM
        check = stages.run("serve", digest(base["run"].name, args.served_prompts, args.eval_new_tokens),
                           lambda out: served(model, base["run"] / "drafter", prompts["mtbench"],
                                              args.served_prompts, args.eval_new_tokens, out))
        result = json.loads((check / "served.json").read_text())
        extra = {"tau_vllm_mtbench": round(result["vllm"]["acceptance_length"], 3),
                 "project_whole_blocks_mtbench": round(result["project_whole_blocks"]["acceptance_length"], 3),
                 "served_outputs_equal": result["outputs_equal"], "served_acceptance_equal": result["acceptance_equal"],
                 "served_prompts": args.served_prompts}

    chosen = [n for n in args.only.split(",") if n] if args.only else list(LEVERS) if args.levers else []
    unknown = set(chosen) - set(LEVERS)
    if unknown:
        ap.error(f"--only: unknown levers {sorted(unknown)}; choose from {list(LEVERS)}")
    levers = {n: recipe_figures(stages, ctx, n, {**BASE_RECIPE, **LEVERS[n]}, lever=True) for n in chosen
              if n != args.recipe}

    print(f"\nMT-Bench: {args.eval_prompts} first turns, held-out ShareGPT: {args.heldout_prompts}; "
          f"{args.eval_new_tokens} new tokens each; drafter: {args.steps} steps on {len(train_records)} completions")
    def shown(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    print(f"{'recipe':>24}  {'MT-Bench':>8}  {'n-gram':>6}  {'prompts':>7}  {'held-out':>8}  {'n-gram':>6}  "
          f"{'train tok/s':>11}  {'coverage':>8}  per-position (MT-Bench)")
    for name, f in {args.recipe: base, **levers}.items():
        coverage = "-" if f["draft_vocab_coverage"] is None else f"{f['draft_vocab_coverage']:.4f}"
        print(f"{name:>24}  {f['tau_mtbench']:8.2f}  {f['tau_ngram_mtbench']:6.2f}  {f['mtbench_prompts']:7d}  "
              f"{shown(f['tau_heldout']):>8}  {shown(f['tau_ngram_heldout']):>6}  {f['train_tokens_per_s']:11.0f}  "
              f"{coverage:>8}  {f['position_acceptance_mtbench']}")
    print(f"untrained DFlash on MT-Bench: {base['tau_untrained']:.2f}; generation of {len(sample)} prompts: "
          f"transformers engine {throughput['transformers']['tokens_per_s']} tokens/s, OpenAI engine on the real "
          f"vLLM {throughput['openai']['tokens_per_s']} tokens/s"
          + (f"; vLLM served τ {extra['tau_vllm_mtbench']}" if extra else ""))
    print(f"stage wall times (s): {stages.times}")
    report("quality_real", "tokens/step", base["tau_mtbench"], base["tau_ngram_mtbench"], float(base["block_size"]),
           tau_mtbench=round(base["tau_mtbench"], 3), tau_ngram_mtbench=round(base["tau_ngram_mtbench"], 3),
           tau_heldout=round(base["tau_heldout"], 3), tau_ngram_heldout=round(base["tau_ngram_heldout"], 3),
           tau_untrained=round(base["tau_untrained"], 3), tau_vllm_count_mtbench=round(base["tau_vllm_count_mtbench"], 3),
           position_acceptance=base["position_acceptance_mtbench"],
           ngram_position_acceptance=base["ngram_position_acceptance_mtbench"], outputs_equal=base["outputs_equal"],
           transformers_engine_tokens_per_s=throughput["transformers"]["tokens_per_s"],
           openai_engine_vllm_tokens_per_s=throughput["openai"]["tokens_per_s"], generation_engine=args.engine,
           sharegpt_unreadable=prompts["sharegpt_errors"],
           target=model.name, steps=args.steps, train_prompts=len(train_records), recipe=args.recipe,
           recipe_spec=recipe, trained_tokens=trained_tokens,
           stage_seconds=stages.times, **extra,
           train_tokens_per_s=base["train_tokens_per_s"],
           levers={n: {k: f[k] for k in ("tau_mtbench", "tau_ngram_mtbench", "mtbench_prompts",
                                         "position_acceptance_mtbench", "train_tokens_per_s", "draft_vocab_coverage")}
                   for n, f in levers.items()})


if __name__ == "__main__":
    main()
