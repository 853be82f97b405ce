"""The device layer the offload executor runs on: a copy stream beside the compute stream,
events, pinned host memory and the allocator's counters (docs/design.md section 5).

Two implementations of one small interface, :class:`DeviceStreams`:

- :class:`CudaStreams`, thin: each method is one or two ``torch.cuda`` calls. These are the
  package's CUDA-only lines; a GPU runs them, the CPU tests cannot (marked "CUDA only").
- :class:`SimulatedStreams`, the CPU stand-in the tests use and the executor runs on for CPU
  tensors. A copy is queued and completes late (after ``latency`` further copies, or when
  the compute stream waits for it, or on :meth:`SimulatedStreams.complete`), in issue order
  as on one copy stream. The bytes really move only at completion: a device tensor fetched
  back reads as NaN until the compute stream has waited for its copy, and a source freed
  before its copy completed is an error. It counts bytes in flight, waits and pinned bytes,
  and logs every copy, so a test can show that a dropped activation is gone before the next
  stage, that the compute waits for the copy, and that prefetch follows the save order.
  With ``latency=0`` a copy completes at once (the CPU path of the executor in training).

Lines only a GPU runs, across the package (each marked "CUDA only" where it stands); the
CPU tests run the logic around them through this stand-in or through fakes of
``torch.cuda``, never these calls themselves:

- here, every method of :class:`CudaStreams` (copy stream, events, ``record_stream``,
  pinned buffers, allocator counters);
- ``runtime/offload.py``: ``measure_bandwidth``'s CUDA branch with real events and pinned
  memory (``_cuda_bandwidth``'s device and stream handling runs on fakes);
- ``graph/instruments.py``: ``Clock``'s CUDA events, its ``torch.cuda._sleep`` backlog and
  ``_dispatch_backlog_cycles`` (the timing logic runs on a simulated timeline);
- ``lightning/memory_timeline.py``: the allocator counter reads (run on fakes);
- ``lightning/trial.py``: ``max_memory_reserved`` and the step-time synchronise;
- ``messages.py``: ``DistributedRanks``' extra gloo group under NCCL;
- ``device.py``: ``default_budget``'s ``mem_get_info`` and counters, ``device_name``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["CudaStreams", "DeviceStreams", "SimulatedStreams", "streams_for"]


class DeviceStreams:
    """A compute stream, one copy stream, events and the allocator's counters of one device.
    Events are opaque: pass them back to :meth:`done` and :meth:`compute_waits`."""

    device: torch.device

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        """Start ``dst.copy_(src)`` (device to host) on the copy stream, after everything the
        compute stream has queued so far; the event of its completion."""
        raise NotImplementedError

    def copy_to_device(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying host tensor ``src`` into a new device tensor on the copy stream; the
        tensor (usable after :meth:`compute_waits` on the event) and the event."""
        raise NotImplementedError

    def compute_waits(self, event: Any) -> None:
        """Make the compute stream wait for ``event`` (on the device, the host does not)."""
        raise NotImplementedError

    def done(self, event: Any) -> bool:
        """Whether ``event``'s copy has completed (a query, never a wait)."""
        raise NotImplementedError

    def hand_to_compute(self, tensor: torch.Tensor) -> None:
        """``tensor`` was made on the copy stream and is used on the compute stream: tell the
        allocator, so its memory is not reused before the compute stream is done with it."""

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A page-locked host buffer of ``nbytes`` bytes (uint8)."""
        raise NotImplementedError

    def allocated_bytes(self) -> int:
        """Bytes the device allocator has handed out now."""
        raise NotImplementedError

    def reserved_bytes(self) -> int:
        """Bytes the device allocator holds from the driver now (handed out or cached)."""
        raise NotImplementedError


class CudaStreams(DeviceStreams):
    """:class:`DeviceStreams` of one CUDA device. CUDA only: every method."""

    def __init__(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # CUDA only
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device)  # CUDA only

    def _compute(self) -> Any:
        return torch.cuda.current_stream(self.device)  # CUDA only: the stream training runs on

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        self.copy_stream.wait_stream(self._compute())  # CUDA only: see the kernel that made src
        with torch.cuda.stream(self.copy_stream):  # CUDA only
            dst.copy_(src, non_blocking=True)
            return self.copy_stream.record_event()

    def copy_to_device(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.copy_stream):  # CUDA only: allocated and filled on the copy stream
            out = torch.empty_like(src, device=self.device)
            out.copy_(src, non_blocking=True)
            return out, self.copy_stream.record_event()

    def compute_waits(self, event: Any) -> None:
        self._compute().wait_event(event)  # CUDA only: a device-side wait

    def done(self, event: Any) -> bool:
        return bool(event.query())  # CUDA only

    def hand_to_compute(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self._compute())  # CUDA only

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # CUDA only

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))  # CUDA only

    def reserved_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))  # CUDA only


@dataclass(eq=False)  # an event is itself, whatever it copies
class _Copy:
    """A copy queued on the stand-in's copy stream."""

    kind: str  # "to_host" or "to_device"
    src: torch.Tensor | None
    src_ref: StorageWeakRef
    dst: torch.Tensor
    nbytes: int
    completed: bool = False


