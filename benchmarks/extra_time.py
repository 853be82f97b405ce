"""Where a plan's extra step time goes: the plain step and the plan's step under
torch.profiler, op by op, beside what the time model predicts.

The model (docs/design.md section 4.7) predicts a plan's extra time as the profiled forward
time of the ops it runs again (Kusumoto et al.'s eq. 1) plus the executor's own time per
recomputed stage and vertex (``measure_recompute_overhead``). This script measures what the
step actually spends beyond plain: each profiler event's self time in one plain step and one
plan step (alternated after a warm-up; the median of ``--profiled`` such pairs), the rows
that grew most first. Rows named after an
autograd node (``ConvolutionBackward0``) hold, as self time, what runs inside it that is no
op: the recomputation's Python when that node unpacks a recomputed value. ``PythonDispatchMode``
is the selective-checkpoint policy's own time, paid on every op of a recomputed stage in the
forward and again in the recomputation.

    python benchmarks/extra_time.py --model resnet50 --budget 75%

One model per run, at the CPU set's batch and size (``benchmarks/run.py``'s ``SIZES``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--budget", default="75%")
    p.add_argument("--solver", default="auto")
    p.add_argument("--steps", type=int, default=4, help="timed steps of each, alternated")
    p.add_argument("--profiled", type=int, default=3, help="profiled steps of each, alternated")
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--peer", default=None, metavar="checkpoint_sequential:SEGMENTS",
                   help="also time this peer, alternated with plain and the plan in this process")
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    import lightning_remat
    from benchmarks.run import SIZES, build, step_loss
    from lightning_remat.solvers.schedule import make_schedule
    from lightning_remat.solvers.scoring import executor_seconds, recomputed_seconds

    batch, size = SIZES["cpu"][args.model]
    model, x, sequential = build(args.model, "cpu", batch, size)
    planned = lightning_remat.remat(model, x, memory_budget=args.budget, solver=args.solver, loss_fn=step_loss)
    plan, graph = planned.plan, planned.graph
    schedule = make_schedule(graph, plan)
    stages = [s for s in schedule.stages if s.action == "recompute"]

    def step(module) -> None:
        torch.manual_seed(1)
        step_loss(module(x)).backward()
        model.zero_grad(set_to_none=True)

    runs = {"plain": model, "plan": planned}
    if args.peer:
        from torch.utils.checkpoint import checkpoint_sequential

        segments = int(args.peer.split(":")[1])
        if sequential is None:  # it shares the model's modules
            p.error(f"{args.model} has no sequential form for {args.peer}")

        def peer(inp):
            return checkpoint_sequential(sequential, segments, inp, use_reentrant=False)
        runs["peer"] = peer
    for module in runs.values():
        step(module)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.steps):
        for name, module in runs.items():
            start = time.perf_counter()
            step(module)
            times[name].append(time.perf_counter() - start)
    plain_s, plan_s = (statistics.median(times[k]) for k in ("plain", "plan"))

    rounds: dict[str, list[dict[str, tuple[float, int]]]] = {k: [] for k in runs}
    for _ in range(args.profiled):
        for name, module in runs.items():
            if name == "peer":  # timed only
                continue
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(module)
            rounds[name].append({e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()})
    # Each event's median self time over the profiled steps: one step's reading varies by
    # tens of milliseconds on a convolution's backward.
    self_times = {name: {key: (statistics.median(r.get(key, (0.0, 0))[0] for r in taken),
                               max(r.get(key, (0.0, 0))[1] for r in taken))
                         for key in set().union(*taken)}
                  for name, taken in rounds.items()}

    recomputed, executor = recomputed_seconds(graph, schedule), executor_seconds(graph, schedule)
    print(f"{args.model} (batch {batch}, {size}), {plan.solver} at {args.budget}: {len(stages)} recomputed "
          f"stages, {sum(len(s.vertices) for s in stages)} vertices in them, torch {torch.__version__}")
    print(f"step: plain {plain_s:.3f} s, plan {plan_s:.3f} s, extra {plan_s - plain_s:+.3f} s "
          f"({plan_s / plain_s - 1:+.1%}); median of {args.steps}, alternated")
    if args.peer:
        peer_s = statistics.median(times["peer"])
        print(f"peer {args.peer}: {peer_s:.3f} s ({peer_s / plain_s - 1:+.1%}); plan/peer {plan_s / peer_s:.3f}")
    print(f"model: {recomputed + executor:+.3f} s ({(recomputed + executor) / plain_s:+.1%}) = ops run again "
          f"{recomputed:.3f} s + executor {executor:.3f} s ({graph.meta.recompute_stage_seconds or 0:.6f} s per "
          f"stage, {graph.meta.recompute_vertex_seconds or 0:.6f} s per vertex)")
    plain, ours = self_times["plain"], self_times["plan"]
    grown = sorted(set(plain) | set(ours), key=lambda k: plain.get(k, (0, 0))[0] - ours.get(k, (0, 0))[0])
    total = sum(v[0] for v in ours.values()) - sum(v[0] for v in plain.values())
    print(f"\nself time under torch.profiler (median of {args.profiled} steps each), plan less plain: "
          f"{total:+.3f} s in all; the {args.rows} that grew most, then the 5 that shrank most\n")
    print("| event | plain (ms) | calls | plan (ms) | calls | plan less plain (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    # The rows that grew most, then the ones that shrank most (an in-place op the plan runs
    # out of place moves its time from aten::add_ to aten::add).
    for key in grown[:args.rows] + grown[-5:][::-1]:
        (a, n), (b, m) = plain.get(key, (0.0, 0)), ours.get(key, (0.0, 0))
        print(f"| {key} | {a * 1e3:.1f} | {n} | {b * 1e3:.1f} | {m} | {(b - a) * 1e3:+.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
