"""The CLI's (and the demo's) watch display ends on the job's final counts, every stage complete, even
though a stage's last progress event came before it finished; metric points show the latest figures."""

from __future__ import annotations

import time

from dfp_cli.client_view import WatchView, figures
from dfp_shared.jobs.store import JobRecord, JobState
from rich.console import Console
from rich.progress import Progress, TextColumn

UNITS = {"generate": ("completions", {"completions": 32, "tasks": 3, "shards": 2}),
         "tokenize": ("files", {"files": 2, "tasks": 3, "samples": 32}),
         "train": ("steps", {"steps": 20})}


def _record(stage: str, share: float, state: JobState, **extra) -> dict:
    primary, totals = UNITS[stage]
    now = time.time()
    rec = JobRecord(id=f"{stage}-job", type=stage, state=state, spec={}, created_at=now - 10, started_at=now - 9,
                    finished_at=now if state.terminal else None, primary_unit=primary, totals=totals,
                    counters={**{u: int(t * share) for u, t in totals.items()}, **extra})
    return rec.to_dict()


def _display(feed) -> str:
    console = Console(record=True, width=200, force_terminal=False)
    with Progress(TextColumn("{task.description:>22}"), TextColumn("{task.completed:.0f}/{task.fields[total_text]}"),
                  TextColumn("{task.fields[note]}"), console=console, auto_refresh=False) as progress:
        feed(WatchView(progress))
    return console.export_text()


def test_the_final_display_shows_every_stage_complete():
    def feed(view: WatchView) -> None:
        view.show("generate:", _record("generate", 17 / 32, JobState.running))  # the last event of the stage
        view.show("tokenize:", _record("tokenize", 0.5, JobState.running))
        stages = {s: _record(s, 1.0, JobState.succeeded, **({"loss": 2.5, "tau": 1.75} if s == "train" else {}))
                  for s in UNITS}
        pipeline = JobRecord(id="p", type="pipeline", state=JobState.succeeded, spec={}, created_at=1.0,
                             started_at=1.0, finished_at=2.0, totals={"stages": 3}, counters={"stages": 3},
                             primary_unit="stages").to_dict()
        view.finish(pipeline, stages)

    text = _display(feed)
    for stage, (_, totals) in UNITS.items():
        for unit, total in totals.items():
            line = next(line for line in text.splitlines() if line.strip().startswith(f"{stage}:{unit} "))
            assert f"{total}/{total}" in line, line
    assert "17/32" not in text and "stages 3/3" in " ".join(text.split())
    assert "loss 2.5  tau 1.75" in text  # the train stage's latest figures beside its steps


def test_figures_of_a_metric_point():
    assert figures({"step": 40, "loss": 3.2101, "accuracy": 0.31, "tau": 1.8, "lr": 1e-3}) == \
        "loss 3.21  accuracy 0.31  tau 1.8"


def test_a_log_file_or_an_80_column_pipe_gets_whole_lines_not_a_cut_table():
    import io

    from dfp_cli.client_view import LineProgress, live_table_fits

    out = io.StringIO()
    console = Console(file=out, width=80)
    assert not live_table_fits(console)  # a file: plain lines
    assert not live_table_fits(Console(file=io.StringIO(), width=80, force_terminal=True))  # too narrow a terminal
    assert live_table_fits(Console(file=io.StringIO(), width=160, force_terminal=True))
    with LineProgress(console) as progress:
        view = WatchView(progress)
        for share in (0.0, 0.05, 0.5, 1.0):
            view.show("generate:", _record("generate", share, JobState.running))
        view.finish(_record("generate", 1.0, JobState.succeeded), {
            "train": _record("train", 1.0, JobState.succeeded, loss=2.5, tau=1.75)})
    text = out.getvalue()
    assert "…" not in text
    final = [line.strip() for line in text.splitlines()[-7:]]  # every bar's final counts, one line each
    assert any(line.startswith("generate:completions 32/32 (100%)") for line in final), final
    assert any(line.startswith("train:steps 20/20 (100%)") and "tau 1.75" in line for line in final), final
    assert text.count("generate:completions") < 8  # lines when a bar moves by a tenth, not at every event
