"""Offloading saved activations to host memory during training (docs/design.md section 5).

:class:`OffloadHooks` is a context manager built on
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves for the backward
inside the ``with`` block (parameters and tensors below ``min_bytes`` excepted) is copied to
host memory, and brought back for the backward in the plan's order, ahead of need.

On CUDA (the executor of the schedules of Beaumont, Eyraud-Dubois and Shilova, "Optimal
GPU-CPU Offloading Strategies for Deep Neural Network Training", Euro-Par 2020):

- the offload is a ``non_blocking`` copy into pinned host memory on a side stream that waits
  (by an event, no device-wide synchronisation) for the kernel that produced the tensor;
  the device tensor is kept alive until the copy's event has completed, then released (the
  check is an ``event.query()`` at every later pack or unpack, never a wait);
- in the backward, unpacking saved tensor ``i`` (they are unpacked in reverse order)
  starts the host-to-device copies of the ``prefetch`` tensors saved before it on the side
  stream; the compute stream waits for a copy's event only when it needs that tensor.

Without CUDA the same code path runs host to host: the "offload" is a copy into a separate
host buffer and the "prefetch" a copy back into a fresh buffer, with the same bookkeeping
and no streams, so the tests check gradients everywhere.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["OffloadHooks", "OffloadStats", "OffloadedModule", "measure_bandwidth"]

_BANDWIDTH_CACHE: dict[tuple[str, int], float] = {}


def measure_bandwidth(device: str | torch.device | None = None, nbytes: int = 64 * 2**20,
                      repeats: int = 3, refresh: bool = False) -> float:
    """Host-device bandwidth in bytes per second (``beta`` of the offloading model; the graph
    JSON keeps it as ``meta['bandwidth_bytes_per_s']``), measured once per device and cached.

    CUDA: the slower direction of pinned-host <-> device copies of ``nbytes``, timed with CUDA
    events (best of ``repeats``). CPU: a host-to-host copy of ``nbytes`` (the CPU path of
    :class:`OffloadHooks`; a stand-in, not a figure to plan a GPU with).
    """
    import time

    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (str(dev), int(nbytes))
    if key in _BANDWIDTH_CACHE and not refresh:
        return _BANDWIDTH_CACHE[key]
    if nbytes <= 0 or repeats <= 0:
        raise ValueError(f"nbytes={nbytes} and repeats={repeats} must be positive")
    count = nbytes // 4
    if dev.type == "cuda":
        host = torch.empty(count, dtype=torch.float32, pin_memory=True)
        gpu = torch.empty(count, dtype=torch.float32, device=dev)
        best = {"to_host": 0.0, "to_device": 0.0}
        for _ in range(repeats + 1):  # the first round warms up
            for direction in best:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                if direction == "to_host":
                    host.copy_(gpu, non_blocking=True)
                else:
                    gpu.copy_(host, non_blocking=True)
                stop.record()
                stop.synchronize()
                rate = count * 4 / (start.elapsed_time(stop) / 1e3)
                best[direction] = max(best[direction], rate)
        value = min(best.values())
    elif dev.type == "cpu":
        src = torch.ones(count, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)
        rates = []
        for _ in range(repeats):
            start_s = time.perf_counter()
            dst.copy_(src)
            rates.append(count * 4 / max(time.perf_counter() - start_s, 1e-9))
        value = max(rates)
    else:
        raise ValueError(f"cannot measure a bandwidth on device {dev}: use cpu or cuda")
    _BANDWIDTH_CACHE[key] = float(value)
    return float(value)


@dataclass
class OffloadStats:
    """What the hooks did (cumulative over the hooks object's life)."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    skipped_parameters: int = 0
    skipped_small: int = 0
    released_early: int = 0
    """Device copies released once their offload had completed, before the backward."""
    prefetched: int = 0
    """Host-to-device copies started ahead of need."""
    fetched_on_demand: int = 0
    """Unpacks that found their tensor on the host and had to fetch it then."""
    served_from_prefetch: int = 0
    served_before_offload_done: int = 0
    """Unpacks that found the original device tensor still held (its copy still running)."""


class _Saved:
    """One offloaded tensor: its host copy and, at times, a device copy."""

    __slots__ = ("host", "device", "device_copy", "event", "state", "index", "nbytes",
                 "unpacked", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, index: int, nbytes: int) -> None:
        self.host = host
        self.device = device
        self.device_copy: torch.Tensor | None = None
        self.event: Any = None
        self.state = "host"  # offloading -> host -> fetching/ready -> host ...
        self.index = index
        self.nbytes = nbytes
        self.unpacked = False


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Offload what autograd saves inside the ``with`` block to host memory.

    ``min_bytes``: tensors smaller than this stay where they are (copies of small tensors
    cost more in latency than they save). ``prefetch``: how many tensors ahead (in reverse
    save order) the backward brings back. ``pin_memory``: page-locked host buffers (default:
    when CUDA is available; needed for asynchronous copies). ``use_streams``: the CUDA
    path with a side stream (default: when CUDA is available); False forces the host-to-host
    path.

    One object can be entered several times (several offloaded stages of one step); the
    order of all its saved tensors is the order the prefetches follow.
    """

    def __init__(self, min_bytes: int = 64 * 1024, prefetch: int = 2,
                 pin_memory: bool | None = None, use_streams: bool | None = None) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes={min_bytes} must be >= 0")
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch} must be >= 0 (0: fetch on demand only)")
        cuda = torch.cuda.is_available()
        self.min_bytes = int(min_bytes)
        self.prefetch = int(prefetch)
        self.pin_memory = cuda if pin_memory is None else bool(pin_memory)
        self.use_streams = cuda if use_streams is None else bool(use_streams and cuda)
        self.stats = OffloadStats()
        self._order: list[weakref.ref[_Saved]] = []
        self._in_flight: list[_Saved] = []
        self._streams: dict[torch.device, Any] = {}
        super().__init__(self._pack, self._unpack)

    # ---- context ------------------------------------------------------------------------
    def __enter__(self) -> OffloadHooks:
        # Forget tensors of finished steps (their graphs, and so their handles, are gone).
        self._order = [ref for ref in self._order if ref() is not None]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.release_finished()

    # ---- helpers ------------------------------------------------------------------------
    def _side_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            self._streams[device] = stream
        return stream

    def _cuda_path(self, t: torch.Tensor) -> bool:
        return self.use_streams and t.is_cuda

    def release_finished(self) -> int:
        """Release the device copies whose offload has completed (``event.query()``, no
        wait). Returns how many were released."""
        released = 0
        while self._in_flight:
            handle = self._in_flight[0]
            if handle.event is not None and not handle.event.query():
                break  # copies on one stream complete in order
            self._in_flight.pop(0)
            if handle.state == "offloading":
                handle.device_copy = None
                handle.event = None
                handle.state = "host"
                released += 1
        self.stats.released_early += released
        return released

    def _should_offload(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t  # Linear saves weight.t(), a view
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
            self.stats.skipped_parameters += 1
            return False
        if t.layout != torch.strided or t.device.type not in ("cpu", "cuda"):
            return False
        if t.numel() * t.element_size() < self.min_bytes or t.numel() == 0:
            self.stats.skipped_small += 1
            return False
        return True

    # ---- pack: device -> host ---------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        if not self._should_offload(t):
            return t
        self.release_finished()
        nbytes = t.numel() * t.element_size()
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout,
                           pin_memory=self.pin_memory and t.is_cuda)
        handle = _Saved(host, t.device, len(self._order), nbytes)
        if self._cuda_path(t):
            stream = self._side_stream(t.device)
            produced = torch.cuda.current_stream(t.device).record_event()
            stream.wait_event(produced)  # the copy must see the kernel that made t
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
                handle.event = stream.record_event()
            handle.device_copy = t  # kept until the copy is done, then released
            handle.state = "offloading"
            self._in_flight.append(handle)
        else:
            host.copy_(t)
            handle.state = "host"
        self._order.append(weakref.ref(handle))
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += nbytes
        return handle

    # ---- unpack: host -> device, and prefetch of the next ones --------------------------------
    def _fetch(self, handle: _Saved) -> None:
        if handle.device.type == "cuda" and self.use_streams:
            stream = self._side_stream(handle.device)
            with torch.cuda.stream(stream):
                copy = torch.empty_like(handle.host, device=handle.device)
                copy.copy_(handle.host, non_blocking=True)
                handle.event = stream.record_event()
            handle.state = "fetching"
        else:
            copy = torch.empty_like(handle.host, device=handle.device)
            copy.copy_(handle.host)
            handle.event = None
            handle.state = "ready"
        handle.device_copy = copy

    def _prefetch_next(self) -> None:
        """Have the ``prefetch`` highest-indexed tensors not yet unpacked on their way back
        (the backward unpacks roughly in reverse save order; an op that saved several
        tensors may unpack them in any order, hence "not yet unpacked", not "below")."""
        ahead = 0
        for k in range(len(self._order) - 1, -1, -1):
            if ahead >= self.prefetch:
                break
            handle = self._order[k]()
            if handle is None or handle.unpacked:
                continue
            if handle.state == "host":
                self._fetch(handle)
                self.stats.prefetched += 1
            ahead += 1

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        handle: _Saved = packed
        self.release_finished()
        if handle.state == "offloading":
            # The copy out has not finished: the original is still on the device.
            tensor = handle.device_copy
            self.stats.served_before_offload_done += 1
        else:
            if handle.state == "host":
                self._fetch(handle)
                self.stats.fetched_on_demand += 1
            else:
                self.stats.served_from_prefetch += 1
            tensor = handle.device_copy
            if handle.event is not None:
                current = torch.cuda.current_stream(handle.device)
                current.wait_event(handle.event)
                # Allocated on the side stream, used on this one: tell the allocator.
                tensor.record_stream(current)
            handle.device_copy = None
            handle.event = None
            handle.state = "host"  # the host copy stays for retain_graph=True
        assert tensor is not None
        handle.unpacked = True
        self._prefetch_next()
        return tensor


class OffloadedModule(nn.Module):
    """Run ``module`` with what its forward saves offloaded by ``hooks`` (one stage of a
    plan with action ``offload``). Parameters and ``state_dict`` keys are the wrapped
    module's, under ``module.``."""

    def __init__(self, module: nn.Module, hooks: OffloadHooks) -> None:
        super().__init__()
        self.module = module
        self.hooks = hooks

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.hooks:
            return self.module(*args, **kwargs)
