"""Run something on a module and leave its training state exactly as it was."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def preserved_training_state(module: nn.Module) -> Iterator[None]:
    """Restore parameters, buffers (BatchNorm statistics), gradients, the training flag
    and the RNG state on exit, so measuring a step does not change training."""
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    grads = {name: (None if p.grad is None else p.grad.detach().clone())
             for name, p in module.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    modes = {name: m.training for name, m in module.named_modules()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(params[name])
                p.grad = grads[name]
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
        for name, m in module.named_modules():
            m.training = modes[name]
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
