"""Drafter quality on a learnable target: τ of the trained DFlash drafter against n-gram speculation.

The whole recipe, each stage the project's own code: the learnable target (a small Qwen3 trained
on the standard library's functions, :mod:`dfp_dev.targets.learnable`, built once and
cached) answers the training prompts greedily (the generation service's transformers engine), the
completions are tokenized (the tokenizer pool, over a private Redis), a drafter is trained for a
fixed budget (the trainer, target in process), and both the trained and the untrained drafter are
evaluated by the evaluate job's code: real greedy speculative decoding on held-out prompts the
drafter never saw, beside n-gram (prompt-lookup) speculation at the same draft length in the same
harness (every output equals the target's greedy output).

Project: τ of the trained drafter (tokens per verify step). Baseline: τ of n-gram speculation.
Limit: the block size (every draft accepted). Also printed: the untrained drafter's τ, the
acceptance of each draft position, and the wall time of each stage. ``--levers`` trains and
evaluates one drafter per recipe lever (feature noise, loss decay γ, anchors, block size 16,
D-PACE, draft layers started from the target's, distillation from the target's distribution, the drafter
families and draft vocabulary sizes) beside the base recipe and prints τ per lever, with the training's
tokens/s and the draft vocabulary's coverage of the trained tokens.

``--peer`` trains vLLM speculators' DFlash trainer (PyPI ``speculators`` 0.9.0, in an environment of its own) on
the same samples, at the same shape and budget as each of our drafters chosen by ``--ours``, once per
``--peer-seeds`` seed, and serves ours and the peer's with the real vLLM on the held-out prompts
(:mod:`peer_compare`): vLLM's acceptance length of each, the ratio ours / peer, and each training's tokens/s.

Stages are cached under ``--work`` by their inputs, so a second run (or another lever) redoes only
what changed; a cached stage shows the time it took when it ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import _common  # noqa: F401 - import path
from _common import report

SEED = 0  # of every drafter run
BASE_RECIPE = {"block_size": 8, "gamma": 4.0, "max_anchors": 8, "noise_std": 0.0, "loss": "decay"}
LEVERS = {
    "noise_std=0.02": {"noise_std": 0.02},
    "gamma=7": {"gamma": 7.0},
    "max_anchors=16": {"max_anchors": 16},
    "block_size=16": {"block_size": 16, "gamma": 7.0},
    "loss=dpace": {"loss": "dpace"},
    "init=target_layers": {"init": "target_layers"},  # the draft layers start as the target's last two
    "distill=1.0": {"distill_weight": 1.0},  # forward KL from the target's distribution only
    "distill=0.5": {"distill_weight": 0.5},  # half KL, half cross-entropy
    "init=unit_logits": {"init": "unit_logits"},  # the final norm scaled so the first logits have unit spread
}
# the drafter families and draft vocabularies (shared with the real-target benchmark): each beside the base
# recipe's DFlash drafter over the target's full vocabulary
FAMILY_LEVERS = {
    "draft_vocab=32768": {"draft_vocab_size": 32_768},
    "draft_vocab=8192": {"draft_vocab_size": 8_192},
    "family=dspark": {"family": "dspark"},
    "dspark+draft_vocab=8192": {"family": "dspark", "draft_vocab_size": 8_192},
    "family=dflash2": {"family": "dflash2"},  # the full vocabulary only (vLLM's DFlash2 has no d2t)
}
LEVERS.update(FAMILY_LEVERS)
# where vLLM speculators' DFlash trainer (0.9.0) differs from the base recipe at equal data, shape and budget, each
# alone and all together, over an 8,192-token draft vocabulary (every trained token of this target; a step several
# times cheaper on these CPUs), beside that vocabulary's base, `draft_vocab=8192`
V8K = {"draft_vocab_size": 8_192}
PEER = {"adam_beta2": 0.999, "loss_norm": "positions", "anchor_spread": "batch", "weight_decay": 0.01}
LEVERS.update({**{f"v8k+{k}={v}": {**V8K, k: v} for k, v in PEER.items()}, "v8k+peer": {**V8K, **PEER}})
# what the target itself can teach, over the same vocabulary: its distribution, its layers as the start, both
LEVERS.update({"v8k+init=target_layers": {**V8K, "init": "target_layers"}, "v8k+distill=0.5": {**V8K, "distill_weight": 0.5},
               "v8k+distill=0.5+init": {**V8K, "distill_weight": 0.5, "init": "target_layers"}})
# the peer's labels (the target's argmax), and a start whose first logits have unit spread, alone and with distillation
LEVERS.update({"v8k+labels=target_argmax": {**V8K, "labels": "target_argmax"},
               "v8k+init=unit_logits": {**V8K, "init": "unit_logits"},
               "v8k+distill=0.5+unit_logits": {**V8K, "distill_weight": 0.5, "init": "unit_logits"},
               # a second seed of the vocabulary's base and of the unit-spread start
               "v8k+seed=1": {**V8K, "seed": 1}, "v8k+init=unit_logits+seed=1": {**V8K, "init": "unit_logits", "seed": 1}})


def lever_recipe(name: str, levers: dict | None = None) -> dict:
    """The train-spec changes a lever name stands for: a name of ``levers`` (default :data:`LEVERS`), or
    ``+``-joined parts each of which is one (``v8k`` for the 8,192-token draft vocabulary; a lever whose own name
    holds ``+`` counts as one part) or a ``field=value`` of the train spec (a number where it reads as one), e.g.
    ``v8k+init=unit_logits+optimizer=muon`` or ``muon+family=dspark+seed=1``."""
    levers = LEVERS if levers is None else levers
    parts, recipe, at = name.split("+"), {}, 0
    while at < len(parts):
        # the longest run of parts from here that names a lever, else this part alone
        end = next((j for j in range(len(parts), at, -1) if "+".join(parts[at:j]) in levers), at + 1)
        part = "+".join(parts[at:end])
        if part in levers or part == "v8k":
            recipe.update(levers.get(part, V8K))
        elif "=" in part:
            key, value = part.split("=", 1)
            try:
                recipe[key] = json.loads(value)
            except ValueError:
                recipe[key] = value
        else:
            raise ValueError(f"unknown lever {part!r} in {name!r}; choose from {list(levers)} or field=value")
        at = end
    return recipe


def digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


class Stages:
    """Runs each stage once per input digest; records and prints its wall time."""

    def __init__(self, work: Path):
        self.work, self.times = work, {}

    def run(self, name: str, key: str, fn) -> Path:
        out = self.work / f"{name}-{key}"  # no glob characters: engines find weights by globbing the path
        done = out / "stage.json"
        if done.exists():
            took = json.loads(done.read_text())["seconds"]
            print(f"  {name}: cached ({took:.0f} s when it ran)", flush=True)
        else:
            shutil.rmtree(out, ignore_errors=True)  # what an interrupted run left
            began = time.perf_counter()
            fn(out)
            took = time.perf_counter() - began
            out.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps({"seconds": took}))
            print(f"  {name}: {took:.0f} s", flush=True)
        self.times[name] = round(took, 1)
        return out


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_prompts(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def generate(model_dir: Path, prompts: Path, max_new_tokens: int, out: Path, *, thinking: bool = True,
             batch_size: int = 16, spec: dict | None = None, **settings) -> dict:
    """The target answers ``prompts`` greedily through the generation service (``spec``/``settings``: another
    engine); returns its tokens/s, also written to ``throughput.json``."""
    from dfp_generation.local import run_local
    from dfp_generation.settings import GenerationSettings
    from dfp_shared.specs.generate import GenerateSpec

    job = GenerateSpec.model_validate({
        "prompts": f"file://{prompts}", "output": f"file://{out}", "model": f"file://{model_dir}",
        "engine": "transformers", "temperature": 0.0, "max_new_tokens": max_new_tokens, "thinking": thinking,
        "shard_size": 64, **(spec or {})})
    began = time.perf_counter()
    run_local(job, GenerationSettings(storage_url=f"file://{out.parent}", generation_batch_size=batch_size, **settings))
    seconds = time.perf_counter() - began
    tokens = sum(r["meta"].get("completion_tokens", 0) for f in sorted((out / "completions").glob("*.jsonl"))
                 for r in read_records(f))
    figures = {"completion_tokens": tokens, "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1)}
    (out / "throughput.json").write_text(json.dumps(figures))
    return figures


def tokenize(model_dir: Path, completions: Path, out: Path, *, thinking: bool = True, max_length: int = 1024) -> None:
    from dfp_dev.local.redis_server import RedisServer
    from dfp_tokenizer.local import run_job
    from dfp_tokenizer.settings import TokenizerSettings

    redis = RedisServer().start()
    try:
        settings = TokenizerSettings(redis_url=redis.url, storage_url=f"file://{out.parent}", processes="1")
        rec, _ = run_job(settings, {"input": f"file://{completions}/completions/", "output": f"file://{out}",
                                    "tokenizer": f"file://{model_dir}", "thinking": thinking, "max_length": max_length,
                                    "truncation": "truncate"})
        if rec.state.value != "succeeded":
            raise RuntimeError(f"tokenize job {rec.state.value}: {rec.error}")
    finally:
        redis.stop()


def train(model_dir: Path, dataset: Path, recipe: dict, steps: int, out: Path, **spec) -> None:
    """A drafter for ``steps`` steps of ``recipe`` (``spec``: more train-spec fields)."""
    from dfp_shared.specs.train import TrainSpec
    from dfp_trainer.run import run_local
    from dfp_trainer.settings import TrainerSettings

    job = TrainSpec.model_validate({
        "dataset": f"file://{dataset}", "target": f"file://{model_dir}", "output": f"file://{out}",
        "steps": steps, "tokens_per_batch": 1024, "max_length": 512, "num_draft_layers": 2, "lr": 3e-3,
        "warmup_ratio": 0.05, "checkpoint_every": steps, "eval_prompts": 0, "seed": SEED, "exports": ["zlab"],
        "optimizer": "adamw",  # the recipes' base (the trainer's default is Muon: the lever `optimizer=muon`)
        **spec, **recipe})
    result = run_local(job, TrainerSettings(storage_url=f"file://{out.parent}", target_url="inprocess"), resume=False)
    if not result.completed:
        raise RuntimeError("training stopped before its last step")


def untrained_export(model_dir: Path, trained: Path, out: Path, init: str = "random") -> None:
    """The drafter the run started from (same config, same seed, same ``init``), exported like a trained one."""
    import torch
    from dfp_shared.models.loading import load_causal_lm
    from dfp_trainer.drafter.load import load_exported
    from dfp_trainer.drafter.model import DFlashDrafter
    from dfp_trainer.export.zlab import export_drafter

    target = load_causal_lm(str(model_dir), device="cpu")
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    config = load_exported(trained, embed, head).config
    torch.manual_seed(SEED)  # as the trainer initialises a run
    drafter = DFlashDrafter(config, embed, head)
    if init == "target_layers":
        from dfp_trainer.drafter.init_from_target import init_from_target_layers

        init_from_target_layers(drafter, model_dir)
    export_drafter(drafter, out)


def evaluate(model_dir: Path, drafter: Path, prompt_sets: list[Path], prompts: int, max_new_tokens: int, out: Path,
             *, thinking: bool = True, batch_size: int = 8) -> None:
    """The evaluate job's decoding on each prompt set: DFlash and n-gram speculation beside greedy."""
    from dfp_shared.specs.evaluate import EvaluateSpec
    from dfp_trainer.evaluate.job import evaluate_job

    spec = EvaluateSpec.model_validate({"drafter": f"file://{drafter}", "target": f"file://{model_dir}",
                                        "prompts": [f"file://{p}" for p in prompt_sets], "output": f"file://{out}",
                                        "max_prompts": prompts, "max_new_tokens": max_new_tokens,
                                        "enable_thinking": thinking, "batch_size": batch_size})
    evaluate_job(spec, device="cpu")


