"""Offloading saved activations to host memory during training (docs/design.md section 5).

:class:`OffloadHooks` is a context manager built on
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves for the backward
inside the ``with`` block is copied to host memory and brought back for the backward ahead of
need. It runs on the device layer of :mod:`lightning_remat.streams` (CUDA streams and
events, or the CPU stand-in), so its logic runs the same in the CPU tests as on a GPU. The
design follows torchtune's ``OffloadActivations`` and executes the schedules of Beaumont,
Eyraud-Dubois and Shilova, "Optimal GPU-CPU Offloading Strategies for Deep Neural Network
Training", Euro-Par 2020:

- What the profile counts as resident is never moved: parameters, buffers and the step's
  inputs (:meth:`OffloadHooks.keep_resident`), and tensors under ``min_bytes``.
- A storage is copied once per step however many ops save it (q, k and v of one input), as
  a whole, so views come back with their strides and expanded tensors stay small.
- The copy runs on the copy stream after the kernel that produced the tensor; the device
  tensor is held until its copy is done. When the bytes in flight pass
  ``max_in_flight_bytes``, and at every stage exit, the compute stream waits for the oldest
  copies (a device-side wait, not a host sync) and the references go: after the stage the
  device holds none of its offloaded activations, as the plan assumes.
- Host copies live in one pinned area, sized to the bytes a step offloads (at least
  :meth:`OffloadHooks.reserve`), reused every step and never rounded up.
- In the backward a cursor walks the save order downwards; the next tensors are fetched on
  the copy stream while the bytes fetched and not yet used stay within ``prefetch_bytes``.
  A fetched tensor the backward passed without using is dropped when the window needs room.
  The compute stream waits for a fetch's event only when it uses the tensor.

Length: the offload hooks, the pinned area and the prefetch window share one step's state
(what is on the host, what is in flight), so they stay in one module.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from lightning_remat.streams import DeviceStreams, SimulatedStreams, pinned_block_bytes, streams_for

__all__ = [
    "OffloadHooks", "OffloadStats", "OffloadedModule", "measure_bandwidth", "pinned_block_bytes",
    "plan_offload_bytes",
]

_BANDWIDTH_CACHE: dict[tuple[str, int], float] = {}

_ALIGN = 512
"""Alignment of each host copy inside the pinned area (bytes)."""


def measure_bandwidth(device: str | torch.device | None = None, nbytes: int = 64 * 2**20,
                      repeats: int = 3, refresh: bool = False) -> float:
    """Host-device bandwidth in bytes per second (``beta`` of the offloading model; the graph
    JSON keeps it as ``meta['bandwidth_bytes_per_s']``), measured once per device and cached.

    CUDA: the slower direction of pinned-host <-> device copies of ``nbytes``, timed with CUDA
    events recorded on that device's stream (best of ``repeats``). CPU: a host-to-host copy of
    ``nbytes`` (the CPU path of :class:`OffloadHooks`; a stand-in, not a figure to plan a GPU
    with).
    """
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())  # CUDA only
    key = (str(dev), int(nbytes))
    if key in _BANDWIDTH_CACHE and not refresh:
        return _BANDWIDTH_CACHE[key]
    if nbytes <= 0 or repeats <= 0:
        raise ValueError(f"nbytes={nbytes} and repeats={repeats} must be positive")
    count = nbytes // 4
    if dev.type == "cuda":
        value = _cuda_bandwidth(dev, count, repeats)
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


def _cuda_bandwidth(dev: torch.device, count: int, repeats: int, cuda: Any = torch.cuda,
                    empty: Any = torch.empty) -> float:
    """CUDA only: the events are recorded on ``dev``'s own stream, inside its device
    context, so a model on ``cuda:1`` is not timed by ``cuda:0``'s clock. (``cuda`` and
    ``empty`` are ``torch.cuda`` and ``torch.empty``; the tests pass fakes.)"""
    with cuda.device(dev):
        stream = cuda.current_stream(dev)
        host = empty(count, dtype=torch.float32, pin_memory=True)
        gpu = empty(count, dtype=torch.float32, device=dev)
        best = {"to_host": 0.0, "to_device": 0.0}
        for _ in range(repeats + 1):  # the first round warms up
            for direction in best:
                start, stop = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
                start.record(stream)
                with cuda.stream(stream):
                    if direction == "to_host":
                        host.copy_(gpu, non_blocking=True)
                    else:
                        gpu.copy_(host, non_blocking=True)
                stop.record(stream)
                stop.synchronize()
                rate = count * 4 / (start.elapsed_time(stop) / 1e3)
                best[direction] = max(best[direction], rate)
    return min(best.values())


@dataclass
class OffloadStats:
    """What the hooks did (cumulative over the hooks object's life)."""

    offloaded_tensors: int = 0
    """Storages copied to the host (once per step each, however many ops saved them)."""
    offloaded_bytes: int = 0
    shared_saves: int = 0
    """Saves of a storage already offloaded this step (served by the same host copy)."""
    skipped_parameters: int = 0
    skipped_resident: int = 0
    """Saves of buffers and the step's inputs, which the profile counts as resident."""
    skipped_small: int = 0
    released_early: int = 0
    """Device copies released once their offload had completed, before the stage's end."""
    compute_waits: int = 0
    """Device-side waits of the compute stream for a copy (the bound, a stage exit, a use)."""
    prefetched: int = 0
    """Host-to-device copies started ahead of need."""
    prefetch_dropped: int = 0
    """Prefetched tensors the backward passed without using, dropped to make room."""
    fetched_on_demand: int = 0
    """Unpacks that found their tensor on the host and had to fetch it then."""
    served_from_prefetch: int = 0
    served_before_offload_done: int = 0
    """Unpacks that found the original device tensor still held (its copy still running)."""
    pinned_bytes: int = 0
    """Host memory the pinned buffers hold: each block as the caching host allocator hands
    it out (:func:`pinned_block_bytes`), the area and what overflowed it, freed blocks
    included (the allocator keeps them)."""


class _Saved:
    """One offloaded storage: its host copy and, at times, a device copy."""

    __slots__ = ("host", "device", "device_bytes", "event", "state", "index", "nbytes",
                 "saves", "pass_id", "unpacks_in_pass", "fetched_at", "storage_ref", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, index: int, nbytes: int) -> None:
        self.host = host
        self.device = device
        self.device_bytes: torch.Tensor | None = None
        """The storage on the device as uint8: the original until the copy out completes,
        then a fetched copy between prefetch and use."""
        self.event: Any = None
        self.state = "host"  # offloading -> host -> fetching -> (ready ->) host ...
        self.index = index
        self.nbytes = nbytes
        self.saves = 1
        """How many saved tensors share it (a backward pass unpacks each once)."""
        self.pass_id = 0
        """The latest backward pass that unpacked it (retain_graph allows several)."""
        self.unpacks_in_pass = 0
        self.fetched_at = 0
        """The hooks' unpack count when it was fetched."""
        self.storage_ref: StorageWeakRef | None = None


class _Packed:
    """What autograd keeps for one saved tensor: the storage's handle and the view."""

    __slots__ = ("handle", "dtype", "size", "stride", "offset", "passes")

    def __init__(self, handle: _Saved, t: torch.Tensor) -> None:
        self.handle = handle
        self.passes = 0
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()


def _storage_key(t: torch.Tensor) -> int | None:
    """The data pointer of the storage ``t`` reads: a DTensor's (torch FSDP2's sharded
    parameters) is its local shard's, since the DTensor itself has no storage; None for a
    tensor without one."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        t = local
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Offload what autograd saves inside the ``with`` block to host memory.

    ``min_bytes``: tensors smaller than this stay where they are (copies of small tensors
    cost more in latency than they save). ``prefetch_bytes``: the backward's look-ahead, in
    bytes fetched and not yet used (0: fetch on demand only; None: the plan's largest
    offloaded stage as :meth:`reserve` was told, else twice the largest storage offloaded).
    ``max_in_flight_bytes``: device bytes whose copy out may still run before the compute
    stream waits (None: twice the largest storage offloaded). ``streams``:
    the device layer (default: :func:`~lightning_remat.streams.streams_for` each device;
    tests pass a :class:`~lightning_remat.streams.SimulatedStreams`). ``use_streams=False``
    runs CUDA tensors through the stand-in as well (copies complete at once).

    One object can be entered several times (several offloaded stages of one step); the
    order of all its saved tensors is the order the prefetches follow.
    """

    def __init__(self, min_bytes: int = 64 * 1024, prefetch_bytes: int | None = None,
                 max_in_flight_bytes: int | None = None, streams: DeviceStreams | None = None,
                 use_streams: bool | None = None) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes={min_bytes} must be >= 0")
        if prefetch_bytes is not None and prefetch_bytes < 0:
            raise ValueError(f"prefetch_bytes={prefetch_bytes} must be >= 0 (0: fetch on demand only)")
        if max_in_flight_bytes is not None and max_in_flight_bytes < 0:
            raise ValueError(f"max_in_flight_bytes={max_in_flight_bytes} must be >= 0")
        self.min_bytes = int(min_bytes)
        self.prefetch_bytes = prefetch_bytes
        self.max_in_flight_bytes = max_in_flight_bytes
        self.use_streams = use_streams is not False
        self.stats = OffloadStats()
        self._given_streams = streams
        self._streams: dict[torch.device, DeviceStreams] = {}
        self._order: list[weakref.ref[_Saved]] = []
        # Weak references: a handle lives as long as autograd's graph holds it.
        self._by_storage: dict[int, weakref.ref[_Saved]] = {}
        self._in_flight: list[_Saved] = []
        self._in_flight_bytes = 0
        self._fetched: list[weakref.ref[_Saved]] = []
        self._cursor = -1
        self._last_unpacked = -1
        self._unpacks = 0
        self._pass = 0
        self._largest = 0
        self._resident: set[int] = set()
        self._area: torch.Tensor | None = None
        self._area_size = 0
        self._area_used = 0
        self._step_bytes = 0
        self._reserved = 0
        self._plan_window = 0
        super().__init__(self._pack, self._unpack)

    # ---- what the plan tells ---------------------------------------------------------------
    def reserve(self, step_bytes: int, stage_bytes: int = 0) -> None:
        """Size the pinned area for ``step_bytes`` offloaded per step and, unless
        ``prefetch_bytes`` was given, the prefetch window for ``stage_bytes`` (the plan's
        figures, :func:`plan_offload_bytes`)."""
        self._reserved = max(self._reserved, int(step_bytes))
        self._plan_window = max(self._plan_window, int(stage_bytes))

    def keep_resident(self, tensors: Iterable[Any]) -> None:
        """Never offload the storages of ``tensors`` (parameters, buffers, the step's inputs:
        what the profile counts as resident), for the current step."""
        self._resident = {
            key for t in pytree.tree_leaves(list(tensors))
            if isinstance(t, torch.Tensor) and t.layout == torch.strided
            and (key := _storage_key(t)) is not None
        }

    # ---- context ------------------------------------------------------------------------
    def __enter__(self) -> OffloadHooks:
        self._order = [ref for ref in self._order if ref() is not None]
        if not self._order:
            self._new_step()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        # The plan counts a stage's offloaded activations gone once the stage ends.
        self._release(wait=True)

    def _new_step(self) -> None:
        """No handle of an earlier step is alive: start the save order, the pinned area and
        the storage map afresh."""
        self._by_storage.clear()
        self._fetched = []
        self._cursor, self._pass = -1, 0
        needed = max(self._reserved, self._step_bytes)
        if self._area is None or self._area.numel() < needed:
            self._area, self._area_size = None, needed  # made at the first pack, on its device
        self._area_used = 0
        self._step_bytes = 0

    # ---- helpers ------------------------------------------------------------------------
    def _layer(self, device: torch.device | None) -> DeviceStreams:
        if self._given_streams is not None:
            return self._given_streams
        device = torch.device("cpu") if device is None else device
        layer = self._streams.get(device)
        if layer is None:
            if device.type == "cuda" and self.use_streams:
                layer = streams_for(device)
            else:  # the CPU, or CUDA tensors without streams: copies complete at once
                layer = SimulatedStreams(latency=0, device=device)
            self._streams[device] = layer
        return layer

    def _host_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of the pinned area (a fresh pinned buffer when the area is full; the
        next step's area is then sized to fit the whole step)."""
        self._step_bytes += -(-nbytes // _ALIGN) * _ALIGN
        if self._area is None and self._area_size:
            # The allocator rounds the block up anyway: the area uses all of it. An earlier,
            # smaller area stays in the allocator's cache, so it is still counted.
            size = pinned_block_bytes(self._area_size)
            self._area = self._layer(device).pinned_empty(size)
            self.stats.pinned_bytes += size
        start = self._area_used
        if self._area is not None and start + nbytes <= self._area.numel():
            self._area_used = start + -(-nbytes // _ALIGN) * _ALIGN
            return self._area[start:start + nbytes]
        # An overflow buffer: its block, rounded, stays cached after the step frees it.
        self.stats.pinned_bytes += pinned_block_bytes(nbytes)
        return self._layer(device).pinned_empty(nbytes)

    def _release(self, wait: bool, down_to: int | None = None) -> None:
        """Drop the device references of finished copies out (oldest first). ``wait``: make
        the compute stream wait for unfinished ones too, until the bytes in flight are at
        most ``down_to`` (None: all)."""
        limit = 0 if down_to is None else down_to
        while self._in_flight:
            handle = self._in_flight[0]
            layer = self._layer(handle.device)
            if not layer.done(handle.event):
                if not wait or self._in_flight_bytes <= limit:
                    break
                layer.compute_waits(handle.event)  # on the device: no host sync
                self.stats.compute_waits += 1
            else:
                self.stats.released_early += 1
            self._in_flight.pop(0)
            self._in_flight_bytes -= handle.nbytes
            if handle.state == "offloading":
                handle.device_bytes, handle.event, handle.state = None, None, "host"

    def _should_offload(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t  # Linear saves weight.t(), a view
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
            self.stats.skipped_parameters += 1
            return False
        if (t.layout != torch.strided or t.device.type not in ("cpu", "cuda") or t.is_conj()
                or t.is_neg() or t.is_quantized):
            return False
        key = _storage_key(t)
        if key is None:
            return False
        if key in self._resident:
            self.stats.skipped_resident += 1
            return False
        if t.numel() * t.element_size() < self.min_bytes or t.numel() == 0:
            self.stats.skipped_small += 1
            return False
        return True

    # ---- pack: device -> host ---------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        if not self._should_offload(t):
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        ref = self._by_storage.get(ptr)
        handle = None if ref is None else ref()
        if handle is not None and handle.storage_ref is not None and not handle.storage_ref.expired():
            self.stats.shared_saves += 1
            handle.saves += 1
            return _Packed(handle, t)
        self._release(wait=False)
        nbytes = storage.nbytes()
        handle = _Saved(self._host_buffer(nbytes, t.device), t.device, len(self._order), nbytes)
        handle.storage_ref = StorageWeakRef(storage)
        device_bytes = _storage_bytes(t)
        handle.event = self._layer(t.device).copy_to_host(device_bytes, handle.host)
        handle.device_bytes = device_bytes  # held until the copy is done
        handle.state = "offloading"
        self._in_flight.append(handle)
        self._in_flight_bytes += nbytes
        self._largest = max(self._largest, nbytes)
        self._by_storage[ptr] = weakref.ref(handle)
        self._order.append(weakref.ref(handle))
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += nbytes
        bound = self.max_in_flight_bytes if self.max_in_flight_bytes is not None else 2 * self._largest
        if self._in_flight_bytes > bound:
            self._release(wait=True, down_to=bound)
        return _Packed(handle, t)

    # ---- unpack: host -> device, and prefetch of the next ones --------------------------------
    def _fetch(self, handle: _Saved) -> None:
        handle.device_bytes, handle.event = self._layer(handle.device).copy_to_device(handle.host)
        handle.state = "fetching"
        handle.fetched_at = self._unpacks
        self._fetched.append(weakref.ref(handle))

    def _fetched_handles(self) -> list[_Saved]:
        """Fetched and not yet used (a handle whose graph is gone took its copy with it)."""
        live = [h for h in (ref() for ref in self._fetched) if h is not None and h.state == "fetching"]
        self._fetched = [weakref.ref(h) for h in live]
        return live

    def _unfetch(self, handle: _Saved) -> None:
        handle.device_bytes, handle.event, handle.state = None, None, "host"
        self._fetched = [ref for ref in self._fetched if ref() is not handle]

    def _window(self) -> int:
        if self.prefetch_bytes is not None:
            return self.prefetch_bytes
        return self._plan_window or 2 * self._largest

    def _prefetch_next(self) -> None:
        """Fetch down the save order from the cursor while the bytes fetched and not yet
        used fit the window; fetched tensors the backward passed without using (an unpack
        below them came after their fetch) make room first, highest first."""
        window = self._window()
        while self._cursor >= 0:
            handle = self._order[self._cursor]()
            if handle is None or handle.pass_id == self._pass or handle.state != "host":
                self._cursor -= 1
                continue
            while sum(h.nbytes for h in self._fetched_handles()) + handle.nbytes > window:
                passed = [h for h in self._fetched_handles()
                          if h.index > self._last_unpacked and h.fetched_at < self._unpacks]
                if not passed:
                    return
                self._unfetch(max(passed, key=lambda h: h.index))
                self.stats.prefetch_dropped += 1
            self._fetch(handle)
            self.stats.prefetched += 1
            self._cursor -= 1

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        handle: _Saved = packed.handle
        if packed.passes >= self._pass:  # the first unpack of a (new) backward pass
            self._pass = packed.passes + 1
            self._cursor = len(self._order) - 1
        packed.passes = self._pass
        if handle.pass_id != self._pass:
            handle.pass_id, handle.unpacks_in_pass = self._pass, 0
        handle.unpacks_in_pass += 1
        self._release(wait=False)
        layer = self._layer(handle.device)
        if handle.state == "offloading":
            # The copy out has not finished: the original is still on the device.
            device_bytes = handle.device_bytes
            self.stats.served_before_offload_done += 1
        elif handle.state == "ready":  # another save of the storage brought it back already
            device_bytes = handle.device_bytes
            self.stats.served_from_prefetch += 1
        else:
            if handle.state == "host":
                self._fetch(handle)
                self.stats.fetched_on_demand += 1
            else:
                self.stats.served_from_prefetch += 1
            device_bytes = handle.device_bytes
            layer.compute_waits(handle.event)  # on the device: only for the tensor it needs
            self.stats.compute_waits += 1
            layer.hand_to_compute(device_bytes)
            self._unfetch(handle)
            handle.device_bytes, handle.state = device_bytes, "ready"
        if handle.state == "ready" and handle.unpacks_in_pass >= handle.saves:
            handle.device_bytes, handle.state = None, "host"  # the host copy stays for retain_graph
        # The cursor moves down only as it fetches: an op may unpack its saves in any order,
        # so the ones above this index are still wanted (or dropped once passed).
        self._last_unpacked = handle.index
        self._unpacks += 1
        self._prefetch_next()
        assert device_bytes is not None
        out = torch.empty(0, dtype=packed.dtype, device=handle.device)
        return out.set_(device_bytes.untyped_storage(), packed.offset, packed.size, packed.stride)


def plan_offload_bytes(graph: Any, plan: Any) -> tuple[int, int]:
    """What a plan offloads: the saved bytes of its offloaded stages' ops in one step (the
    pinned area's size) and in its largest offloaded stage (the prefetch window: the plan
    has room for one stage's saved bytes coming back at once); zeros without a graph."""
    if graph is None:
        return 0, 0
    saved = {node.id: node.saved for node in graph.nodes}
    stages = [sum(saved.get(v, 0) for v in stage.nodes) for stage in plan.stages if stage.action == "offload"]
    return sum(stages), max(stages, default=0)


class OffloadedModule(nn.Module):
    """Run ``module`` with what its forward saves offloaded by ``hooks`` (one stage of a
    plan with action ``offload``). Parameters and ``state_dict`` keys are the wrapped
    module's, under ``module.``."""

    def __init__(self, module: nn.Module, hooks: OffloadHooks) -> None:
        super().__init__()
        self.module = module
        self.hooks = hooks

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.hooks.keep_resident([*self.module.buffers()])
        with self.hooks:
            return self.module(*args, **kwargs)
