"""Hong et al. checkpoint selection: Algorithms 3, 5 and 6 against brute force over every
checkpoint set, the articulation chain of a DAG against its definition, and the plans."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_remat.graph.ir import Graph, Node
from lightning_remat.solvers import get_solver, min_budget
from lightning_remat.solvers.hong import (
    articulation_chain,
    checkpoint_selection_cubic,
    classic_objective,
    dynamic_checkpoint_selection_linear,
    dynamic_checkpoint_selection_quadratic,
    dynamic_objective,
    solve_hong_cubic,
    solve_hong_linear,
)
from lightning_remat.solvers.scoring import plain_plan

# ---- oracles ----------------------------------------------------------------------------


def brute_force(sizes, objective):
    """The least objective over every checkpoint set containing 0 and n."""
    n = len(sizes) - 1
    if n == 0:
        return objective(sizes, [0])
    interior = range(1, n)
    return min(
        objective(sizes, [0, *subset, n])
        for r in range(n)
        for subset in itertools.combinations(interior, r)
    )


# Small ranges make ties and zero sizes common; the large one makes them rare.
small_chains = st.lists(
    st.one_of(st.integers(0, 3), st.integers(0, 1000)), min_size=1, max_size=10
)


def assert_is_checkpoint_set(sizes, checkpoints):
    n = len(sizes) - 1
    assert checkpoints == sorted(set(checkpoints))
    assert checkpoints[0] == 0 and checkpoints[-1] == n


# ---- the objectives, from the equations -------------------------------------------------


def test_classic_objective_is_checkpoints_plus_largest_segment():
    # eq. 6: checkpoints d0 + d2 + d4 = 1 + 3 + 5, segments {d1} = 2 and {d3} = 4.
    assert classic_objective([1, 2, 3, 4, 5], [0, 2, 4]) == 9 + 4
    assert classic_objective([1, 2, 3, 4, 5], [0, 1, 2, 3, 4]) == 15  # all empty segments


def test_dynamic_objective_counts_the_largest_gradient_twice():
    # eq. 12 at checkpoint 2: (1 + 3) + s(0, 2) = 4 + (2 + max(1, 2)) = 8;
    # at checkpoint 4: (1 + 3 + 5) + s(2, 4) = 9 + (4 + max(3, 4)) = 17.
    assert dynamic_objective([1, 2, 3, 4, 5], [0, 2, 4]) == 17
    assert dynamic_objective([6], [0]) == 6


@pytest.mark.parametrize("objective", [classic_objective, dynamic_objective])
@pytest.mark.parametrize(
    "checkpoints, words",
    [([1, 4], "must include 0"), ([0, 2], "must include 0 .* and 4"), ([0, 0, 4], "repeat")],
)
def test_objectives_reject_checkpoint_sets_without_both_ends(objective, checkpoints, words):
    with pytest.raises(ValueError, match=words):
        objective([1, 2, 3, 4, 5], checkpoints)


@pytest.mark.parametrize(
    "select",
    [checkpoint_selection_cubic, dynamic_checkpoint_selection_linear,
     dynamic_checkpoint_selection_quadratic],
)
@pytest.mark.parametrize(
    "sizes, words",
    [([], "empty"), ([1, -2], "non-negative"), ([1, math.nan], "not a number"),
     ([1, True], "not a number"), ([1, math.inf], "finite")],
)
def test_bad_sizes_are_refused_with_the_reason(select, sizes, words):
    with pytest.raises(ValueError, match=words):
        select(sizes)


# ---- Algorithm 3 ------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(small_chains)
def test_algorithm3_is_optimal_under_eq6(sizes):
    objective, checkpoints = checkpoint_selection_cubic(sizes)
    assert_is_checkpoint_set(sizes, checkpoints)
    assert classic_objective(sizes, checkpoints) == objective
    assert objective == brute_force(sizes, classic_objective)


# ---- Algorithms 5 and 6 -----------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(small_chains)
def test_algorithm6_is_optimal_under_the_dynamic_objective(sizes):
    objective, checkpoints = dynamic_checkpoint_selection_linear(sizes)
    assert_is_checkpoint_set(sizes, checkpoints)
    assert dynamic_objective(sizes, checkpoints) == objective
    assert objective == brute_force(sizes, dynamic_objective)


@settings(max_examples=150, deadline=None)
@given(small_chains)
def test_algorithm5_is_optimal_under_the_dynamic_objective(sizes):
    objective, checkpoints = dynamic_checkpoint_selection_quadratic(sizes)
    assert dynamic_objective(sizes, checkpoints) == objective
    assert objective == brute_force(sizes, dynamic_objective)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2), st.integers(0, 10**6)), min_size=11, max_size=120))
def test_algorithm6_matches_algorithm5_on_longer_chains(sizes):
    # Chains too long for brute force: the O(n^2) recursion (eq. 13) is the reference.
    linear, checkpoints = dynamic_checkpoint_selection_linear(sizes)
    assert linear == dynamic_checkpoint_selection_quadratic(sizes)[0]
    assert dynamic_objective(sizes, checkpoints) == linear


@pytest.mark.parametrize(
    "select, objective",
    [(checkpoint_selection_cubic, classic_objective),
     (dynamic_checkpoint_selection_linear, dynamic_objective),
     (dynamic_checkpoint_selection_quadratic, dynamic_objective)],
)
@pytest.mark.parametrize("size", [0, 7])
def test_one_and_two_element_chains(select, objective, size):
    assert select([size]) == (size, [0])
    assert select([size, 3]) == (objective([size, 3], [0, 1]), [0, 1])


@pytest.mark.parametrize(
    "select, objective",
    [(checkpoint_selection_cubic, classic_objective),
     (dynamic_checkpoint_selection_linear, dynamic_objective)],
)
@pytest.mark.parametrize("sizes", [[0] * 9, [5] * 10, [2, 0, 2, 0, 2, 0, 2, 0, 2, 0], [1, 9, 1, 9, 1, 9, 1]])
def test_ties_still_give_an_optimal_set(select, objective, sizes):
    value, checkpoints = select(sizes)
    assert objective(sizes, checkpoints) == value == brute_force(sizes, objective)


def test_float_sizes_work():
    sizes = [0.5, 1.25, 3.0, 0.75, 2.5]
    assert dynamic_checkpoint_selection_linear(sizes)[0] == brute_force(sizes, dynamic_objective)
    assert checkpoint_selection_cubic(sizes)[0] == brute_force(sizes, classic_objective)


# ---- articulation chain -----------------------------------------------------------------


def residual_graph():
    """n0 -> [n1 -> n2] -> n3 (+ n0) -> [n4] -> n5 (+ n3) -> n6: two residual blocks."""
    mems = [10, 20, 20, 10, 30, 10, 10]
    nodes = [Node(f"n{i}", "op", mem=m, t_fwd=1.0) for i, m in enumerate(mems)]
    edges = [("n0", "n1"), ("n1", "n2"), ("n2", "n3"), ("n0", "n3"), ("n3", "n4"),
             ("n4", "n5"), ("n3", "n5"), ("n5", "n6")]
    return Graph(nodes, edges)


def cut_vertices_by_definition(graph):
    """Vertices on some source-to-sink path that every such path passes through."""
    sources = [v for v in graph.ids if not graph.predecessors(v)]
    sinks = {v for v in graph.ids if not graph.successors(v)}

    def reach(starts, avoid):
        seen = {s for s in starts if s != avoid}
        stack = list(seen)
        while stack:
            for w in graph.successors(stack.pop()):
                if w != avoid and w not in seen:
                    seen.add(w)
                    stack.append(w)
        return seen

    def reaches_a_sink(v):
        return bool(reach([v], None) & sinks)

    on_some_path = reach(sources, None)
    return [
        v for v in graph.ids
        if v in on_some_path and reaches_a_sink(v) and not (reach(sources, v) & sinks)
    ]


@st.composite
def random_dags(draw):
    n = draw(st.integers(1, 9))
    edges = [
        (f"v{u}", f"v{w}")
        for u in range(n) for w in range(u + 1, n)
        if draw(st.booleans() if w - u > 1 else st.sampled_from([True, True, False]))
    ]
    mems = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    nodes = [Node(f"v{i}", "op", mem=m, t_fwd=1.0) for i, m in enumerate(mems)]
    return Graph(nodes, edges)


@settings(max_examples=200, deadline=None)
@given(random_dags())
def test_articulation_chain_matches_its_definition(graph):
    assert articulation_chain(graph) == cut_vertices_by_definition(graph)


def test_residual_blocks_are_contracted_to_their_articulation_vertices():
    graph = residual_graph()
    assert articulation_chain(graph) == ["n0", "n3", "n5", "n6"]
    for solve in (solve_hong_linear, solve_hong_cubic):
        plan = solve(graph, None)
        plan.validate(graph)
        assert "articulation vertices" in plan.notes[0]
        assert any(note.startswith("objective") for note in plan.notes)
        # Cuts only after articulation vertices; the stored set is the checkpoints.
        for stage in plan.stages[:-1]:
            assert stage.nodes[-1] in {"n0", "n3", "n5"}
            # A stage of checkpoints only has nothing to recompute.
            assert stage.action == "recompute" or set(stage.nodes) <= set(plan.stored)
        assert plan.stages[-1].action == "keep"
        assert set(plan.stored) <= {"n0", "n3", "n5", "n6"}
        assert {"n0", "n6"} <= set(plan.stored)  # the chain's ends are d_0 and d_n


def test_input_consumers_decide_where_paths_start():
    # "c" is computed from nothing (a constant); it must not break the chain before it.
    nodes = [Node(i, "op", mem=4) for i in ("a", "b", "c", "d")]
    graph = Graph(nodes, [("a", "b"), ("b", "d"), ("c", "d")], {"input_consumers": ["a"]})
    assert articulation_chain(graph) == ["a", "b", "d"]
    without_meta = Graph(nodes, [("a", "b"), ("b", "d"), ("c", "d")])
    assert articulation_chain(without_meta) == ["d"]


# ---- plans ------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(random_dags(), st.sampled_from(["hong-linear", "hong-cubic"]))
def test_plans_on_random_dags_validate_and_report_their_objective(graph, name):
    plan = get_solver(name)(graph, None)
    plan.validate(graph)
    chain = articulation_chain(graph)
    if not chain:
        assert len(plan.stages) == 1 and plan.stages[0].action == "keep"
        return
    sizes = [graph[v].mem for v in chain]
    select = dynamic_checkpoint_selection_linear if name == "hong-linear" else checkpoint_selection_cubic
    objective, checkpoints = select(sizes)
    assert f"= {objective} bytes" in " ".join(plan.notes)
    assert plan.stored == [chain[c] for c in checkpoints]
    assert len(plan.stages) == len(checkpoints)


@pytest.mark.parametrize("name", ["hong-linear", "hong-cubic"])
def test_feasibility_follows_the_budget_and_min_budget_is_the_peak(name):
    graph = Graph.chain([3, 8, 1, 6, 2, 9, 4, 4, 7, 1])
    plan = get_solver(name)(graph, None)
    peak = plan.predicted_peak_bytes
    assert get_solver(name)(graph, peak).feasible
    assert not get_solver(name)(graph, peak - 1).feasible
    assert min_budget(graph, name) == peak


@pytest.mark.parametrize("name", ["hong-linear", "hong-cubic"])
def test_long_uniform_chain_needs_far_less_than_the_plain_plan(name):
    graph = Graph.chain([1000] * 400)
    plan = get_solver(name)(graph, None)
    plan.validate(graph)
    assert plan.count("recompute") >= 10
    assert plan.predicted_peak_bytes < 0.25 * plain_plan(graph).predicted_peak_bytes


@pytest.mark.parametrize("name", ["hong-linear", "hong-cubic"])
def test_one_vertex_and_empty_graphs(name):
    single = Graph.chain([7])
    plan = get_solver(name)(single, None)
    assert [(s.nodes, s.action) for s in plan.stages] == [(["v0"], "keep")]
    empty = get_solver(name)(Graph([], []), 100)
    assert empty.stages == [] and empty.feasible


def test_unknown_options_are_refused():
    with pytest.raises(ValueError, match="takes no options"):
        solve_hong_linear(Graph.chain([1, 2]), None, segments=3)


# ---- the graph solvers hold the paper's objective on the graph's own chain -------------------


def _graph_checkpoints(plan, n):
    return sorted(int(v[1:]) for v in plan.stored)


def test_the_papers_example_of_a_one_unit_gap_is_closed():
    # d = the chain's vertex sizes, d_0 and d_n checkpoints (Algorithm 5: M(n) = d_n).
    sizes = [4, 9, 5, 4, 8, 4, 7]
    plan = solve_hong_linear(Graph.chain(sizes), None)
    chosen = _graph_checkpoints(plan, len(sizes) - 1)
    assert dynamic_objective(sizes, chosen) == brute_force(sizes, dynamic_objective) == 31


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=2, max_size=9))
def test_graph_solvers_are_optimal_for_their_equation_on_random_chains(sizes):
    n = len(sizes) - 1
    linear = solve_hong_linear(Graph.chain(sizes), None)
    chosen = _graph_checkpoints(linear, n)
    assert chosen[0] == 0 and chosen[-1] == n
    assert dynamic_objective(sizes, chosen) == brute_force(sizes, dynamic_objective)
    cubic = solve_hong_cubic(Graph.chain(sizes), None)
    chosen = _graph_checkpoints(cubic, n)
    assert classic_objective(sizes, chosen) == brute_force(sizes, classic_objective)
