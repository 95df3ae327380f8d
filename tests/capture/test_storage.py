"""Where captures go: storage failures cost captures, never requests; the queue is bounded; retention."""

from __future__ import annotations

import asyncio
import calendar
import time

import pytest
from dfp_capture.assemble import admit
from dfp_capture.proxy import wants_capture
from dfp_capture.settings import CaptureSettings, parse_patterns
from dfp_capture.writer import Capture, CaptureWriter, Redactor
from dfp_shared.storage.store import LocalStore, ObjectStore, StorageError, open_store

from .conftest import counter, records, wait_records
from .test_passthrough import CHAT, OPT_IN, raw


class DownStore(ObjectStore):
    """A store whose every write fails, as an unreachable S3 endpoint does."""

    def __init__(self):
        self.puts = 0

    def list(self, prefix="", page_size=1000):
        return iter(())

    def get(self, key):
        raise StorageError("down")

    def put(self, key, data):
        self.puts += 1
        raise StorageError("endpoint unreachable")

    def exists(self, key):
        return False

    def put_if_absent(self, key, data):
        return self.put(key, data)

    def delete(self, key):
        raise StorageError("down")


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_storage_down_costs_the_captures_never_the_requests(upstream, capture, tmp_path):
    store = DownStore()
    proxy = capture(store=store, capture_enabled=True)
    before = counter("dfp_capture_dropped_total", reason="storage_error")
    for stream in (False, True):
        body = {**CHAT, "stream": stream}
        assert raw(proxy.url, "/v1/chat/completions", body) == raw(upstream.url, "/v1/chat/completions", body)
    wait_for(lambda: counter("dfp_capture_dropped_total", reason="storage_error") - before == 2)
    assert store.puts >= 1


def test_an_unwritable_path_costs_the_captures_never_the_requests(upstream, capture, tmp_path):
    proxy = capture(capture_enabled=True)
    (tmp_path / "capture" / "completions").write_text("a file where the shards' folder should be")
    before = counter("dfp_capture_dropped_total", reason="storage_error")
    body = {**CHAT, "stream": True}
    assert raw(proxy.url, "/v1/chat/completions", body) == raw(upstream.url, "/v1/chat/completions", body)
    wait_for(lambda: counter("dfp_capture_dropped_total", reason="storage_error") - before == 1)
    assert records(tmp_path / "capture") == []


def _writer(store, **overrides) -> CaptureWriter:
    options = dict(worker="w", max_records=2, max_bytes=2**20, max_record_bytes=2**20, flush_interval_s=60,
                   retention_hours=24, sweep_interval_s=600)
    options.update(overrides)
    return CaptureWriter(store, Redactor([]), **options)


def _capture(text="hi") -> Capture:
    exchange = admit("chat", b'{"messages": [{"role": "user", "content": "%s"}]}' % text.encode(), 8, 4, 2**20)
    exchange.add(0, "answer", None, "stop")
    return Capture(exchange, time.time(), incomplete=False)


def test_a_full_queue_drops_captures_and_counts_them(tmp_path):
    writer = _writer(LocalStore(tmp_path))
    before = counter("dfp_capture_dropped_total", reason="buffer_full")
    assert [writer.submit(_capture()) for _ in range(3)] == [True, True, False]
    assert counter("dfp_capture_dropped_total", reason="buffer_full") - before == 1
    assert asyncio.run(writer.flush()) == 2
    assert len(records(tmp_path)) == 2
    small = _writer(LocalStore(tmp_path / "small"), max_records=100, max_bytes=1024)
    assert not small.submit(_capture("x" * 100))


def test_the_retention_sweep_deletes_old_shards_only(tmp_path):
    store = LocalStore(tmp_path)
    now = calendar.timegm((2026, 3, 10, 12, 30, 0, 0, 0, 0))
    keys = {"completions/20260309T11/w-a-000001.jsonl": True,  # its hour ended 25 h ago
            "completions/20260309T12/w-a-000002.jsonl": False,  # still inside the last 24 h
            "completions/20260310T12/w-a-000003.jsonl": False,
            "notes/20260101T00/keep.jsonl": False}
    for key in keys:
        store.put(key, b"{}\n")
    expired = _writer(store).sweep(now)
    assert sorted(expired) == sorted(k for k, old in keys.items() if old)
    assert sorted(store.list("")) == sorted(k for k, old in keys.items() if not old)


def test_opt_in_and_sampling():
    off = CaptureSettings(capture_enabled=False)
    on = CaptureSettings(capture_enabled=True)
    assert not wants_capture(off, {}) and wants_capture(off, {"X-DFlash-Capture": "1"})
    assert wants_capture(on, {}) and not wants_capture(on, {"X-DFlash-Capture": "0"})
    never = CaptureSettings(capture_enabled=True, capture_sample_rate=0.0)
    assert not any(wants_capture(never, {"X-DFlash-Capture": "1"}) for _ in range(50))
    custom = CaptureSettings(capture_header="X-Keep")
    assert wants_capture(custom, {"X-Keep": "yes"}) and not wants_capture(custom, {"X-DFlash-Capture": "1"})


def test_redaction_patterns_are_bounded_and_checked():
    assert parse_patterns('["a+", "b"]') == ["a+", "b"] and parse_patterns("a+\nb\n") == ["a+", "b"]
    for bad in ('["("]', "[" + ",".join(['"a"'] * 65) + "]", '["' + "a" * 513 + '"]'):
        with pytest.raises(ValueError):
            parse_patterns(bad)
    with pytest.raises(ValueError):
        CaptureSettings(capture_redact='["("]')


def test_captures_go_to_s3_too(upstream, capture, s3_server, s3_bucket):
    store = open_store(s3_bucket + "/capture", endpoint_url=s3_server.endpoint_url)
    proxy = capture(store=store, capture_enabled=True)
    raw(proxy.url, "/v1/chat/completions", {**CHAT, "stream": True}, OPT_IN)
    wait_for(lambda: any(store.list("completions/")))
    [key] = list(store.list("completions/"))
    assert key.startswith("completions/") and key.endswith(".jsonl") and b"echo: hello there" in store.get(key)


def test_the_capture_prefix_must_lie_inside_the_storage_roots(tmp_path):
    from dfp_capture.service import capture_store
    from dfp_shared.storage.uris import OutsideRoots

    with pytest.raises(OutsideRoots):
        capture_store(CaptureSettings(storage_url=f"file://{tmp_path}/root", allowed_prefixes="",
                                      capture_prefix="file:///etc/capture"))
    store = capture_store(CaptureSettings(storage_url=f"file://{tmp_path}/root", allowed_prefixes=""))
    assert store.uri.endswith("root/capture")


def test_records_wait_for_no_one(upstream, capture, tmp_path):
    """A slow flush interval does not hold a reply back; the record comes at the next flush."""
    proxy = capture(capture_enabled=True, capture_flush_interval_s=3.0)
    started = time.monotonic()
    raw(proxy.url, "/v1/chat/completions", CHAT)
    assert time.monotonic() - started < 3.0
    assert len(wait_records(tmp_path / "capture", 1)) == 1
