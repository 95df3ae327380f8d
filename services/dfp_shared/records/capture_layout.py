"""The capture layout, shared by the pass-through that writes it and the adaptation loop that reads it:
completion records under the capture prefix in hourly folders, ``completions/<YYYYMMDDTHH>/<shard>.jsonl``
(UTC), each record's ``meta.captured_at`` in :data:`CAPTURED_AT_FORMAT`."""

from __future__ import annotations

import re

HOUR_FORMAT = "%Y%m%dT%H"  # the hour folders, UTC
HOUR_RE = re.compile(r"^completions/(\d{8}T\d{2})/[^/]+\.jsonl$")  # a shard's key under the capture prefix
CAPTURED_AT_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # a record's meta.captured_at, UTC
SHARDS = "completions/"
