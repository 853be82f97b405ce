"""Solvers: each reads a Graph and a budget and returns a Plan.

Every solver has the signature ``solver(graph, budget_bytes, **options) -> Plan``; a budget
of ``None`` means no limit. A solver that cannot meet the budget returns its best plan with
``feasible=False`` rather than raising, so callers can report how far off it was. A solver
that does not plan a graph of this kind at any budget (the exact Kusumoto DP past its
``max_lower_sets``) raises :class:`~lightning_remat.errors.SolverDeclinedError`, a
``RematInfeasibleError`` with no smallest budget, naming what to use instead.

:data:`SOLVERS` is the one registry: a :class:`SolverEntry` per name holding the solver,
its own smallest-budget function, whether its plans offload, and the paper it implements.
Adding a solver is adding an entry; the command line's choices, the error messages, the
planner's device check and the solver contract test (tests/test_solver_contract.py) all read
the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_remat.errors import RematInfeasibleError, SolverDeclinedError
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers import auto, beaumont, chen, feng, hong, kusumoto
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.scoring import make_plan, plain_plan, solve_plain
from lightning_remat.solvers.simulate import simulate, unchanged

__all__ = [
    "SOLVERS", "Paper", "Plan", "SolverEntry", "Stage", "fits", "get_solver", "make_plan",
    "min_budget", "plain_plan", "simulate", "solve", "solver_entry",
]

SolverFn = Callable[..., Plan]
MinBudgetFn = Callable[..., int]


@dataclass(frozen=True)
class Paper:
    """The publication a solver implements."""

    authors: str
    title: str
    year: int | None
    """``None`` where the paper as published carries no year."""
    venue: str = ""

    def __str__(self) -> str:
        when = ", ".join(str(part) for part in (self.venue, self.year) if part)
        return f'{self.authors}, "{self.title}"' + (f" ({when})" if when else "")


@dataclass(frozen=True)
class SolverEntry:
    """One registered solver."""

    solve: SolverFn
    """``solve(graph, budget_bytes, **options) -> Plan``."""
    min_budget: MinBudgetFn | None
    """``min_budget(graph, **options) -> int``: the solver's own smallest budget, where its
    paper gives one cheaper than a binary search; ``None``: :func:`min_budget` bisects."""
    offloads: bool
    """Whether its plans move saved tensors to host memory, so it needs a device with a
    memory apart from the host's (and the graph's host-device bandwidth). ``auto`` is not
    one: it offloads only where its ``allow_offload`` option lets it."""
    paper: Paper | None
    """What it implements; ``None`` for the baselines of this package's own."""
    summary: str
    """One line: what it does."""


KUSUMOTO = Paper("Kusumoto, Inoue, Watanabe, Akiba and Koyama",
                 "A Graph Theoretic Framework of Recomputation Algorithms for Memory-Efficient "
                 "Backpropagation", 2019, "NeurIPS")
FENG = Paper("Feng and Huang", "Optimal Gradient Checkpoint Search for Arbitrary Computation "
             "Graphs", 2021, "CVPR")
HONG = Paper("Hong, Tsai, Wang, Liu and Wu", "GPU Memory Usage Optimization for Backward "
             "Propagation in Deep Network Training", None)
CHEN = Paper("Chen, Xu, Zhang and Guestrin", "Training Deep Nets with Sublinear Memory Cost",
             2016, "arXiv:1604.06174")
BEAUMONT = Paper("Beaumont, Eyraud-Dubois and Shilova", "Optimal GPU-CPU Offloading Strategies "
                 "for Deep Neural Network Training", 2020, "Euro-Par")

