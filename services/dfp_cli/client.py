"""The job client: ``dflash-pipeline submit | jobs | status | cancel`` over the REST API.

The API URL and key come from ``--api-url`` / ``--api-key`` or ``DFLASH_API_URL`` /
``DFLASH_API_KEY``. A spec comes from a YAML/JSON file (``-f``), ``--set field=value`` pairs
(dotted for pipeline stages: ``--set tokenize.output=s3://...``) and the per-field flags of the
job type (``submit generate --prompts ... --output ... --model ...``), later ones winning.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path

import click
import yaml
from dfp_shared.api_client import DEFAULT_URL, Api
from dfp_shared.cli_support import apply_assignments, put_field
from dfp_shared.jobs.types import JOB_TYPES

from dfp_cli.client_view import job_line, job_table, job_view, show, watch_job


def api_options(fn):
    fn = click.option("--api-key", envvar="DFLASH_API_KEY", default=None, show_envvar=True,
                      help="API key (bearer token).")(fn)
    fn = click.option("--api-url", envvar="DFLASH_API_URL", default=DEFAULT_URL, show_default=True,
                      show_envvar=True, help="Base URL of the API.")(fn)
    return fn


def build_spec(spec_file: str | None, sets: tuple[str, ...], fields: dict) -> dict:
    spec: dict = {}
    if spec_file:
        text = sys.stdin.read() if spec_file == "-" else Path(spec_file).read_text()
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise click.BadParameter(f"{spec_file}: not valid YAML/JSON: {exc}", param_hint="--file") from None
        if not isinstance(loaded, dict):
            raise click.BadParameter(f"{spec_file}: expected a mapping of spec fields", param_hint="--file")
        spec = loaded.get("spec", loaded) if set(loaded) <= {"type", "spec"} and "spec" in loaded else loaded
    apply_assignments(spec, sets, "--set")
    for name, value in fields.items():
        if value is None or value == ():
            continue
        if isinstance(value, tuple):  # a stage mapping given as repeated KEY=VALUE
            apply_assignments(spec, value, f"--{name}", prefix=name)
        else:
            put_field(spec, name, value)
    return spec


def _required(ann):
    """``X`` of an optional ``X | None`` (a pipeline's generate stage), else ``ann``."""
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    return args[0] if isinstance(ann, types.UnionType) and len(args) == 1 else ann


def _field_option(name: str, info) -> click.Option:
    flag = "--" + name.replace("_", "-")
    help_text = info.description or name
    ann = _required(info.annotation)
    if ann is dict or getattr(ann, "__origin__", None) is dict:
        return click.Option([flag, name], multiple=True, metavar="KEY=VALUE",
                            help=f"{help_text} (repeatable KEY=VALUE).")
    if getattr(ann, "__origin__", None) is list:
        return click.Option([flag, name], multiple=True, help=f"{help_text} (repeatable).")
    if ann is bool:
        return click.Option([f"{flag}/--no-{name.replace('_', '-')}", name], default=None, help=help_text)
    kind = {int: click.INT, float: click.FLOAT}.get(ann, click.STRING)
    return click.Option([flag, name], type=kind, default=None, help=help_text)


def _submit_command(job_type: str) -> click.Command:
    model = JOB_TYPES[job_type].spec

    lists = {name for name, info in model.model_fields.items() if getattr(info.annotation, "__origin__", None) is list}

    def run(api_url, api_key, spec_file, sets, idempotency_key, watch, as_json, **fields):
        fields = {k: (list(v) or None if k in lists else v) for k, v in fields.items()}  # a repeated flag: a list
        spec = build_spec(spec_file, sets, fields)
        api = Api(api_url, api_key)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        resp = api.call("POST", "/v1/jobs", json={"type": job_type, "spec": spec}, headers=headers)
        job = resp.json()
        replay = " (already submitted with this idempotency key)" if resp.status_code == 200 else ""
        show(job, as_json, lambda record: job_line(record, replay))
        if watch:
            sys.exit(watch_job(api, job["id"]))

    params = [
        click.Option(["-f", "--file", "spec_file"], default=None, help="Spec as a YAML or JSON file ('-' = stdin)."),
        click.Option(["--set", "sets"], multiple=True, metavar="FIELD=VALUE",
                     help="Set a spec field (dotted for nested fields); repeatable."),
        click.Option(["--idempotency-key"], default=None, help="Retries with the same key return the same job."),
        click.Option(["--watch/--no-watch"], default=False, help="Follow the job's progress until it ends."),
        click.Option(["--json", "as_json"], is_flag=True, help="Print the job as JSON."),
        *[_field_option(name, info) for name, info in model.model_fields.items()],
    ]
    cmd = click.Command(job_type, params=params, callback=run,
                        help=f"Submit {'an' if job_type[0] in 'aeiou' else 'a'} {job_type} job (spec fields below, or -f / --set).")
    return api_options(cmd)


class _SubmitGroup(click.Group):
    def list_commands(self, ctx):
        return list(JOB_TYPES)

    def get_command(self, ctx, name):
        return _submit_command(name) if name in JOB_TYPES else None


@click.group(cls=_SubmitGroup)
def submit():
    """Submit a job: generate, tokenize, train, pipeline, evaluate, cache or import_gguf."""


@click.command()
@api_options
@click.option("--state", default=None, help="Only jobs in this state.")
@click.option("--type", "job_type", default=None, help="Only jobs of this type.")
@click.option("--limit", type=int, default=20, show_default=True)
@click.option("--offset", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the page as JSON.")
def jobs(api_url, api_key, state, job_type, limit, offset, as_json):
    """List jobs, newest first."""
    params = {k: v for k, v in {"state": state, "type": job_type, "limit": limit, "offset": offset}.items()
              if v is not None}
    show(Api(api_url, api_key).call("GET", "/v1/jobs", params=params).json(), as_json, job_table)


@click.command()
@api_options
@click.argument("job_id")
@click.option("--watch", is_flag=True, help="Live progress bars until the job ends; exit 1 unless it succeeds.")
@click.option("--json", "as_json", is_flag=True, help="Print the job as JSON.")
def status(api_url, api_key, job_id, watch, as_json):
    """Show a job: state, progress, rate, ETA, error and outputs."""
    api = Api(api_url, api_key)
    if watch:
        sys.exit(watch_job(api, job_id))
    show(api.call("GET", f"/v1/jobs/{job_id}").json(), as_json, job_view)


@click.command()
@api_options
@click.argument("job_id")
def cancel(api_url, api_key, job_id):
    """Cancel a queued or running job (a pipeline also cancels its running stage)."""
    job_line(Api(api_url, api_key).call("POST", f"/v1/jobs/{job_id}/cancel").json())