@dataclass
class SimulatedStreams(DeviceStreams):
    """The CPU stand-in of :class:`CudaStreams` (see the module docstring).

    ``latency``: how many later copies a copy completes after (None: only when waited for
    or :meth:`complete`\\ d; 0: at once). ``device``: the "device" its tensors live on (the
    CPU; the name is what the executor keys on)."""

    latency: int | None = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    log: list[tuple[str, int]] = field(default_factory=list)
    """Every copy as ``(kind, nbytes)`` in issue order, and ``("wait", nbytes)`` for every
    compute-stream wait that found its copy still running."""
    bytes_in_flight: int = 0
    max_bytes_in_flight: int = 0
    compute_waits_count: int = 0
    pinned_requests: list[int] = field(default_factory=list)
    """Sizes of the pinned buffers asked for."""
    pinned_allocations: list[int] = field(default_factory=list)
    """Sizes of the pinned blocks handed out: each request rounded up to a power of two,
    as CUDA's caching host allocator does (which also keeps freed blocks)."""
    _queue: deque = field(default_factory=deque, repr=False)

    def _issue(self, copy: _Copy) -> _Copy:
        self._queue.append(copy)
        self.log.append((copy.kind, copy.nbytes))
        self.bytes_in_flight += copy.nbytes
        self.max_bytes_in_flight = max(self.max_bytes_in_flight, self.bytes_in_flight)
        if self.latency is not None:
            self.complete(len(self._queue) - self.latency)
        return copy

    def complete(self, count: int | None = None) -> None:
        """Complete the ``count`` oldest queued copies (None: all), in issue order."""
        count = len(self._queue) if count is None else max(0, min(count, len(self._queue)))
        for _ in range(count):
            copy = self._queue.popleft()
            if copy.src_ref.expired():
                raise RuntimeError("the source of a queued copy was freed before the copy completed")
            assert copy.src is not None
            copy.dst.copy_(copy.src)
            copy.src = None  # the stream no longer reads it
            copy.completed = True
            self.bytes_in_flight -= copy.nbytes

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        # A CUDA stream holds a pointer, not a reference: the executor must keep the source
        # alive until the copy is done. The queue holds a snapshot of the bytes and a weak
        # reference to the source's storage, and fails at completion if that is gone.
        data = src if self.latency == 0 else src.clone()
        return self._issue(_Copy("to_host", data, StorageWeakRef(src.untyped_storage()), dst,
                                 src.numel() * src.element_size()))

    def copy_to_device(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out = torch.empty_like(src, device=self.device)
        if self.latency != 0:
            _poison(out)  # what the compute stream would read before the copy lands
        copy = self._issue(_Copy("to_device", src, StorageWeakRef(src.untyped_storage()), out,
                                 src.numel() * src.element_size()))
        return out, copy

    def compute_waits(self, event: Any) -> None:
        self.compute_waits_count += 1
        if not event.completed:
            self.log.append(("wait", event.nbytes))
            self.complete(next(i for i, c in enumerate(self._queue) if c is event) + 1)

    def done(self, event: Any) -> bool:
        return bool(event.completed)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        self.pinned_requests.append(int(nbytes))
        block = pinned_block_bytes(nbytes)
        self.pinned_allocations.append(block)
        return torch.empty(block, dtype=torch.uint8)[:nbytes]

    def allocated_bytes(self) -> int:
        return 0

    def reserved_bytes(self) -> int:
        return 0


def _poison(tensor: torch.Tensor) -> None:
    """Fill with bytes that read as NaN in every floating dtype."""
    tensor.view(torch.uint8).fill_(0xFF)


def streams_for(device: torch.device) -> DeviceStreams:
    """The device layer of ``device``: CUDA's, or the stand-in (copies complete at once)."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaStreams(device)  # CUDA only
    return SimulatedStreams(latency=0, device=device)


def pinned_block_bytes(nbytes: int) -> int:
    """What ``torch.empty(nbytes, pin_memory=True)`` takes from the host: CUDA's caching
    host allocator hands out blocks rounded up to a power of two, and keeps a freed block
    for reuse instead of returning it."""
    return 1 << max(int(nbytes) - 1, 0).bit_length() if nbytes > 0 else 0
