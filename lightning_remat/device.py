"""What the rest of the package asks of a device: where a module lives, how much memory is
free, whether an error means memory ran out, and how to run something without leaving a trace.

Everything here is written once and used by the profiler, the planner, the batch-size search
and the Lightning callbacks alike.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = [
    "default_budget", "device_name", "training_budget", "free_device_memory", "is_out_of_memory", "module_device",
    "move_to_device", "optimizer_state_made", "fsdp_unit_types", "is_sharded_unit",
]

DEFAULT_MARGIN = 0.1
"""Share of the available device memory a default budget leaves for the allocator's
fragmentation and for what other libraries take."""

# Messages of allocation failures that do not raise torch.OutOfMemoryError: the CPU
# allocator, and cuDNN/cuBLAS failing to get their workspace.
# (cuDNN reports a failed workspace allocation as NOT_SUPPORTED, as Lightning's
# is_oom_error also assumes.)
_OOM_MESSAGES = (
    "out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
    "cudnn error: cudnn_status_not_supported.", "defaultcpuallocator: can't allocate memory",
)


def module_device(module: nn.Module, inputs: Iterable[Any] = ()) -> torch.device:
    """The device of a module's first parameter or buffer; for a module without any, the
    device of the first tensor in ``inputs``; else the CPU."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    for value in pytree.tree_leaves(list(inputs)):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def move_to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside it moved to ``device``: the containers torch's pytree
    knows (tuples, named tuples, lists, dicts, ordered dicts) keep their types."""
    return pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


def device_name(device: torch.device) -> str:
    """A name that tells devices of different kinds apart (a CUDA device's product name)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def default_budget(device: torch.device, margin: float = DEFAULT_MARGIN) -> int | None:
    """The budget when none is given: on CUDA the memory available to the next allocations
    (free memory plus what the caching allocator holds unused) less ``margin``; None (no
    limit) elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int((free + cached_unused) * (1 - margin))


def training_budget(device: torch.device, optimizers: Sequence[torch.optim.Optimizer]) -> int | None:
    """:func:`default_budget` as training has it from its second step on, with the
    optimizers' state in place (:func:`optimizer_state_made`): a plan made at the first
    step, before that state exists, would otherwise count it as free. None off CUDA."""
    if default_budget(device) is None:
        return None  # no limit (the CPU)
    with optimizer_state_made(optimizers):
        return default_budget(device)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` means a device (CUDA, MPS, the CPU allocator) ran out of memory."""
    # torch.cuda.OutOfMemoryError is the one class every device's allocator raises.
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(message in text for message in _OOM_MESSAGES)
    return False


def free_device_memory(device: torch.device | None = None) -> None:
    """Collect garbage and hand cached device memory back, so the next run starts clean."""
    gc.collect()
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def fsdp_unit_types() -> tuple[type, ...]:
    """torch FSDP's unit classes (FSDP2 ``FSDPModule``, FSDP1 ``FullyShardedDataParallel``);
    none without an initialised process group (no module can be sharded then, and the FSDP
    modules are not imported for nothing)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return ()
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (FSDPModule, FullyShardedDataParallel)


def is_sharded_unit(module: nn.Module) -> bool:
    """Whether torch FSDP manages ``module`` as one unit (``fully_shard`` applied to it, or a
    ``FullyShardedDataParallel`` wrapper)."""
    types = fsdp_unit_types()
    return bool(types) and isinstance(module, types)



@contextlib.contextmanager
def optimizer_state_made(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """Inside, every optimizer holds the state its first step creates (momenta, Adam's
    moments), so that the free device memory read inside is what training has from its
    second step on. An optimizer without state takes one step over zero gradients; on exit
    its parameters, their gradients and its (empty) state are restored. The parameters'
    copies are kept on the host, so they take no device memory from the reading."""
    without = [o for o in optimizers if not o.state]
    params = list({id(p): p for o in without for group in o.param_groups for p in group["params"]
                   if p.requires_grad}.values())
    host = torch.device("cpu")
    kept = [(p, p.detach().to(host, copy=True), p.grad) for p in params]
    states = [(o, o.state_dict()) for o in without]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for optimizer in without:
            optimizer.step()
        yield
    finally:
        with torch.no_grad():
            for p, data, grad in kept:
                p.copy_(data)
                p.grad = grad
        for optimizer, state in states:
            optimizer.load_state_dict(state)
