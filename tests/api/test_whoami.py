"""``GET /v1/whoami``: the calling key's name and scopes, the principal its jobs' outputs belong to."""

from __future__ import annotations

from .conftest import READ_KEY, WRITE_KEY, auth


def test_a_key_learns_its_own_name_and_scopes(api):
    assert api.get("/v1/whoami", headers=auth(WRITE_KEY)).json() == {"name": "writer", "scopes": ["read", "write"]}
    assert api.get("/v1/whoami", headers=auth(READ_KEY)).json() == {"name": "reader", "scopes": ["read"]}


def test_without_a_valid_key_it_is_401(api):
    assert api.get("/v1/whoami", headers={"Authorization": "Bearer dfp_nobody-0123456789"}).status_code == 401
    api.headers.pop("Authorization")
    assert api.get("/v1/whoami").status_code == 401
