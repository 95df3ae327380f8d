"""The job types: for each, its spec model, the stream its tasks go on, the counter its progress is
reported by, and what a pipeline runs after it.

Every part of the system that needs to know what a job type is reads :data:`JOB_TYPES` (or one of
the named entries): the API's request models and errors, the job client, the storage-root checks,
submitting, job completion and the workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from dfp_shared.specs import (
    CacheSpec,
    EvaluateSpec,
    GenerateSpec,
    ImportGGUFSpec,
    PipelineSpec,
    TokenizeSpec,
    TrainSpec,
)


@dataclass(frozen=True)
class Feeds:
    """In a pipeline, the stage that runs after this one and how this one's output reaches it."""

    stage: str  # the next stage (a job type)
    field: str  # the field of the next stage's spec that is set ...
    output: str  # ... to this output of this stage


@dataclass(frozen=True)
class JobType:
    name: str
    spec: type[BaseModel]
    primary_unit: str  # the counter the job's ETA is reported by
    stream: str | None  # the task stream its plan task goes on; None: the job runs no tasks of its own
    feeds: Feeds | None = None


GENERATE = JobType("generate", GenerateSpec, "prompts", "generate", Feeds("tokenize", "input", "completions"))
TOKENIZE = JobType("tokenize", TokenizeSpec, "files", "tokenize", Feeds("train", "dataset", "dataset"))
TRAIN = JobType("train", TrainSpec, "steps", "train")
# a pipeline runs its stages as jobs of their own (see dfp_shared.jobs.flow)
PIPELINE = JobType("pipeline", PipelineSpec, "stages", None)
# evaluate jobs run on the trainer workers (they hold the target and drafter code)
EVALUATE = JobType("evaluate", EvaluateSpec, "prompts", TRAIN.stream)

# cache jobs fill a hidden-state cache offline, on the trainer workers too (they hold the target's source)
CACHE = JobType("cache", CacheSpec, "shards", TRAIN.stream)

# import_gguf jobs turn a GGUF file into a model directory, on the trainer workers too (torch, transformers, gguf);
# progress by the import's phases (dfp_shared.models.gguf_import.PHASES)
IMPORT_GGUF = JobType("import_gguf", ImportGGUFSpec, "phases", TRAIN.stream)

JOB_TYPES: dict[str, JobType] = {t.name: t for t in (GENERATE, TOKENIZE, TRAIN, PIPELINE, EVALUATE, CACHE,
                                                     IMPORT_GGUF)}


def job_type(name: str) -> JobType:
    """The job type called ``name``; raises ValueError naming the known ones."""
    try:
        return JOB_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown job type {name!r}; expected one of {sorted(JOB_TYPES)}") from None


def task_job_type(stream: str, name: str) -> JobType:
    """The type a task read from ``stream`` runs as: the type its job record names where that type's tasks
    go on this stream, else the type the stream is named for (a record may come from anyone who can write
    to Redis, and a worker runs only what its stream carries)."""
    named = JOB_TYPES.get(name)
    return named if named is not None and named.stream == stream else JOB_TYPES[stream]


def fed_fields(stage: str) -> set[str]:
    """The fields of ``stage``'s spec that a pipeline sets from the stage before it."""
    return {t.feeds.field for t in JOB_TYPES.values() if t.feeds is not None and t.feeds.stage == stage}
