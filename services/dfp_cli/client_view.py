"""Terminal views of jobs for the client: a table, one job's details, and live progress bars.

What the API answers may quote users' text (errors naming files, URIs): every view prints it without
control characters (:func:`~dfp_shared.printable.printable_tree`) and as text, never as markup.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timezone

import click
from dfp_shared.api_client import Api, sse_events
from dfp_shared.printable import printable, printable_tree
from dfp_shared.specs import PipelineSpec
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

console = Console(highlight=False)
TERMINAL = {"succeeded", "failed", "cancelled"}


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _num(v) -> str:
    return "-" if v is None else (f"{v:.0f}" if float(v).is_integer() else f"{v:.2f}")


def job_table(page: dict) -> None:
    table = Table(title=f"{len(page['items'])} of {page['total']} jobs")
    for col in ("id", "type", "state", "progress", "created (UTC)", "error"):
        table.add_column(col)
    for job in page["items"]:
        p = job["progress"]
        frac = "-" if p["fraction"] is None else f"{100 * p['fraction']:.0f}% {p['primary_unit']}"
        table.add_row(escape(job["id"]), job["type"] + (f" ({job['stage']})" if job.get("stage") else ""),
                      job["state"], frac, _when(job["created_at"]), escape((job.get("error") or "")[:60]))
    console.print(table)


def show(data: dict, as_json: bool, view: Callable[[dict], None]) -> None:
    """``data`` as indented JSON, or through ``view`` (one of the views here)."""
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        view(printable_tree(data))


def job_line(job: dict, note: str = "") -> None:
    """One line: id, type and state (and ``note``)."""
    click.echo(printable(f"{job['id']}  {job['type']}  {job['state']}{note}"))


def job_view(job: dict) -> None:
    p = job["progress"]
    console.print(f"[bold]{escape(job['id'])}[/bold]  {job['type']}  [bold]{job['state']}[/bold]")
    console.print(f"  created {_when(job['created_at'])}  started {_when(job['started_at'])}  "
                  f"finished {_when(job['finished_at'])}")
    for unit, u in p["units"].items():
        console.print(f"  {unit:>12}: {_num(u['done'])} / {_num(u['total'])}  ({_num(u['rate_per_s'])}/s)")
    if p.get("eta_s") is not None:
        console.print(f"  ETA {p['eta_s']:.0f} s")
    if job.get("error"):
        console.print(f"  [red]error:[/red] {escape(job['error'])}")
    for name, value in job.get("outputs", {}).items():
        console.print(f"  output {name}: {value}", markup=False)
    console.print("  spec: " + json.dumps(job["spec"]), markup=False)


FIGURES = ("loss", "accuracy", "heldout_loss", "tau")


def figures(values: dict) -> str:
    """The latest training figures of a metric point or a train job's counters: ``loss 3.21  tau 1.80``."""
    return "  ".join(f"{k} {values[k]:.4g}" for k in FIGURES if isinstance(values.get(k), (int, float)))


class WatchView:
    """Progress bars of a job (and of a pipeline's stages, prefixed ``<stage>:``), kept to the last counts."""

    def __init__(self, progress: Progress):
        self.progress, self.bars = progress, {}

    def show(self, prefix: str, record: dict) -> None:
        units = record["progress"]["units"]
        primary = record["progress"].get("primary_unit")
        latest = figures({k: u["done"] for k, u in units.items()})
        for unit, u in units.items():
            if u["total"] is None and unit != primary:
                continue
            name = f"{prefix}{unit}"
            total = u["total"]
            if name not in self.bars:
                self.bars[name] = self.progress.add_task(name, total=total, total_text=_num(total), note="")
            rate = u["rate_per_s"]
            note = (f"{rate:.2f}/s" if rate else "") + (f"  {latest}" if latest and unit == primary else "")
            self.progress.update(self.bars[name], completed=u["done"], total=total, total_text=_num(total), note=note)

    def finish(self, job: dict, stages: dict[str, dict]) -> None:
        """End on the job's final counts, and each stage's (events stop once a stage is over)."""
        self.show("", job)
        for name, record in stages.items():
            self.show(f"{name}:", record)


