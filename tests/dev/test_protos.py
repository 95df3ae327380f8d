"""The committed generated gRPC code is exactly what ``python -m dfp_dev.protogen`` produces."""

from __future__ import annotations

from pathlib import Path

from dfp_dev import protogen

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_fresh_protogen_run(tmp_path):
    fresh = protogen.generate(out_dir=tmp_path)
    assert fresh, "protogen produced nothing"
    committed_dir = ROOT / "services" / protogen.VIRTUAL
    fresh_names = sorted(p.name for p in fresh)
    committed_names = sorted(p.name for p in committed_dir.glob("*_pb2*.py*"))
    assert fresh_names == committed_names, "generated files differ from the committed set; run python -m dfp_dev.protogen"
    for path in fresh:
        committed = (committed_dir / path.name).read_text()
        assert path.read_text() == committed, f"{path.name} is stale; run python -m dfp_dev.protogen"
    assert {p.stem for p in (ROOT / "protos").glob("*.proto")} <= {n.split("_pb2")[0] for n in fresh_names}
