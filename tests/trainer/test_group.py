"""A trainer group on the chart's own wiring: the rendered StatefulSet's pods run as local processes.

Two trainer "pods" × 1 process (gloo) train one job through torchrun's c10d rendezvous at the
group's address; a pod lost mid-training stops the group, which re-forms, resumes from the
checkpoint and finishes, the job succeeding once, with the same parameters as an uninterrupted
1 pod × 2 processes run on the same global batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.storage.store import open_store
from redis import Redis

from tests.support.chart import render_objects
from tests.support.local_cluster import LocalCluster
from tests.trainer.train_support import final_weights, subprocess_env, tiny_spec

TRAINER = "dflash-trainer"


def group_values(tmp_path, allowed: str) -> dict:
    return {"gpu": {"enabled": False},
            "storage": {"url": f"file://{tmp_path}/store", "allowedPrefixes": [allowed]},
            "trainer": {"nodes": 2, "targetMode": "inprocess",
                        "env": {"DFLASH_LEASE_MS": "4000", "DFLASH_PROGRESS_EVERY_S": "0.01"}}}


@pytest.fixture
def group(tmp_path, tmp_path_factory):
    objects = render_objects(group_values(tmp_path, f"file://{tmp_path_factory.getbasetemp()}"), include_tests=False)
    cluster = LocalCluster(objects, tmp_path / "cluster", base_env=subprocess_env())
    cluster.start("dflash-redis")
    yield cluster
    for index in range(len(cluster.pods.get(TRAINER, []))):  # before Redis, which they would wait for
        cluster.kill(TRAINER, index, sig=15)
    cluster.stop()


def wait_for(pred, what: str, cluster: LocalCluster, timeout: float = 400):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    logs = "\n".join(f"--- {n}\n{p.log_tail(30)}" for n, p in cluster.group.procs.items())
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def one_pod_two_processes(tmp_path, spec: dict) -> dict[str, torch.Tensor]:
    """The reference: what a lone trainer pod with 2 processes runs (torchrun --standalone)."""
    spec_path = tmp_path / "ref-spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dfp_trainer.run", "--spec", str(spec_path)]
    done = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    return final_weights(spec["output"])[1]


def assert_same_weights(got: dict, want: dict) -> None:
    # both runs all-reduce the same two ranks' gradients over gloo: a + b in float32 does not depend on
    # which pod holds which rank, so the parameters agree bit for bit
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)


def run_group_job(cluster: LocalCluster, spec: dict, during=None) -> tuple[JobStore, str]:
    r = Redis(port=cluster.service_ports[("dflash-redis", 6379)], decode_responses=True)
    jobs = JobStore(r)
    job, _ = queue_job(r, "train", spec)
    cluster.start(TRAINER)  # both members of the group
    assert len(cluster.pods[TRAINER]) == 2
    if during:
        during(jobs, job.id)
    rec = wait_for(lambda: (lambda j: j if j.state in (JobState.succeeded, JobState.failed) else None)(
        jobs.get(job.id)), "the group's job to finish", cluster)
    assert rec.state == JobState.succeeded, rec.error
    return jobs, job.id


def test_two_pods_train_one_job_like_one_pod_and_survive_losing_one(group, tmp_path, tiny_qwen3_dir, tiny_dataset):
    """One run shows both (each costs a group start and a reference run, the suite's time is short):
    2 pods × 1 process, with pod 1 lost after the first checkpoint, end bit-identical to an
    uninterrupted 1 pod × 2 processes run on the same global batch."""
    steps = 8
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/group", steps=steps, tokens_per_batch=256,
                     checkpoint_every=3)

    def lose_member_one(jobs: JobStore, job_id: str) -> None:
        wait_for(lambda: jobs.get(job_id).counters.get("steps", 0) >= 4, "training past a checkpoint", group)
        group.lose_pod(TRAINER, 1)
        group.restart_pod(TRAINER, 1)

    jobs, job_id = run_group_job(group, spec, during=lose_member_one)
    rec = jobs.get(job_id)
    assert rec.counters["steps"] == steps
    for key in ("tokens_per_s", "data_wait_fraction", "comm_fraction"):
        assert key in rec.counters, key
        for node in (0, 1):  # each pod's own figures beside the group's
            assert f"node{node}_{key}" in rec.counters, (node, key)
    assert rec.counters["node0_tokens_per_s"] > 0 and rec.counters["node1_tokens_per_s"] > 0
    assert "joining group run" in group.process(TRAINER, 1).log_path.read_text()  # member 1 trained too
    # succeeded once: one transition into succeeded in the job's events
    states = [data.get("state") for _, kind, data in jobs.events(job_id, count=10_000) if kind == "state"]
    assert states.count("succeeded") == 1, states
    logs = "".join(group.process(TRAINER, i).log_path.read_text() for i in range(2))
    resumed = [json.loads(line)["step"] for line in logs.splitlines() if '"msg": "resumed"' in line]
    assert resumed and max(resumed) >= 3, resumed
    step, got = final_weights(spec["output"])
    assert step == steps
    assert_same_weights(got, one_pod_two_processes(tmp_path, {**spec, "output": f"file://{tmp_path}/ref"}))


@pytest.mark.parametrize("how", ["cancel", "sigterm"])
def test_a_cancel_or_sigterm_stops_every_rank_with_one_checkpoint(group, tmp_path, tiny_qwen3_dir, tiny_dataset, how):
    """Cancelling a group's job, or SIGTERM to the claimant pod: the claimant stops its torchrun, the stop
    reaches every rank through the group's collective stop flag, rank 0 writes one checkpoint, and no
    rank of either pod keeps training."""
    import psutil

    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/cancelled", steps=500, tokens_per_batch=256,
                     checkpoint_every=10_000)
    def ranks() -> list:
        """torchrun and its ranks, started from this test's pods, wherever they are now (orphans included)."""
        found = []
        for proc in psutil.process_iter(["cmdline", "cwd", "status"]):
            info = proc.info
            if (info["status"] != psutil.STATUS_ZOMBIE and "dfp_trainer.run" in " ".join(info["cmdline"] or [])
                    and str(info["cwd"] or "").startswith(str(tmp_path))):
                found.append(proc)
        return found

    r = Redis(port=group.service_ports[("dflash-redis", 6379)], decode_responses=True)
    jobs = JobStore(r)
    job, _ = queue_job(r, "train", spec)
    group.start(TRAINER)
    wait_for(lambda: jobs.get(job.id).counters.get("steps", 0) >= 3, "the group training", group)
    assert len(ranks()) == 4  # in each pod, torchrun and its one rank
    if how == "cancel":
        jobs.cancel(job.id)
    else:
        group.kill(TRAINER, 0, sig=15)

    wait_for(lambda: not ranks(), "every rank of both pods to stop", group, timeout=120)
    ckpts = [k for k in open_store(spec["output"]).list("checkpoints/") if k.endswith("model.safetensors")]
    stopped_at = json.loads(open_store(spec["output"]).get("checkpoints/latest.json"))["step"]
    assert len(ckpts) == 1 and 3 <= stopped_at < 500, ckpts
    # cancelled, or given back to the stream for a later claimant to resume (a SIGTERM is not a failure)
    assert jobs.get(job.id).state == (JobState.cancelled if how == "cancel" else JobState.running)
    logs = "".join(group.process(TRAINER, i).log_path.read_text() for i in range(2))
    assert logs.count('"stopping early: checkpoint written"') >= 1
    time.sleep(3)  # the member does not train the cancelled job again on its own
    assert not ranks()
