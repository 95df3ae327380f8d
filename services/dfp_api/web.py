"""The jobs page: static HTML, JavaScript and CSS shipped in this package, served at ``/ui``.

The page calls the REST API with the key the user enters (kept in the tab's sessionStorage, sent as
``Authorization: Bearer``); the files themselves hold nothing secret and need no key. Only the
files named here are served, with a content security policy that allows this origin alone.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter, Response
from fastapi.responses import RedirectResponse

from .errors import ApiError

FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "style.css": "text/css; charset=utf-8"}
HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

web = APIRouter(include_in_schema=False)


@cache
def _read(name: str) -> bytes:
    return resources.files("dfp_api").joinpath("web", name).read_bytes()


@web.get("/ui")
async def ui_root() -> RedirectResponse:
    return RedirectResponse("/ui/")


@web.get("/ui/")
async def ui_index() -> Response:
    return _file("index.html")


@web.get("/ui/{name}")
async def ui_file(name: str) -> Response:
    return _file(name)


def _file(name: str) -> Response:
    if name not in FILES:
        raise ApiError(404, "not_found", "no such page file")
    return Response(_read(name), media_type=FILES[name], headers=HEADERS)
