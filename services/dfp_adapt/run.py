"""One adaptation run: captured traffic in, a candidate drafter trained, evaluated and promoted or refused.

1. :func:`~dfp_adapt.source.prepare_source` splits the window's records under the run's prefix:
   greedy records to train on as they are, sampled ones to regenerate (or train on as they are), and the
   newest share as held-out prompts;
2. a ``generate`` job answers the sampled prompts greedily; its completions join the greedy records;
3. a ``pipeline`` job (tokenize, then train warm-started from the served drafter's current version);
4. two ``evaluate`` jobs on the held-out prompts: the candidate, and the served version (both report n-gram
   speculation beside them); with no drafter served yet, n-gram speculation is the baseline;
5. :func:`~dfp_adapt.rule.decide` on the paired per-prompt τ; the served store promotes the
   candidate or records the refusal, with the evidence.

Every job goes through the API with the caller's key (its checks of roots, owners and bounds apply); the run
reads and writes its own prefix and the served store directly, inside the storage roots, after claiming both
for the key's principal as a job claims its output.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from dfp_shared.specs.evaluate import EvaluateSpec
from dfp_shared.storage.ownership import MARKER, OutputClaims
from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import NotFound, open_store, split_uri, visible

from dfp_adapt.served_store import ServedDrafters
from dfp_adapt.serving import NONE, Option, judge, ngram_config, read_drafter_config
from dfp_adapt.settings import AdaptSettings
from dfp_adapt.source import prepare_source, window

log = logging.getLogger(__name__)
TERMINAL = ("succeeded", "failed", "cancelled")
MAX_REPORT_BYTES = 64 << 20
STAGE_FIELDS = ("generate", "tokenize", "train", "evaluate")


class AdaptError(RuntimeError):
    """A run that cannot go on (a job failed, a window without data); the message says why."""


class JobsApi:
    """Submit a job and wait for it to end, through the REST API (``api`` is a :class:`~dfp_shared.api_client.Api`)."""

    def __init__(self, api, poll_s: float, timeout_s: float):
        self.api, self.poll_s, self.timeout_s = api, poll_s, timeout_s
        self.job_ids: list[str] = []  # every job this run submitted, in order (a failure's record names them)

    def whoami(self) -> str:
        """The key's principal: the owner of the run's jobs, and of the run's prefix and the served store."""
        caller = self.api.call("GET", "/v1/whoami").json()
        if "write" not in caller["scopes"]:
            raise AdaptError(f"the API key {caller['name']!r} cannot submit jobs (scopes {caller['scopes']}); "
                             "an adapt run needs a key with the write scope")
        return caller["name"]

    def run(self, job_type: str, spec: dict) -> dict:
        job = self.api.call("POST", "/v1/jobs", json={"type": job_type, "spec": spec}).json()
        self.job_ids.append(job["id"])
        log.info("adapt job submitted", extra={"job_id": job["id"], "type": job_type})
        deadline = time.monotonic() + self.timeout_s
        while job["state"] not in TERMINAL:
            if time.monotonic() > deadline:
                raise AdaptError(f"{job_type} job {job['id']} still {job['state']} after {self.timeout_s:.0f} s")
            time.sleep(self.poll_s)
            job = self.api.call("GET", f"/v1/jobs/{job['id']}").json()
        if job["state"] != "succeeded":
            raise AdaptError(f"{job_type} job {job['id']} {job['state']}: {job.get('error') or ''}".rstrip(": "))
        return job


@dataclass
class RunPlan:
    """Where one run reads and writes: all inside the storage roots."""

    capture: str
    run: str  # the run's own prefix
    served: ServedDrafters
    stages: dict  # the stages' spec fields (generate, tokenize, train, evaluate)
    roots: StorageRoots

    def output(self, job: dict, name: str, under: str) -> str:
        """A finished job's output ``name``, read from the job record only when it lies under the run's ``under``
        prefix where the run asked for it (a job record is not trusted with where the run reads or promotes from)."""
        return self.roots.check_inside(job["outputs"][name], self.run + under, f"{job.get('type', 'job')} output {name}")


def plan_run(settings: AdaptSettings, stages: dict, owner: str, now: datetime | None = None) -> RunPlan:
    """The run's locations, each checked against the storage roots; the run's prefix and the served store are
    claimed for ``owner`` (the key's principal) as a job's output is, so no other principal's job can write there
    and a served store another principal holds is refused."""
    roots = StorageRoots.from_settings(settings)
    unknown = set(stages) - set(STAGE_FIELDS)
    if unknown:
        raise AdaptError(f"adapt spec: unknown stages {sorted(unknown)}; expected some of {list(STAGE_FIELDS)}")
    capture = roots.check(settings.capture(), "adapt capture prefix")
    served = roots.check(settings.served(), "adapt served location")
    stamp = (now or datetime.now(timezone.utc)).strftime(RUN_STAMP)
    run = roots.check(f"{settings.runs().rstrip('/')}/{settings.adapt_name}/{stamp}/", "adapt runs prefix")
    roots.check_explicit_output(run, "adapt runs prefix")
    drafters = ServedDrafters(served, settings.adapt_name, settings.s3_endpoint_url)
    # prefixes the operator keeps for another principal: refused before anything is claimed for this one
    roots.check_reserved(drafters.uri, owner, "adapt served location")
    roots.check_reserved(run, owner, "adapt runs prefix")
    claims = OutputClaims(roots, settings.s3_endpoint_url)
    claims.claim(drafters.uri, owner, f"adapt-{stamp}", "adapt served location")
    claims.claim(run, owner, f"adapt-{stamp}", "adapt runs prefix")
    return RunPlan(capture, run, drafters, stages, roots)


