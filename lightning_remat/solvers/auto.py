"""``solver="auto"`` (docs/design.md section 4.6): Kusumoto's recommended order, then offloading.

1. approximate DP, time-centric (least extra time within the budget);
2. if its plan does not fit: approximate DP, memory-centric at the budget, and then the
   memory-centric strategy at the smallest budget the DP can meet (Kusumoto section 4.4: the
   coarse partition gives liveness the most room, so its real peak is the lowest);
3. if still nothing fits: the memory-centric DP at a range of other budgets (its formula has
   no liveness, so a looser budget can give a lower real peak) and the memory-optimal
   recomputation solvers (Feng & Huang's re-forwarding, Hong et al.'s Algorithm 6, Chen's
   budgeted greedy), whose plans use less memory than the DP's liveness-free formula lets it
   find; the fitting one with the least extra time is taken;
4. if still nothing fits: Beaumont et al.'s DynProg offloading
   (:func:`lightning_remat.solvers.beaumont.solve_dynprog`), where offloading is allowed;
5. otherwise the best infeasible plan (the least predicted peak among those tried).

"Fits" means the simulator's predicted peak (``plan.predicted_peak_bytes``, which models
PyTorch freeing dead tensors) is within the budget: that is what the runtime will see, and it
is why a memory-centric plan can fit where the time-centric one does not although both meet
the DP's own (liveness-free) peak formula. The plan's ``solver`` names the step that produced
it (``"auto:kusumoto-tc"``, ``"auto:kusumoto-mc"``, ``"auto:dynprog"``) and its ``notes`` say
why earlier steps failed.
"""

from __future__ import annotations

from typing import Any

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers import chen, feng, hong
from lightning_remat.solvers.beaumont import min_budget_solve_dynprog, solve_dynprog
from lightning_remat.solvers.kusumoto import (
    min_budget_solve_approx_tc,
    solve_approx_mc,
    solve_approx_tc,
)
from lightning_remat.solvers.plan import Plan
from lightning_remat.solvers.simulate import plain_plan

__all__ = ["min_budget_solve_auto", "solve_auto"]

_KUSUMOTO_OPTIONS = ("max_lower_sets", "time_steps")


def _kusumoto_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k in _KUSUMOTO_OPTIONS}


def _fits(plan: Plan, budget: int) -> bool:
    return plan.guaranteed_peak_bytes <= budget


def _why(plan: Plan, budget: int) -> str:
    if not plan.feasible:
        return f"no strategy meets {budget} bytes under the DP's peak formula"
    return f"its predicted peak {plan.predicted_peak_bytes} bytes exceeds the budget {budget} bytes"


def solve_auto(graph: Graph, budget_bytes: int | None, **options: Any) -> Plan:
    """TC, then MC, then DynProg offloading, then the best infeasible plan (module doc).
    ``options``: ``max_lower_sets`` and ``time_steps`` reach the Kusumoto solvers;
    ``offload_options`` (a dict) reaches the offloading solver; ``allow_offload=False``
    stops the chain before offloading."""
    kusumoto_options = _kusumoto_options(options)
    if budget_bytes is None:
        return _label(solve_approx_tc(graph, None, **kusumoto_options), "auto:kusumoto-tc",
                      [], True)
    budget = budget_bytes
    notes: list[str] = []
    tried: list[Plan] = []

    tc = _calibrated_tc(graph, budget, kusumoto_options)
    if tc.feasible and _fits(tc, budget):
        return _label(tc, "auto:kusumoto-tc", notes, True)
    notes.append(f"kusumoto-tc failed: {_why(tc, budget)}")
    tried.append(tc)

    mc = solve_approx_mc(graph, budget, **kusumoto_options)
    if _fits(mc, budget):
        return _label(mc, "auto:kusumoto-mc", notes, True)
    notes.append(f"kusumoto-mc failed: {_why(mc, budget)}")
    tried.append(mc)
    if mc.feasible:
        # The DP met the budget but the real peak does not: take the memory-centric strategy
        # at the smallest budget the DP can meet, the lowest-memory one it has.
        least = solve_approx_mc(graph, None, **kusumoto_options)
        if _fits(least, budget):
            notes.append("using the memory-centric strategy at the DP's smallest budget")
            return _label(least, "auto:kusumoto-mc", notes, True)
        notes.append("kusumoto-mc at the DP's smallest budget failed: its predicted peak "
                     f"{least.predicted_peak_bytes} bytes exceeds the budget")
        tried.append(least)

    # The memory-centric DP at other budgets (see _scanned_mc) and the memory-optimal solvers:
    # whichever fits with the least extra time.
    fitting = [(plan, "auto:kusumoto-mc",
                f"kusumoto-mc given {given} bytes fits: the DP's formula has no liveness, so a "
                "looser budget can give a plan with a lower real peak")
               for given, plan in _scanned_mc(graph, kusumoto_options)
               if plan.feasible and _fits(plan, budget)]
    fitting += [(plan, f"auto:{plan.solver}", f"{plan.solver} fits: its memory-optimal plan is "
                 "within the budget") for plan in _memory_optimal_plans(graph, budget) if _fits(plan, budget)]
    if fitting:
        best, name, why = min(fitting, key=lambda f: (f[0].predicted_extra_seconds, f[0].predicted_peak_bytes))
        notes.append(why)
        return _label(best, name, notes, True)
    notes.append(f"{', '.join(_MEMORY_OPTIMAL)} failed: their least-memory plans exceed the budget")

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
            if offloaded.feasible and _fits(offloaded, budget):
                return _label(offloaded, "auto:dynprog", notes, True)
            notes.append("dynprog failed: offloading does not meet the budget either")
            tried.append(offloaded)

    best = min(tried, key=lambda p: (p.predicted_peak_bytes, p.predicted_extra_seconds))
    notes.append(f"nothing fits; returning the {best.solver} plan with the least predicted peak")
    return _label(best, f"auto:{best.solver}", notes, False)


