"""Hostile GGUF files through a real trainer worker process: the one whose metadata array claims 2^63
elements and the one with two tensors of one name fail their jobs at once with the reason (no control
characters in it), never redelivered, the worker's memory (its whole process tree) bounded; a cancel ends an
import mid-parse, its child process with it, and the worker takes the next task."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time

from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.printable import printable

from tests.support.gguf_file import write_tiny_llama_gguf
from tests.support.hostile_files import write_endless_array_gguf, write_twin_tensor_gguf
from tests.trainer.train_support import cli, subprocess_env

GiB = 1 << 30
WORKER_CEILING = 8 * GiB  # on today's code the worker grows without end: kept off the machine's other work


def _ceiling():
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_CEILING, WORKER_CEILING))


def _start_worker(redis_server, *args: str, **env) -> subprocess.Popen:
    return subprocess.Popen(cli("trainer", "worker", "--redis-url", redis_server.url, *args),
                            env=subprocess_env(DFLASH_LEASE_MS=3000, **env), preexec_fn=_ceiling,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _reap(proc: subprocess.Popen, timeout: float) -> tuple[int, int]:
    """(exit code, the worker's peak resident bytes); kills it at ``timeout``. The peak is the largest VmHWM
    seen while it ran (its own, since its exec), or the wait's figure, which also counts the children it
    reaped (and may count this process's size when it forked) when that is all there is."""
    deadline, hwm = time.monotonic() + timeout, 0
    while True:
        hwm = max(hwm, _vm_hwm(proc.pid))
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, hwm or usage.ru_maxrss * 1024
        if time.monotonic() > deadline:
            proc.kill()
        time.sleep(0.05)


def _vm_hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) << 10 for line in fh if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def _import(redis_client, tmp_path, source) -> str:
    job, _ = queue_job(redis_client, "import_gguf", {"source": source.as_uri(),
                                                     "output": (tmp_path / f"out-{source.stem}").as_uri()})
    return job.id


def test_hostile_gguf_headers_fail_their_jobs_at_once_and_the_worker_stays_small(tmp_path, redis_server,
                                                                                 redis_client):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    endless = _import(redis_client, tmp_path, write_endless_array_gguf(tmp_path / "a" / "endless.gguf"))
    twins = _import(redis_client, tmp_path, write_twin_tensor_gguf(tmp_path / "b" / "twins.gguf",
                                                                   "blk.0\x1b]0;pwned\x07\x1b[2J"))
    proc = _start_worker(redis_server, "--max-tasks", "2", "--idle-exit", "5")
    code, peak = _reap(proc, timeout=240)
    assert code == 0, proc.stderr.read()[-3000:]
    jobs = JobStore(redis_client)
    first, second = jobs.get(endless), jobs.get(twins)
    assert first.state == second.state == JobState.failed
    assert "endless.gguf: malformed GGUF (metadata 'general.architecture': claims 9,223,372,036,854,775,808 " \
           "elements" in first.error
    assert "twins.gguf: malformed GGUF (tensor 'blk.0]0;pwned[2J': two tensors of this name)" in second.error
    assert printable(second.error) == second.error
    for rec in (first, second):
        assert rec.finished_at - rec.started_at < 60, rec  # refused from the header, not after a parse runs out
    queue = TaskQueue(redis_client, "train")
    assert queue.dead_letters() == [] and queue.pending() == 0  # failed, not retried
    print(f"peak worker RSS {peak >> 20} MiB")
    assert peak < 2 * GiB


def test_a_cancel_ends_an_import_mid_parse_and_the_worker_takes_the_next_task(tmp_path, redis_server,
                                                                             redis_client):
    (tmp_path / "ok").mkdir()
    (tmp_path / "bad").mkdir()
    write_tiny_llama_gguf(tmp_path / "ok" / "tiny.gguf")
    slow = _import(redis_client, tmp_path, tmp_path / "ok" / "tiny.gguf")
    proc = _start_worker(redis_server, "--max-tasks", "2", "--idle-exit", "5")
    try:
        child = _confined_child_of(proc.pid, timeout=300)  # the worker imports torch first: slow on a loaded machine
        jobs = JobStore(redis_client)
        assert jobs.get(slow).state == JobState.running
        jobs.cancel(slow)
        cancelled_at = time.monotonic()
        while _alive(child) and time.monotonic() - cancelled_at < 10:
            time.sleep(0.1)
        assert not _alive(child), "the parse went on after the cancel"
        stopped_after = time.monotonic() - cancelled_at
        bad = _import(redis_client, tmp_path, write_endless_array_gguf(tmp_path / "bad" / "endless.gguf"))
        code, _ = _reap(proc, timeout=120)
    finally:
        proc.kill()
    assert code == 0
    assert stopped_after < 5
    assert jobs.get(slow).state == JobState.cancelled and not list((tmp_path / "out-tiny").glob("*.safetensors"))
    assert jobs.get(bad).state == JobState.failed  # the next task, on the same worker
    assert TaskQueue(redis_client, "train").pending() == 0


def _confined_child_of(parent: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = open(f"/proc/{pid}/stat").read()
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"dfp_shared.models.confined" in cmdline:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError("no confined child started")


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_sigterm_gives_an_import_back_mid_parse_within_the_grace_period(tmp_path, redis_server, redis_client):
    (tmp_path / "ok").mkdir()
    write_tiny_llama_gguf(tmp_path / "ok" / "tiny.gguf")
    job_id = _import(redis_client, tmp_path, tmp_path / "ok" / "tiny.gguf")
    proc = _start_worker(redis_server)
    try:
        child = _confined_child_of(proc.pid, timeout=300)  # the worker imports torch first: slow on a loaded machine
        proc.send_signal(signal.SIGTERM)  # a rollout: the chart gives the pod its grace period
        signalled = time.monotonic()
        code, _ = _reap(proc, timeout=30)
        exited_after = time.monotonic() - signalled
    finally:
        proc.kill()
    assert code == 0 and exited_after < 10 and not _alive(child)
    assert JobStore(redis_client).get(job_id).state == JobState.running  # not failed: another worker takes it
    queue = TaskQueue(redis_client, "train")
    assert queue.pending() == 1 and queue.dead_letters() == []
    (entry_id,) = [e for e, _ in redis_client.xrange(queue.stream)]
    assert redis_client.hget(queue.released_key, entry_id) == "1"  # given back, not a death
