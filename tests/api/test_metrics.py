"""A job's metric history: pages of points after a step, bounded, only for those who may see the job,
a pipeline's from its train stage, and every point on the job's event stream."""

from __future__ import annotations

from dfp_shared.jobs.store import METRICS_MAXLEN, JobStore

from tests.api.sse import read_events

from .conftest import READ_KEY, WRITE_KEY, auth


def _train_job(redis_client, owner: str = "writer", **extra) -> str:
    job, _ = JobStore(redis_client).create("train", {}, owner=owner, **extra)
    return job.id


def test_points_come_in_pages_after_a_step_and_a_rewound_run_replaces_its_tail(api, redis_client):
    jobs = JobStore(redis_client)
    job_id = _train_job(redis_client)
    for step in range(1, 8):
        jobs.add_metrics(job_id, {"step": step, "loss": 10.0 - step})
    jobs.add_metrics(job_id, {"step": 5, "loss": 0.5})  # resumed from step 4: 5.. are logged again
    page = api.get(f"/v1/jobs/{job_id}/metrics", params={"after": 2, "limit": 2}).json()
    assert page == {"job_id": job_id, "items": [{"step": 3, "loss": 7.0}, {"step": 4, "loss": 6.0}], "next_after": 4}
    rest = api.get(f"/v1/jobs/{job_id}/metrics", params={"after": page["next_after"]}).json()
    assert rest["items"] == [{"step": 5, "loss": 0.5}] and rest["next_after"] is None
    assert api.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 100_000}).status_code == 422


def test_history_is_bounded_to_the_newest_points(redis_client):
    jobs = JobStore(redis_client)
    job_id = _train_job(redis_client)
    pipe = redis_client.pipeline()
    key = jobs.keys(job_id).metrics
    pipe.zadd(key, {f'{{"step": {s}}}': s for s in range(METRICS_MAXLEN)})
    pipe.execute()
    jobs.add_metrics(job_id, {"step": METRICS_MAXLEN, "loss": 1.0})
    assert redis_client.zcard(key) == METRICS_MAXLEN
    assert jobs.metrics(job_id, limit=1)[0]["step"] == 1


def test_another_principal_s_job_has_no_metrics_and_a_pipeline_shows_its_train_stage(api, redis_client):
    jobs = JobStore(redis_client)
    hidden = _train_job(redis_client, owner="reader")
    jobs.add_metrics(hidden, {"step": 1, "loss": 1.0})
    assert api.get(f"/v1/jobs/{hidden}/metrics").status_code == 404
    assert api.get(f"/v1/jobs/{hidden}/metrics", headers=auth(READ_KEY)).json()["items"] == [{"step": 1, "loss": 1.0}]
    pipe, _ = jobs.create("pipeline", {}, owner="writer")
    assert api.get(f"/v1/jobs/{pipe.id}/metrics").json() == {"job_id": pipe.id, "items": [], "next_after": None}
    stage = _train_job(redis_client, parent_id=pipe.id, stage="train")
    jobs.set_outputs(pipe.id, train_job=stage)
    jobs.add_metrics(stage, {"step": 2, "tau": 1.5})
    assert api.get(f"/v1/jobs/{pipe.id}/metrics").json()["items"] == [{"step": 2, "tau": 1.5}]


def test_each_point_is_streamed_as_a_metrics_event(api, redis_client):
    jobs = JobStore(redis_client)
    job_id = _train_job(redis_client)
    jobs.add_metrics(job_id, {"step": 3, "loss": 2.0})
    jobs.transition(job_id, "running")
    jobs.transition(job_id, "succeeded")
    events = read_events(api, job_id, headers=auth(WRITE_KEY))
    assert ("metrics", {"step": 3, "loss": 2.0}) in [(event, data) for event, _, data in events]
