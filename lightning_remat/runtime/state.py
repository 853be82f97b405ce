"""Run something on a module and leave its training state exactly as it was."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lightning_remat.graph.trace import preserved_state


@contextlib.contextmanager
def preserved_training_state(module: nn.Module) -> Iterator[None]:
    """:func:`~lightning_remat.graph.trace.preserved_state` (buffers such as BatchNorm
    statistics, training flags, RNG) plus the parameters and their gradients, for runs that
    take optimizer steps or accumulate gradients (measuring a step, a batch-size trial)."""
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    grads = {name: (None if p.grad is None else p.grad.detach().clone())
             for name, p in module.named_parameters()}
    devices = sorted({p.device for p in module.parameters()}, key=str)
    with preserved_state(module, devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in module.named_parameters():
                    p.copy_(params[name])
                    p.grad = grads[name]
