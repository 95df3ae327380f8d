"""Redis connections that survive a Redis restart (retries with backoff on connection errors)."""

from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry


def connect(url: str, retries: int = 20) -> redis.Redis:
    """A client for ``url`` that reconnects for about half a minute before giving up."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError, ConnectionResetError],
        health_check_interval=30,
        socket_connect_timeout=5,
        socket_keepalive=True,
    )
