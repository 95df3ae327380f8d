"""The OpenAI-compatible endpoints an operator configured; a job picks one by name.

The worker's bearer tokens go only to these addresses: a spec carries a name (``openai_endpoint``),
never a URL.

* ``default``: ``DFLASH_OPENAI_BASE_URL``, with ``DFLASH_OPENAI_API_KEY`` and ``DFLASH_OPENAI_MODEL``;
* ``DFLASH_OPENAI_ENDPOINTS``: a JSON object of further endpoints, name -> URL, or name -> object
  ``{"url": ..., "model": ..., "api_key_env": VAR, "api_key_file": PATH}``. The token of such an
  endpoint is the environment variable ``api_key_env`` or the content of ``api_key_file`` (a
  mounted Secret, read each time an engine is built, so a rotated Secret takes effect); an endpoint
  with neither gets no ``Authorization`` header. ``DFLASH_OPENAI_API_KEY`` is never sent to them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from dfp_shared.specs._names import DEFAULT, load_name_map

ENTRY_KEYS = {"url", "model", "api_key_env", "api_key_file"}


class EndpointError(ValueError):
    """A job names an endpoint this worker cannot send to (fails the job, without retries)."""


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str
    model: str | None = None
    api_key: str | None = None  # the default endpoint's DFLASH_OPENAI_API_KEY
    api_key_env: str | None = None
    api_key_file: str | None = None

    def token(self) -> str | None:
        """The bearer token to send to this endpoint, read now (None: send no Authorization header)."""
        if self.api_key_env:
            value = os.environ.get(self.api_key_env, "").strip()
            if not value:
                raise EndpointError(f"openai endpoint {self.name!r}: its token variable {self.api_key_env} is not set "
                                    "on this worker")
            return value
        if self.api_key_file:
            try:
                value = Path(self.api_key_file).read_text().strip()
            except OSError as exc:
                raise EndpointError(f"openai endpoint {self.name!r}: cannot read its token file "
                                    f"{self.api_key_file}: {exc.strerror or exc}") from None
            if not value:
                raise EndpointError(f"openai endpoint {self.name!r}: its token file {self.api_key_file} is empty")
            return value
        return self.api_key


def check_url(url: str) -> str:
    """An http(s) base URL with a host and no credentials, query or fragment (raises ValueError)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r} must start with http:// or https:// and name a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{url!r} must not carry a user or password (give the token as api_key_env or api_key_file)")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r} must not have a query or fragment")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"{url!r} has an invalid port") from None
    return url


def parse_endpoints(text: str, *, check_secrets: bool = True) -> dict[str, Endpoint]:
    """The endpoints of ``DFLASH_OPENAI_ENDPOINTS`` (raises ValueError naming the entry and the reason)."""
    raw = load_name_map(text, "endpoint", "URL")
    out = {}
    for name, entry in raw.items():
        if isinstance(entry, str):
            entry = {"url": entry}
        if not isinstance(entry, dict):
            raise ValueError(f"endpoint {name!r}: give a URL or an object with url, model, api_key_env, api_key_file")
        unknown = sorted(set(entry) - ENTRY_KEYS)
        if unknown:
            raise ValueError(f"endpoint {name!r}: unknown key(s) {unknown}; expected {sorted(ENTRY_KEYS)}")
        for key, value in entry.items():
            if not isinstance(value, str) or not value:
                raise ValueError(f"endpoint {name!r}: {key} must be a non-empty string")
        if "url" not in entry:
            raise ValueError(f"endpoint {name!r}: url is required")
        if "api_key_env" in entry and "api_key_file" in entry:
            raise ValueError(f"endpoint {name!r}: give api_key_env or api_key_file, not both")
        try:
            check_url(entry["url"])
        except ValueError as exc:
            raise ValueError(f"endpoint {name!r}: url {exc}") from None
        endpoint = Endpoint(name, entry["url"], model=entry.get("model"), api_key_env=entry.get("api_key_env"),
                            api_key_file=entry.get("api_key_file"))
        if check_secrets:
            try:
                endpoint.token()
            except EndpointError as exc:
                raise ValueError(str(exc)) from None
        out[name] = endpoint
    return out


def configured(base_url: str | None, api_key: str | None, model: str | None, endpoints: str) -> dict[str, Endpoint]:
    """Every endpoint a worker with these settings may send to, ``default`` first when it is set."""
    named = parse_endpoints(endpoints, check_secrets=False)
    if base_url:
        return {DEFAULT: Endpoint(DEFAULT, base_url, model=model, api_key=api_key), **named}
    return named


def resolve(endpoints: dict[str, Endpoint], name: str | None) -> Endpoint:
    """The endpoint a job names (unset: ``default``); raises EndpointError listing the configured names."""
    name = name or DEFAULT
    if name in endpoints:
        return endpoints[name]
    if not endpoints:
        raise EndpointError("engine 'openai': no OpenAI-compatible endpoint is configured on this worker (the "
                            "operator sets DFLASH_OPENAI_BASE_URL for 'default', or DFLASH_OPENAI_ENDPOINTS)")
    names = ", ".join(repr(n) for n in endpoints)
    raise EndpointError(f"openai_endpoint {name!r} is not configured on this worker; configured: {names} "
                        "(DFLASH_OPENAI_BASE_URL is 'default', DFLASH_OPENAI_ENDPOINTS the others)")
