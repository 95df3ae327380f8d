"""What the app holds for its lifetime: settings, Redis clients, key ring, rate limiter, stream slots."""

from __future__ import annotations

from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from dfp_shared.jobs.redis_conn import connect
from dfp_shared.storage.roots import StorageRoots

from .auth import KeySet
from .quotas import StreamSlots
from .ratelimit import RateLimiter
from .settings import ApiSettings
from .store import AsyncJobReader


@dataclass
class ApiState:
    settings: ApiSettings
    redis: redis.Redis
    """Sync client for writes through the shared job code (used from worker threads)."""
    aredis: aioredis.Redis
    """Async client for the request path: reads and rate limits."""
    stream_redis: aioredis.Redis
    """Async client of the event streams alone: a pool of its own, so open streams (each holds a
    connection while it waits on Redis) never take the request path's connections."""
    probe_redis: aioredis.Redis
    """A few connections of /readyz alone: it reports Redis, not a pool that callers filled."""
    keyring: KeySet | None
    """None when authentication is disabled; reloads from its file when that changes."""
    limiter: RateLimiter
    stream_limiter: RateLimiter
    """The same buckets as ``limiter``, on the streams' pool: a stream is admitted without the request path's."""
    reader: AsyncJobReader
    stream_reader: AsyncJobReader
    streams: StreamSlots
    roots: StorageRoots
    """The storage every URI of a submitted spec must lie in."""

    @classmethod
    def build(cls, settings: ApiSettings) -> ApiState:
        def client(**pool) -> aioredis.Redis:
            return aioredis.Redis.from_url(settings.redis_url, decode_responses=True, socket_connect_timeout=3,
                                           health_check_interval=30, **pool)

        aclient = client(max_connections=settings.redis_max_connections)
        # a stream past the process's limit is refused before it asks for a connection; the few over
        # it cover the slot bookkeeping of streams opening and closing meanwhile
        sclient = client(max_connections=settings.max_event_streams + 16)
        probe = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            settings.redis_url, decode_responses=True, socket_connect_timeout=3, socket_timeout=3,
            max_connections=4, timeout=3))
        keyring = None if settings.auth_disabled else KeySet(settings.api_keys or "")
        return cls(
            settings=settings,
            redis=connect(settings.redis_url, retries=3),
            aredis=aclient,
            stream_redis=sclient,
            probe_redis=probe,
            keyring=keyring,
            limiter=RateLimiter(aclient, settings.rate_limit_per_s, settings.rate_limit_burst),
            stream_limiter=RateLimiter(sclient, settings.rate_limit_per_s, settings.rate_limit_burst),
            reader=AsyncJobReader(aclient),
            stream_reader=AsyncJobReader(sclient),
            streams=StreamSlots(sclient, settings.max_streams_per_key, settings.max_event_streams),
            roots=StorageRoots.from_settings(settings),
        )

    async def close(self) -> None:
        await self.aredis.aclose()
        await self.stream_redis.aclose()
        await self.probe_redis.aclose()
        self.redis.close()
