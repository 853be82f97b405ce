"""The first real training step under a plan, measured against the plan's prediction
(docs/design.md section 4.7: predicted against measured, a gap is a bug in the model).

On CUDA the user's own step is measured, from the module's forward to the end of the
backward its outputs start (the caller's loss included): the caching allocator's peak
counter costs the step nothing and leaves nothing running. The end of the backward is
where autograd runs the callbacks queued while it ran
(``Variable._execution_engine.queue_callback``, queued when the first of the outputs'
gradients is computed, ``torch.autograd.graph.register_multi_grad_hook``).

Elsewhere the CPU meter is a profiler or a dispatch mode: thread-local state, which the
autograd engine copies into the backward it runs and restores when the backward returns.
Entered in the forward, it could not be left at the end of the caller's backward (the
engine would put it back on the caller's thread), so it would stay on until the module's
next call. Instead, as the last part of planning, one metered step of the new plan runs
(:func:`metered_step`): the plan's forward, the loss the plan was made for and its
backward, with the meter entered and left around exactly that step; the module's state
(buffers, RNG, modes) and its gradients are as before it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["CudaStepMeter", "metered_step", "watch_backward"]


class CudaStepMeter:
    """The caching allocator's peak above what was allocated when the step started. Its
    peak counter is reset then (a reading taken before the step is lost)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        """Called as the step's forward starts."""
        torch.cuda.synchronize(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> int:
        """Called when the step's backward has ended: the step's peak bytes."""
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device) - self.base)


def watch_backward(outputs: Any, on_end: Callable[[], None]) -> bool:
    """Call ``on_end()`` when the backward that ``outputs`` start has ended; False (and
    no call) when no output requires a gradient. The hook goes with the outputs, or once
    it has run."""
    tensors = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return False
    handle: list[Any] = []

    def started(_: Any) -> None:
        if handle:
            handle.pop().remove()
        torch.autograd.Variable._execution_engine.queue_callback(on_end)

    handle.append(torch.autograd.graph.register_multi_grad_hook(tensors, started, mode="any"))
    return True


def metered_step(forward: Callable[[], Any], loss_fn: Callable[[Any], torch.Tensor], outputs_held: bool,
                 grad_holders: list[torch.Tensor],
                 measure: Callable[[Callable[[], None]], int]) -> int:
    """The peak bytes of one training step, ``forward()``, ``loss_fn`` of its outputs and
    the backward, as ``measure(step)`` reads it (the project's meter:
    :func:`~lightning_remat.meter.peak_bytes`). ``outputs_held``: the step holds its
    outputs until the backward has ended (the loop people write) rather than dropping them
    once the loss has read them. The step starts from no gradients on ``grad_holders`` (the
    parameters, the inputs that require one), as the profile's steps do, and the gradients
    it makes are dropped: each holder's is as before. The caller restores the module's
    state (:func:`~lightning_remat.graph.effects.preserved_state`)."""

    def step() -> None:
        outputs = forward()
        loss = loss_fn(outputs)
        if not outputs_held:
            del outputs
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(f"the step's loss must be a scalar that requires grad, got {loss!r:.80}")
        loss.backward()

    kept = [(t, t.grad) for t in grad_holders]
    for t in grad_holders:
        t.grad = None
    try:
        return int(measure(step))
    finally:
        for t, grad in kept:
            t.grad = grad