def sets(eval_dir: Path) -> dict:
    return json.loads((eval_dir / "evaluation.json").read_text())["sets"][0]


def recipe_figures(stages: Stages, ctx: dict, name: str, recipe: dict, untrained: bool = True) -> dict:
    """Train one drafter on the recipe and evaluate it and its untrained start on the held-out prompts."""
    key = digest(ctx["dataset_key"], recipe, ctx["steps"])
    print(f"recipe {name}: {recipe}", flush=True)
    run = stages.run(f"train.{name}", key, lambda out: train(ctx["model"], ctx["dataset"], recipe, ctx["steps"], out))
    evaluated = stages.run(f"evaluate.{name}", digest(key, ctx["eval_key"]), lambda out: evaluate(
        ctx["model"], run / "drafter", [ctx["heldout"]], ctx["eval_prompts"], ctx["max_new_tokens"], out))
    trained, start, ran = sets(evaluated), None, train_figures(run)
    if untrained:
        start = sets(stages.run(f"evaluate-untrained.{name}", digest(key, ctx["eval_key"], "untrained"), lambda out: (
            untrained_export(ctx["model"], run / "drafter", out / "drafter", recipe.get("init", "random")),
            evaluate(ctx["model"], out / "drafter", [ctx["heldout"]], ctx["eval_prompts"], ctx["max_new_tokens"], out))))
    return {"tau": trained["dflash"]["tau"], "tau_vllm": trained["dflash"]["tau_vllm"],
            "tau_untrained": start["dflash"]["tau"] if start else None, "tau_ngram": trained["ngram"]["tau"],
            "position_acceptance": [round(p, 3) for p in trained["dflash"]["position_acceptance"]],
            "ngram_position_acceptance": [round(p, 3) for p in trained["ngram"]["position_acceptance"]],
            "outputs_equal": all(p["outputs_equal"] for p in trained["per_prompt"]),
            "block_size": recipe["block_size"], "dflash_tokens_per_s": round(trained["dflash"]["tokens_per_s"], 1),
            "ngram_tokens_per_s": round(trained["ngram"]["tokens_per_s"], 1), "run": str(run), **ran}


