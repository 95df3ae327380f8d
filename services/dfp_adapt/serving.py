"""Serving configurations and which one serves best: a drafter, n-gram speculation, or no speculation.

A configuration is what ``current.json`` names and what serving passes to vLLM's ``--speculative-config``:

* a drafter: ``{"method": "dflash" | "dspark" | "dflash2", "version": n}`` (the method from the version's
  ``config.json``; vLLM serves ``dflash2`` as ``dflash`` on its V2 model runner);
* n-gram speculation: ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
  "prompt_lookup_max": b}`` (the n-gram the evaluate job reports beside every drafter, at the drafter's draft
  length);
* no speculation: ``{"method": "none"}`` (τ is 1).

Each is judged per held-out prompt by output tokens per second, ``τ / step_time``: a verify step of the target,
plus a drafter forward (a DFlash drafter drafts a whole block in one) or an n-gram lookup. The step costs are the
operator's, measured with the serving engine on the serving hardware (:class:`StepCosts`; docs/adaptation.md says
how to read them off vLLM's metrics): the scheduled run cannot run the engine on that hardware itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from dfp_shared.printable import printable
from dfp_shared.specs.train import MAX_BLOCK_SIZE
from pydantic import BaseModel, ConfigDict, Field

from dfp_adapt.rule import decide

MAX_MIN_GAIN = 10.0  # a share of the served configuration's tokens per second
MAX_STEP_S = 60.0
MAX_CONFIG_BYTES = 1 << 20
DSPARK = "Qwen3DSparkModel"  # the architecture vLLM serves as method dspark
DFLASH2 = "DFlash2DraftModel"
V2_RUNNER = (DSPARK, DFLASH2)  # the architectures vLLM serves on its V2 model runner only
DRAFTER_METHODS = ("dflash", "dspark", "dflash2")
METHODS = (*DRAFTER_METHODS, "ngram", "none")
NONE = {"method": "none"}


class StepCosts(BaseModel):
    """Seconds of one step of each part of serving, measured with the serving engine on the serving hardware. The
    defaults describe a GPU serving a large target (tens of milliseconds a verify step) beside a small drafter
    whose forward costs little; measure your own (docs/adaptation.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    target_step_s: float = Field(0.030, gt=0, le=MAX_STEP_S, allow_inf_nan=False,
                                 description="One verify (decoding) step of the target.")
    draft_step_s: float = Field(0.004, gt=0, le=MAX_STEP_S, allow_inf_nan=False,
                                description="One drafter forward (a whole block of drafts).")
    ngram_step_s: float = Field(0.0005, gt=0, le=MAX_STEP_S, allow_inf_nan=False,
                                description="One n-gram lookup.")


def step_time(config: dict, costs: StepCosts) -> float:
    """Seconds of one verify step of ``config``: the target's, plus what proposes the drafts."""
    method = config["method"]
    if method == "none":
        return costs.target_step_s
    if method == "ngram":
        return costs.target_step_s + costs.ngram_step_s
    return costs.target_step_s + costs.draft_step_s


def ngram_config(draft_len: int, lookup_min: int, lookup_max: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": draft_len, "prompt_lookup_min": lookup_min,
            "prompt_lookup_max": lookup_max}


def same(a: dict, b: dict) -> bool:
    """Whether two configurations serve the same way (a drafter by its version)."""
    return {k: v for k, v in a.items() if k != "time"} == {k: v for k, v in b.items() if k != "time"}


def read_drafter_config(store, key: str) -> dict:
    """What serving needs of a drafter's ``config.json``: its method, architectures, layer types and block size
    (bounded as a train spec bounds it). Raises ValueError naming the file."""
    where = store.url(key)
    with store.open_read(key) as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{where}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        raise ValueError(f"{where}: not JSON") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: not a drafter's config")
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    block = dflash.get("block_size", config.get("block_size", 16))  # the trainer's reading: 16 when unsaid
    if type(block) is not int or not 2 <= block <= MAX_BLOCK_SIZE:
        raise ValueError(f"{where}: block_size {printable(repr(block))[:32]} is not 2..{MAX_BLOCK_SIZE}")
    architectures = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    architectures = [a for a in architectures if isinstance(a, str)]
    layers = config.get("layer_types") if isinstance(config.get("layer_types"), list) else []
    method = "dspark" if DSPARK in architectures else "dflash2" if DFLASH2 in architectures else "dflash"
    return {"method": method, "architectures": architectures, "block_size": block,
            "layer_types": [str(t) for t in layers]}


def speculative_config(config: dict, model: str | None = None, drafter: dict | None = None,
                       attention_backend: str = "") -> dict | None:
    """vLLM's ``--speculative-config`` for ``config`` (None for no speculation: vLLM reads ``null`` as none);
    a drafter's needs ``model`` (its directory) and ``drafter`` (:func:`read_drafter_config`)."""
    if config["method"] == "none":
        return None
    if config["method"] == "ngram":
        return {k: config[k] for k in ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")}
    return {"method": "dspark" if drafter["method"] == "dspark" else "dflash", "model": model,
            "num_speculative_tokens": drafter["block_size"] - 1,
            **({"attention_backend": attention_backend} if attention_backend else {})}


def needs_v2_runner(drafter: dict) -> bool:
    return bool(set(drafter["architectures"]) & set(V2_RUNNER)) or len(set(drafter["layer_types"])) > 1


@dataclass(frozen=True)
class Option:
    """One configuration and its τ per held-out prompt (by prompt id)."""

    name: str  # "served", "candidate", "ngram", "none"
    config: dict
    tau: dict[str, float]


def judge(served: Option, options: list[Option], costs: StepCosts, *, min_gain: float, alpha: float,
          min_prompts: int) -> tuple[Option | None, list[dict], str]:
    """The winner among ``options`` (the highest mean tokens per second among those that beat ``served``'s per-prompt
    tokens per second beyond the noise, by at least ``min_gain`` of its mean), every option's figures, and why."""
    base_speed = _speeds(served, costs)
    figures, winners = [_figures(served, base_speed, costs, None)], []
    for option in options:
        if same(option.config, served.config):
            continue
        speed = _speeds(option, costs)
        ids = sorted(i for i in set(speed) & set(base_speed))
        cand, base = [speed[i] for i in ids], [base_speed[i] for i in ids]
        threshold = min_gain * (sum(base) / len(base)) if base else 0.0
        decision = decide(cand, base, threshold=threshold, alpha=alpha, min_prompts=min_prompts)
        figures.append(_figures(option, speed, costs, decision))
        if decision.promote:
            winners.append((sum(cand) / len(cand), option))
    if not winners:
        return None, figures, "no configuration beats the served one beyond the noise by the least gain"
    best_speed, best = max(winners, key=lambda w: w[0])
    return best, figures, f"{best.name} ({best.config['method']}) serves {best_speed:.4g} output tokens/s on the " \
                          f"held-out prompts, the most of those that beat the served configuration beyond the noise"


def _speeds(option: Option, costs: StepCosts) -> dict[str, float]:
    return {i: t / step_time(option.config, costs) for i, t in option.tau.items() if math.isfinite(t)}


def _figures(option: Option, speed: dict[str, float], costs: StepCosts, decision) -> dict:
    taus = [t for t in option.tau.values() if math.isfinite(t)]
    row = {"name": option.name, "config": option.config, "mean_tau": sum(taus) / len(taus) if taus else None,
           "mean_tokens_per_s": sum(speed.values()) / len(speed) if speed else None,
           "step_time_s": step_time(option.config, costs)}
    if decision is not None:
        row.update(promote=decision.promote, gain=decision.mean_difference, standard_error=decision.standard_error,
                   threshold=decision.threshold, t_quantile=decision.t_quantile, alpha=decision.alpha,
                   prompts=decision.prompts, reason=decision.reason)
    return row
