"""τ against training data on the real target: the data-scaling mode of ``bench_quality_real.py`` (``--curve``).

The data are ShareGPT V3's own answers, as they are: each training record is a first user turn (and the system
messages before it) with the conversation's first assistant answer, tokenized with the target's chat template and
loss-masked on that answer. No generation runs: the target computes only the answers' hidden states (one forward
per sample, into the hidden-state cache), so on these CPUs a token costs a forward instead of a decode step, and
the largest size the machine reaches in its budget is several times what generating the answers would give. The
held-out slice (one first turn in 20, by the hash of its text) is the one ``bench_quality_real.py`` keeps out of
every training set; sizes are prefixes of one hash order, so each larger set holds every smaller one.

Each size trains each recipe for the same number of passes over its data (``--curve-epochs``) and is evaluated by
the evaluate job's decoding on MT-Bench (all 80 first turns by default) and the held-out slice, beside n-gram
speculation at the same draft length. A line is fitted through τ against log10(trained tokens) per recipe and
set; its slope says what each 10x of data buys, and where it crosses 1.5x and 2x n-gram's τ says how much data a
GPU run should plan for (an extrapolation, reported as such).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

SAMPLE_MAX_TOKENS = 384  # a record is cut to this many tokens (prompt and answer): the forward's cost per sample


def own_answers(sharegpt: Path, held_out_one_in: int, max_prompt_chars: int, limit: int) -> tuple[list[dict], dict]:
    """Up to ``limit`` training records (first turn and its first answer), in the hash order of
    ``bench_quality_real.first_turns``, none of them in the held-out slice; with counts of what was left out."""
    from dfp_shared.record_sources.json_array import iter_array
    from dfp_shared.records.prompts import ROLE_ALIASES

    seen, kept, counts = set(), [], {"records": 0, "no_answer": 0, "unreadable": 0, "held_out": 0, "duplicate": 0}
    with open(sharegpt, "rb") as stream:
        for _, obj in iter_array(stream):
            counts["records"] += 1
            try:
                turns = [{"role": ROLE_ALIASES[str(m["from"]).lower()], "content": m["value"]}
                         for m in obj["conversations"]]
            except (KeyError, TypeError):
                counts["unreadable"] += 1
                continue
            upto = next((i for i, m in enumerate(turns) if m["role"] == "user"), None)
            if upto is None or upto + 1 >= len(turns) or turns[upto + 1]["role"] != "assistant" \
                    or not str(turns[upto + 1]["content"]).strip():
                counts["no_answer"] += 1
                continue
            text = str(turns[upto]["content"]).strip()
            if not text or len(text) > max_prompt_chars:
                continue
            norm = re.sub(r"\s+", " ", text.lower())
            if norm in seen:
                counts["duplicate"] += 1
                continue
            seen.add(norm)
            digest = hashlib.sha256(norm.encode()).hexdigest()
            if int(digest[:8], 16) % held_out_one_in == 0:
                counts["held_out"] += 1
                continue
            messages = [m for m in turns[:upto] if m["role"] == "system"] + turns[upto:upto + 2]
            kept.append({"hash": digest, "record": {"id": obj.get("id", digest[:12]), "messages": messages}})
    kept.sort(key=lambda r: r["hash"])
    return [r["record"] for r in kept[:limit]], {**counts, "available": len(kept)}


def write_completions(records: list[dict], out: Path) -> None:
    """The records where the tokenizer reads completions (``<out>/completions/``)."""
    (out / "completions").mkdir(parents=True, exist_ok=True)
    (out / "completions" / "part-00000.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def dataset_tokens(dataset: Path, max_length: int) -> tuple[int, int]:
    """(tokens, trained tokens) of a tokenized dataset as the trainer reads it (each sample cut to ``max_length``)."""
    from dfp_shared.records.token_shards import load_dataset

    ds = load_dataset(f"file://{dataset}")
    tokens = trained = 0
    for i in range(ds.num_samples):
        a, b = int(ds.offsets[i]), int(ds.offsets[i + 1])
        b = min(b, a + max_length)
        tokens += b - a
        trained += int(ds.loss_mask[a:b].sum())
    return tokens, trained


def fit_log(points: list[tuple[float, float]]) -> dict | None:
    """Least squares ``tau = a + b log10(tokens)`` through (trained tokens, τ) points; None under two points."""
    if len(points) < 2:
        return None
    xs, ys = [math.log10(t) for t, _ in points], [tau for _, tau in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    residual = math.sqrt(sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys)) / max(len(xs) - 2, 1))
    return {"intercept": intercept, "slope_per_10x": slope, "residual": residual}


def tokens_for(fit: dict | None, tau: float) -> float | None:
    """Trained tokens at which the fitted line reaches ``tau`` (None: no fit, or a flat or falling line)."""
    if not fit or fit["slope_per_10x"] <= 0:
        return None
    return 10 ** ((tau - fit["intercept"]) / fit["slope_per_10x"])


LOCAL_POINTS = 3  # the largest sizes a curve's local line is fitted through: what the next 10x of data buys


def summarise(points: list[dict]) -> dict:
    """Per recipe (in the points' order): its points by size; a line fitted through all of them and one through the
    largest ``LOCAL_POINTS`` (``fits_local``, where the curve has more: it bends as the first positions get right),
    each for MT-Bench and the held-out slice; n-gram's τ (the mean over its points); and the trained tokens each
    line needs for 1x, 1.5x and 2x n-gram's τ."""
    curves = {}
    for name in dict.fromkeys(p["recipe"] for p in points):
        mine = sorted((p for p in points if p["recipe"] == name), key=lambda p: p["trained_tokens"])
        ngram = {key: sum(p[f"tau_ngram_{key}"] for p in mine) / len(mine) for key in ("mtbench", "heldout")}
        curves[name] = {"points": mine, "tau_ngram": ngram}
        for label, some in (("", mine), ("_local", mine[-LOCAL_POINTS:] if len(mine) > LOCAL_POINTS else None)):
            if some is None:
                continue
            fits = {key: fit_log([(p["trained_tokens"], p[f"tau_{key}"]) for p in some]) for key in ("mtbench", "heldout")}
            curves[name][f"fits{label}"] = fits
            curves[name][f"trained_tokens_for{label}"] = {
                f"{key}_{times}_ngram": tokens_for(fits[key], factor * ngram[key])
                for key in ("mtbench", "heldout") for times, factor in (("1x", 1.0), ("1.5x", 1.5), ("2x", 2.0))}
    return curves


def merge(reports: list[dict]) -> list[dict]:
    """The points of several curve reports (``bench_quality_real.py --curve``'s last JSON line, or a file this
    module wrote), one per recipe and size: a later report's point replaces an earlier one's."""
    found: dict[tuple[str, int], dict] = {}
    for rep in reports:
        for name, curve in rep["curves"].items():
            for point in curve["points"]:
                found[(name, point["conversations"])] = {**point, "recipe": name}
    return list(found.values())


def plot(curves: dict, out: Path) -> Path | None:
    """τ against trained tokens per recipe (MT-Bench and held-out), n-gram's τ as flat lines, the fits dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, title in ((axes[0], "mtbench", "MT-Bench first turns"), (axes[1], "heldout", "held-out ShareGPT")):
        ngram = []
        for name, curve in curves.items():
            pts = [(p["trained_tokens"], p[f"tau_{key}"]) for p in curve["points"] if p.get(f"tau_{key}") is not None]
            if not pts:
                continue
            line, = ax.plot([t for t, _ in pts], [v for _, v in pts], "o-", label=name)
            for fits, style, start in ((curve["fits"], "--", 0), (curve.get("fits_local"), ":", -LOCAL_POINTS)):
                fit = (fits or {}).get(key)
                if fit:
                    xs = [pts[start][0], max(t for t, _ in pts) * 4]
                    ax.plot(xs, [fit["intercept"] + fit["slope_per_10x"] * math.log10(x) for x in xs], style,
                            color=line.get_color(), alpha=0.6)
            ngram += [p[f"tau_ngram_{key}"] for p in curve["points"] if p.get(f"tau_ngram_{key}") is not None]
        if ngram:
            level = sum(ngram) / len(ngram)
            ax.axhline(level, color="grey", lw=1, label=f"n-gram {level:.2f}")
            ax.axhline(1.5 * level, color="grey", lw=1, ls=":", label="1.5x n-gram")
        ax.set_xscale("log")
        ax.set_xlabel("trained tokens (ShareGPT answers as they are)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("τ (tokens per verify step)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def greedy_outputs(model_dir: Path, prompt_file: Path, prompts: int, max_new_tokens: int, draft_len: int,
                   batch_size: int, out: Path) -> None:
    """The target's greedy answers to the first ``prompts`` of a set, rendered and read as the evaluate job reads
    them, from n-gram speculation's decoding (which emits exactly them), with n-gram's τ: ``greedy.json``. Every
    drafter of the curve is then evaluated by replay against these answers."""
    import torch
    from dfp_shared.models.loading import load_causal_lm
    from dfp_shared.models.stop_tokens import stop_token_ids
    from dfp_shared.models.tokenizer_assets import load_tokenizer
    from dfp_shared.specs.evaluate import EvaluateSpec
    from dfp_trainer.evaluate.batched import ngram_decode_batch
    from dfp_trainer.evaluate.job import read_prompt_set
    from dfp_trainer.evaluate.tau import tau_figures

    spec = EvaluateSpec.model_validate({"drafter": f"file://{out}", "target": f"file://{model_dir}",
                                        "prompts": [f"file://{prompt_file}"], "output": f"file://{out}",
                                        "max_prompts": prompts, "max_new_tokens": max_new_tokens,
                                        "enable_thinking": False, "batch_size": batch_size})
    tokenizer, target = load_tokenizer(model_dir), load_causal_lm(str(model_dir), device="cpu")
    positions = int(getattr(target.config.get_text_config(), "max_position_embeddings", 0) or 1 << 30)
    max_tokens = min(spec.max_prompt_tokens, positions - max_new_tokens - draft_len - 1)
    pset = read_prompt_set(spec.prompts[0], tokenizer, spec, max_tokens, None)
    ids = [torch.tensor(p, dtype=torch.long) for _, p in pset.prompts]
    runs, _ = ngram_decode_batch(target, ids, draft_len=draft_len, max_new_tokens=max_new_tokens, min_n=spec.ngram_min,
                                 max_n=spec.ngram_max, batch_size=batch_size, stop_token_ids=stop_token_ids(tokenizer))
    out.mkdir(parents=True, exist_ok=True)
    (out / "greedy.json").write_text(json.dumps({
        "prompts": [p for _, p in pset.prompts], "outputs": [r["new_ids"] for r in runs],
        "ngram": tau_figures(runs, draft_len), "bad_lines": pset.bad_lines, "skipped": pset.skipped}))


def replay_tau(model_dir: Path, drafter_dir: Path, greedy: Path, max_new_tokens: int) -> dict:
    """τ figures of the exported drafter by replay (:mod:`dfp_trainer.evaluate.replay`) on ``greedy.json``'s answers."""
    import torch
    from dfp_shared.models.loading import load_causal_lm
    from dfp_shared.models.stop_tokens import stop_token_ids
    from dfp_shared.models.tokenizer_assets import load_tokenizer
    from dfp_trainer.drafter.load import load_exported
    from dfp_trainer.evaluate.replay import replay_decode, sequence_features
    from dfp_trainer.evaluate.tau import tau_figures

    found = json.loads((greedy / "greedy.json").read_text())
    tokenizer, target = load_tokenizer(model_dir), load_causal_lm(str(model_dir), device="cpu")
    drafter = load_exported(drafter_dir, target.get_input_embeddings(), target.get_output_embeddings(),
                            device=target.device, target_config=target.config).to(target.dtype).eval()
    prompts = [torch.tensor(p, dtype=torch.long) for p in found["prompts"]]
    layers = list(drafter.config.target_layer_ids)
    cached = greedy / f"features-{'-'.join(map(str, layers))}-{max_new_tokens}.pt"  # shared by the curve's drafters
    if cached.exists():
        features = torch.load(cached)
    else:
        features = [sequence_features(target, torch.cat([p, torch.tensor(o[:max_new_tokens], dtype=torch.long)]), layers)
                    for p, o in zip(prompts, found["outputs"])]
        torch.save(features, cached.with_suffix(".tmp"))
        cached.with_suffix(".tmp").rename(cached)
    runs = replay_decode(drafter, target, prompts, found["outputs"], max_new_tokens=max_new_tokens,
                         stop_token_ids=stop_token_ids(tokenizer), features=features)
    return {**tau_figures(runs, drafter.config.block_size - 1), "prompts": len(runs)}


def _report(text: str) -> dict:
    """A curve file as written by :func:`main`, or a run's output: its last line that is a curve report."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for line in reversed(text.splitlines()):
        if line.startswith("{") and '"curves"' in line:
            return json.loads(line)
    raise ValueError("no curve report in it (a JSON line with its curves)")


def main() -> None:
    """Merge curve reports into one published curve (JSON and plot), fitted again over every point."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("reports", nargs="+", type=Path, help="Curve reports: the benchmark's last JSON line in a file, "
                                                          "or a curve this command wrote; later ones win per point.")
    ap.add_argument("--json", type=Path, required=True, help="The merged curve (points, fits, data each needs).")
    ap.add_argument("--plot", type=Path, required=True, help="Its plot (PNG).")
    args = ap.parse_args()
    try:
        reports = [_report(path.read_text()) for path in args.reports]
    except (OSError, ValueError) as exc:
        raise SystemExit(f"curve reports: {exc}") from None
    curves = summarise(merge(reports))
    keep = ("conversations", "trained_tokens", "steps", "tau_mtbench", "tau_ngram_mtbench", "tau_heldout",
            "tau_ngram_heldout")
    args.json.write_text(json.dumps({"curves": {n: {**c, "points": [{k: round(p[k], 4) for k in keep if k in p}
                                                                   for p in c["points"]]}
                                                for n, c in curves.items()}}, indent=1) + "\n")
    plot(curves, args.plot)
    for name, c in curves.items():
        print(f"{name}: {[(p['trained_tokens'], p['tau_mtbench'], p['tau_heldout']) for p in c['points']]}")
        for label in ("", "_local"):
            if f"fits{label}" in c:
                print(f"  fit{label} MT-Bench {c[f'fits{label}']['mtbench']}\n  fit{label} held-out "
                      f"{c[f'fits{label}']['heldout']}\n  trained tokens for{label}: {c[f'trained_tokens_for{label}']}")


if __name__ == "__main__":
    main()