def train_figures(run: Path) -> dict:
    """The training's tokens/s (target forward in process included) and the draft vocabulary's coverage."""
    report_json = json.loads((run / "report.json").read_text())
    return {"train_tokens_per_s": round(report_json["summary"]["tokens_per_s"], 1),
            "draft_vocab_coverage": (report_json.get("draft_vocab") or {}).get("coverage")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                    / "dflash-pipeline" / "bench-quality", help="Cache of every stage's output.")
    ap.add_argument("--train-prompts", type=int, default=512, help="Prompts the target answers for the drafter's data.")
    ap.add_argument("--eval-prompts", type=int, default=16, help="Held-out prompts of the evaluation.")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="Tokens per completion and per evaluated prompt.")
    ap.add_argument("--steps", type=int, default=300, help="Drafter optimiser steps (the fixed training budget).")
    ap.add_argument("--levers", action="store_true", help="Also train and evaluate one drafter per recipe lever.")
    ap.add_argument("--only", default=None, help=f"Comma-separated levers to run (of {', '.join(LEVERS)}); implies "
                                                 "--levers. Runs on disjoint levers can share one --work.")
    ap.add_argument("--seeds", default=None, help="Comma-separated seeds each chosen lever is trained with (unset: "
                                                   "each lever's own seed, 0 unless it names one).")
    ap.add_argument("--peer", action="store_true", help="Also train vLLM speculators' DFlash trainer on the same "
                    "samples, shape and budget as each --ours drafter and serve both with the real vLLM.")
    ap.add_argument("--peer-seeds", default="0", help="Comma-separated seeds of the peer's runs (--peer).")
    ap.add_argument("--peer-optimizer", choices=("adamw", "muon"), default="adamw",
                    help="The peer's optimizer (--peer): its default AdamW, or its Muon at our Muon's settings.")
    ap.add_argument("--ours", default="draft_vocab=8192", help="Comma-separated recipes of ours served beside the "
                    "peer (--peer): base, or lever names as --only takes them.")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()

    import torch
    from dfp_dev.targets.learnable import build_learnable_target, default_root
    from dfp_dev.targets.qwen3_tokenizer import qwen3_tokenizer_dir
    from dfp_shared.logs import setup_logging

    setup_logging("INFO", service="bench-quality")  # the stages' progress lines (training: step, loss, tokens/s)
    torch.set_num_threads(args.threads)
    work = args.work.resolve()
    stages = Stages(work)
    began = time.perf_counter()
    built = build_learnable_target(default_root(), qwen3_tokenizer_dir())
    stages.times["target"] = round(time.perf_counter() - began, 1)
    model = Path(built.path)
    print(f"  target: {model.name} ({'cached' if built.hit else 'built'}, {stages.times['target']:.0f} s)", flush=True)
    train_set, heldout_set = (read_records(p) for p in (built.train_prompts, built.held_out_prompts))
    train_file, heldout_file = work / "prompts" / "train.jsonl", work / "prompts" / "heldout.jsonl"
    write_prompts(train_file, train_set[: args.train_prompts])
    write_prompts(heldout_file, heldout_set[: args.eval_prompts])

    gen_key = digest(model.name, train_set[: args.train_prompts], args.max_new_tokens)
    completions = stages.run("generate", gen_key, lambda out: generate(model, train_file, args.max_new_tokens, out))
    dataset = stages.run("tokenize", digest(gen_key), lambda out: tokenize(model, completions, out))
    ctx = {"model": model, "dataset": dataset, "dataset_key": digest(gen_key, "tokens"), "steps": args.steps,
           "heldout": heldout_file, "eval_prompts": args.eval_prompts, "max_new_tokens": args.max_new_tokens,
           "eval_key": digest(model.name, heldout_set[: args.eval_prompts], args.max_new_tokens)}

    base = recipe_figures(stages, ctx, "base", BASE_RECIPE)
    chosen = [n for n in args.only.split(",") if n] if args.only else list(LEVERS) if args.levers else []
    try:
        recipes = {name: lever_recipe(name) for name in chosen}
        ours = {name: {} if name == "base" else lever_recipe(name)
                for name in (n for n in args.ours.split(",") if n)} if args.peer else {}
    except ValueError as exc:
        ap.error(f"--only / --ours: {exc}")
    if args.peer and not (ours and [x for x in args.peer_seeds.split(",") if x]):
        ap.error("--peer needs at least one --ours recipe and one --peer-seeds seed")
    if args.seeds:  # each lever once per seed; the default seed's run keeps the lever's own name and stages
        recipes = {name if seed == SEED and "seed" not in recipe else f"{name}+seed={seed}": (
            recipe if seed == SEED and "seed" not in recipe else {**recipe, "seed": seed})
            for name, recipe in recipes.items() for seed in (int(s) for s in args.seeds.split(","))}
    levers = {name: recipe_figures(stages, ctx, name, {**BASE_RECIPE, **recipe}, untrained="init" in recipe)
              for name, recipe in recipes.items()}
    print(f"\nheld-out prompts: {args.eval_prompts}, {args.max_new_tokens} new tokens each; drafter: "
          f"{args.steps} steps on {args.train_prompts} completions")
    print(f"{'recipe':>24}  {'tau':>5}  {'untrained':>9}  {'ngram':>5}  {'train tok/s':>11}  {'coverage':>8}  "
          "per-position acceptance")
    for name, f in {"base": base, **levers}.items():
        start = f"{f['tau_untrained']:9.2f}" if f["tau_untrained"] is not None else f"{'-':>9}"
        coverage = f"{f['draft_vocab_coverage']:8.4f}" if f["draft_vocab_coverage"] is not None else f"{'-':>8}"
        print(f"{name:>24}  {f['tau']:5.2f}  {start}  {f['tau_ngram']:5.2f}  {f['train_tokens_per_s']:11.0f}  "
              f"{coverage}  {f['position_acceptance']}")
    peer_entry = None
    if args.peer:
        import peer_compare

        served = {}
        for name, change in ours.items():
            recipe = {**BASE_RECIPE, **change}
            figures = base if name == "base" else levers.get(name) or recipe_figures(stages, ctx, name, recipe, False)
            served[name] = (Path(figures["run"]), recipe, figures)
        peer_entry = peer_compare.compare(stages, ctx, served, [int(x) for x in args.peer_seeds.split(",") if x],
                                          args.peer_optimizer)
        peer_compare.print_comparison(peer_entry)
    print(f"stage wall times (s): {stages.times}")
    report("quality", "tokens/step", base["tau"], base["tau_ngram"], float(base["block_size"]),
           tau_untrained=round(base["tau_untrained"], 3), tau_vllm=round(base["tau_vllm"], 3),
           position_acceptance=base["position_acceptance"],
           ngram_position_acceptance=base["ngram_position_acceptance"], outputs_equal=base["outputs_equal"],
           target=model.name, steps=args.steps, train_prompts=args.train_prompts, eval_prompts=args.eval_prompts,
           stage_seconds=stages.times,
           train_tokens_per_s=base["train_tokens_per_s"],
           levers={n: {k: f[k] for k in ("tau", "tau_vllm", "tau_untrained", "tau_ngram", "position_acceptance",
                                         "train_tokens_per_s", "draft_vocab_coverage")}
                   for n, f in levers.items()},
           **({"peer": peer_entry} if peer_entry else {}))


if __name__ == "__main__":
    main()