RUN_STAMP = "%Y%m%dT%H%M%S"
_RUN_STAMP_RE = re.compile(r"^[0-9]{8}T[0-9]{6}$")


def _run_start(stamp: str) -> datetime | None:
    if not _RUN_STAMP_RE.match(stamp):
        return None
    try:
        return datetime.strptime(stamp, RUN_STAMP).replace(tzinfo=timezone.utc)
    except ValueError:  # a stamp's shape but no date (20261399T...): not a run
        return None


def _run_owner(store, stamp: str) -> str | None:
    try:
        with store.open_read(f"{stamp}/{MARKER}") as f:
            owner = json.loads(f.read(4096)).get("owner")
    except (NotFound, ValueError, AttributeError):
        return None
    return owner if isinstance(owner, str) else None


def sweep_old_runs(runs: str, retention_hours: float, now: datetime, owner: str,
                   endpoint_url: str | None = None) -> list[str]:
    """Delete the runs under ``runs`` (``<runs>/<name>/``) of ``owner`` (the marker a run claims its prefix with)
    that started more than ``retention_hours`` before ``now``, whole: their data are copies of captured traffic,
    kept no longer than the traffic itself (promoted drafters live on under the served store, the evidence in its
    history). Returns the deleted runs' stamps."""
    store = open_store(runs, endpoint_url=endpoint_url)
    cutoff = now - timedelta(hours=retention_hours)
    keys: dict[str, list[str]] = {}
    for key in store.list(""):
        stamp, _, rest = key.partition("/")
        if rest:
            keys.setdefault(stamp, []).append(key)
    swept = []
    for stamp, run_keys in sorted(keys.items()):
        started = _run_start(stamp)
        if started is None or started >= cutoff or _run_owner(store, stamp) != owner:
            continue
        folders = {stamp} | {k.rpartition("/")[0] for k in run_keys}
        for key in run_keys + [f"{folder}/{MARKER}" for folder in sorted(folders)]:
            store.delete(key)
        swept.append(stamp)
        log.info("adapt run swept", extra={"run": f"{runs.rstrip('/')}/{stamp}/", "objects": len(run_keys)})
    return swept


def _copy_completions(completions: str, data: str, endpoint_url: str | None) -> int:
    """The generate job's completion files into the run's data prefix (beside the greedy records)."""
    src, dst = open_store(completions, endpoint_url=endpoint_url), open_store(data, endpoint_url=endpoint_url)
    keys = [k for k in visible(src.list("")) if k.endswith(".jsonl")]
    for key in keys:
        dst.put("generated-" + key.replace("/", "-"), src.get(key))
    return len(keys)


def _per_prompt(report_uri: str, endpoint_url: str | None) -> tuple[dict[str, float], dict[str, float]]:
    """Per-prompt τ of the drafter and of n-gram speculation from an evaluate job's report."""
    root, key = split_uri(report_uri)
    with open_store(root, endpoint_url=endpoint_url).open_read(key) as f:
        data = f.read(MAX_REPORT_BYTES + 1)
    if len(data) > MAX_REPORT_BYTES:
        raise AdaptError(f"{report_uri}: larger than {MAX_REPORT_BYTES} bytes")
    rows = json.loads(data)["sets"][0]["per_prompt"]
    return ({str(r["id"]): float(r["tau_dflash"]) for r in rows}, {str(r["id"]): float(r["tau_ngram"]) for r in rows})


def _evaluate(jobs: JobsApi, plan: RunPlan, drafter: str, heldout: str, prompts: int, name: str,
              endpoint_url: str | None) -> tuple[dict, dict]:
    spec = {**plan.stages.get("evaluate", {}), "drafter": drafter, "prompts": [heldout], "output": plan.run + name + "/",
            "max_prompts": prompts}
    job = jobs.run("evaluate", spec)
    return _per_prompt(plan.output(job, "report", name + "/"), endpoint_url)


