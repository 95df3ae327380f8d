"""The served drafter changes whole: serving resolves one small pointer, ``current.json``, naming a version that
was complete before the pointer named it; a rollback moves the pointer back. On a local disk and on S3 (moto's
server)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from dfp_adapt.served_store import POINTER, PromotionError, ServedDrafters
from dfp_shared.storage.store import open_store


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    """(root URI, endpoint) on a local disk and on moto's S3 server."""
    if request.param == "local":
        return f"file://{tmp_path}", None
    s3 = request.getfixturevalue("s3_server")
    return request.getfixturevalue("s3_bucket") + "/data", s3.endpoint_url


def candidate(uri: str, seed: int, size: int, endpoint: str | None) -> str:
    """A drafter export whose config names its seed; returns the weights' digest."""
    store = open_store(uri, endpoint_url=endpoint)
    weights = os.urandom(size)
    store.put("config.json", json.dumps({"architectures": ["DFlashDraftModel"], "seed": seed,
                                         "dflash_config": {"block_size": 8}}).encode())
    store.put("model.safetensors", weights)
    store.put("modeling_dflash.py", f"# modeling {seed}\n".encode())
    return hashlib.sha256(weights).hexdigest()


def serve_once(served_uri: str, endpoint: str | None) -> tuple[int, str]:
    """What a serving pod that starts now loads: the pointer, then the config and weights of the version it names
    (a fresh reader each time, as a new pod is)."""
    store = open_store(served_uri, endpoint_url=endpoint)
    version = json.loads(store.get(POINTER))["version"]
    config = json.loads(store.get(f"versions/{version}/config.json"))
    return config["seed"], hashlib.sha256(store.get(f"versions/{version}/model.safetensors")).hexdigest()


def test_a_pod_starting_while_a_large_candidate_is_promoted_loads_one_whole_version(place, monkeypatch):
    root, endpoint = place
    digests = {1: candidate(f"{root}/c1", 1, 100_000, endpoint), 2: candidate(f"{root}/c2", 2, 4 << 20, endpoint)}
    served = ServedDrafters(f"{root}/served", "d", endpoint)
    served.promote(f"{root}/c1/", {})
    loaded, pointed = [], []

    def sampled(method):
        def write(*args):
            method(*args)  # after every file the promotion (or the rollback) writes or removes, a pod starts
            loaded.append(serve_once(served.uri, endpoint))
            now = served.current()
            pointed.append((now.version, now.uri))
        return write

    for name in ("put_file", "put", "delete"):
        monkeypatch.setattr(served.store, name, sampled(getattr(served.store, name)))
    served.promote(f"{root}/c2/", {})
    served.rollback("regressed")
    # never one version's config beside another's weights: the old version until the flip, then the new
    assert all(digests[seed] == digest for seed, digest in loaded), loaded
    assert [seed for seed, _ in loaded].count(2) and [seed for seed, _ in loaded].count(1)
    assert all(uri == served.version_uri(version) for version, uri in pointed)
    assert serve_once(served.uri, endpoint) == (1, digests[1])  # rolled back: the pointer names version 1 again


def test_versions_stay_as_promoted_and_rollback_moves_the_pointer(place):
    root, endpoint = place
    candidate(f"{root}/c1", 1, 1000, endpoint)
    digest2 = candidate(f"{root}/c2", 2, 2000, endpoint)
    served = ServedDrafters(f"{root}/served", "d", endpoint)
    served.promote(f"{root}/c1/", {})
    served.promote(f"{root}/c2/", {})
    assert served.current().version == 2 and json.loads(served.store.get(POINTER))["version"] == 2
    served.rollback()
    assert served.current().version == 1 and served.current().uri == served.version_uri(1)
    assert serve_once(served.uri, endpoint)[0] == 1
    store = served.store
    assert hashlib.sha256(store.get("versions/2/model.safetensors")).hexdigest() == digest2  # untouched
    assert not list(store.list("current/"))  # no copy beside the versions for a reader to find half-written


def test_nothing_served_is_said(place):
    root, endpoint = place
    served = ServedDrafters(f"{root}/served", "d", endpoint)
    assert served.current() is None and served.current_version() is None


def test_a_store_served_through_its_old_copy_moves_to_the_pointer(place):
    """A store promoted before the pointer existed holds ``current/`` and a history: its history's version is the one
    served until the next change writes the pointer, which then removes the old copy."""
    root, endpoint = place
    candidate(f"{root}/c1", 1, 1000, endpoint)
    candidate(f"{root}/c2", 2, 1000, endpoint)
    served = ServedDrafters(f"{root}/served", "d", endpoint)
    src = open_store(f"{root}/c1", endpoint_url=endpoint)
    for key in src.list(""):
        served.store.put(f"versions/1/{key}", src.get(key))
        served.store.put(f"current/{key}", src.get(key))
    served.store.put("history.json", json.dumps({"name": "d", "stack": [1], "events": []}).encode())
    assert served.current().version == 1 and served.current_version() == 1
    assert served.promote(f"{root}/c2/", {})["version"] == 2
    assert served.current().version == 2 and not list(served.store.list("current/"))


@pytest.mark.parametrize("body", [b"{", b'{"version": "1"}', b'{"version": -1}', b'{"version": true}',
                                  b'{"version": 1e400}', b"[" * 10_000, b'{"version": 1}' + b" " * 8192])
def test_a_pointer_that_is_not_one_is_refused_with_its_reason(tmp_path, body):
    served = ServedDrafters(f"file://{tmp_path}/served", "d")
    served.store.put(POINTER, body)
    with pytest.raises(PromotionError, match="current.json: "):
        served.current()


def test_a_pointer_to_a_version_without_a_drafter_is_refused(tmp_path):
    served = ServedDrafters(f"file://{tmp_path}/served", "d")
    served.store.put(POINTER, b'{"version": 7}')
    with pytest.raises(PromotionError, match="version 7 .*no config.json"):
        served.current()
