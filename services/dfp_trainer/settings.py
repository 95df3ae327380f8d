"""Settings of the trainer service (``DFLASH_*`` variables or CLI flags)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from dfp_shared.models.gguf_import import GGUFImportSettings
from dfp_shared.specs._names import DEFAULT, load_name_map
from pydantic import Field, field_validator, model_validator

DEFAULT_TARGET = DEFAULT


class TrainerSettings(GGUFImportSettings):
    """The trainer workers' settings (their ``import_gguf`` jobs read ``gguf_max_bytes``)."""

    target_url: str = Field("inprocess", min_length=1,
                            description="The hidden-state source named `default`: `inprocess` (target loaded here) or "
                                        "gRPC address(es), comma-separated.")
    target_endpoints: str = Field(
        "", description="Further hidden-state sources a train spec may choose by name (`target_endpoint`), as a JSON "
                        "object name -> `inprocess` or gRPC address(es); a spec can name no other address.")
    device: str = Field("auto", description="Training device: auto, cpu, cuda or cuda:N.")
    nproc_per_node: int = Field(1, ge=1, description="Training processes per pod; >1 spawns torchrun children.")
    fetch_inflight: int = Field(4, ge=1, description="Hidden-state requests kept in flight per rank.")
    prefetch_batches: int = Field(4, ge=1, description="Capacity of each input-pipeline queue (micro-batches).")
    cache_quota_gb: float = Field(1024.0, gt=0, description="Largest hidden-state cache a job may fill (GB, 10^9 "
                                                              "bytes): a cache estimated above it (tokens x layers x "
                                                              "hidden x dtype size) is refused before it starts.")
    cache_shard_mb: float = Field(256.0, gt=0, description="Largest shard of a new hidden-state cache (MB of features; "
                                                           "a token shard is cut into parts of at most this size).")
    lease_ms: int = Field(120_000, ge=1000, description="Lease of a claimed train task (ms); heartbeats renew it.")
    max_deliveries: int = Field(5, ge=1, description="Deliveries of a train task before it is dead-lettered.")
    progress_every_s: float = Field(2.0, gt=0, description="Seconds between progress updates in the job record.")
    mlflow_tracking_uri: str = Field("", description="MLflow tracking server (http(s)://host:port; needs the `tracking` extra) the live "
                                                      "training metrics also go to; empty: TensorBoard event files only.")
    mlflow_experiment: str = Field("dflash-pipeline", min_length=1, max_length=256,
                                   description="MLflow experiment the runs are logged under.")
    metrics_upload_every_s: float = Field(30.0, ge=0, description="Seconds between uploads of the TensorBoard event "
                                                                  "files to the output prefix (0: at every point).")
    work_dir: str = Field("", description="Local scratch directory for staging (the drafter export, torchrun "
                                          "files); created if missing. Empty: the system temporary directory.")
    torchrun_args: str = Field("", description="Extra torchrun flags for multi-pod runs (e.g. --nnodes 2 "
                                               "--rdzv-endpoint host:29400); empty: --standalone.")
    nodes: int = Field(1, ge=1, description="Pods of this trainer's group; >1: they train one job together "
                                            "(torchrun c10d rendezvous at rdzv_endpoint).")
    node_rank: int = Field(0, ge=0, description="This pod's place in its group; member 0 claims the jobs.")
    group_name: str = Field("trainer", min_length=1, description="Name of the trainer group (its Redis keys).")
    rdzv_endpoint: str = Field("", description="host:port of the group's rendezvous (member 0's stable address).")
    max_restarts: int = Field(0, ge=0, description="torchrun restarts of a group run in place after a lost member; "
                                                   "0: the run ends and its task is retried at a fresh rendezvous.")

    @model_validator(mode="after")
    def _group(self):
        if self.nodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nodes > 1 needs rdzv_endpoint (DFLASH_RDZV_ENDPOINT)")
        if self.node_rank >= self.nodes:
            raise ValueError(f"node_rank {self.node_rank} is outside a group of {self.nodes}")
        return self

    @field_validator("target_endpoints")
    @classmethod
    def _target_endpoints(cls, value: str) -> str:
        parse_target_endpoints(value)
        return value

    def target_endpoint_map(self) -> dict[str, str]:
        """Every hidden-state source a job may name: ``default`` (DFLASH_TARGET_URL) and DFLASH_TARGET_ENDPOINTS."""
        return {DEFAULT_TARGET: self.target_url, **parse_target_endpoints(self.target_endpoints)}

    def target_address(self, name: str | None) -> str:
        """The address of the source a job names (unset: ``default``); ValueError lists the configured names."""
        targets = self.target_endpoint_map()
        name = name or DEFAULT_TARGET
        if name not in targets:
            names = ", ".join(repr(n) for n in targets)
            raise ValueError(f"target_endpoint {name!r} is not configured on this trainer; configured: {names} "
                             "(DFLASH_TARGET_URL is 'default', DFLASH_TARGET_ENDPOINTS the others)")
        return targets[name]


def parse_target_endpoints(text: str) -> dict[str, str]:
    """DFLASH_TARGET_ENDPOINTS: a JSON object name -> address (raises ValueError naming the entry)."""
    raw = load_name_map(text, "target", "address")
    for name, address in raw.items():
        if name == DEFAULT_TARGET:
            raise ValueError(f"names {DEFAULT_TARGET!r}, which is DFLASH_TARGET_URL; set that instead")
        if not isinstance(address, str) or not address.strip():
            raise ValueError(f"target {name!r}: give `inprocess` or gRPC address(es) as a non-empty string")
    return raw


def scratch_dir(work_dir: str | None, prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary directory under ``work_dir`` (created if missing), or under the system default."""
    if work_dir:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix=prefix, dir=work_dir or None)
