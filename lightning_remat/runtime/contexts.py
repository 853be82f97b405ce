"""The contexts a recomputed stage runs in (``runtime.module``): each made afresh at every
entry, selective checkpointing's recomputation kept to one backward, autocast without its
cast cache, and profiler ranges past the selective-checkpoint modes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["Contexts", "KeptOnce", "ProfilerRangesAside", "UncachedAutocast", "graph_kept"]


class ProfilerRangesAside(TorchDispatchMode):
    """Runs profiler-range ops (``profiler.*``) past the selective-checkpoint modes beneath
    it. Those modes match the recomputation's ops to the forward's by count, and FSDP's
    hooks open more ranges when a recomputed unit gathers its parameters again than in the
    forward; a range computes nothing to keep or recompute."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "profiler":
            with _disable_current_modes():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class UncachedAutocast(contextlib.ExitStack):
    """Autocast as it is, with its cast cache off. Selective checkpointing replays the
    forward's aten ops by position, and autocast casts a parameter once per region while its
    cache is on: a forward inside a region that cast it already would run fewer casts than
    its recomputation. Without the cache both cast every time (the same values)."""

    def __enter__(self) -> UncachedAutocast:
        super().__enter__()
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                self.enter_context(torch.autocast(
                    device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False))
        return self


class Contexts:
    """The contexts ``factories`` make, entered together, made afresh at each entry:
    checkpoint enters a stage's recomputation context once per backward that recomputes it,
    twice when a double backward (``create_graph=True``, ``retain_graph=True``) passes the
    stage again."""

    def __init__(self, *factories: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.factories = factories
        self.entered: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        with stack:
            for make in self.factories:
                stack.enter_context(make())
            self.entered.append(stack.pop_all())

    def __exit__(self, *exc: Any) -> bool:
        try:
            return bool(self.entered.pop().__exit__(*exc))
        finally:
            if not self.entered and not graph_kept():
                # No backward runs the stage again: what the contexts hold (the forward's
                # kept values a recomputation stopped early left) goes now.
                self.factories = ()


def graph_kept() -> bool:
    """Whether the running backward keeps the graph (True outside a backward)."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def KeptOnce(recompute: contextlib.AbstractContextManager) -> contextlib.AbstractContextManager:
    """Selective checkpointing's recomputation mode, which hands the recomputation the
    values kept from the forward, for a backward that frees the graph; for one that keeps
    it the stage runs again whole. Torch's selective checkpointing hands kept values to one
    backward only, and a backward that keeps the graph (a gradient penalty's
    ``create_graph=True``) is followed by another through the same stage; recomputed, the
    kept values are the same (random ops are never kept)."""
    if graph_kept():
        return contextlib.nullcontext()
    return recompute
