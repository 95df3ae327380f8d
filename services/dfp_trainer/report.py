"""End of a run: export the drafter, evaluate it (trained vs untrained), write the report.

Outputs under the run's output prefix: ``drafter/`` (the z-lab export: the DFlash reference, vLLM, SGLang
and transformers' ``AutoModel`` load it), ``drafter-speculators/`` (vLLM's speculators layout, when
exported), ``report.json`` (``exports``; ``serving``: the vLLM / SGLang command lines and a transformers
snippet for the export;
``evaluation``: τ of both drafters by speculative decoding on the held-out prompts, and of n-gram
speculation at the same draft length (``tau_ngram``),
``tau_predicted``: the τ the held-out per-position accuracies predict by the product rule, counted as the
measured one, with ``tau_gap``, ``tau_gap_noise`` and ``train_serve_mismatch`` (:func:`predictions`),
and ``heldout_trained`` / ``heldout_untrained``: loss, accuracy and accuracy per block position on the
held-out samples; ``summary``: the training-batch loss and accuracy of the last steps, throughput,
data-wait and communication shares; ``tau_curve``: τ over training steps; ``draft_vocab``, with a pruned
vocabulary: its size, the share of the training samples' trained target tokens it covers (``coverage``)
and the required token ids), ``init_from``, for a run started from a stored drafter: its URI, layout and
family (:mod:`.drafter.warm_start`), ``loss_curve.png``,
``position_accuracy.png`` and, with an evaluation, ``tau_curve.png`` (:mod:`.plots`; with matplotlib
installed).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from dfp_shared.models.loading import load_causal_lm
from dfp_shared.models.stop_tokens import stop_token_ids
from dfp_shared.storage.store import open_store

from .components.metrics.heldout import evaluate_heldout, initial_weights
from .drafter.wrappers import unwrap
from .evaluate.ngram import ngram_decode
from .evaluate.prediction import serve_gap
from .evaluate.prompts import eval_prompts
from .evaluate.tau import tau_figures, tau_of
from .export import speculators, zlab
from .export.serving import local_path, serving_commands
from .plots import report_figures
from .settings import scratch_dir

log = logging.getLogger(__name__)


def evaluate_drafters(setup, drafter) -> dict:
    """τ of the trained drafter and of the same drafter at its initial weights, by real speculative decoding.

    The prompts are the held-out samples' own prompt tokens (chat template and thinking mode exactly
    as the dataset was tokenized, which is how the drafter will serve).
    """
    prompts = eval_prompts(setup)
    if not prompts:
        return {}
    target = verifying_target(setup, drafter)
    with initial_weights(setup, drafter):
        untrained = _tau_entry(tau_of(setup, drafter, target, prompts))
    trained = _tau_entry(tau_of(setup, drafter, target, prompts))
    ngram = ngram_tau(setup, target, prompts, drafter.config.block_size - 1)
    return {"tau_trained": float(trained["tau"]), "tau_untrained": float(untrained["tau"]),
            "tau_ngram": float(ngram["tau"]), "eval_prompts": len(prompts), "eval_trained": trained,
            "eval_untrained": untrained, "eval_ngram": ngram}


def ngram_tau(setup, target, prompts: list[torch.Tensor], draft_len: int) -> dict:
    """τ of n-gram (prompt-lookup) speculation at the drafter's draft length on the same prompts and
    settings: what a user gets without a drafter (counted as the drafters' τ)."""
    dev = next(target.parameters()).device
    with torch.no_grad():
        runs = [ngram_decode(target, ids.to(dev), draft_len=draft_len, max_new_tokens=setup.spec.eval_max_new_tokens,
                             min_n=1, max_n=4, stop_token_ids=stop_token_ids(setup.tokenizer), whole_blocks=False)
                for ids in prompts]
    figures = tau_figures(runs, draft_len)
    return {"tau": figures["tau"], "steps": figures["steps"], "new_tokens": figures["new_tokens"],
            "per_prompt": [tau_figures([r], draft_len)["tau"] for r in runs]}


def verifying_target(setup, drafter):
    """The target that verifies drafts: the in-process one already loaded, else loaded from the run's model."""
    target = getattr(setup.source, "model", None)
    if target is None:
        target = load_causal_lm(str(setup.model_dir), device=str(next(drafter.parameters()).device))
    return target


def _tau_entry(result: dict) -> dict:
    """The report's form of an acceptance result: totals, and the tau of each prompt."""
    return {"tau": result["tau"], "steps": result["steps"], "new_tokens": result["new_tokens"],
            "per_prompt": [p["tau"] for p in result["per_prompt"]],
            "per_prompt_steps": [p["steps"] for p in result["per_prompt"]],
            "per_prompt_new_tokens": [p["new_tokens"] for p in result["per_prompt"]]}


def _plain(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool, list))}


def tau_points(history: list[dict], evaluation: dict) -> list[dict]:
    """τ over training steps: the untrained drafter at step 0, each mid-training evaluation, the trained
    drafter at the last step; each point ``{"step", "tau", "tau_predicted"}`` with the figures it has
    (a mid-training evaluation measures τ only with the target in-process, and predicts it always)."""
    def point(step: int, tau, predicted) -> dict:
        return {"step": step, **({"tau": tau} if tau is not None else {}),
                **({"tau_predicted": predicted} if predicted is not None else {})}

    points = []
    if evaluation.get("tau_untrained") is not None or evaluation.get("tau_predicted_untrained") is not None:
        points.append(point(0, evaluation.get("tau_untrained"), evaluation.get("tau_predicted_untrained")))
    points += [point(r["step"], r.get("tau"), r.get("tau_predicted")) for r in history
               if "tau" in r or "tau_predicted" in r]
    if history and (evaluation.get("tau_trained") is not None or evaluation.get("tau_predicted") is not None):
        points.append(point(history[-1]["step"], evaluation.get("tau_trained"), evaluation.get("tau_predicted")))
    return points


