"""A terminal progress bar over a tokenize job's record: files, samples, tokens, tokens/s, ETA; tokens/s
count from the files' start, the start-up before it shown apart."""

from __future__ import annotations

import time

from dfp_shared.jobs.store import JobStore
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def work_started_at(jobs: JobStore, job_id: str) -> float | None:
    """When the job's files began (its ``planned`` event, in epoch seconds): the start-up before it (processes,
    tokenizer, plan) is not tokenization."""
    for event_id, kind, _ in jobs.events(job_id, count=20):
        if kind == "planned":
            return int(event_id.split("-")[0]) / 1000
    return None


def timing(rec, work_start: float | None, started: float) -> dict:
    """Seconds of start-up (from ``started``, the command's start, to the files' start) and of tokenization,
    and tokens per second of tokenization alone."""
    end = rec.finished_at or time.time()
    work_s = max(1e-9, end - work_start) if work_start else None
    return {"startup_s": round(work_start - started, 3) if work_start else None,
            "tokenize_s": round(work_s, 3) if work_s else None,
            "tokens_per_s": round(rec.counters.get("tokens", 0) / work_s, 1) if work_s else None}


def job_line(rec, work_start: float | None = None) -> str:
    prog = rec.progress()
    c = rec.counters
    rate = (timing(rec, work_start, work_start)["tokens_per_s"] if work_start
            else prog["units"].get("tokens", {}).get("rate_per_s")) or 0.0
    eta = prog.get("eta_s")
    return (f"{int(c.get('samples', 0))} samples, {int(c.get('tokens', 0))} tokens, {rate:,.0f} tok/s, "
            f"{int(c.get('bad_lines', 0))} bad lines" + (f", ETA {eta:.0f}s" if eta is not None else ""))


class JobProgress:
    """``tick()`` refreshes the bar from Redis and returns True once the job has finished."""

    def __init__(self, jobs: JobStore, job_id: str, progress: Progress):
        self.jobs, self.job_id, self.bar = jobs, job_id, progress
        self.task = progress.add_task("tokenize", total=None, line="queued")
        self.record = None
        self.work_start: float | None = None

    def tick(self) -> bool:
        rec = self.record = self.jobs.get(self.job_id)
        if self.work_start is None:
            self.work_start = work_started_at(self.jobs, self.job_id)
        total = rec.totals.get("files")
        self.bar.update(self.task, total=total, completed=rec.counters.get("files", 0),
                        line=job_line(rec, self.work_start))
        return rec.state.terminal


def progress_bar() -> Progress:
    return Progress(TextColumn("[bold]tokenize files"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[line]}"),
                    TimeElapsedColumn(), transient=False)


def watching(jobs: JobStore, job_id: str, progress: Progress) -> JobProgress:
    return JobProgress(jobs, job_id, progress)
