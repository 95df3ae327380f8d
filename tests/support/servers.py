"""Real servers for tests: a private redis-server on a free port, moto's S3 server."""

from __future__ import annotations

import os
from pathlib import Path

from dfp_dev.local.redis_server import RedisServer, free_port, redis_binary, wait_for_port

__all__ = ["MlflowServer", "RedisServer", "S3Server", "free_port", "redis_binary", "wait_for_port"]


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


class MlflowServer:
    """A real ``mlflow server`` (SQLite backend, artifacts in a directory) on a free loopback port."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> MlflowServer:
        import subprocess
        import sys

        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "server.log", "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
             "--default-artifact-root", str(self.root / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_port(self.port, timeout=timeout)
        except Exception:
            self.stop()
            raise RuntimeError("mlflow server did not start: " + (self.root / "server.log").read_text()[-2000:]) from None
        return self

    def stop(self) -> None:
        import os
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
