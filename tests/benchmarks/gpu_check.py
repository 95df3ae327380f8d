"""One prepared GPU check: the CUDA paths measured through the project's own code, explained in a table.

On CUDA (``make gpu-check``) it builds random-weight models at real shapes (a Qwen3-8B target, a
5-layer DFlash drafter, the 151,936-token vocabulary; nothing downloaded), shrinks them when the
device's memory is short, and measures the target forward, the drafter step (flex attention
compiled vs SDPA; and with pruned draft vocabularies beside the full head), the training pipeline with the in-process target and with a colocated target
service over shared memory, the hidden-state transfer, generation with the transformers engine,
from those rates the best split of an 8-GPU node, and last the hidden-state cache (filled in the
target's dtype under the check's scratch directory, its per-sample read rate beside raw file reads,
and the pipeline trained from it). Without CUDA it rehearses every stage at tiny shapes in seconds.
Every figure goes to one JSON file (``--out``).

Run: make gpu-check   (or: python tests/benchmarks/gpu_check.py [--out gpu-check.json] [--rehearse])
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch

# project imports: every one in this block
from dfp_generation.engines.base import GenRequest, SamplingParams
from dfp_generation.engines.transformers_engine import TransformersEngine
from dfp_shared.hidden_states import (
    CachedSource,
    CacheKey,
    HiddenStateCache,
    InProcessTarget,
    TargetClient,
    build_model_info,
    dataset_checksum,
    estimate_bytes,
    fill_shards,
    plan_batches,
)
from dfp_shared.hidden_states.shm_transport import HEADER_BYTES, ShmPool
from dfp_shared.records.token_shards import TokenDataset
from dfp_shared.specs.train import TrainSpec
from dfp_target.server import TargetServer
from dfp_target.settings import TargetSettings
from dfp_trainer.components.data.collate import collate, fetch_hidden
from dfp_trainer.components.data.stages import DeviceCopier, Pipeline
from dfp_trainer.components.optimizer import make_optimizer as trainer_optimizer
from dfp_trainer.components.optimizer import muon_matrices
from dfp_trainer.drafter.batch import Batch
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.model import DFlashDrafter
from dfp_trainer.drafter.objective import dflash_loss

ROOT = Path(__file__).resolve().parents[2]
NODE_GPUS = 8
GIB = 1 << 30
CACHE_SAMPLES = 16  # samples the hidden-state cache holds (the pipeline trains from the first warmup + steps)
CACHE_DISK_MB_S = 200.0  # a pessimistic disk rate: how the cache stage sizes its time before it starts

# dense bf16 tensor-core peaks (TFLOP/s, no sparsity), matched against torch.cuda.get_device_name()
BF16_PEAK_TFLOPS = {"B200": 2250, "H200": 989, "GH200": 989, "H100 NVL": 835, "H100 PCIe": 756, "H100": 989,
                    "H800": 989, "A100": 312, "A800": 312, "L40S": 362, "L40": 181, "L4": 121, "A10": 125,
                    "RTX 4090": 165}


@dataclasses.dataclass
class Shape:
    """Target and drafter shapes of one run, and how much each stage measures."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_layers: int
    block: int
    anchors: int
    tokens: int  # tokens per training sample
    target_batch_tokens: int  # token budget of one target forward
    gen_batch_sizes: tuple[int, ...]
    gen_prompt_tokens: int
    gen_new_tokens: int
    steps: int  # timed steps per measurement
    warmup: int
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def mask_token_id(self) -> int:
        return self.vocab - 2  # any id of the vocabulary serves a random-weight model

    def target_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return 2 * self.vocab * self.hidden + self.layers * (attn + 3 * self.hidden * self.intermediate)

    def drafter_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        layer = attn + 3 * self.hidden * self.intermediate
        return self.draft_layers * layer + self.draft_layers * self.hidden * self.hidden


QWEN3_8B = Shape("Qwen3-8B target, 5-layer drafter (public recipe)", hidden=4096, layers=36, heads=32, kv_heads=8,
                 head_dim=128, intermediate=12288, vocab=151936, draft_layers=5, block=16, anchors=512,
                 tokens=3072, target_batch_tokens=16384, gen_batch_sizes=(1, 8, 32), gen_prompt_tokens=256,
                 gen_new_tokens=64, steps=6, warmup=2)
TINY = Shape("tiny (CPU rehearsal)", hidden=64, layers=8, heads=4, kv_heads=2, head_dim=16, intermediate=128,
             vocab=4096, draft_layers=5, block=4, anchors=8, tokens=64, target_batch_tokens=256,
             gen_batch_sizes=(1, 4), gen_prompt_tokens=8, gen_new_tokens=4, steps=2, warmup=1)


def layer_ids(shape: Shape) -> list[int]:
    from dfp_shared.models.loading import default_target_layer_ids

    return default_target_layer_ids(shape.layers, shape.draft_layers)


