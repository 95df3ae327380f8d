"""``bench_quality.py --peer``: our drafters and vLLM speculators' beside each other, both served by the real vLLM.

For each of our chosen drafters the peer is trained at the same shape (its draft vocabulary size included) on the
same samples and budget, once per ``--peer-seeds`` seed (:mod:`peer_speculators`), each run a cached stage. Every
drafter, ours and the peer's, is then served by vLLM's OpenAI server (its own CPU environment,
:mod:`dfp_dev.serving`) beside the target on ``ctx["served"]`` (default the held-out prompts), greedily in the
training's thinking mode (``ctx["thinking"]``, default on), each output checked token for token against the
target's plain greedy decode; vLLM's acceptance length
(1 + accepted drafts / drafts, whole verified blocks) is the figure, and ours / the peer's mean is the ratio.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import peer_speculators as peer

SPECULATIVE_SETTINGS = {"lr": 3e-3, "warmup_ratio": 0.05, "weight_decay": 0.0, "gamma": 4.0, "total_seq_len": 1024}
OPTIMIZERS = {"adamw": {"optimizer": "adamw"}, "muon": {"optimizer": "muon", "muon_lr": 0.02}}  # muon_lr: our default


def code_hash() -> str:
    """The peer side's code, so a change of adapter or pins trains again."""
    h = hashlib.sha256(peer.pins_hash().encode())
    for name in ("peer_train.py", "peer_speculators.py"):
        h.update((peer.HERE / name).read_bytes())
    return h.hexdigest()[:12]


def our_shape(run: Path, recipe: dict, steps: int, seed: int) -> dict:
    """Our drafter's shape from its export's ``config.json`` (z-lab layout) and the recipe's batching."""
    config = json.loads((run / "drafter" / "config.json").read_text())
    dflash = config["dflash_config"]
    return {"target_layer_ids": list(dflash["target_layer_ids"]), "mask_token_id": int(dflash["mask_token_id"]),
            "block_size": int(dflash.get("block_size", config.get("block_size"))),
            "num_layers": int(config["num_hidden_layers"]), "draft_vocab_size": config.get("draft_vocab_size"),
            "max_length": int(recipe.get("max_length", 512)), "tokens_per_batch": 1024,
            "max_anchors": int(recipe["max_anchors"]),
            "seed": seed, "steps": steps}


def peer_runs(stages, ctx: dict, shape: dict, seeds: list[int], python: Path, optimizer: str = "adamw") -> dict[int, Path]:
    """The peer trained at ``shape`` once per seed (cached stages) with ``optimizer`` (``adamw``, or ``muon`` at our
    Muon's settings for the matrices); their run directories by seed."""
    vocab = shape["draft_vocab_size"] or "full"
    data_key = digest_of(ctx["dataset_key"], shape, SPECULATIVE_SETTINGS, code_hash())
    def prepare(out: Path) -> None:
        prepared = peer.prepare(ctx["model"], ctx["dataset"], shape, {**SPECULATIVE_SETTINGS, "seed": 0}, out)
        (out / "prepared.json").write_text(json.dumps(prepared, indent=1))

    data = stages.run(f"peer-data.v{vocab}", data_key, prepare)
    runs = {}
    for seed in seeds:
        def train(out: Path, seed=seed) -> None:
            seeded = out / "data"
            seeded.mkdir(parents=True)
            (seeded / "samples.safetensors").symlink_to(data / "samples.safetensors")
            settings = json.loads((data / "settings.json").read_text())
            (seeded / "settings.json").write_text(json.dumps({**settings, "seed": seed, **OPTIMIZERS[optimizer]},
                                                             indent=1))
            peer.train_peer(python, seeded, out, out / "train.log")
            from dfp_dev.serving.vllm_server import check_servable

            check_servable(out / "export", "drafter")  # raises naming the field vLLM's CPU runner refuses
        tag, key = ("", digest_of(data_key, seed)) if optimizer == "adamw" else \
            (f".{optimizer}", digest_of(data_key, seed, OPTIMIZERS[optimizer]))
        runs[seed] = stages.run(f"peer-train.v{vocab}{tag}.seed{seed}", key, train)
    return runs


def served_prompts(ctx: dict) -> tuple[list[list[dict]], list[str]]:
    """The prompts every drafter is served on: ``ctx["served"]`` (a JSONL prompt set), else the held-out set."""
    from dfp_dev.serving.check import load_prompts

    return load_prompts(str(ctx.get("served", ctx["heldout"])), ctx["eval_prompts"], ctx["model"])


