"""How well offloading overlaps with compute on a GPU: the idle time of the compute stream.

A stack of convolution blocks trains one step plainly, then one step with the middle half
of its blocks under :class:`~lightning_remat.runtime.offload.OffloadHooks`. Each step runs
under ``torch.profiler`` (CUDA activity); from the kernels of the trace, per stream: the
span from the first kernel's start to the last one's end, and the time inside that span
when no kernel ran. The compute stream is the one with the most kernel time. Idle time
that offloading adds is time the compute stream waited for a copy (or for the host): a
perfect overlap adds none. Also printed: the peak of each step (allocator counter) and the
bytes offloaded, and how many copies the compute stream waited for.

    python benchmarks/overlap.py [--batch 32] [--size 112] [--blocks 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def stream_idle(trace_events: list[dict[str, Any]]) -> dict[int, tuple[float, float, float]]:
    """Per stream of the kernels in a Chrome trace: (span, busy, idle) in milliseconds,
    busy being the union of the kernels' intervals."""
    by_stream: dict[int, list[tuple[float, float]]] = {}
    for event in trace_events:
        if event.get("cat") != "kernel" or event.get("ph") != "X":
            continue
        stream = int(event.get("args", {}).get("stream", -1))
        start = float(event["ts"])
        by_stream.setdefault(stream, []).append((start, start + float(event.get("dur", 0.0))))
    out = {}
    for stream, intervals in by_stream.items():
        intervals.sort()
        busy, cur_start, cur_end = 0.0, intervals[0][0], intervals[0][1]
        for start, end in intervals[1:]:
            if start > cur_end:
                busy += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        busy += cur_end - cur_start
        span = max(end for _, end in intervals) - intervals[0][0]
        out[stream] = (span / 1e3, busy / 1e3, (span - busy) / 1e3)
    return out


def compute_stream(idle: dict[int, tuple[float, float, float]]) -> int:
    """The stream with the most kernel time."""
    return max(idle, key=lambda s: idle[s][1])


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - needs a GPU
    import torch
    from torch import nn

    from lightning_remat.runtime.offload import OffloadHooks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--channels", type=int, default=64)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("overlap.py: no CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    c = args.channels
    blocks = nn.ModuleList(
        nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()) for _ in range(args.blocks)
    ).to(device)
    stem = nn.Conv2d(3, c, 3, padding=1).to(device)
    head = nn.Linear(c, 10).to(device)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    target = torch.randint(0, 10, (args.batch,), device=device)
    lo, hi = args.blocks // 4, args.blocks - args.blocks // 4

    def step(hooks: OffloadHooks | None) -> None:
        h = stem(x)
        for i, block in enumerate(blocks):
            if hooks is not None and lo <= i < hi:
                with hooks:
                    h = block(h)
            else:
                h = block(h)
        nn.functional.cross_entropy(head(h.mean(dim=(2, 3))), target).backward()

    hooks = OffloadHooks()
    rows = []
    for label, run_hooks in (("plain", None), ("offload", hooks)):
        for _ in range(2):  # warm-up: cuDNN plans, the pinned area
            step(run_hooks)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        waits_before = hooks.stats.compute_waits
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(run_hooks)
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text())["traceEvents"]
        idle = stream_idle(events)
        span, busy, gap = idle[compute_stream(idle)]
        waits = hooks.stats.compute_waits - waits_before if run_hooks is not None else 0
        rows.append((label, peak, span, busy, gap, waits))
    print(f"offload overlap: batch {args.batch}, {args.size} px, {args.blocks} blocks of {c} channels "
          f"(blocks {lo}..{hi - 1} offloaded), {torch.cuda.get_device_name()}")
    header = f"{'step':8} {'peak MiB':>9} {'span ms':>8} {'busy ms':>8} {'idle ms':>8} {'idle %':>7} {'waits':>6}"
    print(header)
    print("-" * len(header))
    for label, peak, span, busy, gap, waits in rows:
        print(f"{label:8} {peak / 2**20:9.1f} {span:8.2f} {busy:8.2f} {gap:8.2f} "
              f"{100 * gap / span if span else 0:6.1f}% {waits:6d}")
    added = rows[1][4] - rows[0][4]
    print(f"compute-stream idle time added by offloading: {added:.2f} ms per step "
          f"({hooks.stats.offloaded_bytes / max(hooks.stats.offloaded_tensors, 1) / 2**20:.1f} MiB per "
          f"offloaded storage on average, pinned area {hooks.stats.pinned_bytes / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
