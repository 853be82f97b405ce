"""The CPU meter against the allocator's edge on three steps: a U-Net's (oneDNN
convolutions), the same with oneDNN off (im2col column buffers) and a GPT's (attention).

For each step, in a fresh child at the allocator's edge (:mod:`benchmarks.edge`): one warm-up
step, then the peak of one step at the edge, then the meter's reading of the same step:
``lightning_remat.meter.peak_bytes`` (every allocation c10's CPU allocator reports, from
torch.profiler's memory events) and, for comparison, ``StorageMeter`` (the tensors that
pass through dispatch: the meter before it counted allocations).

    python benchmarks/meter_check.py            # prints the table (markdown)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS = {
    "unet (oneDNN convolutions)": ("unet", True),
    "unet (oneDNN off: im2col)": ("unet", False),
    "gpt (attention)": ("gpt", True),
}


def _child(model_name: str, onednn: bool) -> dict[str, int]:
    import torch

    from benchmarks.edge import edge_peak_bytes
    from benchmarks.run import SIZES, build, step_loss
    from lightning_remat.meter import StorageMeter, peak_bytes

    batch, size = SIZES["cpu"][model_name]
    model, x, _ = build(model_name, "cpu", batch, size)

    def step() -> None:
        model.zero_grad(set_to_none=True)  # gradients are allocated inside the step
        step_loss(model(x)).backward()

    def storage_peak() -> int:
        with StorageMeter() as meter:
            step()
        return meter.peak

    with torch.backends.mkldnn.flags(enabled=onednn):
        step()
        model.zero_grad(set_to_none=True)
        edge = edge_peak_bytes(step)
        model.zero_grad(set_to_none=True)
        counted = peak_bytes(step)
        model.zero_grad(set_to_none=True)
        storage = storage_peak()
    return {"edge": edge, "allocations": counted, "storage": storage}


def main() -> int:
    from benchmarks.edge import child_env

    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[3] == "1")))
        return 0
    print("| step | allocator's edge (B) | meter: every allocation (B) | ratio | "
          "meter: tensor storage (B) | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, (model_name, onednn) in STEPS.items():
        proc = subprocess.run([sys.executable, __file__, "--child", model_name, "1" if onednn else "0"],
                              capture_output=True, text=True, env=child_env(PYTHONPATH=str(ROOT)))
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines:
            print(f"| {label} | failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]} |")
            continue
        r = json.loads(lines[-1])
        print(f"| {label} | {r['edge']:,} | {r['allocations']:,} | {r['allocations'] / r['edge']:.3f} | "
              f"{r['storage']:,} | {r['storage'] / r['edge']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