_MEMORY_OPTIMAL = ("feng", "hong-linear", "chen-greedy")
# Budgets, as fractions of the plain plan's simulated peak, at which the memory-centric DP is
# also run. Its peak formula has no liveness, so the plan it makes for a looser budget can
# have a lower simulated peak than any it makes for the budget itself (a U-Net measured on
# the CPU: given 75% of plain, its plan peaked at 45%; given 50%, it found none).
_MC_SCAN = (0.25, 0.35, 0.5, 0.75, 1.0, 1.5)


def _scanned_mc(graph: Graph, kusumoto_options: dict[str, Any]) -> list[tuple[int, Plan]]:
    """(budget given, plan) of the memory-centric DP at the ``_MC_SCAN`` budgets."""
    plain = plain_plan(graph).predicted_peak_bytes
    given = [int(plain * fraction) for fraction in _MC_SCAN]
    return [(b, solve_approx_mc(graph, b, **kusumoto_options)) for b in given]


def _memory_optimal_plans(graph: Graph, budget: int) -> list[Plan]:
    return [feng.solve_feng(graph, budget), hong.solve_hong_linear(graph, budget),
            chen.solve_chen_greedy(graph, budget)]


def _calibrated_tc(graph: Graph, budget: int, kusumoto_options: dict[str, Any],
                   steps: int = 10) -> Plan:
    """The time-centric DP with its budget calibrated against the simulator.

    The DP's peak formula (docs/design.md section 4.4) has no liveness (it over-states the peak) and no
    parameter gradients (it under-states it). So the budget handed to the DP is bisected
    for the largest one whose plan's simulated peak still fits ``budget``: downward when the
    plan at ``budget`` does not fit, upward when it does and more room would let the DP
    recompute less. The fastest fitting plan found is returned (the plan at ``budget``
    when none fits)."""
    first = solve_approx_tc(graph, budget, **kusumoto_options)
    fitting = first.feasible and _fits(first, budget)
    if fitting:
        lo, hi = budget, 2 * max(budget, int(graph.total("mem")) + int(graph.total("saved")))
    else:
        lo, hi = min_budget_solve_approx_tc(graph, **kusumoto_options), budget
    best = first if fitting else None
    given = budget
    for _ in range(steps):
        if hi - lo <= max(1, hi // 1000):
            break
        mid = (lo + hi) // 2
        candidate = solve_approx_tc(graph, mid, **kusumoto_options)
        if candidate.feasible and _fits(candidate, budget):
            lo = mid
            if best is None or candidate.predicted_extra_seconds < best.predicted_extra_seconds:
                best, given = candidate, mid
        else:
            hi = mid
    if best is None:
        return first
    if given != budget:
        best.notes.append(f"the DP was given {given} bytes: its plan's simulated peak fits {budget}")
    return best


def _label(plan: Plan, name: str, notes: list[str], fits: bool) -> Plan:
    plan.notes = [*notes, *plan.notes]
    plan.solver = name
    plan.feasible = fits
    return plan


def min_budget_solve_auto(graph: Graph, **options: Any) -> int:
    """The least budget at which :func:`solve_auto` is known to fit: the smallest of the
    predicted peaks of the TC and MC strategies at the approximate DP's own smallest budget
    (and DynProg's smallest budget when the offloading module exists) that ``solve_auto``
    accepts. The MC one is always accepted (at that budget step 2 returns it)."""
    kusumoto_options = _kusumoto_options(options)
    least_dp = min_budget_solve_approx_tc(graph, **kusumoto_options)
    memory_centric = solve_approx_mc(graph, None, **kusumoto_options).predicted_peak_bytes
    candidates = {solve_approx_tc(graph, least_dp, **kusumoto_options).predicted_peak_bytes}
    candidates.update(p.predicted_peak_bytes for p in _memory_optimal_plans(graph, least_dp))
    candidates.update(p.predicted_peak_bytes for _, p in _scanned_mc(graph, kusumoto_options) if p.feasible)
    if options.get("allow_offload", True):
        try:
            candidates.add(min_budget_solve_dynprog(graph, **dict(options.get("offload_options", {}))))
        except ValueError:
            pass  # offloading cannot be planned without a bandwidth
    for candidate in sorted(c for c in candidates if c < memory_centric):
        if solve_auto(graph, int(candidate), **options).feasible:
            return int(candidate)
    return int(memory_centric)
