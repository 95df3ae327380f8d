"""One behaviour suite for object storage, run against file:// and moto's S3 server."""

from __future__ import annotations

import hashlib
import logging
import os

import pytest
from dfp_shared.storage import LocalStore, NotFound, StorageError, check_uri, open_store, split_uri


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(f"file://{tmp_path}/root")
    bucket = request.getfixturevalue("s3_bucket")
    server = request.getfixturevalue("s3_server")
    return open_store(bucket + "/some/prefix", endpoint_url=server.endpoint_url)


def test_put_get_exists_delete(store):
    assert not store.exists("a/b.txt")
    store.put("a/b.txt", b"hello")
    assert store.exists("a/b.txt")
    assert store.get("a/b.txt") == b"hello"
    store.put("a/b.txt", b"again")  # overwrite
    assert store.get("a/b.txt") == b"again"
    store.delete("a/b.txt")
    assert not store.exists("a/b.txt")
    store.delete("a/b.txt")  # deleting a missing key is not an error


def test_missing_key_is_a_clear_error(store):
    with pytest.raises(NotFound, match="nope.bin"):
        store.get("nope.bin")


def test_list_is_paginated_and_sorted(store):
    keys = [f"dir/{i:04d}.bin" for i in range(25)] + ["other/x.bin"]
    store.put_many((k, k.encode()) for k in keys)
    assert list(store.list("dir/", page_size=7)) == sorted(keys[:25])
    assert sorted(store.list("", page_size=10)) == sorted(keys)


def test_files_roundtrip(store, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(100_000))
    store.put_file("f/src.bin", src)
    out = store.get_file("f/src.bin", tmp_path / "out" / "copy.bin")
    assert out.read_bytes() == src.read_bytes()


@pytest.mark.parametrize("bad", ["../x", "a/../../x", "/etc/passwd", "", "a\\b"])
def test_keys_cannot_escape_the_root(store, bad):
    with pytest.raises(StorageError):
        store.put(bad, b"x")


def test_thousand_objects_download_in_parallel_byte_identical(store, tmp_path):
    payloads = {f"many/{i:04d}.bin": hashlib.sha256(str(i).encode()).digest() * 32 for i in range(1000)}
    assert store.put_many(payloads.items(), max_workers=32) == 1000
    got = dict(store.get_many(sorted(payloads), max_workers=32))
    assert got == payloads
    paths = store.download_many(sorted(payloads)[:50], tmp_path / "dl")
    assert all(p.read_bytes() == payloads["many/" + p.name] for p in paths)


def test_local_writes_are_atomic(tmp_path):
    store = LocalStore(tmp_path)
    store.put("x.bin", b"1" * 1000)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert list(store.list()) == ["x.bin"]


def test_missing_bucket_is_a_clear_error(s3_server):
    store = open_store("s3://no-such-bucket-here", endpoint_url=s3_server.endpoint_url)
    with pytest.raises(NotFound, match="bucket does not exist"):
        store.get("k")


def test_missing_credentials_are_a_clear_error(s3_server, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = open_store("s3://bucket", endpoint_url=s3_server.endpoint_url)
    with pytest.raises(StorageError, match="no S3 credentials"):
        store.get("k")


def test_secrets_never_reach_logs(s3_server, monkeypatch, caplog):
    secret = "sUp3rS3cretValue"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    store = open_store("s3://bucket", endpoint_url="http://127.0.0.1:1")  # nothing listens: retried, then fails
    caplog.set_level(logging.DEBUG)
    with pytest.raises(StorageError) as err:
        store.get("k")
    assert secret not in str(err.value)
    assert secret not in caplog.text


def test_log_redaction():
    from dfp_shared.logs import redact

    assert "hunter2" not in redact("connecting to redis://:hunter2@redis:6379/0")
    assert "abc123" not in redact("api_key=abc123 other=1")


def test_uri_helpers():
    assert split_uri("s3://b/a/c.json") == ("s3://b", "a/c.json")
    assert check_uri("s3://bucket/prefix") == "s3://bucket/prefix"
    for bad in ("http://x/y", "s3://b/../c", "file:///a/../b", "s3:///nobucket"):
        with pytest.raises(StorageError):
            check_uri(bad)
    with pytest.raises(StorageError, match="scheme"):
        open_store("gs://bucket")
