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
    from dfp_shared.prompts import ROLE_ALIASES
    from dfp_shared.record_sources.json_array import iter_array

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
    from dfp_shared.token_shards import load_dataset

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
            fit = curve["fits"].get(key)
            if fit:
                xs = [min(t for t, _ in pts), max(t for t, _ in pts) * 4]
                ax.plot(xs, [fit["intercept"] + fit["slope_per_10x"] * math.log10(x) for x in xs], "--",
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
