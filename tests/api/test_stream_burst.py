"""A burst of event streams from one key is admitted or refused without the request path's Redis pool: the
flooding key gets only 200s and 429s (never a 503), and another key's requests meanwhile only 2xx."""

from __future__ import annotations

import socket
import threading

import httpx

from .conftest import READ_KEY, WRITE_KEY, auth, served
from .test_key_limits import GEN, OTHER_KEY, keys  # noqa: F401 - the keys fixture

BURST = 300


def _status(sock: socket.socket) -> int:
    head = b""
    while b"\r\n" not in head:
        chunk = sock.recv(65536)
        if not chunk:
            return 0
        head += chunk
    return int(head.split(b" ", 2)[1])


def test_a_burst_of_streams_never_exhausts_the_request_path(make_app, redis_client, keys):  # noqa: F811
    app = make_app(api_keys=keys, max_streams_per_key=8, redis_max_connections=16, sse_poll_s=1.0)
    with served(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        job_id = http.post("/v1/jobs", json=GEN, headers=auth(WRITE_KEY)).json()["id"]
        other_id = http.post("/v1/jobs", json=GEN, headers=auth(OTHER_KEY)).json()["id"]
        others: list[int] = []
        stop = threading.Event()

        def other_key():
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as mine:
                while not stop.is_set():
                    others.append(mine.get(f"/v1/jobs/{other_id}", headers=auth(OTHER_KEY)).status_code)
                    others.append(mine.get("/v1/jobs", headers=auth(READ_KEY)).status_code)

        thread = threading.Thread(target=other_key)
        thread.start()
        request = f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {WRITE_KEY}\r\n\r\n"
        socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(BURST)]
        try:
            for sock in socks:  # every request sent before any answer is read: they arrive together
                sock.sendall(request.encode())
            statuses = [_status(sock) for sock in socks]
        finally:
            stop.set()
            thread.join(30)
            for sock in socks:
                sock.close()
        assert set(statuses) <= {200, 429}, sorted(set(statuses))
        assert statuses.count(200) == 8 and statuses.count(429) == BURST - 8
        assert others and set(others) == {200}, sorted(set(others))
        assert http.get(f"/v1/jobs/{job_id}", headers=auth(WRITE_KEY)).status_code == 200
