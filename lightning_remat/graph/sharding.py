"""Sharded modules (torch FSDP: ``fully_shard`` or ``FullyShardedDataParallel``) as the capture
and the profile meet them: how a module is sharded (part of what decides a plan), a unit's
forward called through its own hooks, and its gradients kept apart from measuring runs
(docs/design.md section 7, "Sharded training")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from lightning_remat.device import is_sharded_unit

__all__ = ["call_through", "sharded_gradients_kept", "sharding_of"]


def sharding_of(module: nn.Module) -> str:
    """How ``module`` is sharded, for the record of what decided a plan: ``"none"``, or
    ``"fully_shard: Block x4, GPT x1"`` (FSDP2) / ``"FullyShardedDataParallel: ..."`` (FSDP1),
    the classes of its units with their counts."""
    counts: dict[str, int] = {}
    engine = ""
    for sub in module.modules():
        if not is_sharded_unit(sub):
            continue
        inner = getattr(sub, "module", sub) if type(sub).__name__ == "FullyShardedDataParallel" else sub
        engine = "FullyShardedDataParallel" if inner is not sub else "fully_shard"
        # fully_shard swaps in a class named "FSDP" + the module's own class name.
        name = type(inner).__name__.removeprefix("FSDP") if inner is sub else type(inner).__name__
        counts[name] = counts.get(name, 0) + 1
    if not counts:
        return "none"
    return f"{engine}: " + ", ".join(f"{name} x{n}" for name, n in sorted(counts.items()))


def call_through(module: nn.Module, run: Callable[[], Any]) -> Any:
    """``run()`` as the forward of ``module`` when it is an FSDP unit, called through
    ``module()`` so that its hooks run around it: the unit's parameters gathered before and
    its gradients reduced after the backward (profiling the sharded root runs its graph this
    way). Any other module: ``run()`` as it is."""
    if not is_sharded_unit(module):
        return run()
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = lambda *args, **kwargs: run()  # type: ignore[method-assign]
    try:
        return module()
    finally:
        del module.forward
        if had:
            module.forward = previous  # type: ignore[method-assign]


@contextmanager
def sharded_gradients_kept(module: nn.Module) -> Iterator[None]:
    """Around measuring runs of an FSDP2 module (tracing, profiling): its units' parameters
    sharded before and after (``reshard()``, so ``parameters()`` are the sharded ones the
    optimizer holds), their gradients set aside before and put back after, so the measuring
    steps' reduced gradients never reach the training step. Any other module: nothing."""
    units = [m for m in module.modules() if is_sharded_unit(m) and hasattr(m, "reshard")]
    if not units:
        yield
        return
    for unit in units:
        unit.reshard()
    kept = [(p, p.grad) for p in module.parameters()]
    for p, _ in kept:
        p.grad = None
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        for p, grad in kept:
            p.grad = grad
