"""Solvers: each reads a Graph and a budget and returns a Plan.

Every solver has the signature ``solver(graph, budget_bytes, **options) -> Plan``; a budget
of ``None`` means no limit. A solver that cannot meet the budget returns its best plan with
``feasible=False`` rather than raising, so callers can report how far off it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_remat.errors import RematInfeasibleError
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers import auto, beaumont, chen, feng, hong, kusumoto
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.simulate import make_plan, plain_plan, simulate, solve_plain

__all__ = [
    "SOLVERS", "Plan", "Stage", "fits", "get_solver", "make_plan", "min_budget", "plain_plan",
    "simulate", "solve",
]

SolverFn = Callable[..., Plan]

SOLVERS: dict[str, SolverFn] = {
    "plain": solve_plain,
    "chen": chen.solve_chen_sqrt,
    "chen-greedy": chen.solve_chen_greedy,
    "feng": feng.solve_feng,
    "hong-cubic": hong.solve_hong_cubic,
    "hong-linear": hong.solve_hong_linear,
    "kusumoto-tc": kusumoto.solve_approx_tc,
    "kusumoto-mc": kusumoto.solve_approx_mc,
    "kusumoto-exact-tc": kusumoto.solve_exact_tc,
    "kusumoto-exact-mc": kusumoto.solve_exact_mc,
    "lower-bound": beaumont.solve_lower_bound,
    "greedy": beaumont.solve_greedy,
    "dynprog": beaumont.solve_dynprog,
    "vdnn": beaumont.solve_vdnn,
    "auto": auto.solve_auto,
}
"""Every solver by the name users give it."""

# A solver's own smallest budget, where its paper gives one cheaper than a binary search.
_OWN_MIN_BUDGET: dict[str, Callable[..., int]] = {
    "feng": feng.min_budget_solve_feng,
    "hong-cubic": hong.min_budget_solve_hong_cubic,
    "hong-linear": hong.min_budget_solve_hong_linear,
    "kusumoto-tc": kusumoto.min_budget_solve_approx_tc,
    "kusumoto-mc": kusumoto.min_budget_solve_approx_mc,
    "kusumoto-exact-tc": kusumoto.min_budget_solve_exact_tc,
    "kusumoto-exact-mc": kusumoto.min_budget_solve_exact_mc,
    "lower-bound": beaumont.min_budget_solve_lower_bound,
    "greedy": beaumont.min_budget_solve_greedy,
    "dynprog": beaumont.min_budget_solve_dynprog,
    "vdnn": beaumont.min_budget_solve_vdnn,
    "auto": auto.min_budget_solve_auto,
}


def get_solver(name: str) -> SolverFn:
    """The solver function registered under ``name``."""
    try:
        return SOLVERS[name]
    except KeyError:
        raise ValueError(f"unknown solver {name!r}; choose one of {sorted(SOLVERS)}") from None


def fits(plan: Plan, budget_bytes: int | None) -> bool:
    """Whether a plan meets a budget: the solver says so under its own model *and* the
    simulator's predicted peak (PyTorch's real freeing behaviour, parameter gradients
    included) plus the plan's margin (``Plan.margin_bytes``) is within it. The solvers' own models leave things out (the Kusumoto DP has no
    parameter gradients and no liveness; the offloading chain model has no branches), so a
    plan is only handed to the runtime when both agree."""
    return plan.feasible and (budget_bytes is None or plan.guaranteed_peak_bytes <= budget_bytes)


def solve(graph: Graph, budget_bytes: int | None, solver: str = "auto", **options: Any) -> Plan:
    """Plan for a budget; raise RematInfeasibleError (with the smallest feasible budget)
    when the solver's plan does not fit it (see :func:`fits`)."""
    plan = get_solver(solver)(graph, budget_bytes, **options)
    if not fits(plan, budget_bytes):
        raise RematInfeasibleError(budget_bytes or 0, min_budget(graph, solver, **options), solver)
    return plan


def min_budget(graph: Graph, solver: str = "auto", **options: Any) -> int:
    """The smallest budget for which ``solver`` returns a plan that :func:`fits`, by binary
    search over bytes (feasibility is monotone in the budget for the solvers here). Where a
    solver has its own smallest budget, its answer is taken when the plan there fits, and is
    otherwise a lower bound for the search."""
    fn = get_solver(solver)
    own = _OWN_MIN_BUDGET.get(solver)
    lo = 0  # infeasible (no step fits in zero bytes unless the graph is empty)
    if own is not None:
        claimed = int(own(graph, **options))
        if fits(fn(graph, claimed, **options), claimed):
            return claimed
        lo = claimed
    hi = max(plain_plan(graph).predicted_peak_bytes, lo + 1)
    if not fits(fn(graph, hi, **options), hi):
        # The solver's best plan may still exceed the plain peak (it reports its own peak).
        best = fn(graph, None, **options).predicted_peak_bytes
        hi = max(hi, best)
        while not fits(fn(graph, hi, **options), hi) and hi < 64 * max(best, 1):
            hi *= 2
    while hi - lo > max(1, hi // 100_000):
        mid = (lo + hi) // 2
        if fits(fn(graph, mid, **options), mid):
            hi = mid
        else:
            lo = mid
    return int(hi)