SOLVERS: dict[str, SolverEntry] = {
    "plain": SolverEntry(solve_plain, None, False, None,
                         "keep everything: the plain step, the reference every plan is measured against"),
    "chen": SolverEntry(chen.solve_chen_sqrt, None, False, CHEN,
                        "about sqrt(n) segments of equal cost, each recomputed (section 4.1)"),
    "chen-greedy": SolverEntry(chen.solve_chen_greedy, None, False, CHEN,
                               "Memory Planning with Budget (Algorithm 3), its threshold on a grid"),
    "feng": SolverEntry(feng.solve_feng, feng.min_budget_solve_feng, False, FENG,
                        "the memory-optimal stored set of eq. 1 (Algorithms 1-5)"),
    "hong-cubic": SolverEntry(hong.solve_hong_cubic, hong.min_budget_solve_hong_cubic, False, HONG,
                              "checkpoint selection on the articulation chain (Algorithm 3, O(n^3))"),
    "hong-linear": SolverEntry(hong.solve_hong_linear, hong.min_budget_solve_hong_linear, False, HONG,
                               "dynamic checkpoint selection, PyTorch's model (Algorithm 6, O(n))"),
    "kusumoto-tc": SolverEntry(kusumoto.solve_approx_tc, kusumoto.min_budget_solve_approx_tc, False,
                               KUSUMOTO, "approximate DP over n + 2 lower sets, least extra time"),
    "kusumoto-mc": SolverEntry(kusumoto.solve_approx_mc, kusumoto.min_budget_solve_approx_mc, False,
                               KUSUMOTO, "approximate DP over n + 2 lower sets, memory-centric"),
    "kusumoto-exact-tc": SolverEntry(kusumoto.solve_exact_tc, kusumoto.min_budget_solve_exact_tc,
                                     False, KUSUMOTO, "exact DP over every lower set, least extra time"),
    "kusumoto-exact-mc": SolverEntry(kusumoto.solve_exact_mc, kusumoto.min_budget_solve_exact_mc,
                                     False, KUSUMOTO, "exact DP over every lower set, memory-centric"),
    "lower-bound": SolverEntry(beaumont.solve_lower_bound, beaumont.min_budget_solve_lower_bound,
                               True, BEAUMONT, "Proposition 3's bound on any offloading schedule, "
                               "as a plan that keeps everything"),
    "greedy": SolverEntry(beaumont.solve_greedy, beaumont.min_budget_solve_greedy, True, BEAUMONT,
                          "GREEDY: offload the first activations (Theorem 2)"),
    "dynprog": SolverEntry(beaumont.solve_dynprog, beaumont.min_budget_solve_dynprog, True, BEAUMONT,
                           "DYNPROG: the optimal offloaded set on a discretised chain (Algorithm 1)"),
    "vdnn": SolverEntry(beaumont.solve_vdnn, beaumont.min_budget_solve_vdnn, True, BEAUMONT,
                        "the vDNN-style baseline of section 6.1"),
    "auto": SolverEntry(auto.solve_auto, auto.min_budget_solve_auto, False, None,
                        "kusumoto-tc, then kusumoto-mc, then dynprog offloading (docs/design.md "
                        "section 4.6)"),
}
"""Every solver by the name users give it."""


def solver_entry(name: str) -> SolverEntry:
    """The registry entry of ``name``."""
    try:
        return SOLVERS[name]
    except KeyError:
        raise ValueError(f"unknown solver {name!r}; choose one of {sorted(SOLVERS)}") from None


def get_solver(name: str) -> SolverFn:
    """The solver function registered under ``name``."""
    return solver_entry(name).solve


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
    with unchanged(graph):
        try:
            plan = get_solver(solver)(graph, budget_bytes, **options)
        except SolverDeclinedError as declined:
            raise declined.for_solver(budget_bytes, solver) from None
        if not fits(plan, budget_bytes):
            raise RematInfeasibleError(budget_bytes or 0, min_budget(graph, solver, **options), solver)
        return plan


def min_budget(graph: Graph, solver: str = "auto", **options: Any) -> int:
    """The smallest budget for which ``solver`` returns a plan that :func:`fits`, by binary
    search over bytes (feasibility is monotone in the budget for the solvers here). Where a
    solver has its own smallest budget, its answer is taken when the plan there fits, and is
    otherwise a lower bound for the search. A solver that does not plan the graph at any
    budget raises :class:`~lightning_remat.errors.SolverDeclinedError` (a
    ``RematInfeasibleError``) saying why and what to use instead."""
    try:
        with unchanged(graph):
            return _min_budget(graph, solver_entry(solver), **options)
    except SolverDeclinedError as declined:
        raise declined.for_solver(None, solver) from None


def _min_budget(graph: Graph, entry: SolverEntry, **options: Any) -> int:
    fn, own = entry.solve, entry.min_budget
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
