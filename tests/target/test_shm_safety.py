"""Attacks on the shared-memory fast path by a local process that can send gRPC requests, guess or
list segment names and plant files: symlinks and other files under segment names, another client's
segment, a segment directory that others can reach. Each is refused and nothing is written."""

from __future__ import annotations

import os
import subprocess

import grpc
import pytest
import torch
from dfp_shared.hidden_states import TargetClient, shm_transport
from dfp_shared.hidden_states.wire import HIDDEN_STATES_METHOD
from dfp_shared.rpc import target_pb2 as pb

from tests.support.cli import cli_cmd, cli_env

from .support import random_sequences, run, shm_files

VICTIM_BYTES = 4 << 20
NAME = "dfp-hs-1-abcdef12-1.seg"
AS_ROOT = os.geteuid() == 0


def shm_request(name: str, size: int, token: bytes = b"", seqs=((1, 2, 3),)) -> pb.HiddenStatesRequest:
    flat = torch.cat([torch.tensor(s, dtype=torch.int32) for s in seqs])
    request = pb.HiddenStatesRequest(token_ids=flat.numpy().tobytes(), token_dtype="int32",
                                     lengths=[len(s) for s in seqs], layer_ids=[1])
    request.shm.name, request.shm.size, request.shm.token = name, size, token
    return request


def raw_call(port: int, request: pb.HiddenStatesRequest) -> list[bytes]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(HIDDEN_STATES_METHOD, request_serializer=pb.HiddenStatesRequest.SerializeToString,
                                    response_deserializer=None)
        return list(call(request, timeout=30))


