"""Run one tokenize job from the command line: submit it, run the pool here, show progress."""

from __future__ import annotations

import time

from dfp_shared.jobs.redis_conn import connect
from dfp_shared.jobs.store import JobRecord, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.types import TOKENIZE
from dfp_shared.storage.roots import parent_prefix, parse_prefixes

from .pool import Pool
from .progress import progress_bar, timing, watching
from .settings import TokenizerSettings


def run_job(settings: TokenizerSettings, spec: dict, started: float | None = None) -> tuple[JobRecord, dict]:
    """Submit ``spec`` as a tokenize job and consume it with ``settings.process_count()`` processes; returns the
    job's record and its timing (start-up from ``started``, the command's start, then tokenization)."""
    started = started or time.time()
    # a local run is the operator's own: the storage its command line names is allowed storage
    named = [spec[f] for f in ("input", "output", "tokenizer") if spec.get(f)]
    settings = settings.model_copy(update={"allowed_prefixes": ",".join(
        [*parse_prefixes(settings.allowed_prefixes), *(parent_prefix(u) for u in named)])})
    r = connect(settings.redis_url)
    job, _ = queue_job(r, TOKENIZE.name, spec)
    jobs = JobStore(r)
    with progress_bar() as bar:
        watch = watching(jobs, job.id, bar)
        Pool(settings, settings.process_count()).run(tick=watch.tick)
        watch.tick()
    rec = jobs.get(job.id)
    return rec, timing(rec, watch.work_start, started)
