"""Run the target service: load the model, start the gRPC server and metrics, drain on SIGTERM."""

from __future__ import annotations

import logging

from dfp_shared.hidden_states import PrivateDir, ShmError, build_model_info
from dfp_shared.metrics import start_metrics_server
from dfp_shared.models.loading import load_causal_lm, local_model_dir
from dfp_shared.signals import StopSignals

from .server import TargetServer
from .settings import TargetSettings

log = logging.getLogger(__name__)


def build(settings: TargetSettings) -> TargetServer:
    """Load the checkpoint (bf16 on CUDA, fp32 on CPU by default) and build a server around it."""
    path = local_model_dir(settings.model, endpoint_url=settings.s3_endpoint_url)
    model = load_causal_lm(str(path), device=settings.device, dtype=settings.dtype)
    info = build_model_info(model, path, model_id=settings.model_id or None, layer_ids=settings.layer_ids or None,
                            max_tokens_per_request=settings.max_tokens_per_request,
                            max_message_bytes=settings.max_message_bytes)
    return TargetServer(settings, info, model=model)


def serve(settings: TargetSettings) -> None:
    """Serve until SIGTERM or SIGINT, then drain."""
    try:
        if settings.shm_dir:  # refuse an unsafe segment directory before loading the model
            PrivateDir(settings.shm_dir).close()
        server = build(settings).start()
    except ShmError as exc:
        raise SystemExit(f"Error: {exc}") from None
    start_metrics_server(settings.metrics_port)
    with StopSignals() as signals:
        print(f"target listening on port {server.port}", flush=True)
        signals.stop.wait()
        log.info("draining", extra={"grace_s": settings.drain_seconds})
        server.stop()