def fit_to_memory(shape: Shape, free_bytes: int) -> Shape:
    """Halve the sample, then the target's depth, until a rough estimate of the peak fits ``free_bytes``."""

    def need(s: Shape) -> int:
        weights = 2 * 2 * s.target_params() + 16 * s.drafter_params()  # two bf16 targets (colocated), Adam fp32
        queries = s.anchors * s.block
        acts = s.draft_layers * queries * (s.intermediate * 4 * 6 + s.hidden * 4 * 12)
        acts += 3 * 4096 * s.vocab * 4 + queries * (queries + s.tokens) * 4  # logits chunks, attention mask
        acts += s.target_batch_tokens * (s.intermediate * 2 * 4 + len(layer_ids(s)) * s.hidden * 2 * 3)
        return weights + acts + 4 * GIB

    start = dataclasses.replace(shape, notes=list(shape.notes))
    while need(shape) > 0.9 * free_bytes:
        if shape.tokens > 512:
            shape = dataclasses.replace(shape, tokens=shape.tokens // 2, anchors=max(32, shape.anchors // 2),
                                        target_batch_tokens=max(shape.tokens, shape.target_batch_tokens // 2))
        elif shape.layers > 8:
            shape = dataclasses.replace(shape, layers=shape.layers // 2)
        else:
            break
    if shape != start:
        shape.notes.append(f"scaled down to fit {free_bytes / GIB:.0f} GiB free: tokens {start.tokens} -> "
                           f"{shape.tokens}, anchors {start.anchors} -> {shape.anchors}, target layers "
                           f"{start.layers} -> {shape.layers}")
    return shape


# ------------------------------------------------------------------ models built in code


def build_target(shape: Shape, device: torch.device, seed: int = 0):
    """A random-weight Qwen3 causal LM at ``shape``, frozen, in eval mode (bf16 on CUDA, fp32 on CPU)."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=40960,
                         tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=1)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    return model


def save_config(model, directory: Path) -> Path:
    """A checkpoint directory holding only config.json: what the project's model description reads."""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(directory))
    return directory


def build_drafter(shape: Shape, target, device: torch.device) -> DFlashDrafter:
    """The drafter as the trainer builds it: fp32 parameters over the target's frozen embedding and head."""
    config = DrafterConfig.for_target(target.config, num_layers=shape.draft_layers, block_size=shape.block,
                                      mask_token_id=shape.mask_token_id)
    torch.manual_seed(0)
    return DFlashDrafter(config, target.get_input_embeddings(), target.get_output_embeddings()).to(device)


def synthetic_dataset(shape: Shape, samples: int) -> TokenDataset:
    g = torch.Generator().manual_seed(0)
    n = samples * shape.tokens
    offsets = torch.arange(samples + 1, dtype=torch.int64) * shape.tokens
    ids = torch.randint(2, shape.vocab - 2, (n,), generator=g, dtype=torch.int32)
    manifest = {"shards": [{"key": "synthetic.safetensors", "num_samples": samples}]}  # one token shard, in memory
    return TokenDataset(ids, torch.ones(n, dtype=torch.uint8), offsets, [f"s{i}" for i in range(samples)], manifest)


# ------------------------------------------------------------------ FLOP counts (multiply-add = 2 FLOP)


def target_forward_flop(shape: Shape, tokens: int) -> float:
    """Forward of one ``tokens``-long sequence up to the deepest captured layer (no LM head); causal attention."""
    depth = max(layer_ids(shape)) + 1
    linear = 2 * tokens * shape.hidden * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads)
    mlp = 2 * tokens * 3 * shape.hidden * shape.intermediate
    attention = 2 * tokens * tokens * shape.heads * shape.head_dim  # QK^T and AV over the causal half
    return float(depth * (linear + mlp + attention))


def drafter_step_flop(shape: Shape) -> float:
    """Forward and backward of one drafter step on one sample: layers x3, fc x2, the frozen head x3
    (forward, input gradient, recomputed chunk); attention counts the visible keys only."""
    q, c = shape.anchors * shape.block, shape.tokens
    qkv = 2 * q * shape.hidden * shape.heads * shape.head_dim * 2 + 2 * (c + q) * shape.hidden * shape.kv_heads \
        * shape.head_dim * 2
    mlp = 2 * q * 3 * shape.hidden * shape.intermediate
    visible = c / 2 + shape.block  # on average half the context before an anchor, and the own block
    attention = 4 * q * visible * shape.heads * shape.head_dim
    layers = shape.draft_layers * (qkv + mlp + attention)
    fc = 2 * c * len(layer_ids(shape)) * shape.hidden * shape.hidden
    head = 2 * shape.anchors * (shape.block - 1) * shape.hidden * shape.vocab
    return float(3 * layers + 2 * fc + 3 * head)


# ------------------------------------------------------------------ stages


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_info(device: torch.device, shape: Shape, rehearsal: bool) -> dict:
    info = {"type": device.type, "name": platform_name(device), "torch": torch.__version__,
            "cuda": torch.version.cuda or "none", "rehearsal": rehearsal, "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info.update(memory_gib=round(total / GIB, 1), free_gib=round(free / GIB, 1),
                    capability=f"{props.major}.{props.minor}", cudnn=str(torch.backends.cudnn.version()),
                    nccl=nccl_version())
    info["shape"] = {k: v for k, v in dataclasses.asdict(shape).items()} | {"target_layer_ids": layer_ids(shape)}
    return info


def nccl_version() -> str:
    """NCCL's version in this torch build (one GPU needs no process group, so NCCL itself is not run)."""
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return "none"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def shm_base(need_bytes: int, notes: list[str]) -> str | None:
    """/dev/shm when it has room for the segments (a full tmpfs kills the writer with SIGBUS), else disk."""
    if Path("/dev/shm").is_dir():
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize >= need_bytes:
            return "/dev/shm"
        notes.append(f"/dev/shm has {st.f_bavail * st.f_frsize / GIB:.2f} GiB free, {need_bytes / GIB:.2f} GiB "
                     "needed: shared-memory segments live on disk (page cache) instead")
    return None


def platform_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU {platform.machine()} ({platform.processor() or 'unknown'})"


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, iters: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n ** 3 * iters / (time.perf_counter() - t0) / 1e12


def peak(device: torch.device) -> dict:
    """The bf16 peak MFU is quoted against: the table's by device name, else the measured matmul rate."""
    cuda = device.type == "cuda"
    n, iters = (8192, 30) if cuda else (256, 20)
    measured = matmul_tflops(device, torch.bfloat16 if cuda else torch.float32, n, iters)
    fp32 = matmul_tflops(device, torch.float32, n, max(3, iters // 6))
    name = platform_name(device)
    table = next((v for k, v in sorted(BF16_PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])) if cuda and k in name),
                 None)
    return {"bf16_tflops_table": table, "bf16_tflops_measured": round(measured, 3),
            "fp32_tflops_measured": round(fp32, 3), "tflops": float(table or measured),
            "source": "table" if table else "measured matmul" + ("" if cuda else " (fp32 on the CPU)"),
            "matmul_n": n}


def target_forward(model, model_dir: Path, shape: Shape, device: torch.device, peak_tflops: float) -> dict:
    """The in-process target's hidden-state forward (``forward_batch`` under its token budget)."""
    ids = layer_ids(shape)
    target = InProcessTarget(model_dir, model=model, layer_ids=ids, token_budget=shape.target_batch_tokens)
    per_batch = max(1, shape.target_batch_tokens // shape.tokens)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(2, shape.vocab - 2, (shape.tokens,), generator=g, dtype=torch.int32)
            for _ in range(per_batch)]
    for _ in range(shape.warmup):
        target.compute(seqs, ids)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(shape.steps):
        out = target.compute(seqs, ids)
    sync(device)
    seconds = time.perf_counter() - t0
    asyncio.run(target.close())
    assert out[0].shape == (shape.tokens, len(ids) * shape.hidden)
    tokens = shape.steps * per_batch * shape.tokens
    flop = target_forward_flop(shape, shape.tokens)
    rate = tokens / seconds
    return {"tokens_per_s": rate, "samples_per_s": rate / shape.tokens, "tflop_per_sample": flop / 1e12,
            "mfu": rate / shape.tokens * flop / (peak_tflops * 1e12), "sequences_per_forward": per_batch,
            "batches": len(plan_batches([shape.tokens] * per_batch, shape.target_batch_tokens)),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "layers_computed": max(ids) + 1}


def step_inputs(shape: Shape, device: torch.device) -> Batch:
    g = torch.Generator().manual_seed(2)
    width = len(layer_ids(shape)) * shape.hidden
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return Batch(input_ids=torch.randint(2, shape.vocab - 2, (1, shape.tokens), generator=g, dtype=torch.int32),
                 loss_mask=torch.ones(1, shape.tokens, dtype=torch.uint8), lengths=torch.tensor([shape.tokens]),
                 target_hidden=torch.randn(1, shape.tokens, width, generator=g).to(dtype))


def make_optimizer(drafter):
    """The trainer's default optimiser (Muon for the draft layers' matrices, AdamW for the rest) over the drafter."""
    params = drafter.trainable_parameters()
    spec = TrainSpec.model_validate({"dataset": "file:///d", "target": "file:///t", "output": "file:///o"})
    return params, trainer_optimizer(spec, params, muon_matrices(drafter))


def train_step(drafter, params, optim, t: Batch, shape: Shape, step: int, backend: str = "auto",
               autocast: bool = False, forward_only: bool = False) -> dict:
    """One optimiser step as the trainer takes it: the DFlash loss, backward, clip 1.0, the default optimiser."""
    gen = torch.Generator().manual_seed(step)
    ctx = (torch.autocast(t.input_ids.device.type, dtype=torch.bfloat16) if autocast
           else contextlib.nullcontext())
    with ctx:
        loss, metrics = dflash_loss(drafter, t, max_anchors=shape.anchors, gamma=7.0, generator=gen,
                                    attention_backend=backend)
    if forward_only:
        return metrics
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return metrics


def drafter_step(target, shape: Shape, device: torch.device, peak_tflops: float) -> dict:
    """The drafter's training step alone (inputs already on the device): SDPA, flex, SDPA under bf16 autocast."""
    drafter = build_drafter(shape, target, device)
    params, optim = make_optimizer(drafter)
    t = step_inputs(shape, device).to(device)
    flop = drafter_step_flop(shape)
    out = {"tflop_per_sample": flop / 1e12, "parameters": sum(p.numel() for p in params),
           "parameter_dtype": str(params[0].dtype).replace("torch.", "")}
    variants = [("sdpa", "sdpa", False), ("flex", "flex", False), ("sdpa_bf16_autocast", "sdpa", True)]
    for name, backend, autocast in variants:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        forward_only = backend == "flex" and device.type != "cuda"  # torch has no flex backward on the CPU
        grad = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad:
            t0 = time.perf_counter()
            for i in range(shape.warmup):
                metrics = train_step(drafter, params, optim, t, shape, i, backend, autocast, forward_only)
            sync(device)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(shape.steps):
                metrics = train_step(drafter, params, optim, t, shape, 100 + i, backend, autocast, forward_only)
            sync(device)
        step_s = (time.perf_counter() - t0) / shape.steps
        row = {"tokens_per_s": shape.tokens / step_s, "step_s": step_s, "mfu": flop / step_s / (peak_tflops * 1e12),
               "warmup_s": first, "loss": metrics["loss"], "blocks": metrics["num_blocks"]}
        if device.type == "cuda":
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        if backend == "flex":
            row["compiled"] = device.type == "cuda"  # the trainer compiles flex attention on CUDA only
            row["forward_only"] = forward_only
        out[name] = row
    out["flex_vs_sdpa"] = out["flex"]["tokens_per_s"] / out["sdpa"]["tokens_per_s"]
    out["autocast_vs_fp32"] = out["sdpa_bf16_autocast"]["tokens_per_s"] / out["sdpa"]["tokens_per_s"]
    out["trainer_backend"] = "flex" if device.type == "cuda" else "sdpa"  # what attention_backend="auto" picks
    del drafter, optim, params
    return out


def draft_vocab(target, shape: Shape, device: torch.device) -> dict:
    """The drafter step (SDPA) with the target's full LM head beside pruned draft vocabularies of 32,768, 8,192
    and 64 rows (those below the vocabulary), labels in the smallest, for every drafter family:
    ``bench_draft_vocab.draft_vocab_steps``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_draft_vocab", Path(__file__).with_name("bench_draft_vocab.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.draft_vocab_steps(target.get_input_embeddings(), target.get_output_embeddings(),
                                   layers=shape.draft_layers, heads=shape.heads, kv_heads=shape.kv_heads,
                                   head_dim=shape.head_dim, intermediate=shape.intermediate, block=shape.block,
                                   anchors=shape.anchors, tokens=shape.tokens, steps=shape.steps, warmup=shape.warmup,
                                   families=tuple(bench.FAMILIES), device=device)


def pipeline(source, target, shape: Shape, device: torch.device, target_rate: float, step_rate: float,
             ds: TokenDataset | None = None) -> dict:
    """The trainer's input pipeline (collate -> fetch_hidden -> DeviceCopier) into its training step, over the
    first samples of ``ds`` (a synthetic dataset by default); a cache's source is asked by sample index."""
    drafter = build_drafter(shape, target, device)
    params, optim = make_optimizer(drafter)
    steps = shape.warmup + shape.steps
    ds = ds if ds is not None else synthetic_dataset(shape, steps)
    pin = device.type == "cuda"
    ids = layer_ids(shape)

    def items():
        for i in range(steps):
            yield collate(ds, torch.tensor([i]), shape.tokens, pin=pin)

    async def fetch(batch):
        hidden = await fetch_hidden(source, batch.sequences(), ids, None, pin=pin, index=batch.index)
        return dataclasses.replace(batch, target_hidden=hidden)

    copier = DeviceCopier(device)

    def copy(tensors):
        return copier(tensors)

    pipe = Pipeline(items(), fetch, copy, inflight=4, queue_size=4)
    mark_t = mark_wait = None
    try:
        for n, (tensors, event) in enumerate(pipe):
            DeviceCopier.wait(event, tensors)
            train_step(drafter, params, optim, tensors, shape, n)
            if n + 1 == shape.warmup:
                sync(device)
                mark_t, mark_wait = time.perf_counter(), pipe.wait_s
        sync(device)
        seconds = time.perf_counter() - mark_t
        waited = pipe.wait_s - mark_wait
    finally:
        pipe.close()
    rate = shape.steps * shape.tokens / seconds
    serial = 1 / (1 / target_rate + 1 / step_rate)  # one GPU runs the target forward and the step in turn
    return {"tokens_per_s": rate, "data_wait_fraction": waited / seconds, "vs_target_forward": rate / target_rate,
            "vs_one_gpu_bound": rate / serial, "one_gpu_bound_tokens_per_s": serial, "steps": shape.steps}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_colocated(shape_fields: dict, device_name: str, port: int, shm_dir: str, go, ready) -> None:
    """Child process: the target service beside the trainer (same model, shared-memory replies).

    It imports everything at once, then waits for ``go`` before it builds its model, so its start-up
    overlaps the other stages without touching the device while they are measured."""
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401 - the slow import, done before waiting

    go.wait()
    shape = Shape(**shape_fields)
    device = torch.device(device_name)
    model = build_target(shape, device)
    with tempfile.TemporaryDirectory(prefix="gpu-check-target-") as tmp:
        model_dir = save_config(model, Path(tmp) / "target")
        info = build_model_info(model, model_dir, layer_ids=layer_ids(shape))
        settings = TargetSettings(model=str(model_dir), host="127.0.0.1", port=port, shm_dir=shm_dir,
                                  max_batch_tokens=shape.target_batch_tokens, max_wait_ms=2, log_json=False)
        server = TargetServer(settings, info, model=model).start()
        ready.set()
        server.server.wait_for_termination()


class ColocatedTarget:
    """The colocated target service as a child process on the same device (started early, built on demand)."""

    def __init__(self, shape: Shape, device: torch.device, shm_dir: str):
        ctx = mp.get_context("spawn")
        self.go, self.ready, self.port = ctx.Event(), ctx.Event(), free_port()
        self.proc = ctx.Process(target=serve_colocated, daemon=True, args=(
            dataclasses.asdict(shape), str(device), self.port, shm_dir, self.go, self.ready))
        self.proc.start()

    def wait_ready(self, timeout: float = 300) -> float:
        t0 = time.perf_counter()
        self.go.set()
        if not self.ready.wait(timeout):
            raise RuntimeError(f"the colocated target did not start within {timeout:.0f} s")
        return time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def colocated_pipeline(server: ColocatedTarget, target, shape: Shape, device: torch.device, shm_dir: str,
                       target_rate: float, step_rate: float) -> dict:
    """The pipeline fed by a target service in another process on the same device, over shared memory."""
    try:
        start_s = server.wait_ready()
        client = TargetClient(f"127.0.0.1:{server.port}", shm_dir=shm_dir, tokens_per_call=shape.target_batch_tokens,
                              max_in_flight=4)
        try:
            out = pipeline(client, target, shape, device, target_rate, step_rate)
            out["shm_bytes"] = client.stats["bytes"]
            out["calls"] = client.stats["calls"]
        finally:
            with contextlib.suppress(Exception):
                asyncio.run(client.close())
        out["target_build_s"] = start_s
        out["shm_dir_on_tmpfs"] = shm_dir.startswith("/dev/shm")
        return out
    finally:
        server.stop()


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeats


def transfer(shape: Shape, device: torch.device, shm_dir: str) -> dict:
    """Hidden states of one sample device -> host -> shared memory -> pinned host -> device, leg by leg."""
    width = len(layer_ids(shape)) * shape.hidden
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    states = torch.randn(shape.tokens, width, device=device).to(dtype)
    nbytes = states.numel() * states.element_size()
    pin = device.type == "cuda"
    repeats = max(3, shape.steps)
    host = states.to("cpu")
    legs = {"device_to_host": timed(lambda: states.to("cpu", copy=False).contiguous(), device, repeats)}
    with ShmPool(shm_dir) as pool:
        seg = pool.acquire(nbytes)
        legs["host_to_shm"] = timed(lambda: seg.write(HEADER_BYTES, host), device, repeats)
        view = seg.view(HEADER_BYTES, dtype, list(host.shape))
        staged = torch.zeros(1, shape.tokens, width, dtype=dtype, pin_memory=pin)
        legs["shm_to_pinned_host"] = timed(lambda v=view: staged[0].copy_(v), device, repeats)
        copier = DeviceCopier(device)
        empty_ids, empty_mask = torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, dtype=torch.uint8)
        empty_lengths = torch.zeros(1, dtype=torch.int64)

        def h2d(src):
            def run():
                moved, event = copier(Batch(empty_ids, empty_mask, empty_lengths, target_hidden=src))
                DeviceCopier.wait(event, moved)
            return run

        legs["pinned_host_to_device"] = timed(h2d(staged), device, repeats)
        legs["pageable_host_to_device"] = timed(h2d(host[None]), device, repeats)
        del view
        pool.release(seg)
    gbps = {f"{k}_gbps": nbytes / v / 1e9 for k, v in legs.items()}
    path = ("device_to_host", "host_to_shm", "shm_to_pinned_host", "pinned_host_to_device")
    return gbps | {"end_to_end_gbps": nbytes / sum(legs[k] for k in path) / 1e9, "bytes": nbytes,
                   "pinned": pin, "dtype": str(dtype).replace("torch.", "")}


def file_system(path: Path) -> str:
    """The type of the file system holding ``path`` (the longest mount point above it in /proc/mounts)."""
    target, best, kind = str(path.resolve()).rstrip("/") + "/", "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            mount = parts[1].rstrip("/") + "/" if len(parts) > 2 else None
            if mount and target.startswith(mount) and len(mount) > len(best):
                best, kind = mount, parts[2]
    return kind


def drop_page_cache(paths: list[Path]) -> bool:
    """Ask the kernel to drop the files' pages from the page cache (so the next read comes from the disk)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def read_whole(paths: list[Path]) -> float:
    """Seconds to read the files whole, one after another (the raw rate the cache's reads compare with)."""
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            view = memoryview(bytearray(os.fstat(fh.fileno()).st_size))
            while view:
                view = view[fh.readinto(view):]
    return time.perf_counter() - t0


def read_samples(uri: str, key: CacheKey, ds: TokenDataset, order: list[int]) -> float:
    """Seconds to read every sample's features from a freshly opened cache, one sample at a time in ``order``."""
    cache = HiddenStateCache.open(uri, key, ds, create=False)
    try:
        t0 = time.perf_counter()
        for i in order:
            cache.read(i)
        return time.perf_counter() - t0
    finally:
        cache.close()


def hidden_cache(local: InProcessTarget, model, shape: Shape, device: torch.device, scratch: Path, deadline: float,
                 online_rate: float, target_rate: float, step_rate: float) -> dict:
    """The hidden-state cache of the synthetic dataset: filled by the in-process target (its dtype) on the
    scratch disk, read back one sample at a time in shuffled order (as training reads) beside whole-file reads
    of its shards, from the disk (pages dropped first) and from the page cache, then the pipeline trained from
    it (a ``CachedSource``) beside the online in-process pipeline. Skipped, with a note, when its estimated
    time or the disk does not fit before ``deadline``; the fill stops between shards at ``deadline``."""
    ids, info = layer_ids(shape), local.model_info()
    ds = synthetic_dataset(shape, max(CACHE_SAMPLES, shape.warmup + shape.steps))
    key = CacheKey(info.fingerprint, tuple(ids), dataset_checksum(ds.manifest), str(info.dtype), info.hidden_size,
                   info.num_layers)
    root = scratch / "hidden-state-cache"
    uri, nbytes, tokens = f"file://{root}", estimate_bytes(ds, key), int(ds.lengths.sum())
    out = {"path": str(root), "file_system": file_system(scratch), "dtype": key.dtype, "samples": ds.num_samples,
           "bytes": nbytes}

    def skip(why: str) -> dict:
        shape.notes.append(f"hidden-state cache skipped: {why}")
        return out | {"skipped": why}

    free = shutil.disk_usage(scratch).free
    if free < nbytes + GIB:
        return skip(f"{free / GIB:.1f} GiB free under {scratch}, {nbytes / GIB:.1f} GiB + 1 GiB needed")
    rates = [r for r in (target_rate, online_rate, step_rate) if math.isfinite(r) and r > 0]
    if len(rates) == 3:  # fill, five passes over the bytes (write, two raw and two cache reads), the pipeline
        need = tokens / target_rate + 5 * nbytes / (CACHE_DISK_MB_S * 1e6) \
            + (shape.warmup + shape.steps) * shape.tokens / min(online_rate, step_rate)
        left = deadline - time.perf_counter()
        if need > left:
            return skip(f"about {need:.0f} s needed, {max(left, 0):.0f} s left in the time budget")

    cache = HiddenStateCache.open(uri, key, ds, shard_bytes=2 * nbytes // ds.num_samples)  # two samples a shard
    t0 = time.perf_counter()
    fill_shards(cache, local, ds, cache.shards, max_tokens_per_request=shape.target_batch_tokens,
                should_stop=lambda: time.perf_counter() > deadline)
    out.update(fill_s=time.perf_counter() - t0, shards=len(cache.shards))
    missing = cache.missing()
    cache.close()
    if missing:
        return skip(f"the time budget ran out while filling ({len(missing)} of {len(cache.shards)} shards missing)")
    out["fill_mb_s"] = nbytes / 1e6 / out["fill_s"]  # the target's forward and the write together

    files = [root / p.key for p in cache.shards]
    file_bytes = sum(f.stat().st_size for f in files)
    order = torch.randperm(ds.num_samples, generator=torch.Generator().manual_seed(4)).tolist()
    out["page_cache_dropped"] = drop_page_cache(files)
    raw_disk = read_whole(files)
    drop_page_cache(files)
    cache_disk = read_samples(uri, key, ds, order)
    raw_warm = read_whole(files)
    cache_warm = read_samples(uri, key, ds, order)
    out.update(raw_read_mb_s=file_bytes / 1e6 / raw_disk, cache_read_mb_s=nbytes / 1e6 / cache_disk,
               raw_read_warm_mb_s=file_bytes / 1e6 / raw_warm, cache_read_warm_mb_s=nbytes / 1e6 / cache_warm,
               file_bytes=file_bytes)
    out["cache_vs_raw_read"] = out["cache_read_mb_s"] / out["raw_read_mb_s"]

    source = CachedSource(HiddenStateCache.open(uri, key, ds, create=False))  # no target: every sample cached
    try:
        cached = pipeline(source, model, shape, device, target_rate, step_rate, ds=ds)
    finally:
        asyncio.run(source.close())
    cached["samples_from_cache"] = source.served_from_cache
    out["pipeline_cached"] = cached
    out["cached_vs_online"] = cached["tokens_per_s"] / online_rate
    return out


def tokenizer_for(shape: Shape):
    """A word-level tokenizer over the model's vocabulary (``t<id>`` words) with a plain chat template."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1} | {f"t{i}": i for i in range(2, shape.vocab)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.padding_side = "left"
    return fast


def generation_engine(model, tokenizer, batch_size: int) -> TransformersEngine:
    """The transformers engine around an already built model (its constructor loads from a directory)."""
    engine = TransformersEngine.__new__(TransformersEngine)
    engine.tokenizer, engine.model, engine.device = tokenizer, model, next(model.parameters()).device
    engine.batch_size, engine.model_name = batch_size, "gpu-check"
    engine.stop_ids = [tokenizer.eos_token_id]
    engine.max_positions = model.config.max_position_embeddings
    return engine


def generation(model, shape: Shape, device: torch.device) -> dict:
    """Greedy generation through the transformers engine at a few batch sizes (generated tokens/s)."""
    tokenizer = tokenizer_for(shape)
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=shape.gen_new_tokens, thinking=True)
    out = {}
    for bs in shape.gen_batch_sizes:
        engine = generation_engine(model, tokenizer, bs)
        requests = [GenRequest(id=f"r{i}", messages=[{"role": "user", "content": " ".join(
            f"t{int(x)}" for x in torch.randint(2, shape.vocab - 2, (shape.gen_prompt_tokens,), generator=g))}],
            seed=i) for i in range(bs)]
        engine.generate(requests[:1], dataclasses.replace(params, max_new_tokens=2))  # warm-up
        sync(device)
        t0 = time.perf_counter()
        results = engine.generate(requests, params)
        sync(device)
        seconds = time.perf_counter() - t0
        errors = [r.error for r in results if r.error]
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]}")
        tokens = sum(r.completion_tokens for r in results)
        out[str(bs)] = {"tokens_per_s": tokens / seconds, "generated_tokens": tokens, "seconds": seconds,
                        "per_sequence_tokens_per_s": tokens / seconds / bs}
    return {"batch_sizes": out, "prompt_tokens": shape.gen_prompt_tokens, "max_new_tokens": shape.gen_new_tokens}


def node_split(target_rate: float, step_rate: float, gpus: int = NODE_GPUS) -> dict:
    """The split of a node between target and trainer GPUs that trains the most tokens/s.

    Node rate with n target GPUs = min(n x target tokens/s, (gpus - n) x step tokens/s), assuming the
    trainers scale linearly under DDP (gradient all-reduce over NCCL is not measured on one GPU).
    """
    rows = []
    for n in range(1, gpus):
        node = min(n * target_rate, (gpus - n) * step_rate)
        rows.append({"target_gpus": n, "trainer_gpus": gpus - n, "node_tokens_per_s": node,
                     "bound": "target" if n * target_rate < (gpus - n) * step_rate else "trainer"})
    best = max(rows, key=lambda r: r["node_tokens_per_s"])
    default = rows[0]
    n = best["target_gpus"]
    if n == 1:
        values = {"trainer.targetMode": "colocated", "trainer.gpus": gpus - 1, "trainer.colocated.gpus": 1}
        how = "the chart's default: one colocated target sidecar beside 7 trainer GPUs"
    else:
        values = {"trainer.targetMode": "disaggregated", "trainer.gpus": gpus - n, "target.replicas": n,
                  "target.gpus": 1}
        how = (f"{n} target pods of one GPU each (one target process serves one GPU, so a colocated sidecar "
               f"cannot use {n}) beside a trainer pod of {gpus - n} GPUs on the same node")
    return {"gpus": gpus, "target_gpus": n, "trainer_gpus": gpus - n, "node_tokens_per_s": best["node_tokens_per_s"],
            "default_node_tokens_per_s": default["node_tokens_per_s"],
            "vs_default": best["node_tokens_per_s"] / default["node_tokens_per_s"],
            "target_share_balanced": step_rate / (target_rate + step_rate) * gpus,
            "chart_values": values, "how": how, "splits": rows}


# ------------------------------------------------------------------ the run


class Run:
    """Runs stages in order within a time budget; a failing stage records its error and the rest go on."""

    def __init__(self, budget_s: float):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.report: dict = {"stage_seconds": {}, "errors": {}}

    def stage(self, name: str, fn, *args):
        if time.perf_counter() - self.t0 > self.budget_s:
            self.report["errors"][name] = f"skipped: the {self.budget_s:.0f} s budget was spent"
            print(f"-- {name}: skipped (time budget)", flush=True)
            return None
        print(f"-- {name} ...", flush=True)
        t = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 - one failed stage must not cost the others
            traceback.print_exc()
            self.report["errors"][name] = f"{type(exc).__name__}: {exc}"
            result = None
        else:
            self.report[name] = result
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next stage (or the colocated target) gets the memory back
        self.report["stage_seconds"][name] = round(time.perf_counter() - t, 2)
        print(f"   {name} done in {time.perf_counter() - t:.1f} s", flush=True)
        return result


def check(args) -> dict:
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device(args.device if args.device not in ("auto", "cpu") else ("cuda" if cuda else "cpu"))
    rehearsal = args.rehearse or device.type != "cuda"
    shape = dataclasses.replace(TINY if rehearsal else QWEN3_8B, notes=[])
    if rehearsal:
        shape.notes.append("rehearsal: no CUDA device (or --rehearse), every stage runs at tiny shapes; the "
                           "figures test the code paths, not the hardware")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        shape = fit_to_memory(shape, torch.cuda.mem_get_info(device)[0])
    run = Run(args.budget_s)
    run.report.update(check="gpu_check", rehearsal=rehearsal, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    run.stage("device", device_info, device, shape, rehearsal)
    pk = run.stage("peak", peak, device) or {"tflops": float("nan")}
    sample_bytes = shape.tokens * len(layer_ids(shape)) * shape.hidden * 2
    shm_at = shm_base(12 * sample_bytes, shape.notes)  # the client's pool, calls in flight, the transfer stage
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, \
            tempfile.TemporaryDirectory(prefix="gpu-check-shm-", dir=shm_at) as shm_dir:
        server = ColocatedTarget(shape, device, shm_dir)  # imports while the other stages run
        t = time.perf_counter()
        model = build_target(shape, device)
        run.report["stage_seconds"]["build_target"] = round(time.perf_counter() - t, 2)
        model_dir = save_config(model, Path(tmp) / "target")
        fwd = run.stage("target_forward", target_forward, model, model_dir, shape, device, pk["tflops"]) or {}
        step = run.stage("drafter_step", drafter_step, model, shape, device, pk["tflops"]) or {}
        run.stage("draft_vocab", draft_vocab, model, shape, device)
        t_rate = fwd.get("tokens_per_s", float("nan"))
        s_rate = step.get(step.get("trainer_backend", "sdpa"), {}).get("tokens_per_s", float("nan"))
        local = InProcessTarget(model_dir, model=model, layer_ids=layer_ids(shape),
                                token_budget=shape.target_batch_tokens)
        pin = run.stage("pipeline_inprocess", pipeline, local, model, shape, device, t_rate, s_rate) or {}
        run.stage("transfer", transfer, shape, device, shm_dir)
        run.stage("generation", generation, model, shape, device)
        run.stage("pipeline_colocated", colocated_pipeline, server, model, shape, device, shm_dir, t_rate, s_rate)
        server.stop()
        run.stage("node_split", node_split, t_rate, s_rate)
        run.stage("hidden_cache", hidden_cache, local, model, shape, device, Path(tmp), run.t0 + run.budget_s,
                  pin.get("tokens_per_s", float("nan")), t_rate, s_rate)
        asyncio.run(local.close())
    run.report["shape_notes"] = shape.notes
    run.report["elapsed_s"] = round(time.perf_counter() - run.t0, 2)
    return run.report


# ------------------------------------------------------------------ the table


def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        text = f"{value:,.0f}" if abs(value) >= 10 else f"{value:.3f}" if abs(value) >= 0.01 else f"{value:.3g}"
    else:
        text = str(value)
    return f"{text} {unit}".strip()


def table(report: dict) -> str:
    r = report
    dev, pk, fwd, st = r.get("device", {}), r.get("peak", {}), r.get("target_forward", {}), r.get("drafter_step", {})
    pin, col, tr = r.get("pipeline_inprocess", {}), r.get("pipeline_colocated", {}), r.get("transfer", {})
    gen, split, hc = r.get("generation", {}), r.get("node_split", {}), r.get("hidden_cache", {})
    pc = hc.get("pipeline_cached", {})
    rows = [
        ("device", f"{dev.get('name')} · torch {dev.get('torch')} · CUDA {dev.get('cuda')}", "what ran"),
        ("bf16 peak", _fmt(pk.get("tflops"), "TFLOP/s"),
         f"MFU denominator ({pk.get('source')}); measured matmul {_fmt(pk.get('bf16_tflops_measured'))}, "
         f"fp32 {_fmt(pk.get('fp32_tflops_measured'))}"),
        ("target forward", _fmt(fwd.get("tokens_per_s"), "tok/s"),
         f"forward_batch up to layer {fwd.get('layers_computed')} ({fwd.get('dtype')}); MFU {_fmt(fwd.get('mfu'))}, "
         f"{_fmt(fwd.get('tflop_per_sample'))} TFLOP per sample"),
    ]
    for name in ("sdpa", "flex", "sdpa_bf16_autocast"):
        row = st.get(name, {})
        rows.append((f"drafter step {name}", _fmt(row.get("tokens_per_s"), "tok/s"),
                     f"MFU {_fmt(row.get('mfu'))}, {_fmt(row.get('step_s'))} s/step, peak "
                     f"{_fmt(row.get('peak_memory_gib'), 'GiB')}, warm-up {_fmt(row.get('warmup_s'), 's')}"))
    dv = r.get("draft_vocab", {})
    for size in ("32768", "8192", "64"):
        if size in dv:
            rows.append((f"drafter step, {size}-row vocab", _fmt(dv[size].get("tokens_per_s"), "tok/s"),
                         f"{_fmt(dv.get('speedup', {}).get(size))}x the full {dv.get('vocab')}-row head "
                         f"({_fmt(dv.get('full', {}).get('tokens_per_s'))} tok/s); draft_vocab_size"))
    for key, row in dv.items():
        if isinstance(row, dict) and "vs_dflash" in row:
            family, size = key.split(":", 1)
            rows.append((f"{family} drafter step, {size} vocab", _fmt(row.get("tokens_per_s"), "tok/s"),
                         f"{_fmt(row['vs_dflash'])}x DFlash's step at that vocabulary"))
    rows += [
        ("flex vs SDPA", _fmt(st.get("flex_vs_sdpa"), "x"), "the trainer picks flex on CUDA (compiled)"),
        ("bf16 autocast vs fp32", _fmt(st.get("autocast_vs_fp32"), "x"),
         f"the trainer trains {st.get('parameter_dtype')} parameters today; autocast is not its path"),
        ("pipeline in-process", _fmt(pin.get("tokens_per_s"), "tok/s"),
         f"data wait {_fmt(pin.get('data_wait_fraction'))}; vs target forward {_fmt(pin.get('vs_target_forward'))}, "
         f"vs one-GPU bound {_fmt(pin.get('vs_one_gpu_bound'))}"),
        ("pipeline colocated shm", _fmt(col.get("tokens_per_s"), "tok/s"),
         f"data wait {_fmt(col.get('data_wait_fraction'))}; vs target forward {_fmt(col.get('vs_target_forward'))}, "
         f"vs one-GPU bound {_fmt(col.get('vs_one_gpu_bound'))}"),
        ("hidden-state transfer", _fmt(tr.get("end_to_end_gbps"), "GB/s"),
         f"d2h {_fmt(tr.get('device_to_host_gbps'))}, shm {_fmt(tr.get('host_to_shm_gbps'))}, pinned "
         f"{_fmt(tr.get('shm_to_pinned_host_gbps'))}, h2d pinned {_fmt(tr.get('pinned_host_to_device_gbps'))} / "
         f"pageable {_fmt(tr.get('pageable_host_to_device_gbps'))} GB/s"),
    ]
    for bs, g in gen.get("batch_sizes", {}).items():
        rows.append((f"generation batch {bs}", _fmt(g.get("tokens_per_s"), "tok/s"),
                     f"transformers engine, greedy, {gen.get('max_new_tokens')} new tokens"))
    rows.append(("8-GPU node split", f"{split.get('target_gpus')} target + {split.get('trainer_gpus')} trainer",
                 f"{_fmt(split.get('node_tokens_per_s'))} tok/s, {_fmt(split.get('vs_default'))}x the 1 + 7 default; "
                 f"chart {json.dumps(split.get('chart_values'))}"))
    if not hc or hc.get("skipped"):
        rows.append(("hidden-state cache", "skipped" if hc else "—", hc.get("skipped", "not measured (see below)")))
    else:
        rows += [
            ("hidden-state cache fill", _fmt(hc.get("fill_mb_s"), "MB/s"),
             f"{_fmt(hc.get('bytes', 0) / 1e6, 'MB')} {hc.get('dtype')} in {hc.get('shards')} shards, "
             f"{_fmt(hc.get('fill_s'), 's')} (forward + write) under {hc.get('path')} ({hc.get('file_system')})"),
            ("cache read", _fmt(hc.get("cache_read_mb_s"), "MB/s"),
             f"per sample, shuffled; {_fmt(hc.get('cache_vs_raw_read'))}x raw; from the page cache "
             f"{_fmt(hc.get('cache_read_warm_mb_s'))} MB/s"
             + ("" if hc.get("page_cache_dropped") else " (pages not dropped: both warm)")),
            ("raw file read", _fmt(hc.get("raw_read_mb_s"), "MB/s"),
             f"the cache's shard files read whole; from the page cache {_fmt(hc.get('raw_read_warm_mb_s'))} MB/s"),
            ("pipeline cached", _fmt(pc.get("tokens_per_s"), "tok/s"),
             f"from a CachedSource, data wait {_fmt(pc.get('data_wait_fraction'))}; cached vs online "
             f"{_fmt(hc.get('cached_vs_online'))}x the in-process pipeline"),
        ]
    width = max(len(a) for a, _, _ in rows)
    vwidth = max(len(b) for _, b, _ in rows)
    lines = [f"{a:<{width}}  {b:>{vwidth}}  {c}" for a, b, c in rows]
    lines += [f"note: {n}" for n in report.get("shape_notes", [])]
    lines += [f"error in {k}: {v}" for k, v in report.get("errors", {}).items()]
    return "\n".join(lines)


def finite(obj):
    """The report with NaN and infinity as null (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "gpu-check.json"), help="where the JSON of every figure goes")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1, ...")
    parser.add_argument("--rehearse", action="store_true", help="tiny shapes even on CUDA (a quick smoke run)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stages starting after this many seconds "
                                                                      "are skipped (the check must end in 8 min)")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = finite(check(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"figures written to {out}")


if __name__ == "__main__":
    main()
