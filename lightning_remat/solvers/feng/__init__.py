"""Feng and Huang, re-forwarding: memory-optimal gradient checkpoints. "The paper": Feng &
Huang, "Cutting Down Training Memory by Re-forwarding" (2018); "the supplement": the
supplementary material of Feng & Huang, "Optimal Gradient Checkpoint Search for Arbitrary
Computation Graphs" (CVPR 2021). See docs/design.md section 4.2.

Objective (paper eq. 1): a set of stored vertices V_R is kept from the first forward; the
vertices between stored ones are re-forwarded segment by segment during the backward. The
memory cost is

    sum_{v in V_R} l(v)  +  max_segments l(segment),

where l(v) is the vertex's ``mem`` and a segment's cost is the sum of the costs of its
non-stored vertices. The paper's graphs have one source ``s`` and one target ``t`` that are
always stored and counted in eq. 1. On a linear graph :func:`solve_feng` solves exactly that
form (Algorithm 1 with ``pin_ends``): s and t are the chain's first and last vertex. A DAG
may have several sources and sinks, and its inputs and parameters lie outside the graph
(resident, not counted), so on other graphs this package adds a virtual source (the step's
inputs, cost 0) before the vertices without predecessors and a virtual target (the loss,
cost 0) after the vertices without successors; every real vertex may then be stored or
not. ``solve_linear(costs)`` solves a chain in that form too.

One module per algorithm, as the paper builds them on each other:

- :mod:`.linear`: Algorithm 1, the LCG solver (:func:`solve_linear`);
- :mod:`.segments`: eq. 1 on any graph (:func:`objective`, :func:`segments`,
  :func:`two_endpoint_segments`);
- :mod:`.division`: the division tree, Definitions 3-9 and Algorithms 2-4
  (:func:`division_tree`);
- :mod:`.arbitrary`: Algorithm 5, the ACG solver, which runs Algorithm 1 on the linear runs
  of the division tree (:func:`solve_arbitrary`);
- here: the plan (:func:`solve_feng`) and its smallest budget.
"""

from __future__ import annotations

from lightning_remat.graph.ir import Graph, stable_topological_order
from lightning_remat.solvers.feng.arbitrary import FengSolution, solve_arbitrary, solve_tree
from lightning_remat.solvers.feng.division import DivisionNode, division_tree
from lightning_remat.solvers.feng.linear import chain_max_term, solve_linear
from lightning_remat.solvers.feng.segments import (
    Segment,
    objective,
    segments,
    two_endpoint_segments,
)
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.scoring import make_plan

__all__ = [
    "DivisionNode", "FengSolution", "Segment", "division_tree", "min_budget_solve_feng", "objective",
    "segments", "solve_arbitrary", "solve_feng", "solve_linear", "two_endpoint_segments",
]


def _stages(graph: Graph, stored: list[str]) -> list[Stage]:
    """Stages from the segments: each segment with the stored vertex it ends at (that
    vertex's op reads the segment, so its backward needs the segment re-forwarded) is a
    recompute stage; a stored vertex no segment ends at is a keep stage of its own; the
    last stage is kept (the backward starts there; its values are still live)."""
    stored_set = set(stored)
    groups: list[list[str]] = []
    group_of: dict[str, int] = {}
    for seg in segments(graph, stored_set):
        group_of.update(dict.fromkeys(seg.nodes, len(groups)))
        groups.append(list(seg.nodes))
    for v in stored:
        ends_here = [group_of[u] for u in graph.predecessors(v) if u not in stored_set]
        if ends_here:
            g = max(ends_here)
            groups[g].append(v)
            group_of[v] = g
        else:
            group_of[v] = len(groups)
            groups.append([v])
    # Order the groups topologically (ties by their first vertex's position).
    count = len(groups)
    after: list[set[int]] = [set() for _ in range(count)]
    indegree = [0] * count
    for u, v in graph.edges:
        a, b = group_of[u], group_of[v]
        if a != b and b not in after[a]:
            after[a].add(b)
            indegree[b] += 1
    first = [min(graph.position(v) for v in g) for g in groups]
    order = stable_topological_order(after, dict(enumerate(indegree)), first.__getitem__)
    if len(order) != count:
        raise ValueError("the stored set does not cut the graph into two-endpoint segments")
    stages = []
    for rank, g in enumerate(order):
        has_segment = any(v not in stored_set for v in groups[g])
        action = "recompute" if has_segment and rank < count - 1 else "keep"
        stages.append(Stage(sorted(groups[g], key=graph.position), action))
    return stages


def solve_feng(graph: Graph, budget_bytes: int | None = None, **options: object) -> Plan:
    """Feng and Huang's memory-optimal checkpoints as a Plan. The plan minimises eq. 1 and
    does not depend on the budget; ``feasible`` says whether its simulated peak fits.
    Option ``every_term`` (bool): try every candidate max term (Algorithm 5 as printed).

    ``stored`` is the checkpoints. Each recompute stage is one segment plus the checkpoint
    that closes it (that op reads the segment, so its backward needs the segment back); the
    runtime re-runs the whole stage, so ``predicted_extra_seconds`` is the forward time of
    every vertex in a recompute stage, the closing checkpoints included. The paper's
    assumption 2 (multi-input ops need not their inputs for backward) is not modelled: the
    simulator counts what the ops really save."""
    unknown = sorted(set(options) - {"every_term"})
    if unknown:
        raise ValueError(f"feng: unknown options {unknown}; the only option is every_term")
    if len(graph) == 0:
        raise ValueError("feng: the graph has no vertices; trace a model with at least one op")
    if graph.is_chain():
        # The paper's linear computation graph: s and t are the first and last vertex.
        costs = [int(n.mem) for n in graph.nodes]
        objective_value, indices = solve_linear(costs, pin_ends=True)
        solution = FengSolution(objective_value, [graph.ids[i] for i in indices],
                                chain_max_term(costs, indices), 0)
        structure = "linear computation graph (Algorithm 1): s and t are its first and last vertex"
    else:
        solution, root = solve_tree(graph, bool(options.get("every_term", False)))
        kinds: dict[str, int] = {}
        for node in root.walk():
            kinds[node.kind] = kinds.get(node.kind, 0) + 1
        structure = "division tree: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    stages = _stages(graph, solution.stored)
    notes = [
        f"Feng-Huang objective (eq. 1): {solution.objective} bytes = stored "
        f"{solution.objective - solution.max_term} + largest re-forward {solution.max_term}",
        f"{len(solution.stored)} checkpoints of {len(graph)} vertices"
        + (f"; {solution.terms_tried} max terms tried" if solution.terms_tried else ""),
        structure,
        "memory-optimal under the paper's model; the budget only decides `feasible`",
    ]
    return make_plan(graph, stages, "feng", budget_bytes, stored=solution.stored, notes=notes)


def min_budget_solve_feng(graph: Graph, **options: object) -> int:
    """The plan ignores the budget, so the smallest feasible budget is its own peak."""
    return int(solve_feng(graph, None, **options).predicted_peak_bytes)
