"""Wiring: the capture store inside the storage roots, the writer, the app, and uvicorn."""

from __future__ import annotations

import logging
import re
import socket

import uvicorn
from dfp_shared.http_front_door import front_door_protocol, uvicorn_options
from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import ObjectStore, open_store

from . import metrics
from .settings import CaptureSettings
from .writer import CaptureWriter, Redactor

log = logging.getLogger(__name__)


def capture_store(settings: CaptureSettings) -> ObjectStore:
    """The store at the capture prefix, which must lie inside the storage roots and outside the jobs' area."""
    roots = StorageRoots.from_settings(settings)
    prefix = roots.check(settings.prefix(), "DFLASH_CAPTURE_PREFIX")
    roots.check_explicit_output(prefix, "DFLASH_CAPTURE_PREFIX")
    return open_store(prefix, endpoint_url=settings.s3_endpoint_url, region=settings.s3_region)


def worker_name(settings: CaptureSettings) -> str:
    name = settings.capture_worker or re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64]
    return name or "capture"


def build_writer(settings: CaptureSettings, store: ObjectStore | None = None) -> CaptureWriter:
    return CaptureWriter(
        store or capture_store(settings), Redactor(settings.redact_patterns()), worker=worker_name(settings),
        max_records=settings.capture_queue_records, max_bytes=settings.capture_queue_bytes,
        max_record_bytes=settings.capture_max_record_bytes, flush_interval_s=settings.capture_flush_interval_s,
        retention_hours=settings.capture_retention_hours, sweep_interval_s=settings.capture_sweep_interval_s)


def build_app(settings: CaptureSettings, store: ObjectStore | None = None):
    from .proxy import create_app

    return create_app(settings, build_writer(settings, store))


def server_config(settings: CaptureSettings, app) -> uvicorn.Config:
    """uvicorn's configuration of the pass-through: behind the front door (head limits and timeout, keep-alive
    timeout, connection cap) with the settings' limits, its refusals counted in ``dfp_capture_refusals_total``."""
    return uvicorn.Config(app, host=settings.capture_host, port=settings.capture_port, lifespan="on",
                          access_log=False,
                          **uvicorn_options(settings, front_door_protocol(settings, metrics.REFUSALS)))


def serve(settings: CaptureSettings) -> None:
    app = build_app(settings)
    log.info("capture pass-through listening", extra={
        "host": settings.capture_host, "port": settings.capture_port, "upstream": settings.capture_upstream,
        "enabled": settings.capture_enabled, "sample_rate": settings.capture_sample_rate,
        "prefix": settings.prefix()})
    uvicorn.Server(server_config(settings, app)).run()
