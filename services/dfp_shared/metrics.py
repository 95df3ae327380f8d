"""Prometheus metrics: one helper every long-running service uses to expose ``/metrics``."""

from __future__ import annotations

import logging

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest, start_http_server

log = logging.getLogger(__name__)


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> int:
    """Serve the default registry on ``http://addr:port/metrics`` in a daemon thread.

    ``port == 0`` disables it. Returns the port.
    """
    if port <= 0:
        return 0
    start_http_server(port, addr=addr)
    log.info("metrics endpoint listening", extra={"port": port})
    return port


def metrics_payload() -> tuple[bytes, str]:
    """Body and content type of the default registry, for frameworks that serve it themselves."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
