"""The allocator's edge: a step's peak as the kernel counts it, the independent check on the
meter (docs/design.md section 6).

In a process started with glibc's mmap threshold at 64 KiB and one heap for all its threads
(``EDGE_ENV``, set in the child's environment, never in the measuring process), every buffer
over 64 KiB is its own mapping, returned to the kernel when freed; the kernel's high-water
mark of resident memory (``VmHWM``), reset through ``/proc/self/clear_refs`` before the step
and read after it, less the resident bytes before it, is the step's peak: tensors, op-internal
scratch, and whatever else the step touched. This is what ``top`` shows and the OOM killer
enforces. Linux only.

The threshold alone does not make every buffer a mapping: glibc serves a request from a free
chunk of its heap before it maps one, and tracing, profiling and the last step leave megabytes
of free heap. A buffer served from free pages still resident grows resident memory by nothing
(the edge read up to 20% under the allocations on a model of a few MB), and one served from
pages returned earlier stays resident when freed, beside the next (up to 25% over, with
``malloc_trim`` first). So before each step the free heap is plugged (:func:`plug_heap`):
every free chunk a buffer over 64 KiB could come from is allocated and held, so each such
buffer is mapped afresh and unmapped when freed. On generated models' steps of 25 to 95 MB the
edge then reads the library's meter within 0.7%, with oneDNN's convolutions and with im2col's.

On steps of a few megabytes, a fifth of what a step allocates is under 64 KiB and served from
the heap, where reuse and fragmentation moved the edge of one tiny Qwen2 step from 8% under to
22% over the meter from run to run (2,580,480 to 3,416,064 B against 2,798,028 B). A child
started with a lower threshold (``child_env(mmap_threshold=4096)``) maps every buffer of a page
or more on its own: there five runs read 2,473,984 to 2,584,576 B (2026-12-07, 2-core CPU).

The setting makes allocation slower, so no timed step runs under it: the benchmarks run it in
a child of its own (:func:`child_env`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

EDGE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}
"""The child's environment on top of the parent's: every buffer over 64 KiB its own mapping,
and one heap (arena) for every thread, so that :func:`plug_heap` reaches all free chunks.
:func:`child_env` may set a lower threshold."""

_THRESHOLD_KEY = "MALLOC_MMAP_THRESHOLD_"
_LARGEST_THRESHOLD = int(EDGE_ENV[_THRESHOLD_KEY])


def _plug_bytes(threshold: int) -> int:
    """A plug's size: under the threshold, so glibc cuts it from the heap. What a plugged
    chunk keeps is smaller than a plug, so no buffer over the threshold fits in it."""
    return threshold - 4096 if threshold > 8192 else threshold // 2


_plugs: list[int] = []  # held for the process's life: freed, they would be free heap again


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def plug_heap(threshold: int = _LARGEST_THRESHOLD) -> int:
    """Allocate (and hold) every free heap chunk a buffer over the mmap threshold could be
    served from; the number of plugs. glibc takes a request from the best-fitting free chunk
    and extends the heap only when none fits, so plugs are taken until one extends it (the
    heap's size, ``mallinfo2().arena``, grows): then no free chunk of a plug's size is left.
    The plugs are not written, so they cost a page of headers each and no resident data."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    count = 0
    while True:
        before = libc.mallinfo2().arena
        pointer = libc.malloc(_plug_bytes(threshold))
        if not pointer:
            raise MemoryError("plug_heap: malloc returned NULL")
        _plugs.append(pointer)
        count += 1
        if libc.mallinfo2().arena != before:
            return count


def child_env(mmap_threshold: int = _LARGEST_THRESHOLD, **extra: str) -> dict[str, str]:
    """The environment of a child that measures at the allocator's edge: buffers of
    ``mmap_threshold`` bytes or more (a page to 64 KiB) each a mapping of their own."""
    if not 4096 <= mmap_threshold <= _LARGEST_THRESHOLD:
        raise ValueError(f"mmap_threshold={mmap_threshold}: the edge needs a threshold from 4096 (a page) "
                         f"to {_LARGEST_THRESHOLD} bytes")
    return {**os.environ, **EDGE_ENV, _THRESHOLD_KEY: str(mmap_threshold), **extra}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def edge_peak_bytes(fn: Callable[[], Any]) -> int:
    """Run ``fn()`` once, the free heap plugged first (:func:`plug_heap`); the peak resident
    bytes above the level before it. Only in a process started with :data:`EDGE_ENV`
    (otherwise freed buffers stay in glibc's heap and a reuse hides the peak)."""
    threshold = os.environ.get(_THRESHOLD_KEY, "")
    if (os.environ.get("MALLOC_ARENA_MAX") != EDGE_ENV["MALLOC_ARENA_MAX"] or not threshold.isdigit()
            or not 4096 <= int(threshold) <= _LARGEST_THRESHOLD):
        raise RuntimeError("edge_peak_bytes needs a process started with "
                           + " ".join(f"{k}={v}" for k, v in EDGE_ENV.items()) + " (benchmarks.edge.child_env())")
    gc.collect()
    plug_heap(int(threshold))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    fn()
    return _status("VmHWM") - base


def edge_check(worker: list[str], method: str, plans_file: str | None, plan_made: tuple[Any, Any] | None,
               graph_path: Callable[[Path], Path]) -> dict[str, Any]:
    """A benchmark row's step measured again at the allocator's edge, in a child of its own
    (``worker``: the benchmark's worker command without ``--method``): ``edge_peak_bytes``,
    or ``edge_error``. A plan ``remat()`` made in the row's process (``plan_made``: plan and
    graph) is written out and run in the child through ``apply_plan``, so the child measures
    that plan, not one made on a second profile; ``graph_path`` names the graph beside a
    plans file."""
    with tempfile.TemporaryDirectory() as folder:
        if plan_made is not None:
            plan, graph = plan_made
            plans_file = str(Path(folder) / "plan.jsonl")
            Path(plans_file).write_text(plan.to_json() + "\n")
            graph.save(graph_path(Path(plans_file)))
            method = "plan:0"
        cmd = [*worker, "--method", method]
        if plans_file is not None:
            cmd += ["--plans-file", plans_file]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(PYTHONPATH=str(ROOT)))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"edge_error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]}
