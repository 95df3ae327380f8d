"""Per-key rate limits: a token bucket kept in Redis, so every API replica shares it.

Each key's bucket is one hash (``dfp:ratelimit:<name>``: tokens, timestamp) updated by one Lua
script, atomically; Redis's own clock is used so replicas with skewed clocks agree.
"""

from __future__ import annotations

import math
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
local allowed = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, tostring(tokens)}
"""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    remaining: int
    retry_after_s: int
    """Whole seconds until one request is allowed again (0 when allowed)."""


class RateLimiter:
    """``await limiter.hit(name)`` takes one token from ``name``'s bucket."""

    def __init__(self, client: aioredis.Redis, rate_per_s: float, burst: int, prefix: str = "dfp:ratelimit:"):
        self.rate = rate_per_s
        self.burst = burst
        self.prefix = prefix
        self._script = client.register_script(_BUCKET) if rate_per_s > 0 else None

    @property
    def enabled(self) -> bool:
        return self._script is not None

    async def hit(self, name: str) -> Decision:
        if self._script is None:
            return Decision(True, self.burst, 0)
        allowed, tokens = await self._script(keys=[self.prefix + name], args=[self.rate, self.burst])
        tokens = float(tokens)
        if int(allowed):
            return Decision(True, int(tokens), 0)
        return Decision(False, 0, max(1, math.ceil((1 - tokens) / self.rate)))
