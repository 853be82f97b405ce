"""``solver="auto"`` (docs/design.md section 4.6): what Kusumoto et al. recommend, then
offloading.

1. the approximate DP, time-centric, at the budget: the least extra time among the
   strategies whose stage memory fits; then the same DP at budgets above the given one
   (:func:`_least_time_within`), keeping the plan with the least extra time that still fits
   the given budget by the simulator;
2. if it has no plan: the approximate DP, memory-centric (Kusumoto section 4.4). Both DPs
   bound the simulator's stage memory (``solvers.kusumoto``) and search the same strategies,
   so the memory-centric one finds a plan only where the time-centric one does; the step is
   the paper's order, kept for solvers whose stage memory is looser;
3. if still none: Beaumont et al.'s DynProg offloading
   (:func:`lightning_remat.solvers.beaumont.solve_dynprog`) on the memory-centric plan's
   stages, where offloading is allowed (not on a device without memory of its own apart
   from the host's, such as the CPU);
4. if still none, and the budget is at least the smallest one ``auto`` names
   (:func:`min_budget_solve_auto`): the plan that budget was named for, which fits every
   larger budget, so acceptance is monotone in the budget from there up;
5. otherwise the memory-centric plan at the DP's smallest budget, marked infeasible, so
   ``solve`` raises ``RematInfeasibleError`` naming the smallest budget ``auto`` accepts.

No other solver's plan is pooled. A DP-feasible plan fits where the simulator's peak is the
DP's; where the simulator's liveness finds more than the DP's summed cache, step 4 keeps the
smallest budget's plan. Where it finds less (the summed cache counts values the simulator
frees between stages), the DP's plan leaves budget unspent: on a CUDA profile of ResNet-50,
the DP's plan for half the plain peak peaked at 0.37 of it, and the plan for 1.5 times that
budget still fit it with 40% less extra time. Step 1's scan spends it. Feng's,
Hong's and Chen's solvers stay available by name. The plan's ``solver`` names the step that
produced it (``"auto:kusumoto-tc"``, ``"auto:kusumoto-mc"``, ``"auto:dynprog"``) and its
``notes`` say why earlier steps failed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.beaumont import min_budget_solve_dynprog, solve_dynprog
from lightning_remat.solvers.kusumoto import (
    min_budget_solve_approx_tc,
    solve_approx_mc,
    solve_approx_tc,
)
from lightning_remat.solvers.plan import Plan
from lightning_remat.solvers.scoring import make_plan
from lightning_remat.solvers.simulate import unchanged

__all__ = ["min_budget_solve_auto", "solve_auto"]

_KUSUMOTO_OPTIONS = ("max_lower_sets", "time_steps")


def _kusumoto_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k in _KUSUMOTO_OPTIONS}


def _fits(plan: Plan, budget: int) -> bool:
    return plan.feasible and plan.guaranteed_peak_bytes <= budget


def solve_auto(graph: Graph, budget_bytes: int | None, **options: Any) -> Plan:
    """TC, then MC, then DynProg offloading, then the plan :func:`min_budget_solve_auto`
    names its budget for, then the least-memory plan marked infeasible (module doc).
    ``options``: ``max_lower_sets`` and ``time_steps`` reach the Kusumoto solvers;
    ``offload_options`` (a dict) reaches the offloading solver; ``allow_offload=False``
    stops the chain before offloading."""
    kusumoto_options = _kusumoto_options(options)
    if budget_bytes is None:
        return _label(solve_approx_tc(graph, None, **kusumoto_options), "auto:kusumoto-tc", [], True)
    plan, notes, mc = _chain(graph, budget_bytes, options)
    if plan is not None:
        return plan
    # The DPs' stage memory is the simulator's stage by stage, but the cache between stages
    # is summed (Kusumoto et al. 2019, eq. 2's form), which the simulator's liveness can
    # exceed: a strategy the DP takes at a larger budget may then not fit where a smaller
    # budget's did. The plans the smallest budget was named for fit every larger budget, so
    # acceptance is monotone from it up to the plain step.
    for least, anchor in _anchors(graph, options, budget_bytes):
        if least <= budget_bytes:
            notes.append(f"the plan for the smallest budget auto names ({least} bytes) fits")
            return _label(anchor, anchor.solver, notes, True)
    notes.append("nothing fits; returning the memory-centric plan at the DP's smallest budget")
    return _label(mc, "auto:kusumoto-mc", notes, False)


def _chain(graph: Graph, budget: int, options: dict[str, Any]) -> tuple[Plan | None, list[str], Plan]:
    """Steps 1 to 3 of the module doc at ``budget``: the first plan that fits (labelled), or
    None; the notes saying why each earlier step failed; the memory-centric plan."""
    kusumoto_options = _kusumoto_options(options)
    notes: list[str] = []

    tc = solve_approx_tc(graph, budget, **kusumoto_options)
    if _fits(tc, budget):
        best, at = _least_time_within(graph, budget, tc, kusumoto_options)
        if best is not tc:
            notes.append(f"kusumoto-tc run at {at} bytes: its plan fits {budget} bytes with less "
                         "extra time")
        return _label(best, "auto:kusumoto-tc", notes, True), notes, tc
    notes.append(f"kusumoto-tc found no strategy that fits {budget} bytes")

    mc = solve_approx_mc(graph, budget, **kusumoto_options)
    if _fits(mc, budget):
        return _label(mc, "auto:kusumoto-mc", notes, True), notes, mc
    notes.append(f"kusumoto-mc found no strategy that fits {budget} bytes")

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
                return _label(offloaded, "auto:dynprog", notes, True), notes, mc
            notes.append("dynprog failed: offloading does not meet the budget either")
    return None, notes, mc


SCAN_SCALES = (1.25, 1.5, 2.0, 3.0)
"""The budgets, as multiples of the given one, at which step 1 runs the time-centric DP again."""
SCAN_BISECTIONS = 2
"""Bisection steps between the largest scale whose plan fits and the next one."""


def _least_time_within(graph: Graph, budget: int, first: Plan,
                       kusumoto_options: dict[str, Any]) -> tuple[Plan, int]:
    """The time-centric DP's plan with the least extra time that fits ``budget`` by the
    simulator, and the budget the DP was run at: the DP run at ``budget`` (``first``) and at
    ``SCAN_SCALES`` times it up to the first that does not fit, then ``SCAN_BISECTIONS``
    bisections below that one."""
    def better(plan: Plan, than: Plan) -> bool:
        return (plan.predicted_extra_seconds, plan.guaranteed_peak_bytes) < (
            than.predicted_extra_seconds, than.guaranteed_peak_bytes)

    best, at, fit, miss = first, budget, 1.0, None
    for scale in SCAN_SCALES:
        if best.predicted_extra_seconds <= 0:
            return best, at  # nothing recomputed: nothing left to save
        plan = solve_approx_tc(graph, int(budget * scale), **kusumoto_options)
        if not _fits(plan, budget):
            miss = scale
            break
        fit = scale
        if better(plan, best):
            best, at = plan, int(budget * scale)
    for _ in range(SCAN_BISECTIONS if miss is not None else 0):
        scale = (fit + miss) / 2
        plan = solve_approx_tc(graph, int(budget * scale), **kusumoto_options)
        if _fits(plan, budget):
            fit = scale
            if better(plan, best):
                best, at = plan, int(budget * scale)
        else:
            miss = scale
    return best, at


def _anchors(graph: Graph, options: dict[str, Any], budget: int | None = None) -> list[tuple[int, Plan]]:
    """(budget, plan) for each smallest budget auto can name, the plan fitting it: the
    approximate TC DP's plan at its smallest budget (or the MC DP's, where the simulator finds
    more than the DP in the TC plan and not in the MC one; where it does in both, the
    smallest budget up to the TC plan's peak whose TC plan fits it), and, where offloading is
    allowed, the chain's plan at DynProg's smallest budget where it fits there. Given a
    ``budget`` below every one of them, none (without solving anything).

    The TC DP here counts every vertex as one unit of time (:func:`_unit_times`): which of
    the strategies within the smallest budget it takes, and so the simulator's peak of it,
    then depends on the measured bytes only. With measured times, two profiles of the same
    model (same bytes, times a few percent apart) named budgets up to 7% apart, so the
    budget one profile named was refused by the next."""
    unit = _unit_times(graph)
    with unchanged(unit):  # every plan below is scored on it
        return _anchors_on(graph, unit, options, budget)


def _anchors_on(real: Graph, graph: Graph, options: dict[str, Any], budget: int | None) -> list[tuple[int, Plan]]:
    """:func:`_anchors` of ``real``, whose unit-time copy is ``graph``."""
    kusumoto_options = _kusumoto_options(options)
    lo = int(min_budget_solve_approx_tc(graph, **kusumoto_options))
    offload = None
    if options.get("allow_offload", True):
        try:
            offload = int(min_budget_solve_dynprog(graph, **dict(options.get("offload_options", {}))))
        except ValueError:
            offload = None  # offloading cannot be planned without a bandwidth
    if budget is not None and budget < min(lo, lo if offload is None else offload):
        return []
    tc = solve_approx_tc(graph, lo, **kusumoto_options)
    if not _fits(tc, lo):
        # The memory-centric strategy at the same budget, the coarsest partition (Kusumoto
        # section 4.4): where the TC's finer one is found over by the simulator, fewer
        # stages may not be (a Llama's sampled family: TC's 11 stages simulated 10% over
        # the DP's peak; MC's 6 matched it).
        mc = solve_approx_mc(graph, lo, **kusumoto_options)
        if _fits(mc, lo):
            tc = mc
    hi = max(lo, tc.guaranteed_peak_bytes)
    if hi > lo:
        # The DP's plan at its smallest budget needs more by the simulator: the smallest
        # budget between whose own TC plan fits it (``tc`` fits ``hi``).
        lo = lo - 1
        while hi - lo > max(1, hi // 100_000):
            mid = (lo + hi) // 2
            candidate = solve_approx_tc(graph, mid, **kusumoto_options)
            if _fits(candidate, mid):
                hi, tc = mid, candidate
            else:
                lo = mid
    # The same stages on the measured graph: its extra time is the measured one.
    tc = make_plan(real, tc.stages, tc.solver, hi, notes=tc.notes)
    anchors = [(hi, _label(tc, "auto:" + tc.solver.removeprefix("auto:"), [], True))]
    if offload is not None and offload < anchors[0][0]:
        plan = _chain(real, offload, options)[0]
        if plan is not None:
            anchors.insert(0, (offload, plan))
    return anchors


def _unit_times(graph: Graph) -> Graph:
    """``graph`` with every vertex's forward and backward time one unit and no executor
    time of its own (also measured): a strategy's extra time is then the number of
    vertices it runs again."""
    nodes = [replace(node, t_fwd=1.0, t_bwd=1.0) for node in graph.nodes]
    meta = graph.meta.copy()
    meta.recompute_stage_seconds = meta.recompute_vertex_seconds = None
    return Graph(nodes, list(graph.edges), meta)


def _label(plan: Plan, name: str, notes: list[str], fits: bool) -> Plan:
    plan.notes = [*notes, *plan.notes]
    plan.solver = name
    plan.feasible = fits
    return plan


def min_budget_solve_auto(graph: Graph, **options: Any) -> int:
    """The smallest budget :func:`solve_auto` is sure to accept, with every larger one: the
    approximate DP's own smallest budget (or the guaranteed peak of its plan there, where
    the simulator finds more), or DynProg's smallest budget where offloading is allowed and
    the chain's plan fits it."""
    return int(_anchors(graph, options)[0][0])
