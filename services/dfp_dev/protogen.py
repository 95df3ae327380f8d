"""Generate the gRPC Python code from ``protos/`` into ``dfp_shared.rpc`` (grpcio-tools).

Run ``python -m dfp_dev.protogen`` from the repository root after editing a ``.proto``.
The ``.proto`` files are mapped to the virtual path ``dfp_shared/rpc`` so the generated modules
import each other as ``dfp_shared.rpc.<name>_pb2``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTOS = REPO / "protos"
OUT = REPO / "services"
VIRTUAL = "dfp_shared/rpc"


def generate(out_dir: Path = OUT, protos_dir: Path = PROTOS) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    files = sorted(p.name for p in protos_dir.glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{VIRTUAL}={protos_dir}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}"] + [f"{VIRTUAL}/{f}" for f in files]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted((out_dir / VIRTUAL).glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    sys.exit(0)
