"""Per-key rate limits: a token bucket kept in Redis, so every API replica shares it.

Each key's bucket is one hash (``dfp:ratelimit:<name>``: tokens, timestamp) updated by one Lua
script, atomically; Redis's own clock is used so replicas with skewed clocks agree.

A replica takes tokens in small batches (a *lease*: about 1/20 of the burst, at most 1/10 s of
the rate) and spends them locally for at most ``LEASE_TTL_S``; unspent tokens expire. Callers can
never get more than the shared bucket allows; the batching only saves a Redis round trip on most
requests. With a small burst the lease is one token, so every request asks Redis.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

_BUCKET = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local granted = math.min(math.floor(tokens), tonumber(ARGV[3]))
if granted < 0 then granted = 0 end
tokens = tokens - granted
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {granted, tostring(tokens)}
"""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    remaining: int
    retry_after_s: int
    """Whole seconds until one request is allowed again (0 when allowed)."""


LEASE_TTL_S = 0.5


class RateLimiter:
    """``await limiter.hit(name)`` takes one token from ``name``'s bucket."""

    def __init__(self, client: aioredis.Redis, rate_per_s: float, burst: int, prefix: str = "dfp:ratelimit:",
                 lease: int | None = None):
        self.rate = rate_per_s
        self.burst = burst
        self.prefix = prefix
        self.lease = lease or max(1, min(burst // 20, int(rate_per_s / 10), 100))
        self._local: dict[str, tuple[int, float]] = {}  # name -> (leased tokens left, expiry, monotonic)
        self._script = client.register_script(_BUCKET) if rate_per_s > 0 else None

    @property
    def enabled(self) -> bool:
        return self._script is not None

    async def hit(self, name: str) -> Decision:
        if self._script is None:
            return Decision(True, self.burst, 0)
        now = time.monotonic()
        left, expiry = self._local.get(name, (0, 0.0))
        if left > 0 and now < expiry:
            self._local[name] = (left - 1, expiry)
            return Decision(True, left - 1, 0)
        granted, tokens = await self._script(keys=[self.prefix + name], args=[self.rate, self.burst, self.lease])
        granted, tokens = int(granted), float(tokens)
        if granted > 0:
            self._local[name] = (granted - 1, now + LEASE_TTL_S)
            return Decision(True, int(tokens) + granted - 1, 0)
        self._local.pop(name, None)
        return Decision(False, 0, max(1, math.ceil((1 - tokens) / self.rate)))
