"""Run one tokenize job from the command line: submit it, run the pool here, show progress."""

from __future__ import annotations

from dfp_shared.jobs import JobRecord, JobStore
from dfp_shared.redis_conn import connect
from dfp_shared.submit import submit_job

from .pool import Pool
from .progress import progress_bar, watching
from .settings import TokenizerSettings


def run_job(settings: TokenizerSettings, spec: dict) -> JobRecord:
    """Submit ``spec`` as a tokenize job and consume it with ``settings.process_count()`` processes."""
    r = connect(settings.redis_url)
    job, _ = submit_job(r, "tokenize", spec)
    jobs = JobStore(r)
    with progress_bar() as bar:
        tick = watching(jobs, job.id, bar)
        Pool(settings, settings.process_count()).run(tick=tick)
        tick()
    return jobs.get(job.id)
