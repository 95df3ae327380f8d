"""torchrun / DDP: process-group setup, DDP wrapping with timed gradient sync, cross-rank metrics.

DDP buckets gradients and all-reduces each bucket as soon as backward has filled it, so the
synchronisation overlaps the rest of the backward pass. A communication hook wraps the default
all-reduce to time each bucket from launch to completion; :class:`CommTimer` turns that into the
seconds per step during which gradient sync was in flight, reported as a share of step time.
Backend: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    node: int = 0  # this rank's node (torchrun's GROUP_RANK): the pod of a trainer group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto", timeout_s: int = 1800) -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK); one process without it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device in ("auto", "cuda") or device.startswith("cuda:")
    if use_cuda:
        dev = torch.device(device if device.startswith("cuda:") else f"cuda:{local_rank}")
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local_rank, dev, node=int(os.environ.get("GROUP_RANK", "0")))


NODE_KEYS = ("tokens_per_s", "data_wait_fraction", "comm_fraction")


def node_figures(info: DistInfo, tokens: float, step_s: float, wait_s: float, comm_s: float) -> dict[int, dict]:
    """Each node's tokens/s (its ranks' tokens over the slowest rank's step time) and mean data-wait and
    gradient-sync shares of step time, from every rank's figures of one step (a collective call)."""
    mine = torch.tensor([float(info.node), tokens, step_s, wait_s, comm_s], dtype=torch.float64)
    if info.distributed:
        rows = [torch.zeros_like(mine) for _ in range(info.world_size)]
        dist.all_gather(rows, mine.to(info.device) if info.device.type == "cuda" else mine)
        rows = [r.cpu() for r in rows]
    else:
        rows = [mine]
    nodes: dict[int, list] = {}
    for row in rows:
        nodes.setdefault(int(row[0]), []).append(row[1:].tolist())
    out = {}
    for node, ranks in sorted(nodes.items()):
        slowest = max(r[1] for r in ranks)
        out[node] = {"tokens_per_s": sum(r[0] for r in ranks) / slowest if slowest > 0 else 0.0,
                     "data_wait_fraction": sum(r[2] / r[1] for r in ranks if r[1] > 0) / len(ranks),
                     "comm_fraction": sum(r[3] / r[1] for r in ranks if r[1] > 0) / len(ranks)}
    return out


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class CommTimer:
    """Seconds during which at least one gradient bucket's all-reduce was in flight (per step)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []

    def record(self, start: float, end: float) -> None:
        with self._lock:
            self._intervals.append((start, end))

    def take(self) -> float:
        """Busy seconds since the last call (overlapping buckets counted once)."""
        with self._lock:
            spans, self._intervals = sorted(self._intervals), []
        busy, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        return busy


def _timed_allreduce_hook(timer: CommTimer, process_group=None):
    def hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
        start = time.perf_counter()
        group = process_group or dist.group.WORLD
        tensor = bucket.buffer().div_(dist.get_world_size(group))
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def done(f):
            timer.record(start, time.perf_counter())
            return f.value()[0]

        return fut.then(done)

    return hook


def wrap_model(model: torch.nn.Module, info: DistInfo, bucket_cap_mb: float = 25.0):
    """DDP-wrap ``model`` when running distributed (returns (model, CommTimer | None))."""
    if not info.distributed:
        return model, None
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True, broadcast_buffers=False)
    timer = CommTimer()
    ddp.register_comm_hook(None, _timed_allreduce_hook(timer))
    return ddp, timer


def reduce_metrics(metrics: dict[str, float], info: DistInfo, op: str = "mean") -> dict[str, float]:
    """Average (or sum) scalar metrics over ranks; a no-op in one process."""
    if not info.distributed or not metrics:
        return dict(metrics)
    keys = sorted(metrics)
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64,
                     device=info.device if info.device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    if op == "mean":
        t /= info.world_size
    return dict(zip(keys, t.tolist(), strict=True))


def broadcast_flag(flag: bool, info: DistInfo) -> bool:
    """True on every rank if any rank set ``flag`` (e.g. a SIGTERM seen by one rank)."""
    if not info.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=info.device if info.device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()
