"""Settings of the trainer service (``DFLASH_*`` variables or CLI flags)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from dfp_shared.config import CommonSettings
from pydantic import Field


class TrainerSettings(CommonSettings):
    target_url: str = Field("inprocess", description="Hidden states from `inprocess` (target loaded here) or gRPC "
                                                     "address(es), comma-separated.")
    device: str = Field("auto", description="Training device: auto, cpu, cuda or cuda:N.")
    nproc_per_node: int = Field(1, ge=1, description="Training processes per pod; >1 spawns torchrun children.")
    fetch_inflight: int = Field(4, ge=1, description="Hidden-state requests kept in flight per rank.")
    prefetch_batches: int = Field(4, ge=1, description="Capacity of each input-pipeline queue (micro-batches).")
    lease_ms: int = Field(120_000, ge=1000, description="Lease of a claimed train task (ms); heartbeats renew it.")
    max_deliveries: int = Field(5, ge=1, description="Deliveries of a train task before it is dead-lettered.")
    progress_every_s: float = Field(2.0, gt=0, description="Seconds between progress updates in the job record.")
    work_dir: str = Field("", description="Local scratch directory for staging (the drafter export, torchrun "
                                          "files); created if missing. Empty: the system temporary directory.")
    torchrun_args: str = Field("", description="Extra torchrun flags for multi-pod runs (e.g. --nnodes 2 "
                                               "--rdzv-endpoint host:29400); empty: --standalone.")


def scratch_dir(work_dir: str | None, prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary directory under ``work_dir`` (created if missing), or under the system default."""
    if work_dir:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix=prefix, dir=work_dir or None)
