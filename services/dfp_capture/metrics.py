"""The pass-through's Prometheus counters (served on its own ``/metrics``)."""

from __future__ import annotations

from prometheus_client import Counter

REQUESTS = Counter("dfp_capture_requests_total", "Requests forwarded to the upstream, by route and outcome.",
                   ["route", "outcome"])
RECORDS = Counter("dfp_capture_records_written_total", "Completion records written to capture shards.")
INCOMPLETE = Counter("dfp_capture_records_incomplete_total",
                     "Records of streams whose client disconnected before the end (written, marked incomplete).")
DROPPED = Counter("dfp_capture_dropped_total",
                  "Captures not written, by reason (buffer_full, storage_error, malformed_reply, too_large, "
                  "upstream_status, unreadable_request, unsupported_prompt, unencodable).", ["reason"])
BYTES = Counter("dfp_capture_bytes_total", "Bytes passed through (proxied) and written to shards (written).",
                ["direction"])
SHARDS = Counter("dfp_capture_shards_total", "Shard files written (written) and deleted by retention (expired).",
                 ["event"])
REFUSALS = Counter("dfp_capture_refusals_total",
                   "Connections and requests refused at the front door, by reason (request_head, "
                   "request_head_timeout, connections).", ["reason"])


def dropped(reason: str, count: int = 1) -> None:
    DROPPED.labels(reason=reason).inc(count)
