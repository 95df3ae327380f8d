"""Users' text never reaches a terminal as control sequences: job errors are stored without them, and
every client view prints what the API answers without them (even a record written before that rule)."""

from __future__ import annotations

import json

from dfp_shared.jobs.flow import finish_job
from dfp_shared.jobs.store import JobStore
from dfp_shared.printable import printable

from .conftest import WRITE_KEY
from .test_cli import cli, server  # noqa: F401 - the real API server fixture

ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[31m\r\x9b6n\u202e"
NAME = f"blk.0.attn_q.weight{ESCAPES}[red]x[/red]"


def _submitted(url: str) -> str:
    made = cli(url, WRITE_KEY, "submit", "generate", "--prompts", "s3://bucket/prompts/", "--output", "s3://bucket/o",
               "--model", "/models/tiny", "--json")
    assert made.returncode == 0, made.stderr
    return json.loads(made.stdout)["id"]


def _controls(text: str) -> list[str]:
    return sorted({c for c in text if c != printable(c)})


def test_a_job_error_is_stored_without_control_characters(server, redis_client):  # noqa: F811
    url, _ = server
    job_id = _submitted(url)
    finish_job(redis_client, job_id, "failed", error=f"refused: x.gguf: two tensors named {NAME!s}")
    stored = JobStore(redis_client).get(job_id).error
    assert _controls(stored) == [] and "two tensors named blk.0.attn_q.weight]0;pwned[2J[31m6n" in stored
    events = redis_client.xrange(f"dfp:job:{job_id}:events")
    assert all(_controls(fields["data"]) == [] for _, fields in events)


def test_no_client_view_prints_a_control_sequence(server, redis_client):  # noqa: F811
    url, _ = server
    job_id = _submitted(url)
    finish_job(redis_client, job_id, "failed", error="placeholder")
    # a record written some other way (an older worker, straight into Redis) still holds them
    redis_client.hset(f"dfp:job:{job_id}", mapping={"error": f"two tensors named {NAME}",
                                                     "outputs": json.dumps({"model": f"s3://bucket/{ESCAPES}"})})
    for args in (("status", job_id), ("jobs",), ("status", job_id, "--watch"), ("cancel", job_id)):
        shown = cli(url, WRITE_KEY, *args)
        assert _controls(shown.stdout + shown.stderr) == [], (args, shown.stdout, shown.stderr)
    shown = cli(url, WRITE_KEY, "status", job_id)
    assert "two tensors named blk.0.attn_q.weight]0;pwned[2J[31m6n[red]x[/red]" in shown.stdout  # text, not markup
    as_json = cli(url, WRITE_KEY, "status", job_id, "--json")
    assert _controls(as_json.stdout) == [] and json.loads(as_json.stdout)["error"].endswith("[red]x[/red]")
