"""Without Redis the API stays up: readiness fails and job routes answer 503, then recover."""

from __future__ import annotations

import os

from fastapi.testclient import TestClient

from .conftest import API_TEST_STORAGE, WRITE_KEY, auth, key_entries

GEN = {"type": "generate", "spec": {"prompts": "file:///data/p.jsonl", "output": "file:///data/out", "model": "/models/m"}}


def test_redis_outage_is_503_and_recovers(redis_aof):
    from dfp_api.app import create_app
    from dfp_api.settings import ApiSettings

    app = create_app(ApiSettings(redis_url=redis_aof.url, api_keys=key_entries(), rate_limit_per_s=0,
                                 allowed_prefixes=f"{API_TEST_STORAGE},{os.environ.get('DFLASH_ALLOWED_PREFIXES', '')}"))
    with TestClient(app) as client:
        job_id = client.post("/v1/jobs", json=GEN, headers=auth(WRITE_KEY)).json()["id"]
        redis_aof.kill()
        assert client.get("/healthz").status_code == 200
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
        down = client.get(f"/v1/jobs/{job_id}", headers=auth(WRITE_KEY))
        assert down.status_code == 503 and down.json()["error"] == "unavailable" and down.headers["Retry-After"]
        redis_aof.restart()
        assert client.get("/readyz").status_code == 200
        assert client.get(f"/v1/jobs/{job_id}", headers=auth(WRITE_KEY)).json()["state"] == "queued"