def refused(port: int, request: pb.HiddenStatesRequest) -> str:
    with pytest.raises(grpc.RpcError) as err:
        raw_call(port, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    return err.value.details()


@pytest.fixture
def server(qwen3_model, tiny_qwen3_dir, make_server, shm_dir):
    return make_server(qwen3_model, tiny_qwen3_dir, shm_dir=str(shm_dir))


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.bin"
    path.write_bytes(b"V" * VICTIM_BYTES)
    return path


def test_segments_live_in_a_private_directory(server, shm_dir):
    private = shm_transport.segment_dir(shm_dir)
    st = os.lstat(private)
    assert private.parent == shm_dir and (st.st_mode & 0o777) == 0o700 and st.st_uid == os.geteuid()
    with shm_transport.ShmPool(shm_dir) as pool:
        seg = pool.acquire(10)
        assert seg.path.parent == private and (os.stat(seg.path).st_mode & 0o777) == 0o600
        assert shm_files(shm_dir) == sorted([seg.name, pool.lock_name])


def test_symlink_under_a_segment_name_is_not_followed(server, shm_dir, victim):
    for directory in (shm_dir, shm_transport.segment_dir(shm_dir)):  # the old place and the private one
        os.symlink(victim, directory / NAME)
    details = refused(server.port, shm_request(NAME, VICTIM_BYTES, token=b"t" * 16))
    assert NAME in details and "symbolic link" in details
    assert victim.read_bytes() == b"V" * VICTIM_BYTES


@pytest.mark.parametrize("plant, reason", [
    ("hardlink", "2 hard links"),
    ("fifo", "not a regular file"),
    ("directory", "cannot be opened"),
    ("readable", "mode 0644"),
    pytest.param("foreign", "owned by uid 4242", marks=pytest.mark.skipif(not AS_ROOT, reason="needs chown")),
])
def test_anything_but_a_private_regular_file_of_this_user_is_refused(server, shm_dir, victim, plant, reason):
    path = shm_transport.segment_dir(shm_dir) / NAME
    if plant == "hardlink":
        victim_in_tmpfs = shm_dir / "victim.bin"  # a hard link needs the same file system
        victim_in_tmpfs.write_bytes(victim.read_bytes())
        victim = victim_in_tmpfs
        os.link(victim, path)
    elif plant == "fifo":
        os.mkfifo(path, 0o600)
    elif plant == "directory":
        os.mkdir(path, 0o700)
    else:
        path.write_bytes(victim.read_bytes())
        os.chmod(path, 0o644 if plant == "readable" else 0o600)
        if plant == "foreign":
            os.chown(path, 4242, 4242)
        victim = path
    details = refused(server.port, shm_request(NAME, VICTIM_BYTES, token=b"t" * 16))
    assert NAME in details and reason in details, details
    if plant != "fifo" and plant != "directory":
        assert victim.read_bytes() == b"V" * VICTIM_BYTES


def test_a_client_cannot_name_another_clients_segment(server, shm_dir):
    async def go():
        owner = TargetClient(f"127.0.0.1:{server.port}", shm_dir=str(shm_dir))
        try:
            out = await owner.hidden_states(random_sequences([7]), [1])
            seg = owner._pool._all[owner._pool.names()[0]]
            before = bytes(seg.mm)
            del out
            with shm_transport.ShmPool(shm_dir) as other:  # a second client with its own segment and token
                own = other.acquire(1 << 16)
                attempts = {"no token": b"", "its own token": own.token, "a guessed token": bytes(16),
                            "the token of another segment": b"\x01" * 16}
                for label, token in attempts.items():
                    details = refused(server.port, shm_request(seg.name, seg.size, token=token, seqs=[[9] * 50]))
                    assert seg.name in details and "shm.token" in details, (label, details)
                assert bytes(seg.mm) == before  # never written
                # each still reaches its own segment
                raw_call(server.port, shm_request(own.name, own.size, token=own.token))
            again = await owner.hidden_states(random_sequences([7]), [1])
            assert owner.stats["calls"] == 2 and again[0].shape == (7, 64)
        finally:
            await owner.close()

    run(go())


@pytest.mark.parametrize("bad", [
    "../etc/passwd", "/etc/passwd", f"{NAME}\n", "dfp-hs-\u0661-abcdef12-1.seg", "dfp-hs-1-abcdef12-1.seg/",
    "dfp-hs-1-ABCDEF12-1.seg", "dfp-hs-1-abcdef12-1.lock", "", "dfp-hs-1-abcdef12-1.seg\x00",
])
def test_segment_names_are_validated_strictly(server, bad):
    details = refused(server.port, shm_request(bad, VICTIM_BYTES, token=b"t" * 16))
    assert "invalid shared-memory segment name" in details


def test_group_or_world_accessible_segment_directory_is_refused_at_start(qwen3_model, tiny_qwen3_dir, make_server,
                                                                         shm_dir):
    private = shm_transport.segment_dir(shm_dir)
    os.mkdir(private)
    os.chmod(private, 0o777)
    with pytest.raises(shm_transport.ShmError) as err:
        make_server(qwen3_model, tiny_qwen3_dir, shm_dir=str(shm_dir))
    assert str(private) in str(err.value) and "0777" in str(err.value)
    with pytest.raises(shm_transport.ShmError, match="0777"):  # the client refuses it too
        shm_transport.ShmPool(shm_dir)
    os.chmod(private, 0o750)
    with pytest.raises(shm_transport.ShmError, match="0750"):
        shm_transport.ShmPool(shm_dir)


def test_symlinked_segment_directory_is_refused(shm_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, shm_transport.segment_dir(shm_dir))
    with pytest.raises(shm_transport.ShmError) as err:
        shm_transport.ShmPool(shm_dir)
    assert str(shm_transport.segment_dir(shm_dir)) in str(err.value) and "symbolic link" in str(err.value)
    assert os.listdir(elsewhere) == []


@pytest.mark.skipif(not AS_ROOT, reason="needs chown")
def test_segment_directory_of_another_user_is_refused(shm_dir):
    private = shm_transport.segment_dir(shm_dir)
    os.mkdir(private, 0o700)
    os.chown(private, 4242, 4242)
    with pytest.raises(shm_transport.ShmError, match="owned by uid 4242"):
        shm_transport.ShmPool(shm_dir)


def test_serve_refuses_an_open_segment_directory_naming_it(tiny_qwen3_dir, shm_dir):
    private = shm_transport.segment_dir(shm_dir)
    os.mkdir(private)
    os.chmod(private, 0o777)
    cmd = cli_cmd("target", "serve", "--model", str(tiny_qwen3_dir), "--host", "127.0.0.1", "--port", "0",
                  "--shm-dir", str(shm_dir))
    proc = subprocess.run(cmd, env=cli_env(DFLASH_LOG_JSON="false"), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"shared-memory directory {private} has mode 0777" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr

