"""Kusumoto et al. 2019, "A Graph Theoretic Framework of Recomputation Algorithms for
Memory-Efficient Backpropagation" (Kusumoto, Inoue, Watanabe, Akiba and Koyama, NeurIPS 2019).

docs/design.md section 4.4 states the paper's formulas in this package's notation, and this
module follows that statement exactly (paper equation numbers in brackets):

- a strategy is an increasing sequence of lower sets ``{} = L0 < L1 < ... < Lk = V``; stage
  ``i`` computes ``Vi = Li \\ L(i-1)``;
- extra time [eq. 1]: ``T = sum over i < k of time(Vi \\ B(Li))`` with ``time = t_fwd`` (the
  last stage is never recomputed), plus, where the profile measured it, the executor's own
  time per recomputed stage, ``c_stage + c_vertex * |Vi|`` (docs/design.md section 4.7):
  TC minimises that sum, the time the step takes; MC maximises eq. 1 alone, its aim being
  the coarse partition, and both report the sum;
- cache after stage i: ``U(i) = U(i-1) + mem(B(Li) \\ L(i-1))``;
- stage memory: not eq. 2 (which has no liveness and no parameter gradients) but the
  simulator's, the one model of a step (docs/design.md sections 4.4 and 4.7): the peak is
  ``max over i of U(i-1) + f(L(i-1), Li)`` with ``f`` the stage's own peak above the cache
  (``stage_costs.stage_costs``) and the cache additive, ``U(i) = U(i-1) + kept(L(i-1), Li)``
  (the stage's kept boundary values and their extra saved outputs). The DP takes ``f`` and
  ``kept`` from the simulator (exact) where simulating every pair is cheap (``_SIMULATED_WORK``;
  for the exact DP, whose own tables are as large, ``_TIGHTER_WORK``). Otherwise it uses an
  upper bound, vectorised:
  ``f <= mem(Vi) + extra(Vi) + max over v in Vi of grad(v)``, ``grad(v)`` being the gradient
  and transient bytes at v's backward peak, the same under every plan; a view allocates
  nothing (its base's storage is counted where the base is), and so does an in-place op
  whose stage holds what makes it run in place under every plan (``LowerSetFamily.
  _in_place_shared``); other storage shared between vertices (in-place ops a plan may give
  storage of their own; gradients passed through ``add``) is counted per vertex, a random op's boundary value (recomputed, held by its readers) as kept, and the
  loss's measured peak on top of the last stage. Where
  that bound finds no strategy for a budget and simulating every pair stays affordable
  (``_TIGHTER_WORK``), the simulator's own costs are used, so a tight budget is decided by
  the model and not by the bound's looseness, and ``min_budget`` is the smallest budget
  ``solve`` then accepts. So a DP-feasible plan fits by construction; a strategy is feasible for a budget M when its
  peak plus the plan's margin is at most M;
- DP (section 4.2, Appendix A Algorithm 1): a state is ``(L, t)`` holding the least cache
  ``m`` of any prefix that ends in L with extra time t; from ``(L, t, m)`` go to every lower
  set ``L' > L`` of the family with ``m + stage_memory(L, L') <= M``.
- Exact DP: the family of all lower sets (section 4.2). Approximate DP: ``{}``, ``V`` and,
  for each vertex v, v with all its ancestors, n + 2 sets (section 4.3), less those of
  views and of values an in-place op overwrites (``bits.approximate_sets``).
- Time-centric (TC): least T among final states. Memory-centric (MC, section 4.4): largest
  feasible T, the coarse partition that gives liveness analysis the most room.
- The smallest budget with any solution is found by binary search on M (section 5.1).

Implementation choices (why): the plan's ``feasible`` is the DP's own verdict, which the
simulator's figure confirms (by construction); the DP's peak and the simulator's peak both
go into ``plan.notes``. The exact and the approximate DP, time- and memory-centric, share
the rest, in two modules:

- :mod:`.bits`: the graph as bitsets and the families of lower sets (exact: all of them;
  approximate: the n + 2 ancestor sets, less the dominated ones);
- :mod:`.family`: :class:`LowerSetFamily`, each set's quantities and the DP over (L, t);
- here: the family cache, the stage costs' choice (simulated or the upper bound), the plan,
  and one public function per variant with its smallest budget.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from typing import Any

import numpy as np

from lightning_remat.errors import SolverDeclinedError
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.kusumoto.bits import (
    GraphBits,
    all_lower_sets,
    approximate_sets,
    graph_bits,
    prefix_sets,
)
from lightning_remat.solvers.kusumoto.family import LowerSetFamily, SimulatedPairs
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.scoring import make_plan, model_margin

__all__ = [
    "DEFAULT_MAX_LOWER_SETS", "DEFAULT_TIME_STEPS", "LowerSetFamily", "evaluate_sequence",
    "min_budget_solve_approx_mc", "min_budget_solve_approx_tc", "min_budget_solve_exact_mc",
    "min_budget_solve_exact_tc", "solve_approx_mc", "solve_approx_tc", "solve_exact_mc",
    "solve_exact_tc", "solve_in_forward_order",
]

# The exact DP steps between pairs of lower sets, a table quadratic in the family: on a small
# Swin (52,766 sets) min_budget ran over five minutes on a 2-core CPU without an answer.
DEFAULT_MAX_LOWER_SETS = 10_000
DEFAULT_TIME_STEPS = 500
# The approximate DP simulates every pair of its lower sets while pairs x vertices stays
# under this (about a second); above it, it uses the vectorised upper bound.
_SIMULATED_WORK = 100_000
# Where the upper bound finds no strategy for a budget, the simulator's own stage costs are
# tried while pairs x vertices stays under this (seconds on a 100-vertex graph): the bound
# is loose on shared storage, and a tight budget is where that decides feasibility.
_TIGHTER_WORK = 2_000_000
# Above that, a subfamily of it is simulated instead, as much as the approximate DP's own
# simulated family costs (``_SIMULATED_WORK``): ``_sampled_sets``.


# ---- the paper's own formulas, for reference ---------------------------------------------------
def evaluate_sequence(graph: Graph, stages: list[list[str]]) -> tuple[int, float]:
    """Peak [eq. 2 as printed] and extra time [eq. 1] of the canonical strategy whose stages
    (forward order) are given; each prefix union must be a lower set. A reference for
    comparisons: the DP itself uses the simulator's stage memory (module docstring)."""
    done: set[str] = set()
    cache = 0
    peak = 0
    extra = 0.0
    for k, stage in enumerate(stages):
        previous = set(done)
        done |= set(stage)
        out = {w for v in done for w in graph.successors(v)}
        arriving = out - done
        needed = {u for w in out for u in graph.predecessors(w)} - done - out
        stage_peak = (cache + 2 * graph.total("mem", stage) + graph.total("mem", arriving)
                      + graph.total("mem", needed))
        peak = max(peak, int(stage_peak))
        boundary = {v for v in done if any(w not in done for w in graph.successors(v))}
        if k < len(stages) - 1:
            extra += graph.total("t_fwd", [v for v in stage if v not in boundary])
        cache += int(graph.total("mem", boundary - previous))
    return peak, extra


