"""Predicted against measured extra time of ``remat()`` plans, in one process.

For each model (``benchmarks/run.py``'s CPU sizes, or ``--batch``/``--size``) and budget:
plan with ``remat()``, then time plain and planned steps alternately (the same conditions
for both), ``--repeats`` pairs, and print the plan's predicted extra time (its extra
seconds over the profiled step, of which the executor's own per-stage cost) beside the
measured one (median planned step / median plain step - 1). On a shared machine the
figures are noisy: take several runs.

    python benchmarks/recompute_time.py --models gpt,resnet50 --budgets 50%,75%
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(model_name: str, budget: str, batch: int | None, size: int | None, repeats: int) -> dict:
    import torch

    import lightning_remat
    from benchmarks.run import SIZES, build, step_loss
    from lightning_remat.solvers.schedule import make_schedule
    from lightning_remat.solvers.scoring import executor_seconds

    base_batch, base_size = SIZES["cpu"][model_name]
    model, x, _ = build(model_name, "cpu", batch or base_batch, size or base_size)
    model.train()
    run = lightning_remat.remat(model, x, memory_budget=budget, loss_fn=step_loss)
    plan, graph = run.plan, run.graph
    executor = executor_seconds(graph, make_schedule(graph, plan))

    def plain() -> None:
        torch.manual_seed(1)
        step_loss(model(x)).backward()

    def planned() -> None:
        torch.manual_seed(1)
        step_loss(run(x)).backward()

    times: dict = {plain: [], planned: []}
    for fn in times:  # warm-up
        model.zero_grad(set_to_none=True)
        fn()
    for _ in range(repeats):
        for fn, spent in times.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - t0)
    plain_s, planned_s = statistics.median(times[plain]), statistics.median(times[planned])
    step = graph.meta.step_seconds
    return {
        "model": model_name, "budget": budget, "solver": plan.solver,
        "stages": len(plan.stages), "recomputed": plan.count("recompute"),
        "predicted_extra": plan.predicted_extra_seconds / step,
        "predicted_executor": executor / step,
        "measured_extra": planned_s / plain_s - 1,
        "plain_s": plain_s, "planned_s": planned_s, "profiled_step_s": step,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt,resnet50")
    p.add_argument("--budgets", default="50%,75%")
    p.add_argument("--batch", type=int)
    p.add_argument("--size", type=int)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(f"{'model':10} {'budget':6} {'solver':12} {'stages':>6} {'pred %':>7} {'(exec)':>7} "
          f"{'meas %':>7} {'diff pt':>7} {'plain s':>8}")
    for model in args.models.split(","):
        for budget in args.budgets.split(","):
            r = measure(model, budget, args.batch, args.size, args.repeats)
            print(f"{r['model']:10} {r['budget']:6} {r['solver']:12} {r['stages']:6d} "
                  f"{100 * r['predicted_extra']:7.1f} {100 * r['predicted_executor']:7.1f} "
                  f"{100 * r['measured_extra']:7.1f} "
                  f"{100 * (r['measured_extra'] - r['predicted_extra']):7.1f} {r['plain_s']:8.3f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
