"""The forward pass that yields hidden states: only the requested layers are captured.

Forward hooks on the decoder layers keep the requested outputs, and the forward stops after the
deepest one, so neither the remaining layers, the LM head nor all layers' states are computed or
kept. The in-process target and the target service both run :func:`forward_batch`.
"""

from __future__ import annotations

import threading

import torch

from dfp_shared.hidden_states.packing import pad_batch


class _StopForward(Exception):
    pass


def decoder_of(model):
    """The base decoder (with ``layers`` and ``norm``) of a causal LM, also inside multimodal wrappers."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(base, "layers") and hasattr(base, "language_model"):
        base = base.language_model
    return base


def capture_layers(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Outputs of ``layer_ids`` for a (B, T) batch, concatenated: (B, T, K*H); stops after the deepest layer.

    Equals Hugging Face ``hidden_states[i + 1]`` for each layer ``i`` (for the last layer that is the
    final-normed output, as Hugging Face reports it).
    """
    base = decoder_of(model)
    layers = base.layers
    wanted = set(layer_ids)
    deepest = max(wanted)
    captured: dict[int, torch.Tensor] = {}

    def hook(index):
        def fn(_module, _args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
            if index == deepest:
                raise _StopForward

        return fn

    with _model_lock(model):  # hooks are per-model state: one capture at a time per model
        return _capture(base, layers, wanted, deepest, captured, hook, input_ids, attention_mask, layer_ids)


def _model_lock(model) -> threading.Lock:
    return model.__dict__.setdefault("_dflash_capture_lock", threading.Lock())


def _capture(base, layers, wanted, deepest, captured, hook, input_ids, attention_mask, layer_ids):
    handles = [layers[i].register_forward_hook(hook(i)) for i in sorted(wanted)]
    try:
        with torch.inference_mode():
            try:
                base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except _StopForward:
                pass
            if len(layers) - 1 in captured:  # HF reports the last layer after the final norm
                captured[len(layers) - 1] = base.norm(captured[len(layers) - 1])
    finally:
        for h in handles:
            h.remove()
    return torch.cat([captured[i] for i in layer_ids], dim=-1)  # (B, T, K*H)


def forward_batch(model, sequences: list[torch.Tensor], layer_ids: list[int]) -> list[torch.Tensor]:
    """One right-padded forward over ``sequences``; per sequence its (len_i, K*H) states on the CPU."""
    device = next(model.parameters()).device
    ids, mask = pad_batch(sequences, device)
    states = capture_layers(model, ids, mask, layer_ids)  # (B, T, K*H)
    out = []
    for row, seq in enumerate(sequences):
        out.append(states[row, : seq.numel()].to("cpu", copy=False).contiguous())
    return out