# ---- public solvers --------------------------------------------------------------------------
def _check_budget(budget_bytes: Any) -> int | None:
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)):
        raise ValueError(
            f"budget_bytes={budget_bytes!r} is not a whole number of bytes; pass an int "
            "(lightning_remat.parse_budget turns '4GiB' or '60%' into one) or None for no limit"
        )
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes} is negative; pass bytes >= 0 or None")
    return int(budget_bytes)


_FAMILY_CACHE: OrderedDict[tuple, LowerSetFamily] = OrderedDict()
_FAMILY_CACHE_SIZE = 8


def _sampled_sets(bits: GraphBits) -> list[int]:
    """Of the approximate family, in size order, ``k`` equal runs and from each the set whose
    stage keeps the fewest bytes (a transformer layer's output, not a value inside it), ``k``
    such that simulating every pair costs ``_SIMULATED_WORK``. Cut points spread over the
    whole forward: the ``k`` cheapest sets overall were all early ones (masks, position
    tables), and on T5 their smallest budget was the plain peak's."""
    bound = LowerSetFamily(bits, approximate_sets(bits, True))
    runs = max(2, math.isqrt(2 * _SIMULATED_WORK // max(bits.n, 1)))
    return [bound.sets[int(run[np.argmin(bound.held_kept[run])])]
            for run in np.array_split(np.arange(bound.size), runs) if run.size]


def _family(graph: Graph, exact: bool, max_lower_sets: int, simulated: bool = False,
            prefixes: bool = False, sampled: bool = False) -> LowerSetFamily:
    """The family of lower sets for a graph, reused across calls on the same graph and
    costs (auto, min-budget searches and benchmarks call the DP several times);
    ``simulated`` asks for the simulator's stage costs whatever they cost; ``prefixes``:
    the prefixes of the forward's order in place of the approximate family; ``sampled``:
    :func:`_sampled_sets` of the approximate family, with the simulator's stage costs."""
    if isinstance(max_lower_sets, bool) or not isinstance(max_lower_sets, int) or max_lower_sets < 1:
        raise ValueError(f"max_lower_sets={max_lower_sets!r} must be an int of at least 1")
    simulated = simulated or sampled
    key = (exact, simulated, prefixes, sampled, _cost_key(graph))
    family = _FAMILY_CACHE.get(key)
    if family is not None and (not exact or family.size <= max_lower_sets):
        _FAMILY_CACHE.move_to_end(key)
        return family
    bits = graph_bits(graph)
    if sampled:
        sets = _sampled_sets(bits)
    elif prefixes:
        sets = prefix_sets(bits)
    else:
        sets = all_lower_sets(bits, max_lower_sets) if exact else approximate_sets(bits, simulated)
    # The approximate family too takes the simulator's own stage costs where simulating
    # every pair is cheap (a simulation is O(n)): its plans are then as tight as the model.
    pairs = len(set(sets) | {0, bits.full}) ** 2 // 2
    # The exact DP, whose tables are quadratic in its family anyway, simulates up to the work
    # the approximate one affords only for a tight budget: above it (a 329-vertex chain, 54k
    # pairs) the simulations alone took 80 s on a 2-core CPU, and the bound still fits.
    simulated = simulated or pairs * max(bits.n, 1) <= (_TIGHTER_WORK if exact else _SIMULATED_WORK)
    if simulated and not exact and not prefixes and not sampled:
        sets = approximate_sets(bits, True)
    family = LowerSetFamily(bits, sets, simulated=simulated)
    if simulated:
        memory_key = _memory_key(graph)
        family.simulated_pairs = _SIMULATED_PAIRS.setdefault(memory_key, family.simulated_pairs)
        _SIMULATED_PAIRS.move_to_end(memory_key)
        while len(_SIMULATED_PAIRS) > _FAMILY_CACHE_SIZE:
            _SIMULATED_PAIRS.popitem(last=False)
    _FAMILY_CACHE[key] = family
    while len(_FAMILY_CACHE) > _FAMILY_CACHE_SIZE:
        _FAMILY_CACHE.popitem(last=False)
    return family


# Meta fields no stage cost reads: the same graph with another bandwidth or run label is the
# same family (the batch-size search predicts on a derived graph the planner then gets with
# the bandwidth and the run's gradient state set).
_COSTLESS_META = ("bandwidth_bytes_per_s", "step_seconds", "plain_peak_bytes")
_TIME_META = ("recompute_stage_seconds", "recompute_vertex_seconds")
_SIMULATED_PAIRS: OrderedDict[str, SimulatedPairs] = OrderedDict()
"""The simulated stage costs of every family over a graph, by the graph's memory key."""


def _memory_key(graph: Graph) -> str:
    """:func:`_cost_key` less every time: what the simulator's memory reads."""
    data = json.loads(_cost_key(graph))
    for node in data["nodes"]:
        node["t_fwd"] = node["t_bwd"] = 0.0
    for name in _TIME_META:
        data["meta"].pop(name, None)
    return json.dumps(data)


def _cost_key(graph: Graph) -> str:
    """The graph's JSON less the meta fields stage costs do not read, gradients resident
    or not written as a bool."""
    data = graph.to_dict()
    meta = data["meta"]
    for name in _COSTLESS_META:
        meta.pop(name, None)
    for name in graph.meta.extra:
        meta.pop(name, None)
    meta["grads_resident"] = bool(graph.meta.grads_resident)
    return json.dumps(data)


def _tighter_family(graph: Graph, family: LowerSetFamily, prefixes: bool = False,
                    exact: bool = False) -> LowerSetFamily | None:
    """The same approximate family (or the prefixes) with the simulator's stage costs, where
    ``family`` uses the upper bound and simulating every pair is affordable
    (``_TIGHTER_WORK``); beyond that, for the approximate family, its sampled subfamily
    (:func:`_sampled_sets`), whose strategies are the family's and whose costs are exact;
    else None."""
    if family.simulated:
        return None
    if (family.size ** 2 // 2) * max(family.bits.n, 1) > _TIGHTER_WORK:
        if exact or prefixes:
            return None
        return _family(graph, False, DEFAULT_MAX_LOWER_SETS, sampled=True)
    return _family(graph, False, DEFAULT_MAX_LOWER_SETS, simulated=True, prefixes=prefixes)


def _plan_from_sequence(
    graph: Graph, family: LowerSetFamily, sequence: list[int], solver: str,
    budget: int | None, notes: list[str], dp_feasible: bool,
) -> Plan:
    ids = family.bits.ids
    stages: list[Stage] = []
    last = len(sequence) - 1
    for position, (before, after) in enumerate(zip(sequence, sequence[1:]), start=1):
        new = np.flatnonzero(family.member[after] & ~family.member[before])
        nodes = [ids[i] for i in new]
        # Every stage but the last recomputes Vi \ B(Li), keeping B(Li) (the executor runs
        # a stage whose vertices are all kept without running anything again).
        stages.append(Stage(nodes, "recompute" if position < last else "keep"))
    dp_peak, extra = family.evaluate(sequence)
    plan = make_plan(graph, stages, solver, budget, extra_seconds=extra, notes=notes)
    model = "the simulator's stage memory" if family.simulated else "its upper bound"
    plan.notes.append(
        f"DP peak ({model}) {dp_peak} bytes; simulator peak {plan.predicted_peak_bytes} bytes; "
        f"{len(stages)} stages over {family.size} lower sets"
    )
    plan.feasible = dp_feasible and (budget is None or plan.guaranteed_peak_bytes <= budget)
    return plan


def _solve(graph: Graph, budget_bytes: int | None, *, exact: bool, objective: str,
           max_lower_sets: int, time_steps: int, prefixes: bool = False) -> Plan:
    budget = _check_budget(budget_bytes)
    if time_steps < 1:
        raise ValueError(f"time_steps={time_steps} must be at least 1")
    name = "kusumoto-" + ("exact-" if exact else "") + objective
    try:
        family = _family(graph, exact, max_lower_sets, prefixes=prefixes)
    except SolverDeclinedError as declined:
        raise declined.for_solver(budget, name) from None
    notes: list[str] = []
    if not family.bits.integer_times:
        notes.append(f"times bucketed in steps of total forward time / {time_steps}")
    if len(graph) == 0:
        return make_plan(graph, [], name, budget, extra_seconds=0.0, notes=["empty graph"])
    if budget is None and objective == "tc":
        # No limit: least extra time is no recomputation, one stage.
        notes.append("no budget: one stage, nothing recomputed")
        return _plan_from_sequence(graph, family, [0, family.size - 1], name, None, notes, True)
    margin = model_margin(graph)
    # The DP meets the budget less the plan's margin (docs/design.md section 4.7).
    target = None if budget is None else max(budget - margin, 0)
    if target is None:
        target = family.min_budget()
        notes.append(
            f"no budget: memory-centric strategy at the smallest budget with a solution, {target} bytes"
        )
    found = _run(family, target, objective, time_steps)
    if found is not None:
        return _plan_from_sequence(graph, family, found, name, budget, notes, True)
    tighter = _tighter_family(graph, family, prefixes, exact)
    if tighter is not None:
        found = _run(tighter, target, objective, time_steps)
        if found is not None:
            notes.append("no strategy under the stage-memory upper bound; found with the "
                         "simulator's own stage costs"
                         + (f" on {tighter.size} of its {family.size} lower sets"
                            if (family.size ** 2 // 2) * max(family.bits.n, 1) > _TIGHTER_WORK else ""))
            return _plan_from_sequence(graph, tighter, found, name, budget, notes, True)
        if tighter.min_budget() <= family.min_budget():
            family = tighter
    smallest = family.min_budget()
    notes.append(
        f"no strategy has peak <= {budget} bytes; the smallest budget with one is "
        f"{smallest + margin} bytes: this is the strategy for that budget"
    )
    found = _run(family, smallest, objective, time_steps)
    assert found is not None  # g({}) is met by construction
    return _plan_from_sequence(graph, family, found, name, budget, notes, False)


_COARSE_STEPS = 32


def _run(family: LowerSetFamily, budget: int | None, objective: str,
         time_steps: int) -> list[int] | None:
    """The DP, for TC preceded by a coarse pass (``_COARSE_STEPS`` time buckets) whose
    strategy's exact T bounds the fine pass: states slower than it cannot lead to the
    optimum, and at generous budgets most of the fine table is such states."""
    if budget is not None and family.min_budget() > budget:
        return None
    unit = family.time_unit(time_steps)
    bound = None
    coarse = None
    if objective == "tc":
        total = float(family.bits.t_fwd.sum())
        coarse_unit = max(unit, total / _COARSE_STEPS)
        if coarse_unit > unit:
            coarse = family.solve(budget, objective, coarse_unit)
            if coarse is None:
                return None
            bound = coarse[1]
            if bound <= 0.0:
                return coarse[0]  # nothing recomputed: nothing is faster
            if not family.bits.integer_times:
                # Buckets relative to the time that matters (at most the bound), not to
                # the whole forward: at generous budgets T is a small part of it.
                unit = max(bound / time_steps, total * 1e-12)
    result = family.solve(budget, objective, unit, bound)
    if result is None and coarse is not None:
        # A bucket keeps its least-cache state, which may be up to a unit slower than the
        # one it stands for, so over many stages every fine path can overrun the coarse
        # strategy's T and be cut; that strategy itself fits the budget.
        return coarse[0]
    return None if result is None else result[0]


def solve_approx_tc(graph: Graph, budget_bytes: int | None, *,
                    max_lower_sets: int = DEFAULT_MAX_LOWER_SETS,
                    time_steps: int = DEFAULT_TIME_STEPS) -> Plan:
    """Approximate DP (section 4.3, at most n + 2 lower sets), time-centric: least extra time among
    strategies with peak <= budget. Budget None: one stage, nothing recomputed.
    ``max_lower_sets`` is accepted for a uniform signature and not used."""
    return _solve(graph, budget_bytes, exact=False, objective="tc",
                  max_lower_sets=max_lower_sets, time_steps=time_steps)


def solve_approx_mc(graph: Graph, budget_bytes: int | None, *,
                    max_lower_sets: int = DEFAULT_MAX_LOWER_SETS,
                    time_steps: int = DEFAULT_TIME_STEPS) -> Plan:
    """Approximate DP (section 4.3), memory-centric (section 4.4): the largest extra time
    among strategies with peak <= budget. Budget None: the smallest budget with a solution
    (the paper's memory-centric strategy)."""
    return _solve(graph, budget_bytes, exact=False, objective="mc",
                  max_lower_sets=max_lower_sets, time_steps=time_steps)


def solve_exact_tc(graph: Graph, budget_bytes: int | None, *,
                   max_lower_sets: int = DEFAULT_MAX_LOWER_SETS,
                   time_steps: int = DEFAULT_TIME_STEPS) -> Plan:
    """Exact DP (section 4.2, all lower sets), time-centric. Declines a graph with more than
    ``max_lower_sets`` lower sets (:class:`~lightning_remat.errors.SolverDeclinedError`, a
    ``RematInfeasibleError`` naming the approximate DP instead)."""
    return _solve(graph, budget_bytes, exact=True, objective="tc",
                  max_lower_sets=max_lower_sets, time_steps=time_steps)


def solve_exact_mc(graph: Graph, budget_bytes: int | None, *,
                   max_lower_sets: int = DEFAULT_MAX_LOWER_SETS,
                   time_steps: int = DEFAULT_TIME_STEPS) -> Plan:
    """Exact DP (section 4.2), memory-centric (section 4.4)."""
    return _solve(graph, budget_bytes, exact=True, objective="mc",
                  max_lower_sets=max_lower_sets, time_steps=time_steps)


def solve_in_forward_order(graph: Graph, budget_bytes: int | None, objective: str = "tc", *,
                           time_steps: int = DEFAULT_TIME_STEPS) -> Plan:
    """The approximate DP over the n + 1 prefixes of the forward's order in place of the
    ancestor sets: a strategy whose stages run every op where the forward runs it, so the
    backward sums every gradient in plain training's order (docs/design.md section 5,
    "Plain's order"). ``objective``: "tc" or "mc". Its plan is infeasible (``feasible``
    false) where no such strategy meets the budget."""
    return _solve(graph, budget_bytes, exact=False, objective=objective,
                  max_lower_sets=DEFAULT_MAX_LOWER_SETS, time_steps=time_steps, prefixes=True)


def _min_budget(graph: Graph, exact: bool, max_lower_sets: int = DEFAULT_MAX_LOWER_SETS,
                name: str = "kusumoto", **_: Any) -> int:
    if len(graph) == 0:
        return 0
    try:
        family = _family(graph, exact, max_lower_sets)
    except SolverDeclinedError as declined:
        raise declined.for_solver(None, name) from None
    tighter = None if exact else _tighter_family(graph, family)
    least = family.min_budget() if tighter is None else min(family.min_budget(), tighter.min_budget())
    return least + model_margin(graph)


def min_budget_solve_approx_tc(graph: Graph, **options: Any) -> int:
    """Smallest budget for which the approximate DP has a strategy (binary search on M over
    the DP's own feasibility, section 5.1). The same for TC and MC."""
    return _min_budget(graph, exact=False, **options)


def min_budget_solve_approx_mc(graph: Graph, **options: Any) -> int:
    """See :func:`min_budget_solve_approx_tc`."""
    return _min_budget(graph, exact=False, **options)


def min_budget_solve_exact_tc(graph: Graph, **options: Any) -> int:
    """Smallest budget for which any canonical strategy exists (exact DP); declines a graph
    with more than ``max_lower_sets`` lower sets, as :func:`solve_exact_tc` does."""
    return _min_budget(graph, exact=True, name="kusumoto-exact-tc", **options)


def min_budget_solve_exact_mc(graph: Graph, **options: Any) -> int:
    """See :func:`min_budget_solve_exact_tc`."""
    return _min_budget(graph, exact=True, name="kusumoto-exact-mc", **options)
