"""Tensor storage created while entered, live and peak: the CPU meter where another
torch.profiler is running (the way ``torch.distributed._tools.mem_tracker`` counts)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StorageMeter(TorchDispatchMode):
    """Live and peak bytes of the tensor storage created on ``device_type`` while entered.

    An op's output counts as new memory when its schema says it does not alias an input
    (views, in-place and ``out=`` results do) and its storage is none of the inputs'; a
    storage counted once is not counted again (a view of it, an in-place op on it), and a
    resize is followed. ``live`` and ``peak`` start at zero: the reading is above whatever
    was allocated before. Storage created before and freed during the measurement is not
    subtracted (it was never added).
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak = self.live

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        values = [out] if len(returns) == 1 else list(out) if isinstance(out, (tuple, list)) else [out]
        inputs: set[int] | None = None
        for value, ret in zip(values, returns):
            fresh = ret.alias_info is None
            for t in tree_leaves(value):
                if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                    continue
                # A DTensor (torch FSDP2's parameters, their gradients and optimizer state)
                # has no storage of its own: its local shard's is what it takes.
                t = _local(t)
                try:
                    storage = t.untyped_storage()
                    storage.data_ptr()
                except (RuntimeError, NotImplementedError):  # sparse, nested: no storage
                    continue
                key = id(storage)
                if key in self._sizes:
                    self._resized(key, storage.nbytes())
                    continue
                if not fresh:
                    continue
                if inputs is None:  # an op that returns an input without saying so
                    inputs = {_data_ptr(a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
                if storage.data_ptr() in inputs:
                    continue
                self._add(key, storage)
        self.peak = max(self.peak, self.live)
        return out

    def _add(self, key: int, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self.live += nbytes
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._freed(key))

    def _resized(self, key: int, nbytes: int) -> None:
        if nbytes != self._sizes[key]:
            self.live += nbytes - self._sizes[key]
            self._sizes[key] = nbytes

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t




def _data_ptr(t: torch.Tensor) -> int:
    try:
        return _local(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1
