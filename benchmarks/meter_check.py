"""The CPU meter against the allocator's edge on three steps: a U-Net's (oneDNN
convolutions), the same with oneDNN off (im2col column buffers) and a GPT's (attention).

For each step, in a fresh child at the allocator's edge (:mod:`benchmarks.edge`): one warm-up
step, then the peak of one step at the edge, then the meter's reading of the same step:
``lightning_remat.measure.peak.peak_bytes`` (every allocation c10's CPU allocator reports, from
the autograd profiler's memory events) and, for comparison, ``StorageMeter`` (the tensors that
pass through dispatch: the meter before it counted allocations).

    python benchmarks/meter_check.py            # prints the table, writes it for RESULTS.md

The table goes to ``benchmarks/results/meter/cpu.md`` with the machine, torch and date of the
run; ``benchmarks/render.py`` puts it in RESULTS.md.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUTPUT = ROOT / "benchmarks" / "results" / "meter" / "cpu.md"

STEPS = {
    "unet (oneDNN convolutions)": ("unet", True),
    "unet (oneDNN off: im2col)": ("unet", False),
    "gpt (attention)": ("gpt", True),
}


def _child(model_name: str, onednn: bool) -> dict[str, int]:
    import torch

    from benchmarks.edge import edge_peak_bytes
    from benchmarks.run import SIZES, build, step_loss
    from lightning_remat.measure.peak import peak_bytes
    from lightning_remat.measure.storage import StorageMeter

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
    import torch

    from benchmarks.run import git_commit

    lines = [f"The CPU meter against the allocator's edge: {platform.processor() or platform.machine()}, "
             f"{len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, "
             f"measured {datetime.date.today().isoformat()} at {git_commit(True)} "
             "(`python benchmarks/meter_check.py`). *every allocation*: the meter now (the autograd "
             "profiler's memory events); *tensor storage*: the meter before (tensors through dispatch).", "",
             "| step | allocator's edge (B) | meter: every allocation (B) | ratio | "
             "meter: tensor storage (B) | ratio |", "|---|---:|---:|---:|---:|---:|"]
    for label, (model_name, onednn) in STEPS.items():
        proc = subprocess.run([sys.executable, __file__, "--child", model_name, "1" if onednn else "0"],
                              capture_output=True, text=True, env=child_env(PYTHONPATH=str(ROOT)))
        found = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not found:
            lines.append(f"| {label} | failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]} |")
            continue
        r = json.loads(found[-1])
        lines.append(f"| {label} | {r['edge']:,} | {r['allocations']:,} | {r['allocations'] / r['edge']:.3f} | "
                     f"{r['storage']:,} | {r['storage'] / r['edge']:.3f} |")
    print("\n".join(lines))
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
