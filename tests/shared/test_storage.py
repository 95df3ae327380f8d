"""One behaviour suite for object storage, run against file:// and moto's S3 server."""

from __future__ import annotations

import hashlib
import logging
import os

import pytest
from dfp_shared.storage.store import (
    CLIENT_RETRIES,
    LocalStore,
    NotFound,
    S3Store,
    StorageError,
    open_store,
    split_uri,
)
from dfp_shared.storage.uris import canonical_uri

MiB = 1024 * 1024


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


def test_open_read_streams_and_seeks(store):
    data = os.urandom(3 * MiB + 17)
    store.put("big.bin", data)
    with store.open_read("big.bin") as f:
        assert f.read(10) == data[:10]
        f.seek(-7, os.SEEK_END)
        assert f.read() == data[-7:]
        f.seek(MiB)
        assert f.read(MiB) == data[MiB:2 * MiB] and f.tell() == 2 * MiB
    with pytest.raises(NotFound, match="nope.bin"):
        store.open_read("nope.bin")


def test_s3_open_read_gets_ranges(s3_server, s3_bucket):
    store = open_store(s3_bucket, endpoint_url=s3_server.endpoint_url)
    data = os.urandom(100_000)
    store.put("x.bin", data)
    with store.open_read("x.bin", buffer_size=4096) as f:
        assert b"".join(iter(lambda: f.read(3000), b"")) == data


def test_list_is_paginated_and_sorted(store):
    keys = [f"dir/{i:04d}.bin" for i in range(25)] + ["other/x.bin"]
    store.put_many((k, k.encode()) for k in keys)
    assert list(store.list("dir/", page_size=7)) == sorted(keys[:25])
    assert sorted(store.list("", page_size=10)) == sorted(keys)


# keys where a directory-by-directory walk and plain string order disagree ('.' and '-' sort before '/')
PREFIX_KEYS = ["a/a", "a/b-c", "a/b.txt", "a/b/c", "a/b/d/e", "a/b0", "a/bc/d", "a/c/b", "ab", "b"]


@pytest.mark.parametrize("prefix", ["", "a", "a/", "a/b", "a/b/", "a/bc/d", "a/x/", "zz", "./a", "a//b", "../a"])
def test_list_prefix_is_a_plain_string_prefix(store, prefix):
    store.put_many((k, b"") for k in PREFIX_KEYS)
    assert list(store.list(prefix, page_size=2)) == sorted(k for k in PREFIX_KEYS if k.startswith(prefix))


def test_list_rejects_an_empty_page(store):
    with pytest.raises(StorageError, match="page_size"):
        list(store.list("", page_size=0))


def test_local_list_walks_only_below_the_prefix_lazily(tmp_path, monkeypatch):
    store = LocalStore(tmp_path)
    store.put_many((k, b"") for k in ["a/1/x", "a/2/y", "a/b.txt", "a/bc/d", "b/z", "c/e"])
    scanned = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: scanned.append(os.path.relpath(path, tmp_path)) or scandir(path))

    keys = store.list("a/b")
    assert next(keys) == "a/b.txt"
    assert scanned == ["a"]  # not the root, not a/1 or a/2
    assert list(keys) == ["a/bc/d"]
    assert scanned == ["a", "a/bc"]

    scanned.clear()
    keys = store.list("")
    assert next(keys) == "a/1/x"
    assert scanned == [".", "a", "a/1"]  # one directory at a time, in key order


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


def test_exists_on_a_missing_bucket_is_a_clear_error(s3_server, s3_bucket):
    store = open_store("s3://no-such-bucket-here", endpoint_url=s3_server.endpoint_url)
    with pytest.raises(StorageError, match="s3://no-such-bucket-here: bucket does not exist"):
        store.exists("k")

    store = open_store(s3_bucket, endpoint_url=s3_server.endpoint_url)
    bucket_heads = []
    store.client.meta.events.register("before-send.s3.HeadBucket", lambda **_: bucket_heads.append(1))
    assert not store.exists("missing-1")
    assert not store.exists("missing-2")
    assert len(bucket_heads) == 1  # the bucket is checked once per store


