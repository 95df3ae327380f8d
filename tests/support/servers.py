"""Real servers for tests: a private redis-server on a free port, moto's S3 server."""

from __future__ import annotations

import os

from dfp_cli.demo_support.local_redis import RedisServer, free_port, redis_binary, wait_for_port

__all__ = ["RedisServer", "S3Server", "free_port", "redis_binary", "wait_for_port"]


class S3Server:
    """moto's threaded S3 server on a free loopback port, with fake credentials in the environment."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        self.server.start()
        wait_for_port(self.port)
        return self

    def stop(self) -> None:
        self.server.stop()

    def create_bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1").create_bucket(Bucket=name)
        return f"s3://{name}"