def serve(stages, ctx: dict, name: str, key: str, drafter: Path, reference: dict, vllm_python: Path) -> dict:
    """vLLM serving ``drafter`` on the served prompts (a cached stage): acceptance and output equality."""
    from dfp_dev.serving import check as serving
    from dfp_dev.serving.vllm_server import VllmServer

    def run(out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        messages, ids = served_prompts(ctx)
        check = serving.ServeCheck(Path(ctx["model"]).resolve(), drafter.resolve(), messages, ids,
                                   ctx["max_new_tokens"], ctx.get("thinking", True), out)
        block = serving.drafter_block_size(drafter)
        server = VllmServer(vllm_python, check.target, out, drafter_dir=check.drafter,
                            num_speculative_tokens=block - 1, method=serving.drafter_method(drafter),
                            v2_runner=serving.drafter_needs_v2_runner(drafter))
        began = time.perf_counter()
        try:
            server.start()
            result = serving.run_check(check, server, reference)
        except Exception as exc:
            raise RuntimeError(f"{exc}\n{server.log_tail(30)}") from exc
        finally:
            server.stop()
        result["serve_seconds"] = round(time.perf_counter() - began, 1)
        (out / "served.json").write_text(json.dumps(result, indent=1))

    done = stages.run(f"serve.{name}", digest_of(key, ctx["eval_key"]), run)
    result = json.loads((done / "served.json").read_text())
    v = result["vllm"]
    return {"acceptance_length": round(v["acceptance_length"], 4), "accepted": v["accepted"], "drafts": v["drafts"],
            "per_position": [int(x) for x in v["per_position"]], "outputs_equal": result["outputs_equal"],
            "prompts_equal": sum(r["output_equal"] and r["prompt_equal"] for r in result["prompts"]),
            "prompts": len(result["prompts"])}


def digest_of(*parts) -> str:
    """As ``bench_quality.digest``: a stage's key from its inputs."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def reference(stages, ctx: dict, drafter: Path) -> dict:
    """The target's plain greedy outputs on the served prompts (the project's reference decode, cached)."""
    from dfp_dev.serving.check import ServeCheck, reference_decode

    def run(out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        messages, ids = served_prompts(ctx)
        reference_decode(ServeCheck(Path(ctx["model"]).resolve(), drafter.resolve(), messages, ids,
                                    ctx["max_new_tokens"], ctx.get("thinking", True), out))

    return json.loads((stages.run("serve-reference", digest_of(ctx["eval_key"], "greedy"), run)
                       / "reference.json").read_text())


def compare(stages, ctx: dict, ours: dict[str, tuple[Path, dict, dict]], seeds: list[int],
            optimizer: str = "adamw") -> dict:
    """``ours``: name -> (run directory, recipe, training figures). Trains the peer at each of their shapes, serves
    every drafter with vLLM and returns the ``peer`` entry of the report."""
    from dfp_dev.serving.vllm_env import ensure_env

    python = peer.ensure_peer_env()
    vllm_python = ensure_env()
    first = next(iter(ours.values()))[0]
    greedy = reference(stages, ctx, first / "drafter")
    served_ours, peers, ratios = {}, {}, {}
    for name, (run, recipe, figures) in ours.items():
        shape = our_shape(run, recipe, ctx["steps"], 0)  # the anchors a step of our sampler at seed 0
        served_ours[name] = {**serve(stages, ctx, name, digest_of(run.name), run / "drafter", greedy, vllm_python),
                             "train_tokens_per_s": figures["train_tokens_per_s"]}
        vocab = f"v{shape['draft_vocab_size'] or 'full'}"
        if vocab not in peers:
            runs = peer_runs(stages, ctx, shape, seeds, python, optimizer)
            per_seed = {}
            for seed, run_dir in runs.items():
                figs = json.loads((run_dir / "figures.json").read_text())
                per_seed[seed] = {**serve(stages, ctx, f"peer.{vocab}{'' if optimizer == 'adamw' else '.' + optimizer}"
                                                        f".seed{seed}", digest_of(run_dir.name),
                                          run_dir / "export", greedy, vllm_python),
                                  **{k: figs.get(k) for k in ("train_tokens_per_s", "wall_tokens_per_s", "steps",
                                                              "train_tokens", "last50_loss", "last50_full_acc",
                                                              "last50_position_acc", "first_loss")}}
            data = next(iter(runs.values())) / "data"
            prepared = json.loads((data / "samples.safetensors").resolve().with_name("prepared.json").read_text())
            stage = json.loads((data / "samples.safetensors").resolve().with_name("stage.json").read_text())
            mean = sum(s["acceptance_length"] for s in per_seed.values()) / len(per_seed)
            peers[vocab] = {"seeds": per_seed, "acceptance_length_mean": round(mean, 4),
                            "settings": {k: v for k, v in prepared.items() if k not in ("target", "seed")},
                            "hidden_states_seconds": round(stage["seconds"], 1)}
        ratios[name] = round(served_ours[name]["acceptance_length"] / peers[vocab]["acceptance_length_mean"], 4)
        served_ours[name]["peer"] = vocab
    return {"ours": served_ours, "peer": peers, "peer_optimizer": optimizer, "ratio_ours_over_peer": ratios,
            "speculators": peer.PEER,
            "unmatched": peer.UNMATCHED, "prompts": ctx["eval_prompts"],
            "prompt_set": ctx.get("served_name", "held-out"),
            "max_new_tokens": ctx["max_new_tokens"]}


def print_comparison(entry: dict) -> None:
    print(f"\nserved by vLLM ({entry['prompts']} {entry.get('prompt_set', 'held-out')} prompts, "
          f"{entry['max_new_tokens']} tokens, greedy): "
          "acceptance length (1 + accepted / drafts)")
    for name, f in entry["ours"].items():
        p = entry["peer"][f["peer"]]
        seeds = ", ".join(f"seed {s} {x['acceptance_length']:.3f} ({x['prompts_equal']}/{x['prompts']} equal, "
                          f"{x['train_tokens_per_s']:.0f} tok/s)" for s, x in p["seeds"].items())
        print(f"  ours {name}: {f['acceptance_length']:.3f} ({f['prompts_equal']}/{f['prompts']} equal greedy, "
              f"train {f['train_tokens_per_s']:.0f} tok/s); peer {f['peer']}: {seeds}; mean "
              f"{p['acceptance_length_mean']:.3f}; ours / peer {entry['ratio_ours_over_peer'][name]:.3f}")
