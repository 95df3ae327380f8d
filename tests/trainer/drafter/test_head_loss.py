"""The LM head's cross-entropy with the in-place softmax gradient equals the plain computation bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from dfp_trainer.drafter.head_loss import head_cross_entropy
from torch import nn


def _plain(hidden, labels, head):
    logits = head(hidden.to(head.weight.dtype)).float()
    return F.cross_entropy(logits, labels, reduction="none"), (logits.argmax(-1) == labels).float()


@pytest.mark.parametrize("bias", [False, True])
def test_equals_plain_cross_entropy_forward_and_backward(bias):
    torch.manual_seed(0)
    head = nn.Linear(48, 3000, bias=bias)
    head.requires_grad_(False)
    hidden = torch.randn(37, 48) * 3
    labels = torch.randint(0, 3000, (37,))
    labels[:5] = head(hidden[:5]).argmax(-1)  # some hits
    weights = torch.rand(37)
    results = []
    for fn in (_plain, head_cross_entropy):
        h = hidden.clone().requires_grad_(True)
        ce, correct = fn(h, labels, head)
        (ce * weights).sum().backward()
        results.append((ce.detach(), correct, h.grad))
    (ce_a, ok_a, g_a), (ce_b, ok_b, g_b) = results
    assert torch.equal(ce_a, ce_b) and torch.equal(ok_a, ok_b)
    assert ok_b[:5].eq(1).all() and not ok_b.requires_grad
    assert torch.equal(g_b, g_a)


def test_gradients_of_an_unfrozen_head_match():
    torch.manual_seed(1)
    results = []
    for fn in (_plain, head_cross_entropy):
        torch.manual_seed(1)
        head = nn.Linear(16, 200)
        h = torch.randn(9, 16, requires_grad=True)
        labels = torch.randint(0, 200, (9,))
        fn(h, labels, head)[0].sum().backward()
        results.append((h.grad, head.weight.grad, head.bias.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_a_second_backward_is_refused():
    head = nn.Linear(8, 50, bias=False)
    h = torch.randn(4, 8, requires_grad=True)
    ce, _ = head_cross_entropy(h, torch.randint(0, 50, (4,)), head)
    ce.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run twice"):
        ce.sum().backward()
