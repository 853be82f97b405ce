"""``remat()``: a module planned to train within a budget, in one call, outside Lightning."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_remat.device import module_device, move_to_device
from lightning_remat.errors import warn_caller
from lightning_remat.planner import Planner, PlanSettings
from lightning_remat.runtime.module import RematModule

__all__ = ["remat"]


def _uncompiled(module: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, with a warning that it is planned and runs
    eagerly (the plan's stage programs are not compiled); any other module as it is."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported by torch.compile
    compiled = getattr(eval_frame, "OptimizedModule", None)
    if compiled is None or not isinstance(module, compiled):
        return module
    inner = module._orig_mod
    warn_caller(
        f"lightning_remat: remat() was given a torch.compile'd module; it plans the "
        f"{type(inner).__name__} inside it, whose planned forward runs eagerly, not compiled "
        "(its parameters are the same objects; docs/limitations.md)")
    return inner


def remat(
    module: nn.Module,
    example_input: Any,
    memory_budget: int | float | str | None = None,
    solver: str = "auto",
    device: str | torch.device | None = None,
    progress: bool = False,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> RematModule:
    """``module`` rematerialized to train within ``memory_budget``.

    ``example_input``: a tensor, a tuple of positional inputs, or a dict of keyword inputs.
    ``memory_budget``: bytes, a size string (``"4GiB"``, ``"512MB"``) or a fraction of the
    plain step's profiled peak (``"60%"``, ``0.6``; for each input shape, of that shape's own
    plain peak); None means the device's free memory on CUDA and no limit on CPU (the result
    then runs the plain plan, with its profile in ``.graph``). ``device``: where to profile
    and train (the module is moved there; default: where its parameters are).
    ``progress``: write one line to stderr as each planning phase starts (trace, profile,
    solve) and a last one with the time planning took, in seconds and in plain steps.
    ``loss_fn(outputs) -> scalar``: the loss your training step takes of the module's
    outputs, as ``loss_fn(model(x)).backward()``; the plan counts the memory it takes (a
    cross-entropy over a large vocabulary holds several times the logits) and the outputs
    freed once it has read them. Default: the loop people write, ``out = model(x); loss =
    F.cross_entropy(out, y); loss.backward()``, the outputs alive to the step's end and a
    cross-entropy over their last dimension (a loss whose gradient is as large as the
    outputs); a known ``loss_fn`` gives a tighter plan. The result pickles (``torch.save``)
    without ``loss_fn`` (a lambda cannot be pickled): loaded, it runs its plans as before and
    plans a new input shape with the default loss, with one warning.

    The first training step under each plan is measured: on CUDA your own step, on the
    caching allocator's peak from the forward to the end of the backward its outputs start
    (over the plan's prediction, the next call plans again); elsewhere one metered step of
    the plan, run as the last part of planning with the loss the plan was made for, which
    leaves the module's state and gradients as they were (over the prediction, the input
    is planned again at once). The new plan's margin is raised by the excess, and one
    warning says so.

    The result shares the module's Parameter objects and state_dict keys, has ``.plan``,
    ``.graph`` and ``.budget_bytes``, and plans once more for each new input shape (with a
    one-time warning) so a changed shape never silently exceeds the budget. Raises
    ``ValueError`` for a malformed budget and
    :class:`~lightning_remat.errors.RematInfeasibleError` (with the smallest feasible budget)
    when no plan fits.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from lightning_remat import remat
        >>> net = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(32, 32), nn.Tanh())])
        >>> x = torch.randn(512, 32)
        >>> model = remat(net, x, memory_budget="50%")  # or bytes: 2**20, "1MiB", "6GiB"
        >>> model.plan.solver  # doctest: +ELLIPSIS
        'auto:...'
        >>> model.plan.guaranteed_peak_bytes <= model.budget_bytes
        True
        >>> model(x).sum().backward()  # the gradients land on net's own Parameters
        >>> net[0].weight.grad.shape
        torch.Size([32, 32])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"remat() needs a torch.nn.Module, got {type(module).__name__}")
    module = _uncompiled(module)
    settings = PlanSettings(memory_budget, solver)
    if device is not None:
        module.to(torch.device(device))
    target = module_device(module)
    if isinstance(example_input, dict):
        inputs, kwargs = (), dict(example_input)
    elif isinstance(example_input, (tuple, list)):
        inputs, kwargs = tuple(example_input), {}
    else:
        inputs, kwargs = (example_input,), {}
    inputs, kwargs = move_to_device(inputs, target), move_to_device(kwargs, target)
    planner = Planner(module, settings, loss_fn=loss_fn,
                      progress=(lambda line: print(f"lightning-remat: {line}", file=sys.stderr, flush=True)) if progress else None)
    planner.last = planner.planned_for(inputs, kwargs)
    planner.remat_module.set_current(planner.last.variant)
    planner.remat_module.fire_hooks_of(module)
    return planner.remat_module
