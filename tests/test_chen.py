"""Chen et al. 2016 baseline: sqrt(n) segments and the budgeted greedy (Algorithm 3)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_remat.graph.ir import Graph, Node
from lightning_remat.solvers import get_solver
from lightning_remat.solvers.chen import (
    candidate_cuts,
    greedy_cuts,
    solve_chen_greedy,
    solve_chen_sqrt,
)
from lightning_remat.solvers.scoring import plain_plan


def residual(blocks: int) -> Graph:
    """x -> a -> b -> add(x, b) repeated: only the block outputs are single-tensor cuts."""
    nodes, edges, prev = [Node("in", "op", mem=4, t_fwd=1.0)], [], "in"
    for k in range(blocks):
        a, b, out = f"a{k}", f"b{k}", f"add{k}"
        nodes += [Node(i, "op", mem=4, t_fwd=1.0) for i in (a, b, out)]
        edges += [(prev, a), (a, b), (b, out), (prev, out)]
        prev = out
    return Graph(nodes, edges)


@pytest.mark.parametrize("n", [1, 2, 9, 16, 50, 100, 400])
def test_about_sqrt_n_segments_of_equal_cost(n):
    plan = solve_chen_sqrt(Graph.chain([8] * n), None)
    assert abs(len(plan.stages) - math.sqrt(n)) <= 1
    sizes = [len(s.nodes) for s in plan.stages]
    assert max(sizes) - min(sizes) <= 1  # equal memory on a uniform chain
    assert all(s.action == "recompute" for s in plan.stages[:-1])
    assert plan.stages[-1].action == "keep"


def test_segments_follow_memory_not_vertex_count():
    # The first half holds most of the memory, so it gets most of the cuts.
    graph = Graph.chain([100] * 8 + [1] * 8)
    plan = solve_chen_sqrt(graph, None, segments=4)
    first_half_cuts = sum(1 for s in plan.stages[:-1] if graph.position(s.nodes[-1]) < 8)
    assert first_half_cuts == 3


def test_dag_cuts_only_where_one_tensor_crosses():
    graph = residual(9)
    cuts = candidate_cuts(graph)
    assert [graph.ids[p] for p in cuts] == ["in"] + [f"add{k}" for k in range(8)]
    plan = solve_chen_sqrt(graph, None)
    assert len(plan.stages) == round(math.sqrt(len(graph)))
    stage_of = plan.stage_of()
    for k in range(1, len(plan.stages)):
        crossing = {u for u, v in graph.edges if stage_of[u] < k <= stage_of[v]}
        assert len(crossing) == 1 and crossing <= set(plan.stored)
    plan.validate(graph)


def test_too_few_single_tensor_cuts_falls_back_and_says_so():
    # v0 feeds every vertex of a chain: only the cut after v0 has one tensor crossing.
    ids = [f"v{i}" for i in range(16)]
    edges = [("v0", v) for v in ids[2:]] + list(zip(ids, ids[1:]))
    graph = Graph([Node(i, "op", mem=2) for i in ids], edges)
    assert candidate_cuts(graph) == [0]
    plan = solve_chen_sqrt(graph, None)
    assert len(plan.stages) == 4
    assert any("single-tensor stage boundaries" in note for note in plan.notes)
    plan.validate(graph)


def test_greedy_algorithm_3_threshold():
    graph = Graph.chain([3, 3, 3, 3, 3, 3])
    cuts = candidate_cuts(graph)
    assert greedy_cuts(graph, 5, cuts) == [1, 3]  # running 6 > 5 at v1, again at v3
    assert greedy_cuts(graph, 0, cuts) == cuts
    assert greedy_cuts(graph, math.inf, cuts) == []


@settings(max_examples=30, deadline=None)
@given(mem=st.lists(st.integers(1, 50), min_size=1, max_size=30), fraction=st.floats(0.05, 1.2))
def test_greedy_meets_the_budget_when_it_says_so(mem, fraction):
    graph = Graph.chain(mem)
    plain = plain_plan(graph).predicted_peak_bytes
    budget = int(plain * fraction)
    plan = solve_chen_greedy(graph, budget)
    assert plan.feasible == (plan.predicted_peak_bytes <= budget)
    unlimited = solve_chen_greedy(graph, None)
    # Unlimited: the least peak it can reach, never above keeping everything.
    assert unlimited.predicted_peak_bytes <= plain
    if plan.feasible:
        assert plan.predicted_peak_bytes >= unlimited.predicted_peak_bytes
    else:
        assert unlimited.predicted_peak_bytes > budget


def test_one_vertex_and_registry():
    graph = Graph([Node("x", "op", mem=5, t_fwd=1.0)], [])
    for name in ("chen", "chen-greedy"):
        plan = get_solver(name)(graph, 100)
        assert [s.nodes for s in plan.stages] == [["x"]] and plan.feasible
        assert plan.solver == name


def test_bad_options_are_explained():
    graph = Graph.chain([1, 2, 3])
    with pytest.raises(ValueError, match="cost="):
        solve_chen_sqrt(graph, None, cost="flops")
    with pytest.raises(ValueError, match="segments="):
        solve_chen_sqrt(graph, None, segments=0)
    with pytest.raises(ValueError, match="budget_bytes"):
        solve_chen_greedy(graph, -1)
