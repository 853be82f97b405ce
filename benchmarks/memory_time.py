"""Measured peak memory and step time: plain, checkpoint_sequential, torch.compile's
activation memory budget, and lightning-remat with each solver (issue 4).

Every figure comes from a fresh process (``--worker``), so one method's allocations cannot
disturb another's reading. Memory is the step's peak above what was resident before it
(runtime/memory.py: VmHWM on CPU, the allocator's peak on CUDA); time is the median of
``--repeats`` steps after a warm-up; gradient agreement is the largest absolute difference
from the plain model's gradients on the same batch from the same weights.

    python benchmarks/memory_time.py                 # CPU, small inputs, < 20 minutes on 2 cores
    python benchmarks/memory_time.py --device cuda --image-size 224 --batch 32
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUR_SOLVERS = ["auto", "kusumoto-tc", "kusumoto-mc", "feng"]


def build(model_name: str, args: argparse.Namespace):
    """(model, example input, sequential form or None)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if model_name == "gpt":
        from benchmarks.models import GPT

        model = GPT(vocab=args.vocab, width=args.d_model, depth=args.layers, heads=4, context=args.seq_len)
        x = torch.randint(0, args.vocab, (args.batch, args.seq_len))
        return model, x, None
    import torchvision

    model = torchvision.models.get_model(model_name, num_classes=100)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)
    sequential = None
    if model_name.startswith("resnet"):
        children = list(model.children())
        sequential = nn.Sequential(*children[:-1], nn.Flatten(1), children[-1])
    elif model_name.startswith("vgg"):
        sequential = nn.Sequential(model.features, model.avgpool, nn.Flatten(1), *model.classifier)
    return model, x, sequential


def worker(args: argparse.Namespace) -> dict:
    import torch

    from lightning_remat.runtime.memory import peak_bytes

    device = torch.device(args.device)
    model, x, sequential = build(args.model, args)
    model, x = model.to(device), x.to(device)
    model.train()
    # Gradients of the plain model on the same batch, from the same weights (every method
    # pays this first, untimed step alike).
    torch.manual_seed(1)
    model(x).float().sum().backward()
    plain_grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    _reset_bn(model)

    run = model
    note = ""
    if args.method == "checkpoint_sequential":
        if sequential is None:
            return {"skipped": "no sequential form"}
        from torch.utils.checkpoint import checkpoint_sequential

        seq = sequential.to(device)

        def run(inp):  # noqa: F811
            return checkpoint_sequential(seq, args.segments, inp, use_reentrant=False)

        note = f"segments={args.segments}"
    elif args.method.startswith("compile"):
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = float(args.method.split("@")[1])
        run = torch.compile(model)
    elif args.method.startswith("remat:"):
        import lightning_remat

        _, solver, budget = args.method.split(":")
        try:
            run = lightning_remat.remat(model, x, memory_budget=budget, solver=solver)
        except lightning_remat.RematInfeasibleError as exc:
            return {"skipped": f"infeasible: {exc.min_budget_bytes}"}
        note = f"{run.plan.solver}, {run.plan.count('recompute')} recomputed stages"

    def step():
        torch.manual_seed(1)
        out = run(x)
        out.float().sum().backward()

    try:
        step()  # warm-up (compilation, allocator, oneDNN's first-call caches)
    except Exception as exc:  # a peer that cannot run this model is reported, not fatal
        return {"error": f"{type(exc).__name__}: {str(exc)[:80]}"}
    diff = max(float((p.grad - g).abs().max()) for p, g in zip(model.parameters(), plain_grads))
    model.zero_grad(set_to_none=True)
    step()
    # As Lightning does by default, gradients are freed before the step (set_to_none), so a
    # step's peak includes allocating them: the budget's definition (DESIGN.md section 6).
    model.zero_grad(set_to_none=True)
    peak = peak_bytes(step, device)
    times = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"peak": peak, "time": statistics.median(times), "grad_diff": diff, "note": note}


def _reset_bn(model) -> None:
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()


def spawn(args: argparse.Namespace, model: str, method: str, extra: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--method", method, *extra]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:100]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet50,vgg19,densenet121,gpt")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image-size", type=int, default=96)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budgets", default="50%,75%")
    p.add_argument("--solvers", default=",".join(OUR_SOLVERS))
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to build on CPU)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--segments", type=int, default=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    import torch

    shared = ["--device", args.device, "--batch", str(args.batch), "--image-size", str(args.image_size),
              "--seq-len", str(args.seq_len), "--vocab", str(args.vocab), "--d-model", str(args.d_model),
              "--layers", str(args.layers), "--repeats", str(args.repeats)]
    machine = (torch.cuda.get_device_name(0) if args.device.startswith("cuda")
               else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"# memory_time: {datetime.date.today()}, {machine}, torch {torch.__version__}, "
          f"batch {args.batch}, images {args.image_size}px, gpt seq {args.seq_len}")
    print(f"{'model':<12} {'method':<30} {'peak':>10} {'peak/plain':>10} {'time/plain':>10} {'grad diff':>10}  note")
    for model in args.models.split(","):
        plain = spawn(args, model, "plain", shared)
        if "peak" not in plain:
            print(f"{model:<12} plain: {plain}")
            continue
        rows = [("plain", plain)]
        best = None
        for segments in (2, 4):
            r = spawn(args, model, "checkpoint_sequential", [*shared, "--segments", str(segments)])
            if "peak" in r and (best is None or r["peak"] < best["peak"]):
                best = r
            elif "peak" not in r:
                best = best or r
                break
        rows.append(("checkpoint_sequential", best))
        if not args.no_compile:
            rows.append(("compile budget 0.5", spawn(args, model, "compile@0.5", shared)))
        for budget in args.budgets.split(","):
            for solver in args.solvers.split(","):
                rows.append((f"remat {solver} @{budget}", spawn(args, model, f"remat:{solver}:{budget}", shared)))
        for method, r in rows:
            if "peak" not in r:
                print(f"{model:<12} {method:<30} {'-':>10} {'-':>10} {'-':>10} {'-':>10}  {r}")
                continue
            print(f"{model:<12} {method:<30} {r['peak'] / 2**20:>8.1f}Mi {r['peak'] / plain['peak']:>10.2f} "
                  f"{r['time'] / plain['time']:>10.2f} {r['grad_diff']:>10.1e}  {r.get('note', '')}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