def predictions(evaluation: dict) -> dict:
    """The τ each drafter's held-out per-position accuracies predict (:mod:`.evaluate.prediction`),
    counted as its measured τ, and for the trained drafter the gap and the train/serve verdict."""
    out = {}
    for which in ("trained", "untrained"):
        held, measured = evaluation.get(f"heldout_{which}"), evaluation.get(f"eval_{which}")
        if not held or not measured:
            continue
        acc, counts = held["per_position_accuracy"], held.get("per_position_count")
        gap = serve_gap(acc, counts, measured["tau"], measured["per_prompt_new_tokens"], measured["per_prompt_steps"])
        if which == "trained":
            out.update(gap)
        else:
            out["tau_predicted_untrained"] = gap["tau_predicted"]
    return out


def finish_run(setup, drafter, history: list[dict], summary: dict) -> dict:
    """Export, evaluate, write the report and plots; returns the job outputs."""
    config = setup.config
    spec = config.spec
    out = open_store(spec.output, endpoint_url=config.settings.s3_endpoint_url)
    base = spec.output.rstrip("/")
    exported = export_layouts(setup, drafter, out)
    uris = {layout: f"{base}/{prefix}/" for layout, prefix in exported.items()}
    serving = serving_commands(unwrap(drafter).config, spec.target, uris["zlab"], uris.get("speculators"))
    report = {"summary": summary, "spec": spec.model_dump(mode="json"), "target_layer_ids": setup.layer_ids,
              "enable_thinking": spec.enable_thinking, "dataset_thinking": setup.dataset.thinking,
              "exports": uris, "serving": serving}
    if setup.draft_vocab:
        report["draft_vocab"] = setup.draft_vocab
    if setup.init_from:
        report["init_from"] = setup.init_from
    if config.evaluate and spec.eval_prompts:
        evaluation = {**evaluate_drafters(setup, drafter), **evaluate_heldout(setup, drafter)}
        report["evaluation"] = {**evaluation, **predictions(evaluation)}
    report["history"] = [{k: v for k, v in r.items() if k != "per_position_accuracy"} for r in history]
    taus = tau_points(history, report.get("evaluation", {}))
    if taus:
        report["tau_curve"] = taus
    plots = report_figures(history, summary.get("per_position_accuracy", []), taus,
                           report["evaluation"].get("tau_ngram") if taus else None)
    out.put_many([("report.json", json.dumps(report, indent=1).encode()), *plots])
    results = headline(summary, report.get("evaluation", {}))
    if setup.draft_vocab:
        results["draft_vocab_coverage"] = setup.draft_vocab["coverage"]
    log.info("training finished", extra={k: v for k, v in results.items() if v is not None})
    return {"drafter": uris["zlab"], **({"drafter_speculators": uris["speculators"]} if "speculators" in uris else {}),
            "report": base + "/report.json", "plots": [f"{base}/{name}" for name, _ in plots], "serving": serving,
            **results}


EXPORT_PREFIXES = {"zlab": "drafter", "speculators": "drafter-speculators"}


def export_layouts(setup, drafter, out) -> dict[str, str]:
    """Write each export layout the spec asks for under the output prefix; layout -> its prefix there.
    The z-lab layout is always written: the report, the evaluate job and the serving commands read it."""
    spec = setup.config.spec
    layouts = ["zlab", *(x for x in spec.export_layouts() if x != "zlab")]
    target_config = json.loads((Path(setup.model_dir) / "config.json").read_text())
    written = {}
    for layout in layouts:
        with scratch_dir(setup.config.settings.work_dir, "dflash-export-") as tmp:
            if layout == "zlab":
                zlab.export_drafter(drafter, tmp)
            else:
                speculators.export_speculators(drafter, tmp, local_path(spec.target), target_config.get("architectures"))
            prefix = EXPORT_PREFIXES[layout]
            files = [p for p in Path(tmp).rglob("*") if p.is_file()]
            out.put_many([(f"{prefix}/{p.relative_to(tmp).as_posix()}", p.read_bytes()) for p in files])
        written[layout] = prefix
    return written


def headline(summary: dict, evaluation: dict) -> dict:
    """The run's headline figures (job outputs and the finished log): training-batch loss and accuracy
    per block position over the last steps, τ trained vs untrained vs n-gram, the predicted τ and the
    train/serve verdict, and the held-out metrics."""
    held = evaluation.get("heldout_trained") or {}
    held_before = evaluation.get("heldout_untrained") or {}
    return {"final_loss": summary.get("final_loss_avg"),
            "per_position_accuracy": _rounded(summary.get("per_position_accuracy")),
            "tau_trained": evaluation.get("tau_trained"), "tau_untrained": evaluation.get("tau_untrained"),
            "tau_ngram": evaluation.get("tau_ngram"), "tau_predicted": evaluation.get("tau_predicted"),
            "tau_gap": evaluation.get("tau_gap"), "tau_gap_noise": evaluation.get("tau_gap_noise"),
            "train_serve_mismatch": evaluation.get("train_serve_mismatch"),
            "mismatch_reason": evaluation.get("mismatch_reason"), "heldout_loss": held.get("loss"), "heldout_loss_untrained": held_before.get("loss"),
            "heldout_accuracy": held.get("accuracy"),
            "heldout_per_position_accuracy": _rounded(held.get("per_position_accuracy"))}


def _rounded(values: list[float] | None) -> list[float] | None:
    return None if values is None else [round(a, 4) for a in values]
