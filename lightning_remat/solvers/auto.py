"""``solver="auto"`` (docs/design.md section 4.6): what Kusumoto et al. recommend, then
offloading.

1. the approximate DP, time-centric, at the budget: the least extra time among the
   strategies whose stage memory fits;
2. if it has no plan: the approximate DP, memory-centric (Kusumoto section 4.4). Both DPs
   bound the simulator's stage memory (``solvers.kusumoto``) and search the same strategies,
   so the memory-centric one finds a plan only where the time-centric one does; the step is
   the paper's order, kept for solvers whose stage memory is looser;
3. if still none: Beaumont et al.'s DynProg offloading
   (:func:`lightning_remat.solvers.beaumont.solve_dynprog`) on the memory-centric plan's
   stages, where offloading is allowed (not on a device without memory of its own apart
   from the host's, such as the CPU);
4. otherwise the memory-centric plan at the DP's smallest budget, marked infeasible, so
   ``solve`` raises ``RematInfeasibleError`` naming the smallest budget ``auto`` accepts.

No budget is scanned or bisected, and no other solver's plan is pooled: a DP-feasible plan
fits by construction (its stage memory bounds the simulator's, margin included). Feng's,
Hong's and Chen's solvers stay available by name. The plan's ``solver`` names the step that
produced it (``"auto:kusumoto-tc"``, ``"auto:kusumoto-mc"``, ``"auto:dynprog"``) and its
``notes`` say why earlier steps failed.
"""

from __future__ import annotations

from typing import Any

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.beaumont import min_budget_solve_dynprog, solve_dynprog
from lightning_remat.solvers.kusumoto import (
    min_budget_solve_approx_tc,
    solve_approx_mc,
    solve_approx_tc,
)
from lightning_remat.solvers.plan import Plan

__all__ = ["min_budget_solve_auto", "solve_auto"]

_KUSUMOTO_OPTIONS = ("max_lower_sets", "time_steps")


def _kusumoto_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k in _KUSUMOTO_OPTIONS}


def _fits(plan: Plan, budget: int) -> bool:
    return plan.feasible and plan.guaranteed_peak_bytes <= budget


def solve_auto(graph: Graph, budget_bytes: int | None, **options: Any) -> Plan:
    """TC, then MC, then DynProg offloading, then the least-memory plan marked infeasible
    (module doc). ``options``: ``max_lower_sets`` and ``time_steps`` reach the Kusumoto
    solvers; ``offload_options`` (a dict) reaches the offloading solver;
    ``allow_offload=False`` stops the chain before offloading."""
    kusumoto_options = _kusumoto_options(options)
    if budget_bytes is None:
        return _label(solve_approx_tc(graph, None, **kusumoto_options), "auto:kusumoto-tc", [], True)
    budget = budget_bytes
    notes: list[str] = []

    tc = solve_approx_tc(graph, budget, **kusumoto_options)
    if _fits(tc, budget):
        return _label(tc, "auto:kusumoto-tc", notes, True)
    notes.append(f"kusumoto-tc found no strategy within {budget} bytes")

    mc = solve_approx_mc(graph, budget, **kusumoto_options)
    if _fits(mc, budget):
        return _label(mc, "auto:kusumoto-mc", notes, True)
    notes.append(f"kusumoto-mc found no strategy within {budget} bytes")

    if not options.get("allow_offload", True):
        notes.append("dynprog skipped: offloading is off (allow_offload=False; the planner turns "
                     "it off on a device without memory of its own apart from the host's, such "
                     "as the CPU, where offloading frees nothing)")
    else:
        try:
            # Beaumont et al. on the stage chain of the memory-centric plan (docs/design.md section 4.6).
            offload_options = {"stages": [st.nodes for st in mc.stages],
                               **dict(options.get("offload_options", {}))}
            offloaded = solve_dynprog(graph, budget, **offload_options)
        except ValueError as exc:  # e.g. no measured bandwidth in the graph
            notes.append(f"dynprog skipped: {exc}")
        else:
            if _fits(offloaded, budget):
                return _label(offloaded, "auto:dynprog", notes, True)
            notes.append("dynprog failed: offloading does not meet the budget either")

    notes.append("nothing fits; returning the memory-centric plan at the DP's smallest budget")
    return _label(mc, "auto:kusumoto-mc", notes, False)


def _label(plan: Plan, name: str, notes: list[str], fits: bool) -> Plan:
    plan.notes = [*notes, *plan.notes]
    plan.solver = name
    plan.feasible = fits
    return plan


def min_budget_solve_auto(graph: Graph, **options: Any) -> int:
    """The smallest budget :func:`solve_auto` accepts: the approximate DP's own smallest
    budget (its plan there fits by construction), or DynProg's smallest budget where
    offloading is allowed and ``solve_auto`` accepts it."""
    least = min_budget_solve_approx_tc(graph, **_kusumoto_options(options))
    if options.get("allow_offload", True):
        try:
            offload = int(min_budget_solve_dynprog(graph, **dict(options.get("offload_options", {}))))
        except ValueError:
            offload = None  # offloading cannot be planned without a bandwidth
        if offload is not None and offload < least and solve_auto(graph, offload, **options).feasible:
            return offload
    return int(least)
