"""What the app holds for its lifetime: settings, Redis clients, key ring, rate limiter."""

from __future__ import annotations

from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from dfp_shared.redis_conn import connect
from dfp_shared.storage_roots import StorageRoots

from .auth import KeySet
from .ratelimit import RateLimiter
from .settings import ApiSettings
from .store import AsyncJobReader


@dataclass
class ApiState:
    settings: ApiSettings
    redis: redis.Redis
    """Sync client for writes through the shared job code (used from worker threads)."""
    aredis: aioredis.Redis
    """Async client for reads, event streams and rate limits."""
    keyring: KeySet | None
    """None when authentication is disabled; reloads from its file when that changes."""
    limiter: RateLimiter
    reader: AsyncJobReader
    roots: StorageRoots
    """The storage every URI of a submitted spec must lie in."""

    @classmethod
    def build(cls, settings: ApiSettings) -> ApiState:
        aclient = aioredis.Redis.from_url(settings.redis_url, decode_responses=True, socket_connect_timeout=3,
                                          health_check_interval=30, max_connections=256)
        keyring = None if settings.auth_disabled else KeySet(settings.api_keys or "")
        return cls(
            settings=settings,
            redis=connect(settings.redis_url, retries=3),
            aredis=aclient,
            keyring=keyring,
            limiter=RateLimiter(aclient, settings.rate_limit_per_s, settings.rate_limit_burst),
            reader=AsyncJobReader(aclient),
            roots=StorageRoots.from_settings(settings),
        )

    async def close(self) -> None:
        await self.aredis.aclose()
        self.redis.close()
