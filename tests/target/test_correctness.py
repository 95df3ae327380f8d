"""Hidden states over gRPC equal the model's own ``hidden_states[i + 1]``: bit-identical on the same
batch, and within the stated tolerance (max |diff| <= 1e-5 * max |h|, fp32) of each sequence alone,
for a tiny Qwen3 and a tiny Qwen3.5-style hybrid (linear- and full-attention layers)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from dfp_shared.hidden_states import InProcessTarget, TargetClient, forward_batch
from dfp_shared.hidden_states.forward import capture_layers, decoder_of

from .support import close_enough, hf_reference, random_sequences, run

LENGTHS = [7, 64, 33, 1, 120, 18]


@pytest.fixture(params=["qwen3", "hybrid"])
def target(request, tiny_qwen3_dir, tiny_hybrid_dir, qwen3_model, hybrid_model):
    if request.param == "qwen3":
        return qwen3_model, tiny_qwen3_dir
    assert {"linear_attention", "full_attention"} <= set(hybrid_model.config.layer_types)
    return hybrid_model, tiny_hybrid_dir


def test_grpc_bit_identical_to_hf_on_same_batch(target, make_server):
    model, model_dir = target
    server = make_server(model, model_dir, chunk_bytes=8192)  # many chunks per sequence
    num_layers = len(decoder_of(model).layers)
    layer_ids = [num_layers - 1, 1, num_layers // 2]  # any order; the last layer is HF's final-normed state
    sequences = random_sequences(LENGTHS)

    async def go():
        client = TargetClient(f"127.0.0.1:{server.port}")
        try:
            return await client.hidden_states(sequences, layer_ids), client.stats
        finally:
            await client.close()

    got, stats = run(go())
    expected = hf_reference(model, sequences, layer_ids)
    assert stats["chunks"] > len(sequences)
    hidden = server.info.hidden_size
    for seq, g, e in zip(sequences, got, expected):
        assert g.shape == (len(seq), len(layer_ids) * hidden) and g.dtype == torch.float32
        assert torch.equal(g, e)


def test_batched_within_tolerance_of_alone_and_in_process_matches(target):
    model, model_dir = target
    sequences = random_sequences(LENGTHS, seed=1)
    local = InProcessTarget(model_dir, model=model, token_budget=4096)
    layer_ids = local.model_info().layer_ids[::3]
    batched = run(local.hidden_states(sequences, layer_ids))
    assert all(torch.equal(b, e) for b, e in zip(batched, hf_reference(model, sequences, layer_ids)))
    for seq, b in zip(sequences, batched):
        alone = forward_batch(model, [seq], layer_ids)[0]
        assert close_enough(b, alone)
    run(local.close())


def test_capture_stops_after_deepest_layer(qwen3_model):
    layers = decoder_of(qwen3_model).layers
    calls = []
    handles = [layer.register_forward_hook(lambda *_a, i=i: calls.append(i)) for i, layer in enumerate(layers)]
    head_calls = []
    handles.append(qwen3_model.lm_head.register_forward_hook(lambda *_a: head_calls.append(1)))
    try:
        ids = torch.randint(0, 1000, (2, 9))
        out = capture_layers(qwen3_model, ids, torch.ones_like(ids), [3, 1])
    finally:
        for h in handles:
            h.remove()
    assert calls == [0, 1, 2, 3] and not head_calls
    assert out.shape == (2, 9, 2 * qwen3_model.config.hidden_size)


def test_dynamic_batching_across_callers(target, make_server):
    """Sequences of separate gRPC callers share forward passes, and each result stays within the stated
    tolerance of its sequence alone (for the hybrid too: its linear-attention layers see right padding)."""
    model, model_dir = target
    batches: list[int] = []
    lock = threading.Lock()

    def recording_run(seqs, layers):
        with lock:
            batches.append(len(seqs))
        return forward_batch(model, seqs, layers)

    server = make_server(model, model_dir, run=recording_run, max_wait_ms=100, max_batch_tokens=4096)
    callers = [random_sequences([5 + 7 * k, 40 - 3 * k], seed=10 + k) for k in range(6)]
    layer_sets = [[1, 4], [3, 4], [2, 6], [1, 4], [7], [0, 1, 2]]  # hybrid: 3 and 7 are full attention

    async def go():
        clients = [TargetClient(f"127.0.0.1:{server.port}") for _ in callers]
        try:
            return await asyncio.gather(*(c.hidden_states(s, ls) for c, s, ls in zip(clients, callers, layer_sets)))
        finally:
            for c in clients:
                await c.close()

    results = run(go())
    assert sum(batches) == 2 * len(callers)
    assert max(batches) > 2, f"no cross-caller batch formed: {batches}"
    for seqs, layers, outs in zip(callers, layer_sets, results):
        for seq, out in zip(seqs, outs):
            assert close_enough(out, forward_batch(model, [seq], layers)[0])
