"""Reading a server-sent event stream in tests."""

from __future__ import annotations

import json


def read_events(client, job_id: str, headers: dict | None = None) -> list[tuple[str, str | None, dict]]:
    """All (event, id, data) of a job's stream until the server closes it after ``end``."""
    out, event, ev_id, data = [], "message", None, []
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers or {}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line == "":
                if data:
                    out.append((event, ev_id, json.loads("\n".join(data))))
                event, ev_id, data = "message", None, []
            elif line.startswith(":"):
                continue
            else:
                name, _, value = line.partition(": ")
                if name == "event":
                    event = value
                elif name == "id":
                    ev_id = value
                elif name == "data":
                    data.append(value)
    return out
