"""Hidden-state transport: bytes/s delivered into torch tensors, over loopback between two processes.

Payloads shaped like a real run: 2,048-token sequences, 5 layers, hidden size 4,096, bf16 (80 MiB
per sequence). The model forward is replaced by a precomputed tensor, so transport is what is
measured.

- project: the target service's gRPC path (``TargetServer`` + ``TargetClient``: pre-encoded
  chunks, several connections, reassembly into one preallocated buffer per sequence);
- baseline: the same values as protobuf ``repeated float`` (what a naive service does);
- limit: raw bytes over a plain TCP socket between two processes, received into one buffer;
- shm_vs_grpc: the same-node shared-memory path over the gRPC path.

Run: python tests/benchmarks/bench_hidden_states.py [--sequences 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "services"), str(ROOT)]

TOKENS, LAYERS, HIDDEN = 2048, 5, 4096
LAYER_IDS = [1, 4, 7, 10, 13]
SEQ_BYTES = TOKENS * LAYERS * HIDDEN * 2


def payload():
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn((TOKENS, LAYERS * HIDDEN), generator=g).to(torch.bfloat16)


# ------------------------------------------------------------------ servers (child processes)


def serve_target(port: int, chunk_bytes: int, shm_dir: str, ready) -> None:
    from dfp_shared.hidden_states import ModelInfo
    from dfp_target.server import TargetServer
    from dfp_target.settings import TargetSettings

    states = payload()
    info = ModelInfo(model_id="bench", fingerprint="bench", num_layers=16, hidden_size=HIDDEN, vocab_size=151670,
                     dtype="bfloat16", layer_ids=LAYER_IDS, max_tokens_per_request=65536, max_sequence_length=4096)
    settings = TargetSettings(model="bench", host="127.0.0.1", port=port, chunk_bytes=chunk_bytes, shm_dir=shm_dir,
                              max_batch_tokens=TOKENS, max_wait_ms=0)
    server = TargetServer(settings, info, run=lambda seqs, layers: [states[: len(s)] for s in seqs]).start()
    ready.set()
    server.server.wait_for_termination()


def serve_repeated_float(port: int, ready) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    floats_cls = repeated_float_class()
    values = payload().float().numpy().reshape(-1)
    per_msg = (4 << 20) // 4  # 4 MiB of float32 per message

    def stream(request, context):
        n = int.from_bytes(request, "little")
        for start in range(0, n, per_msg):
            msg = floats_cls()
            msg.values.extend(values[start:min(start + per_msg, n)].tolist())
            yield msg.SerializeToString()

    server = grpc.server(ThreadPoolExecutor(4), options=[("grpc.max_send_message_length", 64 << 20)])
    handler = grpc.method_handlers_generic_handler("bench.Floats", {"Get": grpc.unary_stream_rpc_method_handler(stream)})
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    server.wait_for_termination()


def serve_tcp(port: int, ready) -> None:
    from dfp_shared.hidden_states.tensor_codec import tensor_bytes

    data = tensor_bytes(payload())
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        ready.set()
        while True:
            conn, _ = listener.accept()
            with conn:
                count = int.from_bytes(conn.recv(8), "little")
                for _ in range(count):
                    conn.sendall(data)


def repeated_float_class():
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fd = descriptor_pb2.FileDescriptorProto(name="bench_floats.proto", package="bench", syntax="proto3")
    msg = fd.message_type.add(name="Floats")
    msg.field.add(name="values", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Floats"))


# ------------------------------------------------------------------ clients (this process)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(target, *args):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=target, args=(*args, ready), daemon=True)
    proc.start()
    if not ready.wait(120):
        raise RuntimeError(f"{target.__name__} did not start")
    return proc


def best_rate(fn, nbytes: int, repeats: int) -> float:
    fn()  # warm-up (connections, first allocations)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = max(best, nbytes / (time.perf_counter() - t))
    return best


def measure_target(sequences: int, repeats: int, chunk_bytes: int, channels: int, shm_dir: str | None) -> float:
    import torch
    from dfp_shared.hidden_states import TargetClient

    port = free_port()
    proc = start(serve_target, port, chunk_bytes, shm_dir or "")
    seqs = [torch.zeros(TOKENS, dtype=torch.int32) for _ in range(sequences)]
    loop = asyncio.new_event_loop()
    client = TargetClient(f"127.0.0.1:{port}", channels_per_replica=channels, tokens_per_call=TOKENS,
                          shm_dir=shm_dir, max_in_flight=sequences)

    def once():
        out = loop.run_until_complete(client.hidden_states(seqs, LAYER_IDS))
        assert out[0].shape == (TOKENS, LAYERS * HIDDEN) and out[0].dtype == torch.bfloat16

    try:
        return best_rate(once, sequences * SEQ_BYTES, repeats)
    finally:
        loop.run_until_complete(client.close())
        loop.close()
        proc.kill()


def measure_repeated_float(tokens: int, repeats: int) -> float:
    import grpc
    import torch

    floats_cls = repeated_float_class()
    port = free_port()
    proc = start(serve_repeated_float, port)
    n = tokens * LAYERS * HIDDEN
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)])
    call = channel.unary_stream("/bench.Floats/Get", request_serializer=None, response_deserializer=floats_cls.FromString)

    def once():
        parts = [torch.tensor(msg.values, dtype=torch.float32) for msg in call(n.to_bytes(8, "little"))]
        out = torch.cat(parts).to(torch.bfloat16).view(tokens, LAYERS * HIDDEN)
        assert out.numel() == n

    try:
        return best_rate(once, n * 2, repeats)  # bytes of the bf16 tensor delivered
    finally:
        channel.close()
        proc.kill()


def measure_tcp(sequences: int, repeats: int) -> float:
    import torch

    port = free_port()
    proc = start(serve_tcp, port)

    def once():
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(sequences.to_bytes(8, "little"))
            for _ in range(sequences):
                buf = bytearray(SEQ_BYTES)
                view, got = memoryview(buf), 0
                while got < SEQ_BYTES:
                    got += conn.recv_into(view[got:], SEQ_BYTES - got)
                torch.frombuffer(buf, dtype=torch.bfloat16).view(TOKENS, LAYERS * HIDDEN)

    try:
        return best_rate(once, sequences * SEQ_BYTES, repeats)
    finally:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=4, help="2,048-token sequences per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (best kept)")
    parser.add_argument("--chunk-mib", type=float, default=4, help="gRPC data chunk size in MiB")
    parser.add_argument("--channels", type=int, default=2, help="TCP connections per replica")
    parser.add_argument("--baseline-tokens", type=int, default=256, help="tokens sent as repeated float (slow)")
    args = parser.parse_args()
    chunk = int(args.chunk_mib * (1 << 20))

    limit = measure_tcp(args.sequences, args.repeats)
    print(f"limit (raw TCP)        {limit / 1e9:.3f} GB/s", flush=True)
    project = measure_target(args.sequences, args.repeats, chunk, args.channels, None)
    print(f"project (gRPC path)    {project / 1e9:.3f} GB/s", flush=True)
    shm_base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="dfp-bench-shm-", dir=shm_base) as shm_dir:
        shm = measure_target(args.sequences, args.repeats, chunk, args.channels, shm_dir)
    print(f"same-node (shm path)   {shm / 1e9:.3f} GB/s", flush=True)
    baseline = measure_repeated_float(args.baseline_tokens, max(1, args.repeats - 1))
    print(f"baseline (repeated float) {baseline / 1e9:.3f} GB/s", flush=True)
    print(json.dumps({
        "benchmark": "hidden_states", "unit": "bytes/s",
        "project": round(project), "baseline": round(baseline), "limit": round(limit),
        "vs_baseline": round(project / baseline, 3), "vs_limit": round(project / limit, 3),
        "shm": round(shm), "shm_vs_grpc": round(shm / project, 3),
        "sequences": args.sequences, "tokens": TOKENS, "layers": LAYERS, "hidden": HIDDEN, "dtype": "bfloat16",
        "chunk_bytes": chunk, "channels": args.channels,
    }))


if __name__ == "__main__":
    main()
