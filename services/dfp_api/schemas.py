"""Request and response models of the REST API (they are the OpenAPI document).

Job specs come from :mod:`dfp_shared.specs`, the same models the workers read. A pipeline's
stage specs are those models minus the field the pipeline wires from the previous stage
(tokenize's ``input``, train's ``dataset``), so every stage is validated before anything runs. A
pipeline without ``generate`` starts at tokenize, which then names its ``input`` (answers to train on).
"""

from __future__ import annotations

from enum import Enum
from functools import reduce
from operator import or_
from typing import Annotated, Any, Literal

from dfp_shared.jobs.store import JobState
from dfp_shared.jobs.types import JOB_TYPES, PIPELINE, TOKENIZE, TRAIN, fed_fields
from dfp_shared.specs import GenerateSpec
from dfp_shared.specs.pipeline import ANSWERS_INPUT_MISSING
from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

JobType = Enum("JobType", {name: name for name in JOB_TYPES}, type=str)
JobType.__doc__ = "Kind of job."


def _stage_model(stage: str, optional: frozenset[str] = frozenset()) -> type[BaseModel]:
    """The stage's spec model without the field an earlier stage fills in (``optional``: kept, but not required,
    for a pipeline without that earlier stage)."""
    base = JOB_TYPES[stage].spec
    wired = fed_fields(stage) - optional
    fields = {name: (info.annotation, info) for name, info in base.model_fields.items() if name not in wired}
    for name in optional:
        info = base.model_fields[name]
        fields[name] = (Annotated[(info.annotation, *info.metadata)] | None,
                        Field(None, description=f"{info.description} Only in a pipeline without generate (it is fed "
                              "otherwise)."))
    model = create_model(f"Pipeline{stage.capitalize()}Stage", __config__=ConfigDict(extra="forbid", allow_inf_nan=False),
                         **fields)
    model.__doc__ = f"{base.__name__} fields" + (f" except {', '.join(sorted(wired))} (wired by the pipeline)."
                                                  if wired else ".")
    return model


PipelineTokenizeStage = _stage_model(TOKENIZE.name, frozenset({"input"}))
PipelineTrainStage = _stage_model(TRAIN.name)


