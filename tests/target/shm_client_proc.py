"""A same-node client that kills itself (SIGKILL) as soon as the first tensor arrives through shared memory.

Usage: python -m tests.target.shm_client_proc PORT SHM_DIR [SEQUENCES [LENGTH]]
Prints ``owner <pool owner>`` and ``segments <names>`` first.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import torch
from dfp_shared.hidden_states import TargetClient


async def main(port: int, shm_dir: str, count: int = 6, length: int = 39) -> None:
    client = TargetClient(f"127.0.0.1:{port}", shm_dir=shm_dir, tokens_per_call=1 << 16)
    seqs = [torch.arange(1, length + 1, dtype=torch.int32) + k for k in range(count)]
    task = asyncio.ensure_future(client.hidden_states(seqs, [1, 2]))
    while client.stats["chunks"] == 0 and not task.done():
        await asyncio.sleep(0.001)
    if client.stats["chunks"] == 0:  # the call ended before any tensor came: exit with its error, not wait forever
        await task
        raise SystemExit("the call ended before its first tensor arrived")
    print("owner", client._pool.owner, flush=True)
    print("segments", " ".join(client._pool.names()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    await task


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], *(int(a) for a in sys.argv[3:5])))
