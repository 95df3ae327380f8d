"""One way to reach the drafter inside its wrappers (DDP / DataParallel, torch.compile, nested)."""

from __future__ import annotations

import torch
from dfp_trainer.drafter.wrappers import unwrap


def test_unwrap_reaches_the_module_through_every_wrapper():
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model)  # nothing compiles until it is called
    assert unwrap(model) is model
    assert unwrap(compiled) is model
    assert unwrap(torch.nn.DataParallel(model)) is model
    assert unwrap(torch.nn.DataParallel(compiled)) is model
    assert unwrap(torch.compile(torch.nn.DataParallel(model))) is model