class LineProgress:
    """Progress as plain lines, for a log file, a pipe or a narrow terminal, where a live table's columns
    would be cut to ``…``: a line when a bar moves by a tenth of its total, and every bar's final counts at
    the end, each on its own line and never cut. Offers what :class:`WatchView` uses of a rich ``Progress``."""

    STEP = 0.1  # share of a bar's total between two lines

    def __init__(self, console: Console):
        self.console, self.tasks, self.printed = console, {}, {}

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        for name in self.tasks:
            self.console.print(self._line(name), markup=False, highlight=False, soft_wrap=True)

    def add_task(self, name: str, total=None, **fields) -> str:
        self.tasks[name] = {"completed": 0, "total": total, **fields}
        return name

    def update(self, task: str, completed=0, total=None, **fields) -> None:
        self.tasks[task].update(completed=completed, total=total, **fields)
        last, step = self.printed.get(task), (total or 0) * self.STEP
        if last is None or (step and completed - last >= step):
            self.printed[task] = completed
            self.console.print(self._line(task), markup=False, highlight=False, soft_wrap=True)

    def _line(self, name: str) -> str:
        t = self.tasks[name]
        share = f" ({100 * t['completed'] / t['total']:.0f}%)" if t["total"] else ""
        note = f"  {t['note']}" if t.get("note") else ""
        return f"{name:>22} {t['completed']:.0f}/{t.get('total_text', _num(t['total']))}{share}{note}"


def live_table_fits(con: Console) -> bool:
    """Whether a live progress table is readable on ``con``: a terminal at least 100 columns wide."""
    return con.is_terminal and con.width >= 100


def stage_records(api: Api, job: dict) -> dict[str, dict]:
    """A pipeline's stage jobs as they are now, by stage name (empty for other jobs)."""
    return {s: api.call("GET", f"/v1/jobs/{job['outputs'][f'{s}_job']}").json()
            for s in PipelineSpec.STAGES if f"{s}_job" in (job.get("outputs") or {})}


def watch_job(api: Api, job_id: str) -> int:
    """Live progress bars from the job's events until it ends, then its final counts; returns 0 if it
    succeeded, else 1."""
    job = printable_tree(api.call("GET", f"/v1/jobs/{job_id}").json())
    console.print(f"watching {job_id} ({job['type']})", markup=False)
    final = job
    table = live_table_fits(console)
    with (Progress(TextColumn("{task.description:>16}"), BarColumn(), TaskProgressColumn(),
                   TextColumn("{task.completed:.0f}/{task.fields[total_text]}"), TimeRemainingColumn(),
                   TextColumn("{task.fields[note]}"), console=console, transient=False)
          if table else LineProgress(console)) as progress:
        view = WatchView(progress)
        for event, _, data in sse_events(api, job_id):
            data = printable_tree(data)
            if event == "progress":
                view.show("", {"progress": data["progress"]})
                if data.get("stage"):  # a pipeline's current stage
                    view.show(f"{data['stage']['name']}:", data["stage"])
            elif event == "metrics":
                progress.console.print(f"step {data['step']}  {figures(data)}")
            elif event == "state":
                progress.console.print(f"state: {data.get('previous', '-')} -> {data['state']}"
                                       + (f"  {data['error']}" if data.get("error") else ""), markup=False)
            elif event == "stage":
                progress.console.print(f"stage {data['stage']} started: job {data['job_id']}", markup=False)
            elif event == "end":
                final = data
        record = printable_tree(api.call("GET", f"/v1/jobs/{job_id}").json())
        view.finish(record, stage_records(api, record))
    state = final["state"]
    colour = "green" if state == "succeeded" else "red"
    console.print(f"[{colour}]{escape(job_id)} {state}[/{colour}]"
                  + (f": {escape(final['error'])}" if final.get("error") else ""))
    for name, value in (final.get("outputs") or {}).items():
        console.print(f"  output {name}: {value}", markup=False)
    return 0 if state == "succeeded" else 1
