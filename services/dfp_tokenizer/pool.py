"""The worker pool: N processes (one per core by default), each running a few task threads.

The parent forks the processes before anything loads a tokenizer (the Rust tokenizer's thread
pool is not fork-safe), restarts a process that dies (OOM kill, SIGKILL: its task is reclaimed by
another consumer once its lease runs out), and forwards SIGTERM/SIGINT: each process finishes the
tasks in hand, then exits. In a process, each thread is a :class:`~dfp_shared.jobs.worker.Worker`
with its own consumer name, so one thread's download or upload overlaps another's tokenization.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.redis_conn import connect
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.types import TOKENIZE
from dfp_shared.signals import STOP_SIGNALS, StopSignals, ignore_sigint
from dfp_shared.storage.roots import StorageRoots

from .limits import EncodeLimits
from .settings import TokenizerSettings
from .tasks import EncoderCache, TokenizeHandler, TokenizeWorker

log = logging.getLogger(__name__)


def run_process(settings: TokenizerSettings, *, idle_exit_s: float | None = None, slot: int = 0,
                handle_sigint: bool = True) -> int:
    """Consume tokenize tasks with ``settings.threads`` threads until signalled (or idle). Returns tasks done."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    r = connect(settings.redis_url)
    queue = TaskQueue(r, TOKENIZE.stream, lease_ms=settings.lease_ms, max_deliveries=settings.max_deliveries)
    jobs = JobStore(r)
    encoders = EncoderCache(settings.s3_endpoint_url, settings.cache_dir, EncodeLimits.from_settings(settings))
    handler = TokenizeHandler(r, encoders, settings.s3_endpoint_url, StorageRoots.from_settings(settings))
    host = socket.gethostname()
    workers = [TokenizeWorker(queue, jobs, handler, consumer=f"{host}-{os.getpid()}-{t}") for t in range(settings.threads)]

    def on_signal(count, _signum):
        for w in workers:
            if count > 1:
                w.abort.set()
            w.stopping.set()

    signals = StopSignals(on_signal, signals=STOP_SIGNALS if handle_sigint else (signal.SIGTERM,))
    if threading.current_thread() is threading.main_thread():
        signals.install()  # given back on return: the caller's process may go on
    try:
        threads = [threading.Thread(target=w.run, kwargs={"idle_exit_s": idle_exit_s}, name=f"tokenize-{slot}-{i}")
                   for i, w in enumerate(workers)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(0.2)
    finally:
        signals.restore()
    log.info("tokenizer process exiting", extra={"slot": slot, "tasks": sum(w.tasks_done for w in workers)})
    return sum(w.tasks_done for w in workers)


def _child(settings_json: str, slot: int, idle_exit_s: float | None) -> None:
    from dfp_shared.logs import setup_logging

    settings = TokenizerSettings.model_validate_json(settings_json)
    ignore_sigint()  # the parent turns Ctrl-C into one SIGTERM
    setup_logging(settings.log_level, settings.log_json, service="tokenizer")
    run_process(settings, idle_exit_s=idle_exit_s, slot=slot, handle_sigint=False)


def start_pool_metrics(port: int) -> int:
    """Serve the metrics of every process of the pool on ``port`` (needs ``PROMETHEUS_MULTIPROC_DIR``
    set before prometheus_client was imported; without it, this process's metrics only)."""
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    if port <= 0:
        return 0
    registry = None
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    start_http_server(port, registry=registry) if registry else start_http_server(port)
    log.info("metrics endpoint listening", extra={"port": port, "processes": "all" if registry else "this"})
    return port


class Pool:
    """Start, watch, restart and stop the worker processes."""

    def __init__(self, settings: TokenizerSettings, processes: int, *, idle_exit_s: float | None = None):
        self.settings = settings
        self.processes = processes
        self.idle_exit_s = idle_exit_s
        self.ctx = mp.get_context("fork")
        self.children: dict[int, mp.Process] = {}
        self.restarts = 0
        self.stopping = False

    def _start(self, slot: int) -> None:
        p = self.ctx.Process(target=_child, args=(self.settings.model_dump_json(), slot, self.idle_exit_s),
                             name=f"dflash-tokenizer-{slot}", daemon=False)
        p.start()
        self.children[slot] = p
        log.info("tokenizer process started", extra={"slot": slot, "pid": p.pid})

    def pids(self) -> list[int]:
        return [p.pid for p in self.children.values() if p.is_alive()]

    def stop(self) -> None:
        self.stopping = True
        for p in self.children.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    def run(self, tick: Callable[[], bool] | None = None, tick_s: float = 0.25) -> int:
        """Run until every process has exited. ``tick()`` is called periodically; True stops the pool."""
        def on_signal(_count, _signum):
            if self.stopping:
                for p in self.children.values():
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
            self.stop()

        with StopSignals(on_signal):  # the caller's handlers come back when the pool is done
            return self._watch(tick, tick_s)

    def _watch(self, tick: Callable[[], bool] | None, tick_s: float) -> int:
        for slot in range(self.processes):
            self._start(slot)
        while self.children:
            time.sleep(tick_s)
            if tick and not self.stopping and tick():
                self.stop()
            for slot, p in list(self.children.items()):
                if p.is_alive():
                    continue
                p.join()
                del self.children[slot]
                if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                    from prometheus_client import multiprocess

                    multiprocess.mark_process_dead(p.pid)
                if p.exitcode != 0 and not self.stopping:
                    log.error("tokenizer process died; starting it again",
                              extra={"slot": slot, "pid": p.pid, "exitcode": p.exitcode})
                    self.restarts += 1
                    time.sleep(self.settings.restart_delay_s)
                    self._start(slot)
        return self.restarts
