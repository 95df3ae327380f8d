"""A terminal progress bar over a tokenize job's record: files, samples, tokens, tokens/s, ETA."""

from __future__ import annotations

from collections.abc import Callable

from dfp_shared.jobs import JobStore
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def job_line(rec) -> str:
    prog = rec.progress()
    c = rec.counters
    rate = prog["units"].get("tokens", {}).get("rate_per_s") or 0.0
    eta = prog.get("eta_s")
    return (f"{int(c.get('samples', 0))} samples, {int(c.get('tokens', 0))} tokens, {rate:,.0f} tok/s, "
            f"{int(c.get('bad_lines', 0))} bad lines" + (f", ETA {eta:.0f}s" if eta is not None else ""))


class JobProgress:
    """``tick()`` refreshes the bar from Redis and returns True once the job has finished."""

    def __init__(self, jobs: JobStore, job_id: str, progress: Progress):
        self.jobs, self.job_id, self.bar = jobs, job_id, progress
        self.task = progress.add_task("tokenize", total=None, line="queued")
        self.record = None

    def tick(self) -> bool:
        rec = self.record = self.jobs.get(self.job_id)
        total = rec.totals.get("files")
        self.bar.update(self.task, total=total, completed=rec.counters.get("files", 0), line=job_line(rec))
        return rec.state.terminal


def progress_bar() -> Progress:
    return Progress(TextColumn("[bold]tokenize files"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[line]}"),
                    TimeElapsedColumn(), transient=False)


def watching(jobs: JobStore, job_id: str, progress: Progress) -> Callable[[], bool]:
    return JobProgress(jobs, job_id, progress).tick