def train_candidate(jobs: JobsApi, plan: RunPlan, split, endpoint_url: str | None, stage: list) -> tuple[dict, int | None]:
    """Regenerate (if any), tokenize and train; returns the pipeline job and the drafter version it started from
    (the one served, or the last one that was)."""
    if split.regenerate:
        stage[0] = "generate"
        gen = jobs.run("generate", {**plan.stages.get("generate", {}), "prompts": split.regenerate,
                                    "output": plan.run + "generated/", "temperature": 0.0})
        _copy_completions(plan.output(gen, "completions", "generated/"), split.data, endpoint_url)
    stage[0] = "pipeline"
    start_version = plan.served.latest_drafter()
    train = {**plan.stages.get("train", {}), "output": plan.run + "train/"}
    if start_version is not None:
        train["init_from"] = plan.served.version_uri(start_version)
    pipeline = jobs.run("pipeline", {"tokenize": {**plan.stages.get("tokenize", {}), "input": split.data,
                                                  "output": plan.run + "tokens/"}, "train": train})
    return pipeline, start_version


def _options(jobs: JobsApi, plan: RunPlan, drafter: str, split, endpoint: str | None, stage: list):
    """The served configuration and the candidates, each with its τ per held-out prompt."""
    stage[0] = "evaluate"
    cand, ngram = _evaluate(jobs, plan, drafter, split.heldout, split.heldout_records, "eval-candidate", endpoint)
    block = read_drafter_config(open_store(drafter, endpoint_url=endpoint), "config.json")
    evaluate = plan.stages.get("evaluate", {})
    lookup = [evaluate.get(k, EvaluateSpec.model_fields[k].default) for k in ("ngram_min", "ngram_max")]
    ones = {i: 1.0 for i in cand}
    options = [Option("candidate", {"method": block["method"], "candidate": drafter}, cand),
               Option("ngram", ngram_config(block["block_size"] - 1, *lookup), ngram), Option("none", dict(NONE), ones)]
    config = plan.served.configuration() or dict(NONE)
    if config["method"] == "ngram":  # the evaluate job's n-gram, at the candidate's draft length
        served = Option("served", config, ngram)
    elif config["method"] == "none":
        served = Option("served", config, ones)
    else:
        served_tau, _ = _evaluate(jobs, plan, plan.served.version_uri(config["version"]), split.heldout,
                                  split.heldout_records, "eval-served", endpoint)
        served = Option("served", config, served_tau)
    return served, options


def adapt_once(jobs: JobsApi, settings: AdaptSettings, stages: dict, now: datetime | None = None) -> dict:
    """One run (see the module's docstring); returns the served store's event (promoted or refused). A run that
    fails after its served store is known records the failure there (stage, reason, jobs) before it raises."""
    owner = jobs.whoami()
    plan = plan_run(settings, stages, owner, now)
    stage, submitted = ["source"], len(getattr(jobs, "job_ids", []))
    try:
        return _adapt(jobs, plan, settings, owner, now, stage)
    except Exception as exc:
        job_ids = list(getattr(jobs, "job_ids", []))[submitted:]
        try:
            plan.served.record_failure(stage[0], f"{type(exc).__name__}: {exc}", job_ids, run=plan.run)
        except Exception as record_exc:  # the store itself failing: the run's own error is what it raises
            log.warning("adapt failure not recorded", extra={"run": plan.run, "error": str(record_exc)[:500]})
        raise


def _adapt(jobs: JobsApi, plan: RunPlan, settings: AdaptSettings, owner: str, now: datetime | None,
           stage: list) -> dict:
    endpoint = settings.s3_endpoint_url
    sweep_old_runs(plan.run.rstrip("/").rpartition("/")[0] + "/", settings.adapt_retention_hours,
                   now or datetime.now(timezone.utc), owner, endpoint)
    since, until = window(None, now, settings.adapt_window_hours, now=now)
    split = prepare_source(plan.capture, plan.run, since, until, heldout_share=settings.adapt_heldout_share,
                           regenerate=settings.adapt_regenerate, endpoint_url=endpoint)
    log.info("adapt source prepared", extra={"run": plan.run, **split.as_dict()})
    pipeline, start_version = train_candidate(jobs, plan, split, endpoint, stage)
    drafter = plan.output(pipeline, "drafter", "train/")
    served, options = _options(jobs, plan, drafter, split, endpoint, stage)
    stage[0] = "decide"
    costs = settings.adapt_step_costs
    winner, figures, reason = judge(served, options, costs, min_gain=settings.adapt_min_gain,
                                    alpha=settings.adapt_alpha, min_prompts=settings.adapt_min_prompts)
    evidence = {"source_job": pipeline["id"], "run": plan.run, "served": served.config, "warm_start": start_version,
                "window": {"since": f"{since:%Y-%m-%dT%H:%M:%SZ}", "until": f"{until:%Y-%m-%dT%H:%M:%SZ}"},
                "source": split.as_dict(), "step_costs": costs.model_dump(), "alpha": settings.adapt_alpha,
                "min_gain": settings.adapt_min_gain, "min_prompts": settings.adapt_min_prompts,
                "candidates": figures, "reason": reason}
    if winner is None:
        return plan.served.record({"action": "refused", "candidate": drafter, **evidence})
    if winner.name == "candidate":
        return plan.served.promote(drafter, {"winner": "candidate", **evidence})
    return plan.served.serve(winner.config, {"winner": winner.name, "candidate": drafter, **evidence})
