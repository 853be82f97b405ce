"""Solver benchmark: speed on large graphs and a comparison on profiled models.

Run from the repository root::

    PYTHONPATH=. /work/main/.venv/bin/python benchmarks/solvers.py [--quick] [--reprofile]

1. Speed: each solver timed in this process with ``time.perf_counter``, best of 3 (1 with
   ``--quick``), caches cold (Kusumoto's lower-set family cache is cleared before every run):
   the approximate DP of Kusumoto et al. (time- and memory-centric at 50% of the plain peak,
   and its min-budget search) on 1000-vertex graphs (target < 1 s); Feng and Huang's ACG
   solver (Algorithm 5) on a DenseNet-201-size graph (target < 5 s; the paper took 160 s);
   Hong et al.'s Algorithm 6 on a 10^5-layer chain (target < 0.5 s) plus ``solve_hong_linear``
   end to end (no target: it includes building the plan and simulating it).
2. Comparison: for the profiled graphs of ResNet-50, VGG-19, DenseNet-121 and a GPT language
   model (``benchmarks/graphs.py``; cached as JSON under ``benchmarks/graphs/``), each
   solver's predicted peak (% of the plain plan's predicted peak) and predicted extra time
   (% of the profiled plain step time, ``meta.step_seconds``) at budgets of 30%, 50% and
   75% with the solver's runtime. A cell whose plan does not fit shows the solver's smallest
   feasible budget instead (as % of the plain peak). The budgets are fractions of the plain
   peak *above the parameter gradients* (which the simulator counts in every peak and no plan
   removes): at the small CPU sizes profiled here the gradients are most of the peak
   (VGG-19: 548 of 569 MiB), so fractions of the whole peak would all be infeasible.

Profiling the torchvision models needs the interpreter with torchvision::

    PYTHONPATH=. /work/main/.venv-vision/bin/python benchmarks/solvers.py --reprofile
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.graphs import (  # noqa: E402
    PROFILED,
    chain_graph,
    densenet_like_dag,
    densenet_like_graph,
    profiled_graph,
    resnet_like_graph,
)
from lightning_remat.errors import SolverDeclinedError  # noqa: E402
from lightning_remat.graph.ir import Graph  # noqa: E402
from lightning_remat.solvers import get_solver, kusumoto, min_budget, plain_plan  # noqa: E402
from lightning_remat.solvers.feng import solve_arbitrary, solve_feng  # noqa: E402
from lightning_remat.solvers.hong import (  # noqa: E402
    articulation_chain,
    dynamic_checkpoint_selection_linear,
    solve_hong_linear,
)

# Host-device bandwidth for the offloading solvers (dynprog, auto): a documented constant,
# about what pinned copies reach over PCIe 3.0 x16 (12.2 GB/s), since this CPU machine has no
# device to measure (measure_bandwidth() on the CPU times a host-to-host copy instead).
BANDWIDTH_BYTES_PER_S = 12.2e9

COMPARED = ["chen", "chen-greedy", "feng", "hong-cubic", "hong-linear", "kusumoto-tc",
            "kusumoto-mc", "kusumoto-exact-tc", "kusumoto-exact-mc", "auto", "dynprog"]
BUDGET_FRACTIONS = (0.30, 0.50, 0.75)
HONG_CUBIC_MAX_ARTICULATION = 400  # O(n^3): above this many articulation vertices, skip it
EXACT_MAX_LOWER_SETS = 20_000  # the exact DP's limit here (the library default is 100 000)


def clear_caches() -> None:
    """Cold start for the next timed run: Kusumoto's lower-set families are cached per graph
    (module-level); Feng's and Hong's solvers keep no state between calls."""
    kusumoto._FAMILY_CACHE.clear()


def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Least wall time of ``repeats`` cold runs of ``fn`` and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        clear_caches()
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def header() -> str:
    import torch

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"lightning-remat solver benchmark, {now}; {platform.platform()}, "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"python {platform.python_version()}, torch {torch.__version__}")


def pct(value: float, whole: float) -> str:
    return f"{100 * value / whole:.0f}%" if whole else "-"


def table(rows: list[list[str]], title: str) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [title]
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if c == 0 else cell.rjust(w)
                               for c, (cell, w) in enumerate(zip(row, widths))).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---- 1. speed ------------------------------------------------------------------------------
def speed(repeats: int) -> None:
    rows = [["case", "graph", "target", "measured", "result"]]

    def row(case: str, graph_text: str, target: float | None, seconds: float) -> None:
        verdict = "-" if target is None else ("pass" if seconds < target else "MISS")
        rows.append([case, graph_text, "-" if target is None else f"< {target:g} s",
                     f"{seconds:.3f} s", verdict])
        print(f"  {case} on {graph_text}: {seconds:.3f} s", file=sys.stderr, flush=True)

    for shape, make in (("chain", chain_graph), ("resnet-like", resnet_like_graph),
                        ("densenet-like", densenet_like_dag)):
        graph = make(1000)
        text = f"{shape} n={len(graph)} e={len(graph.edges)}"
        half = plain_plan(graph).predicted_peak_bytes // 2
        for name, fn in (("kusumoto-tc @50%", kusumoto.solve_approx_tc),
                         ("kusumoto-mc @50%", kusumoto.solve_approx_mc)):
            seconds, plan = best_of(lambda fn=fn, g=graph, b=half: fn(g, b), repeats)
            row(name + ("" if plan.feasible else " (infeasible)"), text, 1.0, seconds)
        seconds, _ = best_of(lambda g=graph: kusumoto.min_budget_solve_approx_tc(g), repeats)
        row("kusumoto min_budget", text, 1.0, seconds)

    dense = densenet_like_graph()
    text = f"DenseNet-201-like n={len(dense)} e={len(dense.edges)}"
    seconds, _ = best_of(lambda: solve_arbitrary(dense), repeats)
    row("feng solve_arbitrary (ACG)", text, 5.0, seconds)
    seconds, _ = best_of(lambda: solve_feng(dense, None), repeats)
    row("feng solve_feng (plan)", text, 5.0, seconds)

    layers = 100_000
    long_chain = chain_graph(layers)
    sizes = [node.mem for node in long_chain.nodes]
    text = f"chain n={layers}"
    seconds, _ = best_of(lambda: dynamic_checkpoint_selection_linear(sizes), repeats)
    row("hong Algorithm 6", text, 0.5, seconds)
    seconds, _ = best_of(lambda: solve_hong_linear(long_chain, None), repeats)
    row("hong solve_hong_linear (plan)", text, None, seconds)
    print(table(rows, f"Speed (best of {repeats}, cold caches, time.perf_counter)"))
    print("  solve_hong_linear end to end also builds the stages and simulates the plan "
          "(no target set).")


# ---- 2. comparison -------------------------------------------------------------------------
def compare_model(name: str, graph: Graph, fractions: tuple[float, ...], skip_exact: bool) -> None:
    graph.meta.bandwidth_bytes_per_s = BANDWIDTH_BYTES_PER_S
    plain = plain_plan(graph).predicted_peak_bytes
    # Parameter gradients are part of every plan's peak (the simulator counts them) and no
    # recomputation or offloading removes them; budgets are fractions of the rest.
    floor = sum(int(b) for b in (graph.meta.param_bytes or {}).values())
    removable = max(plain - floor, 1)
    step = graph.meta.step_seconds
    step_source = "meta.step_seconds"
    if not step:
        step = sum(node.t_fwd + node.t_bwd for node in graph.nodes)
        step_source = "sum of t_fwd + t_bwd"
    articulation = len(articulation_chain(graph))
    notes: list[str] = []
    budgets = [floor + int(removable * f) for f in fractions]
    rows = [["solver"] + [f"{round(100 * f)}% act = {pct(b, plain)} peak: peak extra time"
                          for f, b in zip(fractions, budgets)]]
    over_budget = False
    for solver in COMPARED:
        if solver == "hong-cubic" and articulation > HONG_CUBIC_MAX_ARTICULATION:
            notes.append(f"hong-cubic skipped: {articulation} articulation vertices > "
                         f"{HONG_CUBIC_MAX_ARTICULATION} (Algorithm 3 is O(n^3))")
            continue
        if solver.startswith("kusumoto-exact") and skip_exact:
            continue
        exact = solver.startswith("kusumoto-exact")
        options = {"max_lower_sets": EXACT_MAX_LOWER_SETS} if exact else {}
        fn = get_solver(solver)
        cells: list[str] = []
        smallest: int | None = None
        try:
            for budget in budgets:
                clear_caches()
                start = time.perf_counter()
                plan = fn(graph, budget, **options)
                seconds = time.perf_counter() - start
                if plan.feasible:
                    # '!': the solver calls it feasible but the simulator's peak is over budget.
                    mark = "!" if plan.predicted_peak_bytes > budget else " "
                    over_budget |= mark == "!"
                    cells.append(f"{pct(plan.predicted_peak_bytes, plain):>4}{mark} "
                                 f"{'+' + pct(plan.predicted_extra_seconds, step):>5} {seconds:5.2f}s")
                else:
                    if smallest is None:
                        smallest = min_budget(graph, solver, **options)
                    cells.append(f"min {pct(smallest, plain):>4} {seconds:5.2f}s")
        except SolverDeclinedError as exc:
            if not exact or "lower sets" not in str(exc):
                raise
            cells = ["too many lower sets"] * len(budgets)
            notes.append(f"{solver}: more than {EXACT_MAX_LOWER_SETS} lower sets (its limit "
                         "here; max_lower_sets raises it)")
        rows.append([solver] + cells)
    title = (f"{name}: {PROFILED[name][1]}; {len(graph)} vertices, {len(graph.edges)} edges, "
             f"{articulation} articulation vertices; plain peak {plain / 2**20:.1f} MiB of which "
             f"parameter gradients {floor / 2**20:.1f} MiB; step {1000 * step:.1f} ms ({step_source})")
    print(table(rows, title))
    sources = [node.id for node in graph.nodes if not graph.predecessors(node.id)]
    if len(sources) > 1:
        notes.append(f"{len(sources)} source vertices ({', '.join(sources[:4])}): Hong's solvers "
                     "cut only at vertices on every path from every source (articulation "
                     "vertices), so a side input reaching the loss leaves them few cut points")
    if over_budget:
        notes.append("'!': the solver reports the plan feasible, but the simulator's predicted "
                     "peak exceeds the budget")
    for note in notes:
        print(f"  note: {note}")
    print()


def comparison(quick: bool, reprofile: bool) -> None:
    fractions = (0.50,) if quick else BUDGET_FRACTIONS
    print(f"Comparison at budgets of {', '.join(f'{round(100 * f)}%' for f in fractions)} of the "
          "plain plan's predicted peak above the parameter gradients ('act'; the column header "
          "also gives the budget as % of the whole plain peak). Cell: predicted peak (% of the "
          "plain peak), predicted extra time (% of the plain step), solver runtime; 'min X%': "
          "infeasible at this budget, the solver's smallest feasible budget is X% of the plain "
          f"peak. dynprog/auto use a bandwidth of {BANDWIDTH_BYTES_PER_S / 1e9:g} GB/s (a "
          "constant, PCIe 3.0 x16 pinned copies; not measured here); the op times are CPU "
          "times, so transfers at that rate hide behind compute and offloading costs ~0%.")
    print()
    for name in PROFILED:
        print(f"  profiling/loading {name}", file=sys.stderr, flush=True)
        compare_model(name, profiled_graph(name, reprofile=reprofile), fractions, skip_exact=quick)
    if quick:
        print("--quick: one budget (50%), exact Kusumoto skipped, speed figures best of 1.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="best of 1, one budget, no exact DP (a few minutes on 2 cores)")
    parser.add_argument("--reprofile", action="store_true",
                        help="profile the models again (torchvision needed) and rewrite the JSON")
    parser.add_argument("--only", choices=["speed", "comparison"], help="run one part")
    args = parser.parse_args(argv)
    print(header())
    print()
    if args.only != "comparison":
        speed(1 if args.quick else 3)
        print()
    if args.only != "speed":
        comparison(args.quick, args.reprofile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
