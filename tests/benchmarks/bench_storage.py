"""Many small objects from an S3 API: the serial download loop vs the parallel path.

1,000 x 64 KiB objects on moto's S3 server (a separate process, so server and client do not
share a GIL). Baseline: one ``get_object`` after another (what the hand-written script did).
Project: ``ObjectStore.get_many`` on its bounded thread pool. Unit: objects/s.

The headline figures use a server that answers after ``--latency-ms`` (20 ms by default, a
typical first-byte time of an object store over a network); the same pair measured on bare
loopback, where moto's own CPU time bounds both, is reported beside them as ``loopback_*``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from _common import ROOT, report  # noqa: F401
from dfp_shared.storage.store import open_store

from tests.support.servers import free_port, wait_for_port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--objects", type=int, default=1000)
    ap.add_argument("--size-kib", type=int, default=64)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--latency-ms", type=float, default=20.0, help="per-request server latency of the headline run")
    args = ap.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    loop_serial, loop_parallel = measure(args, 0.0)
    serial, parallel = measure(args, args.latency_ms)
    report("storage", "objects/s", parallel, serial, objects=args.objects, size_kib=args.size_kib,
           workers=args.workers, latency_ms=args.latency_ms, loopback_project=round(loop_parallel, 1),
           loopback_baseline=round(loop_serial, 1), loopback_vs_baseline=round(loop_parallel / loop_serial, 3))


def measure(args, latency_ms: float) -> tuple[float, float]:
    """(serial, parallel) objects/s against a fresh server with the given per-request latency."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tests.support.s3_server_proc", "--port", str(port),
                               "--latency-ms", str(latency_ms)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, timeout=60)
        store = open_store("s3://bench", endpoint_url=f"http://127.0.0.1:{port}")
        store.ensure_bucket()
        payload = os.urandom(args.size_kib * 1024)
        keys = [f"objs/{i:05d}.bin" for i in range(args.objects)]
        store.put_many(((k, payload) for k in keys), max_workers=args.workers)

        t0 = time.perf_counter()
        for k in keys:
            store.client.get_object(Bucket="bench", Key=k)["Body"].read()
        serial = args.objects / (time.perf_counter() - t0)

        t0 = time.perf_counter()
        got = sum(len(data) for _, data in store.get_many(keys, max_workers=args.workers))
        parallel = args.objects / (time.perf_counter() - t0)
        assert got == args.objects * len(payload)
        return serial, parallel
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
