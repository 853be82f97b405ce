"""The allocator's edge: a step's peak as the kernel counts it, the independent check on the
meter (docs/design.md section 6).

In a process started with glibc's mmap threshold at 64 KiB (``EDGE_ENV``, set in the child's
environment, never in the measuring process), every buffer over 64 KiB is its own mapping,
returned to the kernel when freed; the kernel's high-water mark of resident memory
(``VmHWM``), reset through ``/proc/self/clear_refs`` before the step and read after it, less
the resident bytes before it, is the step's peak: tensors, op-internal scratch, and whatever
else the step touched. This is what ``top`` shows and the OOM killer enforces. Linux only.

The setting makes allocation slower, so no timed step runs under it: the benchmarks run it in
a child of its own (:func:`child_env`).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

EDGE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""The child's environment on top of the parent's: every buffer over 64 KiB its own mapping."""


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child that measures at the allocator's edge."""
    return {**os.environ, **EDGE_ENV, **extra}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def edge_peak_bytes(fn: Callable[[], Any]) -> int:
    """Run ``fn()`` once; the peak resident bytes above the level before it. Only in a
    process started with :data:`EDGE_ENV` (otherwise freed buffers stay in glibc's heap and
    a reuse hides the peak)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != EDGE_ENV["MALLOC_MMAP_THRESHOLD_"]:
        raise RuntimeError("edge_peak_bytes needs a process started with MALLOC_MMAP_THRESHOLD_=65536 "
                           "(benchmarks.edge.child_env())")
    gc.collect()
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
