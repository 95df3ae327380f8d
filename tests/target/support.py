"""Helpers for the target tests: in-process servers, the server as a subprocess, shared-memory dirs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import torch

from tests.support.cli import cli_cmd, cli_env
from tests.support.servers import free_port, wait_for_port


def run(coro):
    return asyncio.run(coro)


def random_sequences(lengths, vocab: int = 150000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g, dtype=torch.int32) for n in lengths]


def hf_reference(model, sequences, layer_ids) -> list[torch.Tensor]:
    """Hugging Face ``hidden_states[i + 1]`` for each layer, on the right-padded batch of ``sequences``."""
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq.long()
        mask[row, : len(seq)] = 1
    with torch.inference_mode():
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    return [torch.cat([hs[i + 1][row, : len(seq)] for i in layer_ids], dim=-1) for row, seq in enumerate(sequences)]


def close_enough(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    """The stated tolerance for one sequence batched vs alone: max |a - b| <= rel * max |b| (fp32)."""
    return a.shape == b.shape and float((a - b).abs().max()) <= rel * float(b.abs().max())


def grpc_code(exc_info) -> grpc.StatusCode:
    return exc_info.value.code()


class ServerProcess:
    """``dflash-pipeline target serve`` in a subprocess on a fixed port (so it can be restarted there)."""

    def __init__(self, model_dir: Path, *args: str, port: int | None = None, env: dict | None = None):
        self.model_dir = model_dir
        self.args = list(args)
        self.port = port or free_port()
        # PYTHONFAULTHANDLER: a crash leaves its stack in the output
        self.env = cli_env(**{"DFLASH_LOG_JSON": "false", "PYTHONFAULTHANDLER": "1", **(env or {})})
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        cmd = cli_cmd("target", "serve", "--model", str(self.model_dir), "--host", "127.0.0.1",
                      "--port", str(self.port), *self.args)
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for_port(self.port, timeout=120)
        except TimeoutError:
            self.proc.kill()
            raise RuntimeError("target did not start:\n" + (self.proc.stdout.read() or "")) from None
        return self

    def ended(self) -> str:
        """How a server that exited ended, with its output (for an assertion's message)."""
        return f"target exited with {self.proc.wait()}:\n{self.proc.stdout.read()}"

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def shm_files(directory: Path) -> list[str]:
    """Segment and lock files in the private segment directory under ``directory``."""
    from dfp_shared.hidden_states.shm_transport import segment_dir

    private = segment_dir(directory)
    names = os.listdir(private) if private.is_dir() else []
    return sorted(n for n in names if n.startswith("dfp-hs") or n.startswith(".dfp-hs"))
