"""moto's S3 server as its own process, optionally adding a fixed latency to every request.

Real object stores answer a GET after a round trip of tens of milliseconds; on loopback moto
answers in about one. ``--latency-ms`` restores that wait (a sleep, which overlaps across
concurrent requests exactly as network latency does) so a benchmark sees the regime where a
serial download loop actually loses its time.
"""

from __future__ import annotations

import argparse
import time

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--latency-ms", type=float, default=0.0)
    args = ap.parse_args()
    app = DomainDispatcherApplication(create_backend_app)
    delay = args.latency_ms / 1000

    def delayed(environ, start_response):
        if delay:
            time.sleep(delay)
        return app(environ, start_response)

    make_server("127.0.0.1", args.port, delayed, True, request_handler=MotoRequestHandler).serve_forever()


if __name__ == "__main__":
    main()
