"""A real vLLM OpenAI-compatible server on a free loopback port, and its speculative-decoding counters.

The server runs from the vLLM environment (:mod:`dfp_dev.serving.vllm_env`) in a process group of its own
(:class:`~dfp_dev.local.processes.ProcessGroup`), so stopping it stops its engine and worker
processes too: SIGTERM first, SIGKILL after a grace period. ``--enforce-eager`` starts it in about
half a minute on the CPU; ``VLLM_CPU_KVCACHE_SPACE`` (GiB) keeps its memory near 4 GB.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..local.processes import ProcessGroup
from ..local.redis_server import free_port

# head sizes vLLM's CPU attention backend serves; any other kills the engine at the first request
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
SPEC_PREFIX = "vllm:spec_decode_"


@dataclass
class SpecCounters:
    """vLLM's cumulative speculative-decoding counters: drafts (verify steps with a proposal), draft
    tokens proposed, draft tokens accepted, and accepted tokens per draft position."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: list[float] = field(default_factory=list)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        width = max(len(self.per_position), len(other.per_position))
        pad = lambda xs: list(xs) + [0.0] * (width - len(xs))
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted,
                            [a - b for a, b in zip(pad(self.per_position), pad(other.per_position))])

    @property
    def acceptance_length(self) -> float:
        """Tokens per verify step as vLLM counts it: 1 + accepted drafts / drafts (whole blocks)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 0.0


def parse_spec_counters(text: str) -> SpecCounters:
    """The ``vllm:spec_decode_*_total`` samples of a Prometheus text page (summed over engines); a ValueError
    for a page that is not Prometheus text."""
    out = SpecCounters()
    per_pos: dict[int, float] = {}
    names = {"num_drafts_total": "drafts", "num_draft_tokens_total": "draft_tokens",
             "num_accepted_tokens_total": "accepted"}
    samples = (sample for family in text_string_to_metric_families(text) for sample in family.samples)
    for sample in samples:
        if not sample.name.startswith(SPEC_PREFIX):
            continue
        name, value = sample.name[len(SPEC_PREFIX):], float(sample.value)
        if name in names:
            setattr(out, names[name], getattr(out, names[name]) + value)
        elif name == "num_accepted_tokens_per_pos_total":
            pos = int(sample.labels.get("position", -1))
            if pos >= 0:
                per_pos[pos] = per_pos.get(pos, 0.0) + value
    out.per_position = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
    return out


def read_config(model_dir: str | os.PathLike) -> tuple[Path, dict]:
    """A model directory's ``config.json`` (its ``text_config`` when it has one; a speculators-layout drafter's
    ``transformer_layer_config``, with the DFlash marker ``dflash_config`` when it is one), or a ValueError naming
    the file."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (not a model directory)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: line {exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    layers = config.get("transformer_layer_config")
    if isinstance(layers, dict):  # speculators layout: the draft layers' config nested, the algorithm beside it
        dflash = config.get("speculators_model_type") in ("dflash", "dflash2")
        return path, {**layers, **({"dflash_config": {}} if dflash else {})}
    return path, config.get("text_config", config)


def check_servable(model_dir: str | os.PathLike, what: str) -> None:
    """Refuse a model vLLM's CPU runner cannot serve, naming the file and the field: an attention head size
    its CPU attention lacks, or a drafter mixing sliding and full attention layers."""
    path, config = read_config(model_dir)
    head_dim = config.get("head_dim")
    if head_dim is None:
        try:
            head_dim = int(config["hidden_size"]) // int(config["num_attention_heads"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            raise ValueError(f"{path}: head_dim: missing, and no hidden_size / num_attention_heads to derive "
                             "it from") from None
    if head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"{path}: head_dim {head_dim} of the {what} is not served by vLLM's CPU attention "
                         f"(head sizes {', '.join(map(str, CPU_HEAD_SIZES))})")
    kinds = set(config.get("layer_types") or [])
    if {"sliding_attention", "full_attention"} <= kinds and "dflash_config" in config:
        raise ValueError(f"{path}: layer_types mixes sliding_attention and full_attention: vLLM's CPU runner "
                         "refuses such DFlash drafters (Model Runner V1 does not support: mixed sliding/full "
                         "dflash drafts; the V2 runner they need requires Triton)")


def live_group_members(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` that still run (zombies awaiting their reaper do not count)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` serving ``model_dir``, optionally with a drafter served by
    speculative ``method`` (``dflash``, or ``dspark`` for a DSpark drafter), in vLLM's V2 model runner when
    ``v2_runner`` (DSpark and DFlash2 drafters; default: for method ``dspark``)."""

    def __init__(self, python: str | os.PathLike, model_dir: str | os.PathLike, log_dir: str | os.PathLike, *,
                 drafter_dir: str | os.PathLike | None = None, num_speculative_tokens: int | None = None,
                 max_model_len: int = 2048, kv_cache_gib: int = 1, name: str = "vllm", method: str = "dflash",
                 v2_runner: bool | None = None):
        self.python, self.model_dir, self.name, self.method = str(python), str(model_dir), name, method
        self.v2_runner = method == "dspark" if v2_runner is None else v2_runner
        self.drafter_dir, self.num_speculative_tokens = drafter_dir, num_speculative_tokens
        self.max_model_len, self.kv_cache_gib = max_model_len, kv_cache_gib
        self.group = ProcessGroup(log_dir)
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--dtype", "float32",
               "--max-model-len", str(self.max_model_len), "--seed", "0"]
        if self.drafter_dir is not None:
            spec = {"method": self.method, "model": str(self.drafter_dir),
                    "num_speculative_tokens": int(self.num_speculative_tokens)}
            cmd += ["--speculative-config", json.dumps(spec)]
        return cmd

    def start(self, timeout: float = 600.0) -> VllmServer:
        self.port = free_port()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONPATH", None)  # the environment's own packages, not the project's
        if self.v2_runner:  # vLLM drafts DSpark and DFlash2 in its V2 model runner only
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        self.group.start(self.name, self.command(), env)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.group.check_alive(self.name)
            except RuntimeError as exc:
                raise RuntimeError(f"vLLM exited while starting: {exc}") from None
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"vLLM did not answer /health within {timeout:.0f}s; log "
                                   f"{self.group.procs[self.name].log_path}")
            time.sleep(1.0)

    def log_tail(self, lines: int = 30) -> str:
        mp = self.group.procs.get(self.name)
        return mp.log_tail(lines) if mp else ""

    @property
    def log_path(self) -> Path:
        return self.group.log_dir / f"{self.name}.log"

    def alive(self) -> bool:
        mp = self.group.procs.get(self.name)
        return bool(mp and mp.alive())

    def spec_counters(self) -> SpecCounters:
        return parse_spec_counters(httpx.get(f"{self.base_url}/metrics", timeout=30).text)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server's whole process group and wait until none of its processes runs any more."""
        mp = self.group.procs.get(self.name)
        self.group.stop_all(timeout=timeout)
        deadline = time.monotonic() + timeout
        while mp and live_group_members(mp.pid) and time.monotonic() < deadline:
            time.sleep(0.2)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