def test_large_objects_go_up_and_down_in_parts(s3_server, s3_bucket, tmp_path):
    bucket = s3_bucket.removeprefix("s3://")
    store = S3Store(bucket, "big", endpoint_url=s3_server.endpoint_url, multipart_threshold=8 * MiB,
                    multipart_chunksize=5 * MiB)
    ranges = []
    store.client.meta.events.register("before-parameter-build.s3.GetObject",
                                      lambda params, **_: ranges.append(params.get("Range")))

    def etag(key):
        return store.client.head_object(Bucket=bucket, Key="big/" + key)["ETag"].strip('"')

    data = os.urandom(12 * MiB)
    store.put("blob.bin", data)
    assert etag("blob.bin").endswith("-3")  # S3 gives a multipart object the ETag "<md5 of part md5s>-<parts>"
    assert store.get("blob.bin") == data
    out = store.get_file("blob.bin", tmp_path / "blob.bin")
    assert out.read_bytes() == data
    assert len([r for r in ranges if r]) == 3  # get_file fetched three ranges

    store.put_file("copy.bin", out)
    assert etag("copy.bin").endswith("-3")
    assert store.get("copy.bin") == data
    store.put("small.bin", data[: 7 * MiB])
    assert "-" not in etag("small.bin")  # below the threshold: one PUT

    missing = S3Store("no-such-bucket-here", endpoint_url=s3_server.endpoint_url, multipart_threshold=8 * MiB,
                      multipart_chunksize=5 * MiB)
    with pytest.raises(NotFound, match="bucket does not exist"):
        missing.put("blob.bin", data)
    with pytest.raises(NotFound, match="bucket does not exist"):  # boto3 wraps this one's error
        missing.put_file("blob.bin", out)


class _Faults:
    """Answers the first ``times`` GetObject requests with a fault instead of sending them to the server."""

    def __init__(self, store: S3Store, fault: str, times: int):
        self.fault, self.times, self.seen = fault, times, 0
        store.client.meta.events.register("before-send.s3.GetObject", self)

    def __call__(self, request, **_):
        from botocore.awsrequest import AWSResponse
        from botocore.exceptions import ConnectionClosedError

        self.seen += 1
        if self.seen > self.times:
            return None  # sent for real
        if self.fault == "reset":
            raise ConnectionClosedError(endpoint_url=request.url)
        status = {"SlowDown": 503, "InternalError": 500}[self.fault]
        body = f"<Error><Code>{self.fault}</Code><Message>try again</Message></Error>".encode()
        return AWSResponse(request.url, status, {"content-type": "application/xml"}, _RawBody(body))


class _RawBody:
    def __init__(self, body: bytes):
        self.body = body

    def stream(self, **_):
        yield self.body


@pytest.mark.parametrize(("fault", "times"), [("SlowDown", 1), ("InternalError", 2), ("reset", 4)])
def test_transient_errors_are_retried_until_the_call_succeeds(s3_server, s3_bucket, caplog, fault, times):
    store = open_store(s3_bucket, endpoint_url=s3_server.endpoint_url)
    store.put("k.bin", b"payload")
    faults = _Faults(store, fault, times)
    with caplog.at_level(logging.WARNING, logger="dfp_shared.storage.retry"):
        assert store.get("k.bin") == b"payload"
    assert faults.seen == times + 1
    # past the client's own retries, the store's loop takes over
    store_retried = "transient storage error, retrying" in caplog.text
    assert store_retried == (times > CLIENT_RETRIES)