class PipelineRequestSpec(BaseModel):
    """[generate ->] tokenize -> train; each stage starts when the previous one succeeds. Without generate,
    tokenize's ``input`` names the records (with their answers) to train on."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    generate: GenerateSpec | None = None
    tokenize: PipelineTokenizeStage  # type: ignore[valid-type]
    train: PipelineTrainStage  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _input_of_tokenize(self) -> PipelineRequestSpec:
        if self.generate is None and self.tokenize.input is None:
            raise ValueError(f"tokenize.input: {ANSWERS_INPUT_MISSING}")
        if self.generate is not None and self.tokenize.input is not None:
            raise ValueError("tokenize.input: the generate stage feeds it; name it only in a pipeline without generate")
        return self

    @model_validator(mode="after")
    def _same_thinking_mode(self) -> PipelineRequestSpec:
        # the trainer refuses a dataset of the other mode: say so now, not after generation ran
        if self.tokenize.thinking != self.train.enable_thinking:
            raise ValueError(f"tokenize.thinking is {self.tokenize.thinking} but train.enable_thinking is "
                             f"{self.train.enable_thinking}: the drafter must be trained in the mode its data "
                             "was tokenized in")
        return self


def _job_request(name: str, job_type: str, spec: type[BaseModel]) -> type[BaseModel]:
    """The request body of one job type: ``type`` and its spec, nothing else."""
    return create_model(f"{name}Request", __config__=ConfigDict(extra="forbid", title=name), __module__=__name__,
                        type=(Literal[job_type], ...), spec=(spec, ...))


# the request body's spec of each job type: its spec model, but a pipeline's (stages validated as wired)
_REQUEST_SPECS: dict[str, type[BaseModel]] = {PIPELINE.name: PipelineRequestSpec}
# one request model per job type of dfp_shared.jobs.types, in its order: ``<Spec name without Spec>JobRequest``
JOB_REQUESTS: dict[str, type[BaseModel]] = {
    name: _job_request(t.spec.__name__.removesuffix("Spec") + "Job", name, _REQUEST_SPECS.get(name, t.spec))
    for name, t in JOB_TYPES.items()}

JobRequest = Annotated[reduce(or_, JOB_REQUESTS.values()), Field(discriminator="type")]


class UnitProgress(BaseModel):
    done: float = Field(description="Units finished.")
    total: float | None = Field(description="Units planned (null until the job is planned).")
    fraction: float | None = Field(description="done / total, 0..1.")
    rate_per_s: float | None = Field(description="Units per second since the job started.")


class Progress(BaseModel):
    units: dict[str, UnitProgress]
    primary_unit: str = Field(description="The unit the fraction and ETA refer to.")
    fraction: float | None
    rate_per_s: float | None
    eta_s: float | None = Field(description="Seconds left at the current rate (null when unknown or finished).")
    elapsed_s: float


class JobSummary(BaseModel):
    """A job as listed: everything but its spec (which may be large; GET /v1/jobs/{id} has it)."""

    id: str
    type: str
    state: JobState
    created_at: float = Field(description="Unix time.")
    started_at: float | None
    finished_at: float | None
    error: str | None
    outputs: dict[str, Any] = Field(description="URIs the job produced (and, for a pipeline, its stage job ids).")
    counters: dict[str, float]
    totals: dict[str, float]
    primary_unit: str
    parent_id: str | None = Field(description="The pipeline this job is a stage of.")
    stage: str | None
    owner: str | None = Field(description="Name of the API key that submitted the job (a pipeline's stages "
                                          "inherit it); only it, and admin keys, see the job.")
    progress: Progress


class Job(JobSummary):
    spec: dict[str, Any]


class JobPage(BaseModel):
    items: list[JobSummary]
    total: int = Field(description="Jobs matching the filters.")
    offset: int
    limit: int


class MetricPage(BaseModel):
    """A page of a job's training metric points, oldest first (for a pipeline: its train stage's)."""

    job_id: str = Field(description="The job whose points these are (a pipeline's train stage job).")
    items: list[dict[str, float]] = Field(description="Points: `step` and the figures logged at it (train/eval).")
    next_after: int | None = Field(description="Pass as `after` for the next page; null when this page was the last.")


class FieldError(BaseModel):
    field: str = Field(description="Dotted path of the bad field (e.g. spec.output), or the parameter name.")
    location: str = Field(description="body, query, path or header.")
    reason: str


class Error(BaseModel):
    error: str = Field(description="Machine-readable error code.")
    message: str
    fields: list[FieldError] | None = None
    usage: dict[str, float] | None = Field(
        None, description="With a 429: the key's own usage of the limit it hit, and that limit.")


class Caller(BaseModel):
    name: str = Field(description="The key's name: the owner of the jobs it submits and of their outputs.")
    scopes: list[str] = Field(description="The scopes the key holds (read, write, admin).")


class Health(BaseModel):
    status: str
    checks: dict[str, str] = Field(default_factory=dict)


def error_responses(*codes: int, explicit_json: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for error statuses. ``explicit_json`` for routes whose success type is not JSON."""
    text = {401: "Missing or invalid API key", 403: "The key lacks the scope", 404: "No such job",
            409: "Illegal state transition", 413: "Request body over the limit (DFLASH_MAX_BODY_BYTES)",
            422: "Invalid request",
            429: "A limit of the key (request rate, open event streams, queued and running jobs) or of the server",
            503: "Dependency unavailable"}
    if explicit_json:
        content = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
        out: dict[int | str, dict[str, Any]] = {c: {"description": text[c], "content": content} for c in codes}
    else:
        out = {code: {"model": Error, "description": text[code]} for code in codes}
    if 429 in out:
        out[429]["headers"] = {"Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}}
    if 401 in out:
        out[401]["headers"] = {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}}
    return out
