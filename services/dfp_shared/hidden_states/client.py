"""gRPC client of the target service (a :class:`~dfp_shared.hidden_states.HiddenStateSource`).

- async (``grpc.aio``), several calls in flight at once (``max_in_flight``);
- replicas: each address (``host:port``, ``dns:///name:port``, comma-separated for several) is
  resolved to all its A records (a headless Service's DNS name gives one per pod) and calls go
  round-robin over every replica, ``channels_per_replica`` TCP connections each; names are
  resolved again after failures, so restarted pods with new addresses are found;
- retries with exponential backoff and jitter on UNAVAILABLE and RESOURCE_EXHAUSTED; a retry asks
  only for the sequences not yet received, on the next replica;
- zero-copy decode: each sequence's chunks land in one preallocated bytearray that
  ``torch.frombuffer`` views;
- same-node fast path (``shm_dir``): the tensors come through a shared-memory segment this client
  owns (see :mod:`dfp_shared.hidden_states.shm_transport`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import threading
import time
import uuid

import grpc
import torch

from dfp_shared.hidden_states.contract import HiddenStateSource, InvalidInput, ModelInfo, SourceUnavailable
from dfp_shared.hidden_states.model_info import channel_options, info_from_message
from dfp_shared.hidden_states.packing import plan_requests
from dfp_shared.hidden_states.tensor_codec import to_dtype
from dfp_shared.hidden_states.wire import (
    HIDDEN_STATES_METHOD,
    MODEL_INFO_METHOD,
    SequenceAssembler,
    decode_chunk,
    pack_tokens,
)
from dfp_shared.rpc import target_pb2 as pb

log = logging.getLogger(__name__)

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


def split_host_port(address: str) -> tuple[str, int]:
    address = address.strip()
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if address.startswith(prefix):
            address = address[len(prefix):]
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest.lstrip(":") or "50051"
    else:
        host, _, port = address.rpartition(":") if ":" in address else (address, "", "50051")
    if not host or not port.isdigit():
        raise ValueError(f"target address {address!r} is not host:port")
    return host, int(port)


def resolve(addresses: str | list[str]) -> list[str]:
    """Every replica behind the addresses: each name resolved to all its A/AAAA records, as ``ip:port``."""
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    out: list[str] = []
    for item in filter(None, (a.strip() for a in items)):
        host, port = split_host_port(item)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            infos = []
        ips = sorted({info[4][0] for info in infos}, key=lambda ip: (":" in ip, ip))
        for ip in ips or [host]:
            target = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            if target not in out:
                out.append(target)
    if not out:
        raise ValueError(f"no target addresses in {addresses!r}")
    return out


class Backoff:
    """Exponential retry delays from ``initial_s`` up to ``max_s``, for ``deadline_s`` seconds from its creation."""

    def __init__(self, deadline_s: float, initial_s: float, max_s: float):
        self._deadline = time.monotonic() + deadline_s
        self._delay, self._max_s = initial_s, max_s

    def expired(self) -> bool:
        return time.monotonic() > self._deadline

    def next_delay(self, jitter: bool = False) -> float:
        """The next delay (with jitter: between half and one and a half of it); doubles the one after."""
        delay = self._delay * (0.5 + random.random()) if jitter else self._delay
        self._delay = min(self._delay * 2, self._max_s)
        return delay


class TargetClient:
    def __init__(self, addresses: str | list[str], *, channels_per_replica: int = 2, max_in_flight: int = 8,
                 tokens_per_call: int = 8192, retry_deadline_s: float = 120.0, backoff_initial_s: float = 0.05,
                 backoff_max_s: float = 2.0, max_message_bytes: int = 64 << 20, timeout_s: float = 600.0,
                 shm_dir: str | None = None, resolve_every_s: float = 5.0):
        self.addresses = addresses
        self.channels_per_replica = channels_per_replica
        self.tokens_per_call = tokens_per_call
        self._retry = (retry_deadline_s, backoff_initial_s, backoff_max_s)  # a Backoff's arguments
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self.resolve_every_s = resolve_every_s
        self.replicas = resolve(addresses)
        self._resolved_at = time.monotonic()
        self._max_in_flight = max_in_flight
        self._semaphore: asyncio.Semaphore | None = None
        self._channels: dict[tuple[str, int], grpc.aio.Channel] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rr = 0
        self._info: ModelInfo | None = None
        self._info_lock = threading.Lock()
        self._shm_dir = shm_dir
        self._pool = None
        self.stats = {"calls": 0, "retries": 0, "chunks": 0, "bytes": 0}

    # ------------------------------------------------------------------ model info (sync, cached)

    def model_info(self) -> ModelInfo:
        with self._info_lock:
            if self._info is None:
                self._info = self._fetch_info()
            return self._info

    def _fetch_info(self) -> ModelInfo:
        backoff = Backoff(*self._retry)
        while True:
            errors = []
            for target in self.replicas:
                with grpc.insecure_channel(target, options=channel_options(self.max_message_bytes)) as ch:
                    call = ch.unary_unary(MODEL_INFO_METHOD, request_serializer=pb.ModelInfoRequest.SerializeToString,
                                          response_deserializer=pb.ModelInfo.FromString)
                    try:
                        return info_from_message(call(pb.ModelInfoRequest(), timeout=10))
                    except grpc.RpcError as exc:
                        errors.append(f"{target}: {exc.code().name} {exc.details()}")
            if backoff.expired():
                raise SourceUnavailable("target unreachable: " + "; ".join(errors))
            time.sleep(backoff.next_delay())
            self._maybe_resolve(force=True)

    # ------------------------------------------------------------------ channels

    def _maybe_resolve(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._resolved_at < self.resolve_every_s:
            return
        try:
            self.replicas = resolve(self.addresses)
        except ValueError:
            return
        self._resolved_at = time.monotonic()

    def _next_stub(self):
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # channels belong to one event loop
            self._channels.clear()
            self._loop = loop
            self._semaphore = asyncio.Semaphore(self._max_in_flight)
        slots = [(r, k) for r in self.replicas for k in range(self.channels_per_replica)]
        slot = slots[self._rr % len(slots)]
        self._rr += 1
        channel = self._channels.get(slot)
        if channel is None:
            options = channel_options(self.max_message_bytes) + [("dflash.channel", f"{slot[1]}-{uuid.uuid4().hex}")]
            channel = self._channels[slot] = grpc.aio.insecure_channel(slot[0], options=options)
        return slot[0], channel.unary_stream(HIDDEN_STATES_METHOD,
                                             request_serializer=pb.HiddenStatesRequest.SerializeToString,
                                             response_deserializer=None)

    def _shm_pool(self):
        if self._shm_dir and self._pool is None:
            from dfp_shared.hidden_states.shm_transport import ShmPool

            self._pool = ShmPool(self._shm_dir)
        return self._pool

    # ------------------------------------------------------------------ hidden states

    async def hidden_states(self, sequences: list[torch.Tensor], layer_ids: list[int]) -> list[torch.Tensor]:
        info = self._info or await asyncio.to_thread(self.model_info)  # blocking fetch off the event loop
        if not sequences:
            return []
        self._next_stub()  # binds channels and the semaphore to this loop
        budget = min(self.tokens_per_call, info.max_tokens_per_request or self.tokens_per_call)
        groups = plan_requests([int(s.numel()) for s in sequences], budget)
        parts = await asyncio.gather(*(self._limited(sequences, g, list(layer_ids or info.layer_ids), info)
                                       for g in groups))
        out: list[torch.Tensor | None] = [None] * len(sequences)
        for group, tensors in zip(groups, parts):
            for i, t in zip(group, tensors):
                out[i] = t
        return out  # type: ignore[return-value]

    async def _limited(self, sequences, group, layer_ids, info):
        async with self._semaphore:
            return await self._call({i: sequences[i] for i in group}, group, layer_ids, info)

    async def _call(self, pending: dict[int, torch.Tensor], order: list[int], layer_ids: list[int],
                    info: ModelInfo) -> list[torch.Tensor]:
        results: dict[int, torch.Tensor] = {}
        backoff = Backoff(*self._retry)
        pool = self._shm_pool()
        itemsize = to_dtype(info.dtype).itemsize
        while pending:
            idx = sorted(pending)
            tokens, lengths = pack_tokens([pending[i] for i in idx])
            request = pb.HiddenStatesRequest(token_ids=tokens, token_dtype="int32", lengths=lengths,
                                             layer_ids=layer_ids, sequence_numbers=idx)
            segment = None
            if pool is not None:
                segment = pool.acquire(sum(lengths) * len(layer_ids) * info.hidden_size * itemsize)
                request.shm.name, request.shm.size, request.shm.token = segment.name, segment.size, segment.token
            target, stub = self._next_stub()
            self.stats["calls"] += 1
            try:
                await self._receive(stub(request, timeout=self.timeout_s), idx, pending, results, segment)
                if pending:
                    raise SourceUnavailable(f"{target} ended the reply without sequences {sorted(pending)}")
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    if segment is not None and "shared-memory" in (exc.details() or ""):
                        log.warning("shared memory not usable with %s, using gRPC: %s", target, exc.details())
                        self._shm_dir, pool = None, None
                        continue
                    raise InvalidInput(exc.details()) from None
                if code not in RETRYABLE or backoff.expired():
                    raise SourceUnavailable(f"target {target}: {code.name} {exc.details()}") from None
                self.stats["retries"] += 1
                log.warning("target call to %s failed (%s: %s), retrying %d sequences", target, code.name,
                            exc.details(), len(pending))
                await asyncio.sleep(backoff.next_delay(jitter=True))
                self._maybe_resolve()
            finally:
                if segment is not None and pool is not None:
                    pool.release(segment)
        return [results[i] for i in order]

    async def _receive(self, call, idx, pending, results, segment) -> None:
        partial: dict[int, SequenceAssembler] = {}
        async for message in call:
            header, data = decode_chunk(message)
            i = idx[header.sequence]
            self.stats["chunks"] += 1
            if header.in_shm:  # zero-copy view; the segment is reused once every view of it is gone
                self._pool.hold(segment)
                results[i] = segment.view(header.shm_offset, to_dtype(header.dtype), list(header.shape),
                                          on_free=lambda seg=segment, pool=self._pool: pool.release(seg))
                self.stats["bytes"] += header.total_bytes
                pending.pop(i, None)
                continue
            if header.dtype:
                partial[i] = SequenceAssembler(header)
            self.stats["bytes"] += len(data)
            if partial[i].add(header, data):
                results[i] = partial.pop(i).tensor()
                pending.pop(i, None)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def open_hidden_state_source(target_url: str, model_dir: str | None = None, **kwargs) -> HiddenStateSource:
    """``inprocess`` → the model loaded here from ``model_dir``; else a client of the gRPC address(es)."""
    if target_url.strip().lower() == "inprocess":
        if not model_dir:
            raise ValueError("an in-process target needs the model directory")
        from dfp_shared.hidden_states.local import InProcessTarget

        return InProcessTarget(model_dir, **kwargs)
    return TargetClient(target_url, **kwargs)
