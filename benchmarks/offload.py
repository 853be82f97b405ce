"""The ratio table of Beaumont et al.'s section 6 (Figures 5, 6, 9): for each memory limit
from the chain's minimum to its plain peak, the lower bound LB (Proposition 3) and the
makespans of GREEDY, DYNPROG and the vDNN-style baseline divided by LB.

Profiles: ``tests/data/*_224.json`` (ResNet-50 and DenseNet-121 at 224 px, batch 32, written
by ``tests/data/make_cnn_profiles.py``), or any graph JSON with
``meta.bandwidth_bytes_per_s`` given on the command line.

    python benchmarks/offload.py [graph.json ...] [--points 11] [--slots 500]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_remat.graph.ir import Graph  # noqa: E402
from lightning_remat.solvers.beaumont import (  # noqa: E402
    chain_from_graph,
    dynprog_offload,
    greedy_offload,
    lower_bound,
    min_memory,
    peak_memory,
    simulate_schedule,
    vdnn_offload,
)

DEFAULT_PROFILES = sorted((Path(__file__).resolve().parents[1] / "tests" / "data").glob("*_224.json"))


def table(path: Path, points: int, slots: int) -> list[str]:
    graph = Graph.load(path)
    chain = chain_from_graph(graph)
    lo, hi = min_memory(chain), peak_memory(chain)
    lines = [
        f"{graph.meta.extra.get('model', path.stem)}: {chain.n} stages, "
        f"compute {chain.compute_time * 1e3:.1f} ms, "
        f"beta {chain.beta / 1e9:.1f} GB/s, memory {lo / 2**30:.2f} .. {hi / 2**30:.2f} GiB",
        f"{'limit':>6} {'GiB':>6} {'LB ms':>8} {'greedy':>7} {'dynprog':>7} {'vdnn':>7} {'dp s':>6}",
    ]
    worst = 0.0
    for k in range(points):
        fraction = k / (points - 1) if points > 1 else 1.0
        limited = chain.with_memory(lo + (hi - lo) * fraction)
        lb = lower_bound(limited)
        start = time.perf_counter()
        dp_set = dynprog_offload(limited, slots)
        dp_seconds = time.perf_counter() - start
        ratios = []
        for chosen in (greedy_offload(limited), dp_set, vdnn_offload(limited)):
            sched = simulate_schedule(limited, chosen)
            ratios.append(sched.makespan / lb if sched.feasible else float("inf"))
        worst = max(worst, ratios[1])
        lines.append(
            f"{fraction:>6.0%} {limited.M_GPU / 2**30:>6.2f} {lb * 1e3:>8.2f} "
            + " ".join(f"{r:>7.3f}" for r in ratios) + f" {dp_seconds:>6.1f}"
        )
    lines.append(f"worst DYNPROG / LB: {worst:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="*", type=Path, default=DEFAULT_PROFILES)
    parser.add_argument("--points", type=int, default=11, help="memory limits, min..peak")
    parser.add_argument("--slots", type=int, default=500, help="DYNPROG memory slots S")
    args = parser.parse_args(argv)
    if not args.graphs:
        parser.error("no graph JSON given and no tests/data/*_224.json found")
    for path in args.graphs:
        print("\n".join(table(path, args.points, args.slots)))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
