"""Cross-entropy of hidden states through the frozen LM head, computed in one reused buffer.

``head_cross_entropy(hidden, labels, lm_head)`` returns the same per-row cross-entropy (and argmax hits)
as ``F.cross_entropy(lm_head(hidden).float(), labels, reduction="none")``, bit for bit, and the same
gradients: the same kernels run (``addmm``/``mm``, ``_log_softmax``, ``_log_softmax_backward_data``,
the input-gradient ``mm``), only writing into one full-vocabulary buffer instead of four fresh ones.

Why: on the CPU those buffers (rows x vocabulary floats, ~90 MB for a few hundred rows of a 49k-word
vocabulary) are the drafter step's cost beside the two LM-head GEMMs, and most of that cost is first
touching freshly mapped memory (a fresh ``log_softmax`` output costs four times the in-place one). So
the logits are written into a buffer kept from the previous call, turned into log-probabilities in
place, saved, and turned into the logits' gradient in place by the backward, which then gives the
buffer back. A second buffer holds the one-hot gradient the backward starts from. Buffers are pooled
on the CPU only (CUDA's caching allocator already reuses memory) and only up to ``POOL_MAX_BYTES``.
The backward consumes its saved buffer, so the graph cannot be walked twice (``retain_graph``): a
second backward raises.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

POOL_MAX_BYTES = 512 << 20  # larger buffers are not kept between calls
_pool: list[torch.Tensor] = []  # free buffers (1-D), at most two
_lock = threading.Lock()


def _take(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised (rows, cols) tensor of ``like``'s dtype and device, from the pool when one fits."""
    n = rows * cols
    if like.device.type == "cpu":
        with _lock:
            for i, buf in enumerate(_pool):
                if buf.dtype == like.dtype and buf.numel() >= n:
                    return _pool.pop(i)[:n].view(rows, cols)
    return torch.empty(n, dtype=like.dtype, device=like.device)[:n].view(rows, cols)


def _give(t: torch.Tensor) -> None:
    """Return the buffer under ``t`` (a tensor from :func:`_take` nobody reads any more) to the pool."""
    base = t._base if t._base is not None else t
    if base.device.type != "cpu" or base.numel() * base.element_size() > POOL_MAX_BYTES:
        return
    with _lock:
        _pool.append(base)
        _pool.sort(key=torch.Tensor.numel, reverse=True)
        del _pool[2:]


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, labels, weight, bias, keep):
        x = hidden.to(weight.dtype)
        if weight.dtype == torch.float32:  # what F.linear runs, into the pooled buffer
            logits = _take(x.shape[0], weight.shape[0], weight)
            if bias is None:
                torch.mm(x, weight.t(), out=logits)
            else:
                torch.addmm(bias, x, weight.t(), out=logits)
        else:
            logits = F.linear(x, weight, bias).float()
        correct = (logits.argmax(-1) == labels).float()
        logp = torch._log_softmax(logits, -1, False, out=logits)  # in place
        ce = -logp.gather(1, labels[:, None]).squeeze(1)
        if keep:
            ctx.save_for_backward(logp, labels, x, weight)
        else:
            _give(logp)
        ctx.hidden_dtype, ctx.has_bias, ctx.spent = hidden.dtype, bias is not None, False
        ctx.mark_non_differentiable(correct)
        return ce, correct

    @staticmethod
    def backward(ctx, grad_ce, _grad_correct):
        if ctx.spent:
            raise RuntimeError("head_cross_entropy's backward consumes its saved buffer: it cannot run twice")
        ctx.spent = True
        logp, labels, x, weight = ctx.saved_tensors
        rows = torch.arange(labels.shape[0], device=labels.device)
        grad_logp = _take(*logp.shape, logp).zero_()  # nll_loss's gradient: -g at each row's label
        grad_logp[rows, labels] = -grad_ce
        grad = torch._log_softmax_backward_data(grad_logp, logp, -1, torch.float32, out=logp)  # in place
        _give(grad_logp)
        need_x, _, need_w, need_b, _ = ctx.needs_input_grad
        grad_mm = grad.to(weight.dtype)
        grad_x = grad_mm.mm(weight).to(ctx.hidden_dtype) if need_x else None
        grad_w = grad_mm.t().mm(x) if need_w else None
        grad_b = grad_mm.sum(0) if need_b and ctx.has_bias else None
        del grad_mm
        _give(grad)
        return grad_x, None, grad_w, grad_b, None


def head_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor,
                       lm_head: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy (rows,) of ``lm_head(hidden)`` against ``labels`` and whether each row's argmax
    is its label (rows,) float, not differentiable. ``hidden`` (rows, H); ``labels`` (rows,) long."""
    weight, bias = lm_head.weight, lm_head.bias
    keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _HeadCrossEntropy.apply(hidden, labels, weight, bias, keep)
