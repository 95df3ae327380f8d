"""A trainer group: several pods train one job together through one torchrun c10d rendezvous.

Member 0 of the group (the pod with ordinal 0) is the only one that claims train tasks from the
Redis stream. For each claimed job it takes the job's training lease and publishes the job as the
group's current run; the other members poll for it and each launches torchrun with the same spec
and the same rendezvous id at the group's stable rendezvous address, so every rank trains the same
spec. Global rank 0, wherever the rendezvous puts it, publishes the run's result; the claimant reads
it, acks the task and finishes the job. Only the claimant acks.

The training lease (``dfp:train-lease:<job>``) is what makes "never trained twice at once" hold
across groups and lone pods: whoever trains a job holds it (a group by its name, a lone pod by its
consumer name), renews it while training and drops it at the end; a claimant that finds it held by
someone else gives the task back without training. This module owns these keys.
"""

from __future__ import annotations

import json
import threading

LEASE_PREFIX = "dfp:train-lease:"
GROUP_PREFIX = "dfp:train-group:"

# take the lease if free or already ours, and renew it; returns the holder
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
return holder
"""
_DROP = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class TrainLease:
    """The lease on training one job, owned by one group or lone pod; renewed by a thread while held."""

    def __init__(self, r, job_id: str, owner: str, ttl_ms: int):
        self.r, self.key, self.owner, self.ttl_ms = r, LEASE_PREFIX + job_id, owner, ttl_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take (or renew) the lease; None when held, otherwise the other holder's name."""
        holder = self.r.eval(_LEASE, 1, self.key, self.owner, self.ttl_ms)
        return None if holder == self.owner else holder

    def __enter__(self) -> TrainLease:
        self._thread = threading.Thread(target=self._renew, name="train-lease", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                self.acquire()
            except Exception:  # noqa: BLE001 - Redis away for a moment: the next renewal retries
                pass

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.r.eval(_DROP, 1, self.key, self.owner)


class GroupRuns:
    """The group's current run (published by the claimant) and its result (published by rank 0)."""

    def __init__(self, r, group: str):
        self.r, self.key = r, GROUP_PREFIX + group

    def publish(self, run_id: str, job_id: str, spec_json: str) -> None:
        self.r.delete(f"{self.key}:result")
        self.r.set(f"{self.key}:run", json.dumps({"run_id": run_id, "job_id": job_id, "spec": spec_json}))

    def current(self) -> dict | None:
        raw = self.r.get(f"{self.key}:run")
        return json.loads(raw) if raw else None

    def is_current(self, run_id: str) -> bool:
        run = self.current()
        return bool(run) and run["run_id"] == run_id

    def close(self, run_id: str) -> None:
        """The run is over: members stop relaunching it."""
        run = self.current()
        if run and run["run_id"] == run_id:
            self.r.delete(f"{self.key}:run")

    def put_result(self, run_id: str, result: dict) -> None:
        self.r.set(f"{self.key}:result", json.dumps({"run_id": run_id, **result}))

    def result(self, run_id: str) -> dict | None:
        raw = self.r.get(f"{self.key}:result")
        result = json.loads(raw) if raw else None
        return result if result and result.pop("run_id") == run_id else None


def rendezvous_args(nodes: int, node_rank: int, endpoint: str, run_id: str, max_restarts: int) -> list[str]:
    """torchrun flags of one group run: all ``nodes`` pods meet at ``endpoint`` under ``run_id``.

    Member 0 hosts the rendezvous store, said outright rather than guessed from host names (which
    cannot tell members apart when they share a host): it is the member the endpoint names."""
    return ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", f"is_host={str(node_rank == 0).lower()}",
            "--max-restarts", str(max_restarts)]
