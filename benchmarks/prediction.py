"""Predicted against measured peak memory of one training step, per model.

For each model: one plain step's peak is measured with ``peak_bytes`` (after a warm-up
step, parameter gradients set to None so the step allocates them as a first step does), the
model is profiled with ``profile_module`` and the simulator predicts the same step's peak.
Each model runs in its own fresh subprocess so earlier models leave nothing behind
(allocator caches, glibc heaps). The step is ``model(x, targets).backward()`` where the
model ends with its cross-entropy loss (``benchmarks.models.WithLoss``).

    python benchmarks/prediction.py                 # CPU (the tensor storage meter)
    python benchmarks/prediction.py --device cuda   # CUDA (allocator counters)

torchvision models need torchvision: the workers run under ``--python`` (default: the
vision venv when it exists, else this interpreter).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VISION_PYTHON = "/work/main/.venv-vision/bin/python"

# name -> (batch, description); small sizes so the CPU run takes a few minutes.
MODELS = {
    "resnet18": (16, "torchvision resnet18, 3x128x128 images, 1000 classes"),
    "vgg11": (8, "torchvision vgg11, 3x128x128 images, 1000 classes"),
    "gpt": (8, "GPT (benchmarks.models): vocab 8192, width 256, 4 blocks, 4 heads, 256 tokens"),
}


def build(name: str, batch: int, device: str):
    import torch

    from benchmarks.models import GPT, WithLoss

    torch.manual_seed(0)
    if name == "gpt":
        model = GPT()
        x = torch.randint(0, 8192, (batch, 256))
        y = torch.randint(0, 8192, (batch, 256))
    else:
        import torchvision

        model = getattr(torchvision.models, name)(num_classes=1000)
        x = torch.randn(batch, 3, 128, 128)
        y = torch.randint(0, 1000, (batch,))
    return WithLoss(model, sequence=name == "gpt").to(device).train(), (x.to(device), y.to(device))


def worker(name: str, device: str) -> dict:
    import torch

    from lightning_remat.graph.profile import profile_module
    from lightning_remat.graph.trace import trace_module
    from lightning_remat.meter import peak_bytes
    from lightning_remat.solvers.simulate import make_plan, simulate

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    batch, _ = MODELS[name]
    model, inputs = build(name, batch, device)

    def step() -> None:
        model(*inputs).backward()

    def clear() -> None:
        for p in model.parameters():
            p.grad = None

    step()
    clear()  # warm-up (lazy initialisation), then measure from a state without gradients
    measured = peak_bytes(step, device)
    clear()
    traced = trace_module(model, inputs)
    graph = profile_module(model, inputs, loss_fn=lambda out: out, warmup=1, repeats=1,
                           traced=traced)
    result = {"model": name, "batch": batch, "vertices": len(graph),
              "measured": measured, "predicted": simulate(graph).peak_bytes}
    # One recompute plan: about sqrt(n) stages of equal size, all but the last recomputed.
    ids = graph.ids
    size = max(1, round(math.sqrt(len(ids))))
    chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
    plan = make_plan(graph, [(c, "recompute") for c in chunks[:-1]] + [(chunks[-1], "keep")],
                     "sqrt-n")
    result["recompute_stages"] = len(chunks) - 1
    result["recompute_predicted"] = plan.predicted_peak_bytes
    result["recompute_measured"] = None
    from lightning_remat.runtime.module import apply_plan

    remat = apply_plan(traced.gm, plan, root=model, charge=traced.charge)
    step_remat = lambda: remat(*inputs).backward()  # noqa: E731
    step_remat()
    clear()
    result["recompute_measured"] = peak_bytes(step_remat, device)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--python", default=VISION_PYTHON if Path(VISION_PYTHON).exists()
                        else sys.executable, help="interpreter for the workers (needs torchvision)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.device)))
        return

    # This checkout is importable in the workers (after any PYTHONPATH the caller set).
    path = [p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    env.setdefault("OMP_NUM_THREADS", "2")
    info = subprocess.run([args.python, "-c", "import torch; print(torch.__version__); "
                           "print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')"],
                          capture_output=True, text=True, env=env).stdout.split("\n")
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs"
          + (f", {info[1]}" if args.device == "cuda" and len(info) > 1 else ""))
    print(f"torch: {info[0]}   device: {args.device}")
    for name in args.models:
        print(f"  {name}: batch {MODELS[name][0]}, {MODELS[name][1]}")
    mib = 2**20
    print("plain: keep everything; recompute N: the vertices cut into N + 1 runs of about "
          "sqrt(n), the first N under non-reentrant checkpoint)")
    header = f"{'model':10} {'batch':>5} {'plan':>12} {'predicted':>12} {'measured':>12} {'error':>8}"
    print(header)
    print("-" * len(header))
    for name in args.models:
        run = subprocess.run([args.python, __file__, "--worker", name, "--device", args.device],
                             capture_output=True, text=True, env=env, cwd=ROOT)
        if run.returncode != 0:
            print(f"{name:10} failed:\n{run.stderr[-2000:]}")
            continue
        r = json.loads(run.stdout.strip().splitlines()[-1])
        err = 100.0 * (r["predicted"] - r["measured"]) / r["measured"]
        print(f"{name:10} {r['batch']:>5} {'plain':>12} {r['predicted'] / mib:>9.1f} MiB"
              f" {r['measured'] / mib:>8.1f} MiB {err:>+7.1f}%")
        plan = f"recompute {r['recompute_stages']:<2}"
        if r["recompute_measured"]:
            err = 100.0 * (r["recompute_predicted"] - r["recompute_measured"]) / r["recompute_measured"]
            print(f"{'':10} {'':>5} {plan:>12} {r['recompute_predicted'] / mib:>9.1f} MiB"
                  f" {r['recompute_measured'] / mib:>8.1f} MiB {err:>+7.1f}%")
        else:
            print(f"{'':10} {'':>5} {plan:>12} {r['recompute_predicted'] / mib:>9.1f} MiB"
                  f" {'(no runtime)':>12}")


if __name__ == "__main__":
    main()
