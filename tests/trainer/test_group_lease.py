"""The training lease: whoever trains a job holds it; another group or a lone pod cannot take it."""

from __future__ import annotations

import uuid

from dfp_trainer.group import GroupRuns, TrainLease


def test_lease_is_held_by_one_owner_at_a_time(redis_client):
    job = "job-" + uuid.uuid4().hex[:8]
    group = TrainLease(redis_client, job, "group:a", ttl_ms=60_000)
    assert group.acquire() is None and group.acquire() is None  # taken, then renewed
    assert TrainLease(redis_client, job, "pod:lone", ttl_ms=60_000).acquire() == "group:a"
    with group:  # released when the training ends
        pass
    assert TrainLease(redis_client, job, "pod:lone", ttl_ms=60_000).acquire() is None


def test_group_result_belongs_to_its_run(redis_client):
    runs = GroupRuns(redis_client, "g-" + uuid.uuid4().hex[:8])
    runs.publish("job-1", "job", "{}")
    assert runs.current()["run_id"] == "job-1"
    runs.put_result("job-1", {"completed": True})
    assert runs.result("job-2") is None and runs.result("job-1") == {"completed": True}
    runs.close("job-2")  # another run's close leaves this one current
    assert runs.current() is not None
    runs.close("job-1")
    assert runs.current() is None