def test_a_lasting_transient_error_fails_clearly(s3_server, s3_bucket, monkeypatch, caplog):
    secret = "sUp3rS3cretValue"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    bucket = s3_bucket.removeprefix("s3://")
    store = S3Store(bucket, endpoint_url=s3_server.endpoint_url, attempts=2)
    faults = _Faults(store, "InternalError", times=1_000_000)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(StorageError) as err:
        store.get("data/k.bin")
    message = str(err.value)
    assert f"s3://{bucket}/data/k.bin" in message
    assert "InternalError" in message and "gave up after 2 attempts" in message
    assert faults.seen == 2 * (CLIENT_RETRIES + 1)
    assert secret not in message and secret not in caplog.text


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
    assert canonical_uri("s3://bucket/prefix") == "s3://bucket/prefix"
    for bad in ("http://x/y", "s3://bucket/../c", "file:///a/../b", "s3:///nobucket"):
        with pytest.raises(StorageError):
            canonical_uri(bad)
    with pytest.raises(StorageError, match="scheme"):
        open_store("gs://bucket")


def test_the_store_s_retry_loop(monkeypatch, caplog):
    """Transient errors retried with doubling pauses (jitter of half to one and a half), the last one's
    reason named when the attempts run out; a lasting error or a foreign exception at once, unretried."""
    import random
    import time

    from botocore.exceptions import ClientError, EndpointConnectionError
    from dfp_shared.storage import retry as storage

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(random, "random", lambda: 0.75)  # jitter factor 1.25

    def failing(*errors, result="done"):
        calls = []

        def fn():
            calls.append(1)
            if len(calls) <= len(errors):
                raise errors[len(calls) - 1]
            return result
        return fn, calls

    slow = ClientError({"Error": {"Code": "SlowDown", "Message": "reduce your rate"},
                        "ResponseMetadata": {"HTTPStatusCode": 503}}, "GetObject")
    down = EndpointConnectionError(endpoint_url="http://s3.test")
    fn, calls = failing(slow, down)
    with caplog.at_level(logging.WARNING, logger="dfp_shared.storage.retry"):
        assert storage._retry(fn, "s3://b/k", attempts=5) == "done"
    assert len(calls) == 3 and slept == [0.25, 0.5]
    logged = [(r.attempt, r.delay_s, r.reason) for r in caplog.records if r.msg == "transient storage error, retrying"]
    assert logged == [(1, 0.25, "SlowDown: reduce your rate"),
                      (2, 0.5, 'EndpointConnectionError: Could not connect to the endpoint URL: "http://s3.test"')]

    slept.clear()
    fn, calls = failing(down, slow, down, slow)
    with pytest.raises(StorageError) as err:
        storage._retry(fn, "s3://b/k", attempts=3, base_delay=1.0)
    assert str(err.value) == "s3://b/k: EndpointConnectionError: Could not connect to the endpoint URL: " \
                             '"http://s3.test" (gave up after 3 attempts)'
    assert err.value.__cause__ is None and len(calls) == 3 and slept == [1.25, 2.5]

    slept.clear()
    fn, calls = failing(slow)
    with pytest.raises(StorageError, match=r"^s3://b/k: SlowDown: reduce your rate \(gave up after 1 attempts\)$"):
        storage._retry(fn, "s3://b/k", attempts=1)
    missing = ClientError({"Error": {"Code": "NoSuchKey"}, "ResponseMetadata": {"HTTPStatusCode": 404}}, "GetObject")
    fn, calls = failing(missing)
    with pytest.raises(NotFound, match="s3://b/k: no such object"):
        storage._retry(fn, "s3://b/k")
    assert len(calls) == 1
    denied = ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject")
    fn, calls = failing(denied)
    with pytest.raises(StorageError, match="access denied"):
        storage._retry(fn, "s3://b/k")
    assert len(calls) == 1
    foreign = ValueError("not a storage error")
    fn, calls = failing(foreign)
    with pytest.raises(ValueError) as err:
        storage._retry(fn, "s3://b/k")
    assert err.value is foreign and len(calls) == 1 and slept == []
