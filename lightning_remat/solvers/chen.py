"""Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": the baseline every
other solver must beat (docs/design.md section 4.1). Reference only; no optimality is claimed.

- :func:`solve_chen_sqrt`: cut the topological order into about sqrt(n) segments of equal
  cost (section 4.1); store each segment's output, recompute the segment in the backward.
- :func:`solve_chen_greedy`: the budgeted greedy, Algorithm 3 "Memory Planning with Budget"
  (section 4.3): walk the order accumulating memory and close a segment at a candidate
  splitting point once the running size passes a threshold ``b``; ``b`` is searched on a grid
  around ``sqrt(x * y)`` as the paper suggests, and the plan with the least predicted peak
  that meets the budget is returned.

Segments end only at candidate splitting points: vertices where the stage boundary is a single
tensor (every edge from the prefix to the rest leaves from that vertex; on a DAG these are the
articulation points of the topological order, as Kusumoto et al. Appendix B configured Chen's
method). Where there are too few of them (fewer than the sqrt(n) plan needs; none for the
greedy) any topological position may be cut instead, noted in the plan.
Every segment but the last is ``recompute`` (the last one's backward follows its forward at
once, as in PyTorch's ``checkpoint_sequential``).
"""

from __future__ import annotations

import math

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.scoring import make_plan

__all__ = ["candidate_cuts", "solve_chen_greedy", "solve_chen_sqrt"]

_COSTS = ("mem", "t_fwd", "count")


def candidate_cuts(graph: Graph) -> list[int]:
    """Positions p (topological order, excluding the last vertex) where cutting after p
    leaves at most one tensor crossing, namely vertex p itself."""
    ids = graph.ids
    last_use = [max((graph.position(w) for w in graph.successors(v)), default=i)
                for i, v in enumerate(ids)]
    cuts = []
    reach = -1  # furthest position any vertex before p is read at
    for p in range(len(ids) - 1):
        if reach <= p:
            cuts.append(p)
        reach = max(reach, last_use[p])
    return cuts


def _costs(graph: Graph, cost: str) -> list[float]:
    if cost not in _COSTS:
        raise ValueError(f"cost={cost!r}; choose one of {_COSTS}")
    if cost == "count":
        return [1.0] * len(graph)
    return [float(getattr(node, cost)) for node in graph.nodes]


def _cuts_or_fallback(graph: Graph, notes: list[str], needed: int = 1) -> list[int]:
    """Single-tensor cut positions, or every topological position when there are fewer than
    ``needed`` of them (noted)."""
    cuts = candidate_cuts(graph)
    if len(cuts) < needed and len(graph) > 1:
        notes.append(f"only {len(cuts)} single-tensor stage boundaries for {needed} cuts; "
                     "cutting the topological order anywhere (boundaries of several tensors "
                     "are stored)")
        cuts = list(range(len(graph) - 1))
    return cuts


def _plan(graph: Graph, cut_positions: list[int], solver: str, budget: int | None,
          notes: list[str]) -> Plan:
    ids = graph.ids
    stages: list[Stage] = []
    start = 0
    for p in sorted(set(cut_positions)):
        stages.append(Stage(ids[start:p + 1], "recompute"))
        start = p + 1
    stages.append(Stage(ids[start:], "keep"))
    return make_plan(graph, [s for s in stages if s.nodes], solver, budget, notes=list(notes))


def _check_budget(budget_bytes: int | None) -> int | None:
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be a whole number of bytes >= 0 or None")
    return budget_bytes


def solve_chen_sqrt(graph: Graph, budget_bytes: int | None, *, segments: int | None = None,
                    cost: str = "mem") -> Plan:
    """About sqrt(n) segments of equal ``cost`` (``"mem"``, ``"t_fwd"`` or ``"count"``) along
    the topological order, each cut at the candidate point nearest its equal share. The
    budget only decides ``feasible`` (from the simulator's peak)."""
    budget = _check_budget(budget_bytes)
    n = len(graph)
    if n == 0:
        return make_plan(graph, [], "chen", budget, notes=["empty graph"])
    wanted = segments if segments is not None else max(1, round(math.sqrt(n)))
    if wanted < 1:
        raise ValueError(f"segments={segments}; need at least 1")
    notes: list[str] = [f"{wanted} segments of equal {cost} wanted (sqrt of {n} vertices)"]
    values = _costs(graph, cost)
    prefix = list(_accumulate(values))
    total = prefix[-1]
    cuts = _cuts_or_fallback(graph, notes, wanted - 1) if wanted > 1 else []
    chosen: set[int] = set()
    for k in range(1, wanted):
        if not cuts:
            break
        share = total * k / wanted
        chosen.add(min(cuts, key=lambda p: (abs(prefix[p] - share), p)))
    if wanted > 1 and len(chosen) < wanted - 1:
        notes.append(f"only {len(chosen) + 1} segments: too few distinct splitting points")
    return _plan(graph, sorted(chosen), "chen", budget, notes)


def _accumulate(values: list[float]):
    running = 0.0
    for value in values:
        running += value
        yield running


def greedy_cuts(graph: Graph, threshold: float, cuts: list[int]) -> list[int]:
    """Algorithm 3 of Chen et al.: accumulate memory along the order; at a candidate point
    whose running size exceeds ``threshold``, store it and start a new segment."""
    is_cut = set(cuts)
    running = 0
    chosen = []
    for p, node in enumerate(graph.nodes):
        running += node.mem
        if p in is_cut and running > threshold:
            chosen.append(p)
            running = 0
    return chosen


def solve_chen_greedy(graph: Graph, budget_bytes: int | None, *, grid: int = 25) -> Plan:
    """The budgeted greedy (Algorithm 3) with ``b`` searched on ``grid`` geometric steps from
    ``sqrt(x*y)/8`` to ``8*sqrt(x*y)`` (x: total memory, y: mean vertex memory, the
    threshold that gives sqrt(n) segments on a uniform chain), plus ``b = 0`` (every
    candidate) and no cut at all. Returns the least predicted peak among the plans that
    meet the budget (ties: less extra time), else the least peak marked infeasible."""
    budget = _check_budget(budget_bytes)
    n = len(graph)
    if n == 0:
        return make_plan(graph, [], "chen-greedy", budget, notes=["empty graph"])
    if grid < 1:
        raise ValueError(f"grid={grid}; need at least 1 threshold")
    notes: list[str] = []
    cuts = _cuts_or_fallback(graph, notes)
    total = float(graph.total("mem"))
    centre = math.sqrt(total * total / n) if total > 0 else 1.0
    thresholds = [0.0, math.inf] + [
        centre * 8.0 ** (2 * k / max(grid - 1, 1) - 1) for k in range(grid)
    ]
    seen: dict[tuple[int, ...], float] = {}
    for b in thresholds:
        seen.setdefault(tuple(greedy_cuts(graph, b, cuts)), b)
    best: Plan | None = None
    for chosen, b in seen.items():
        plan = _plan(graph, list(chosen), "chen-greedy", budget,
                     notes + [f"threshold b = {b:.6g} bytes; {len(seen)} distinct plans tried"])
        key = (not plan.feasible, plan.predicted_peak_bytes, plan.predicted_extra_seconds)
        if best is None or key < (not best.feasible, best.predicted_peak_bytes,
                                  best.predicted_extra_seconds):
            best = plan
    assert best is not None
    return best
