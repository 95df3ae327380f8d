"""The target gRPC server: validates calls, feeds the dynamic batcher, streams hidden states back.

Replies are pre-encoded bytes (:mod:`dfp_shared.hidden_states.wire`), one tensor copy per chunk. A call
that names a shared-memory segment gets its tensors written there and a reply of handles only.
The standard health service and server reflection are registered; SIGTERM drains (health goes
NOT_SERVING, new calls are refused, calls in flight finish within ``drain_seconds``).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor

import grpc
from dfp_shared.hidden_states import (
    HIDDEN_STATES,
    MODEL_INFO,
    SERVICE,
    SHM_HEADER_BYTES,
    CodecError,
    InvalidInput,
    ModelInfo,
    SegmentCache,
    ShmError,
    dtype_name,
    encode_chunk,
    forward_batch,
    info_to_message,
    resolve_layers,
    server_options,
    tensor_chunks,
    to_dtype,
    unpack_tokens,
    validate_sequences,
)
from dfp_shared.rpc import target_pb2 as pb
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import metrics
from .batcher import BatcherClosed, DynamicBatcher, QueueFull
from .settings import TargetSettings

log = logging.getLogger(__name__)


class TargetServer:
    """gRPC server around a loaded model (or any ``run(sequences, layer_ids)`` function)."""

    def __init__(self, settings: TargetSettings, info: ModelInfo, model=None, run=None):
        self.settings = settings
        self.info = info
        run = run or (lambda seqs, layers: forward_batch(model, seqs, layers))
        self.batcher = DynamicBatcher(run, info.hidden_size, max_batch_tokens=settings.max_batch_tokens,
                                      max_wait_s=settings.max_wait_ms / 1000,
                                      max_queue_tokens=settings.max_queue_tokens,
                                      on_batch=metrics.observe_gpu_memory)
        self.itemsize = to_dtype(info.dtype).itemsize
        self.server = grpc.server(ThreadPoolExecutor(settings.handler_threads, thread_name_prefix="target-rpc"),
                                  options=server_options(settings.max_message_bytes))
        handlers = {
            MODEL_INFO.name: grpc.unary_unary_rpc_method_handler(
                self.get_model_info, request_deserializer=pb.ModelInfoRequest.FromString,
                response_serializer=pb.ModelInfo.SerializeToString),
            HIDDEN_STATES.name: grpc.unary_stream_rpc_method_handler(
                self.hidden_states, request_deserializer=pb.HiddenStatesRequest.FromString,
                response_serializer=None),  # replies are already-encoded bytes
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], self.server)
        self.port = self.server.add_insecure_port(f"{settings.host}:{settings.port}")
        self._stop = threading.Event()
        self._draining = False
        self._active = 0
        self._active_cond = threading.Condition()
        self._sweeper: threading.Thread | None = None
        self.segments: SegmentCache | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> TargetServer:
        if self.settings.shm_dir:  # creates (mode 0700) and checks the private segment directory
            self.segments = SegmentCache(self.settings.shm_dir)
            self.segments.sweep()
            self._sweeper = threading.Thread(target=self._sweep_loop, name="shm-sweeper", daemon=True)
            self._sweeper.start()
        self.server.start()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("target serving", extra={"port": self.port, "model_id": self.info.model_id,
                                          "layers": str(self.info.layer_ids)})
        return self

    def stop(self, grace: float | None = None, linger: float = 1.0) -> None:
        """Drain: refuse new calls, let calls in flight finish within ``grace`` seconds, stop the batcher.

        Calls in flight are awaited before the server stops, then ``linger`` seconds pass so callers
        read the last bytes before the connections close (a close with unread input resets them).
        """
        grace = self.settings.drain_seconds if grace is None else grace
        self.health.enter_graceful_shutdown()
        with self._active_cond:
            self._draining = True
            drained = self._active_cond.wait_for(lambda: self._active == 0, timeout=grace)
        if drained and linger:
            self._stop.wait(linger)
        self.server.stop(1.0).wait()
        self.batcher.close(timeout=grace + 5)
        self._stop.set()
        if self.segments is not None:
            self.segments.close()
        log.info("target stopped")

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.settings.shm_sweep_seconds):
            self._sweep()

    def _sweep(self) -> None:
        try:
            self.segments.sweep()
            self.segments.prune()
        except (OSError, ShmError):
            log.exception("shared-memory sweep failed")

    # ------------------------------------------------------------------ RPCs

    def get_model_info(self, request, context) -> pb.ModelInfo:
        return info_to_message(self.info)

    @staticmethod
    def _wait(fut, context, poll: float = 0.2):
        """The future's result, noticing a caller that went away while it waits."""
        while True:
            try:
                return fut.result(timeout=poll)
            except TimeoutError:
                if not context.is_active():
                    fut.cancel()
                    raise CancelledError from None

    def _call_ended(self) -> None:
        with self._active_cond:
            self._active -= 1
            self._active_cond.notify_all()

    def _parse(self, request: pb.HiddenStatesRequest):
        sequences = unpack_tokens(request)
        numbers = list(request.sequence_numbers) or list(range(len(sequences)))
        layers = resolve_layers(self.info, list(request.layer_ids))
        validate_sequences(self.info, sequences, numbers)
        segment = None
        if request.HasField("shm"):
            if not self.settings.shm_dir:
                raise InvalidInput("shared memory is disabled on this target")
            need = (sum(len(s) for s in sequences) * len(layers) * self.info.hidden_size * self.itemsize
                    + SHM_HEADER_BYTES)
            if request.shm.size < need:
                raise InvalidInput(f"shared-memory segment of {request.shm.size} bytes cannot hold {need} bytes "
                                   f"(its {SHM_HEADER_BYTES}-byte header and the tensors)")
            segment = self.segments.open(request.shm.name, need, request.shm.token)
        return sequences, layers, segment

    def hidden_states(self, request: pb.HiddenStatesRequest, context):
        with self._active_cond:
            if self._draining:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the target is draining; use another replica")
            self._active += 1
        context.add_callback(self._call_ended)
        try:
            sequences, layers, segment = self._parse(request)
        except (InvalidInput, CodecError, ValueError) as exc:
            metrics.INVALID.inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            futures = self.batcher.submit(sequences, layers)
        except QueueFull as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except BatcherClosed as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        state = {"done": False}

        def finished():
            for fut in futures:
                fut.cancel()
            if segment is not None and not state["done"]:  # the caller went away: reclaim dead clients' memory
                threading.Thread(target=self._sweep, daemon=True).start()

        context.add_callback(finished)
        offset = SHM_HEADER_BYTES  # tensors follow the segment's header
        for index, fut in enumerate(futures):
            try:
                states = self._wait(fut, context)
            except CancelledError:  # the caller went away (or the call was cancelled)
                if segment is not None:
                    self._sweep()
                return
            except Exception as exc:  # noqa: BLE001
                context.abort(grpc.StatusCode.INTERNAL, f"forward failed: {exc}")
            if segment is not None:
                try:
                    n = segment.write(offset, states)
                except ShmError as exc:  # mapping dropped (client died and was swept, or evicted): callers retry
                    context.abort(grpc.StatusCode.ABORTED, str(exc))
                yield encode_chunk(pb.HiddenStatesChunk(
                    sequence=index, dtype=dtype_name(states.dtype), shape=list(states.shape), total_bytes=n,
                    last=True, in_shm=True, shm_offset=offset))
                offset += n
                metrics.SENT_BYTES.labels("shm").inc(n)
            else:
                yield from tensor_chunks(index, states, self.settings.chunk_bytes)
                metrics.SENT_BYTES.labels("grpc").inc(states.numel() * states.element_size())
        state["done"] = True
