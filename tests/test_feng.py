"""Feng and Huang re-forwarding solver: Algorithm 1 and the ACG solver against brute force
over stored sets, the division tree against Definitions 1-8, and the plan it yields."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.graphs import densenet_like_graph
from lightning_remat.graph.ir import Graph, Node
from lightning_remat.solvers import get_solver, min_budget
from lightning_remat.solvers.feng import (
    division_tree,
    objective,
    segments,
    solve_arbitrary,
    solve_feng,
    solve_linear,
    two_endpoint_segments,
)
from lightning_remat.solvers.scoring import plain_plan

# ---- graphs -------------------------------------------------------------------------------


def make_graph(costs: list[int], edges: list[tuple[int, int]]) -> Graph:
    nodes = [Node(f"v{i}", "op", mem=c, saved=c, t_fwd=1.0, t_bwd=2.0) for i, c in enumerate(costs)]
    return Graph(nodes, [(f"v{a}", f"v{b}") for a, b in edges])


@st.composite
def small_dags(draw, max_vertices: int = 7) -> Graph:
    n = draw(st.integers(1, max_vertices))
    costs = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    chosen = draw(st.lists(st.booleans(), min_size=len(pairs), max_size=len(pairs)))
    return make_graph(costs, [p for p, keep in zip(pairs, chosen) if keep])


# ---- oracles ------------------------------------------------------------------------------


def chain_objective(costs: list[int], stored: tuple[int, ...], pin_ends: bool) -> int:
    """Eq. 1 on a chain, written out: stored costs + largest sum between consecutive stored
    vertices (the chain ends count as stored, at cost 0 unless pinned)."""
    cuts = sorted(stored) if pin_ends else [-1, *sorted(stored), len(costs)]
    largest = max((sum(costs[a + 1:b]) for a, b in zip(cuts, cuts[1:])), default=0)
    return sum(costs[i] for i in stored) + largest


def brute_force_chain(costs: list[int], pin_ends: bool) -> int:
    n = len(costs)
    subsets = (
        s for r in range(n + 1) for s in itertools.combinations(range(n), r)
        if not pin_ends or (0 in s and n - 1 in s)
    )
    return min(chain_objective(costs, s, pin_ends) for s in subsets)


def _find(parent: dict[str, str], v: str) -> str:
    while parent[v] != v:
        v = parent[v]
    return v


def brute_force_dag(graph: Graph, two_endpoints_only: bool = True) -> int:
    """Eq. 1 minimised over every stored set (whose segments have two endpoints: the
    paper's assumption 1), with segment costs computed independently of the solver."""
    ids = graph.ids
    best = None
    for r in range(len(ids) + 1):
        for stored in itertools.combinations(ids, r):
            stored_set = set(stored)
            # segments: components of the non-stored vertices, by union-find over edges
            parent = {v: v for v in ids if v not in stored_set}

            for u, v in graph.edges:
                if u in parent and v in parent:
                    parent[_find(parent, u)] = _find(parent, v)
            groups: dict[str, list[str]] = {}
            for v in parent:
                groups.setdefault(_find(parent, v), []).append(v)
            if two_endpoints_only:
                ok = True
                for members in groups.values():
                    member_set = set(members)
                    sources = {u if u in stored_set else "in" for v in members
                               for u in (graph.predecessors(v) or ["in"]) if u not in member_set}
                    targets = {w if w in stored_set else "out" for v in members
                               for w in (graph.successors(v) or ["out"]) if w not in member_set}
                    if len(sources) != 1 or len(targets) != 1:
                        ok = False
                        break
                if not ok:
                    continue
            value = sum(graph[v].mem for v in stored) + max(
                (sum(graph[v].mem for v in g) for g in groups.values()), default=0
            )
            best = value if best is None else min(best, value)
    assert best is not None
    return best


# ---- Algorithm 1 --------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=10), st.booleans())
def test_linear_solver_matches_brute_force(costs, pin_ends):
    value, checkpoints = solve_linear(costs, pin_ends=pin_ends)
    assert value == brute_force_chain(costs, pin_ends)
    assert value == chain_objective(costs, tuple(checkpoints), pin_ends)
    if pin_ends:
        assert checkpoints[0] == 0 and checkpoints[-1] == len(costs) - 1


def test_linear_solver_on_identical_costs_matches_the_closed_form():
    # Paper section 3, case 1: with k checkpoints evenly spread over N unit-cost vertices the
    # cost is k + ceil((N - k) / (k + 1)); the best k is near sqrt(N).
    n = 100
    value, checkpoints = solve_linear([1] * n)
    assert value == min(k + -(-(n - k) // (k + 1)) for k in range(n + 1))
    k = len(checkpoints)
    assert k + -(-(n - k) // (k + 1)) == value
    assert chain_objective([1] * n, tuple(checkpoints), pin_ends=False) == value


def test_linear_solver_edge_cases():
    assert solve_linear([]) == (0, [])
    assert solve_linear([7])[0] == 7
    assert solve_linear([7], pin_ends=True) == (7, [0])
    with pytest.raises(ValueError, match="non-negative"):
        solve_linear([3, -1])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=10))
def test_acg_solver_on_a_chain_equals_the_linear_solver(costs):
    assert solve_arbitrary(Graph.chain(costs))[0] == solve_linear(costs)[0]


# ---- the ACG solver -----------------------------------------------------------------------


@settings(max_examples=250, deadline=None)
@given(small_dags(), st.booleans())
def test_acg_solver_matches_brute_force_under_the_two_endpoint_assumption(graph, every_term):
    # The paper claims optimality under its assumption 1 (section 4.1): every segment of the
    # solution has one source and one target. The oracle minimises over exactly those sets.
    value, stored = solve_arbitrary(graph, every_term=every_term)
    assert value == brute_force_dag(graph)
    assert value == objective(graph, stored)
    assert two_endpoint_segments(graph, stored)


def test_optimality_is_only_claimed_under_the_two_endpoint_assumption():
    # v0 -> v2 -> v3 <- v1. Storing v2 alone leaves the segment {v1, v3} fed by the inputs
    # and by v2 (two sources): eq. 1 gives 1 + 2 = 3, below every two-endpoint stored set.
    graph = make_graph([2, 1, 1, 1], [(0, 2), (2, 3), (1, 3)])
    assert objective(graph, ["v2"]) == 3
    assert not two_endpoint_segments(graph, ["v2"])
    value, _ = solve_arbitrary(graph)
    assert value == brute_force_dag(graph) == 4
    assert brute_force_dag(graph, two_endpoints_only=False) == 3


def test_ties_give_the_same_optimal_value_and_a_deterministic_plan():
    # Two identical branches and equal costs: many stored sets tie.
    graph = make_graph([4, 4, 4, 4, 4, 4], [(0, 1), (1, 2), (0, 3), (3, 4), (2, 5), (4, 5)])
    first = solve_arbitrary(graph)
    assert first == solve_arbitrary(graph)
    assert first[0] == brute_force_dag(graph)
    assert solve_feng(graph).to_dict() == solve_feng(graph).to_dict()


def test_one_vertex_graph():
    graph = Graph.chain([5])
    assert solve_arbitrary(graph)[0] == 5
    plan = solve_feng(graph, budget_bytes=None)
    plan.validate(graph)
    assert [s.action for s in plan.stages] == ["keep"]
    assert plan.feasible


def test_bad_input_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="no vertices"):
        solve_feng(Graph([], []))
    with pytest.raises(ValueError, match="unknown options"):
        solve_feng(Graph.chain([1, 2]), None, budget_fraction=0.5)


# ---- the division tree --------------------------------------------------------------------


class Augmented:
    """The graph with the virtual source "S" and target "T", for checking definitions."""

    def __init__(self, graph: Graph) -> None:
        self.names = ["S", *graph.ids, "T"]
        self.succ = {v: set(graph.successors(v)) for v in graph.ids}
        self.succ["S"] = {v for v in graph.ids if not graph.predecessors(v)}
        self.succ["T"] = set()
        for v in graph.ids:
            if not graph.successors(v):
                self.succ[v].add("T")
        self.pred = {v: set() for v in self.names}
        for u, ws in self.succ.items():
            for w in ws:
                self.pred[w].add(u)

    def name(self, index: int) -> str:
        return self.names[index]

    def is_closed_set(self, entry: str, exit_: str, interior: set[str]) -> bool:
        """Definition 1: common ancestor entry, common descendant exit, no edge from the
        interior to anything outside it and the two endpoints."""
        allowed = interior | {entry, exit_}
        for v in interior:
            if not (self.pred[v] <= allowed and self.succ[v] <= allowed):
                return False
            if entry in self.succ[v] or exit_ in self.pred[v]:
                return False
        return all(self.reaches(entry, v) and self.reaches(v, exit_) for v in interior)

    def reaches(self, a: str, b: str) -> bool:
        stack, seen = [a], {a}
        while stack:
            v = stack.pop()
            if v == b:
                return True
            for w in self.succ[v] - seen:
                seen.add(w)
                stack.append(w)
        return False

    def is_splitting(self, entry: str, exit_: str, interior: set[str], direct: bool, v: str) -> bool:
        """Definition 3 via Algorithm 2: the vertices before and after v cover the set and
        no edge joins the two sides."""
        members = interior | {entry, exit_}
        before = {u for u in members if u != v and self.reaches(u, v)}
        after = {u for u in members if u != v and self.reaches(v, u)}
        if before | after | {v} != members or before & after:
            return False
        return not any(w in after for u in before for w in self.succ[u]
                       if direct or (u, w) != (entry, exit_))


def all_closed_sets(aug: Augmented) -> list[tuple[str, str, frozenset[str]]]:
    out = []
    for entry, exit_ in itertools.permutations(aug.names, 2):
        rest = [v for v in aug.names if v not in (entry, exit_)]
        for r in range(1, len(rest) + 1):
            for interior in itertools.combinations(rest, r):
                if aug.is_closed_set(entry, exit_, set(interior)):
                    out.append((entry, exit_, frozenset(interior)))
    return out


@settings(max_examples=150, deadline=None)
@given(small_dags(max_vertices=6))
def test_division_tree_follows_definitions(graph):
    aug = Augmented(graph)
    closed = all_closed_sets(aug)
    root = division_tree(graph)
    assert {aug.name(v) for v in root.interior} == set(graph.ids)
    for node in root.walk():
        entry, exit_ = aug.name(node.entry), aug.name(node.exit)
        interior = {aug.name(v) for v in node.interior}
        assert node.cost == sum(graph[v].mem for v in interior)
        if not interior:
            assert node.kind == "leaf"
            continue
        assert aug.is_closed_set(entry, exit_, interior)
        child_parts = [{aug.name(v) for v in c.interior} for c in node.children]
        splitting = [v for v in interior if aug.is_splitting(entry, exit_, interior, node.direct, v)]
        if node.kind == "splittable":  # type 1: pieces between all the splitting vertices
            assert {aug.name(v) for v in node.splitting[1:-1]} == set(splitting) != set()
            assert set().union(*child_parts) | set(splitting) == interior
        else:
            assert not splitting
        if node.kind == "branched":  # type 2: the branches
            assert set().union(*child_parts) == interior
            assert node.direct or len(node.children) > 1
        if node.kind == "nonbranched":  # type 3: the maximal split
            connecting = {aug.name(v) for v in node.connecting}
            assert set().union(*child_parts) | connecting == interior
            assert sum(len(p) for p in child_parts) == len(set().union(*child_parts))
            for part in child_parts:
                # Lemma 6: no proper closed set strictly contains a member.
                assert not any(part < c[2] < interior for c in closed)
            for v in connecting:
                # a connecting vertex is inside no proper closed set
                assert not any(v in c[2] and c[2] < interior for c in closed)


def test_division_of_the_papers_type_3_example():
    # Paper Fig. 4(c): the closed set between 1 and 4 has maximal split
    # {[s12], [s13], [s23], [s24], [s34]}; here each member holds one vertex.
    #      1->a->2, 1->b->3, 2->c->3, 2->d->4, 3->e->4
    names = ["1", "a", "b", "2", "c", "d", "3", "e", "4"]
    edges = [("1", "a"), ("a", "2"), ("1", "b"), ("b", "3"), ("2", "c"), ("c", "3"),
             ("2", "d"), ("d", "4"), ("3", "e"), ("e", "4")]
    graph = Graph([Node(n, "op", mem=1) for n in names], edges)
    root = division_tree(graph)
    assert root.kind == "splittable"
    name = Augmented(graph).name
    (inner,) = [c for c in root.children if c.interior]
    assert inner.kind == "nonbranched"
    assert sorted(name(v) for v in inner.connecting) == ["2", "3"]
    members = {(name(c.entry), name(c.exit), tuple(name(v) for v in c.interior)) for c in inner.children}
    assert members == {("1", "2", ("a",)), ("1", "3", ("b",)), ("2", "3", ("c",)),
                       ("2", "4", ("d",)), ("3", "4", ("e",))}


def test_densenet_like_graph_divides_into_its_dense_blocks():
    graph = densenet_like_graph(blocks=(3, 4))
    root = division_tree(graph)
    assert sum(1 for n in root.walk() if n.kind == "nonbranched") == 2
    value, stored = solve_arbitrary(graph)
    assert value == objective(graph, stored) < graph.total("mem")
    assert two_endpoint_segments(graph, stored)
    # Max-term skipping and caching reach the value of trying every max term.
    assert solve_arbitrary(graph, every_term=True)[0] == value


# ---- the plan -----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(small_dags())
def test_plan_stages_are_the_segments(graph):
    plan = solve_feng(graph, None)
    plan.validate(graph)
    if graph.is_chain():  # the paper's linear form: s and t are the chain's ends
        costs = [n.mem for n in graph.nodes]
        value, indices = solve_linear(costs, pin_ends=True)
        stored = [graph.ids[i] for i in indices]
    else:
        value, stored = solve_arbitrary(graph)
        assert value == objective(graph, stored)
    assert plan.stored == stored
    assert plan.stages[-1].action == "keep"
    stored_set = set(stored)
    by_first = {s.nodes[0]: s for s in segments(graph, stored)}
    for stage in plan.stages:
        free = [v for v in stage.nodes if v not in stored_set]
        if free:
            seg = by_first[free[0]]
            # the stage is one segment, plus the stored vertex it ends at
            assert free == seg.nodes
            assert set(stage.nodes) - set(free) <= seg.targets
        else:
            assert len(stage.nodes) == 1 and stage.action == "keep"
    assert any(f"objective (eq. 1): {value} bytes" in n for n in plan.notes)


def test_plan_on_a_long_chain_cuts_the_peak():
    costs = [1000 + (37 * i) % 500 for i in range(60)]
    graph = Graph.chain(costs)
    plan = solve_feng(graph, None)
    plain = plain_plan(graph)
    assert plan.predicted_peak_bytes < plain.predicted_peak_bytes
    assert plan.count("recompute") >= 2
    # What runs again: each recomputed segment less the stored vertex that closes it (kept
    # from the forward, docs/design.md section 5).
    recomputed = {v for s in plan.stages if s.action == "recompute" for v in s.nodes[:-1]}
    assert plan.predicted_extra_seconds == pytest.approx(graph.total("t_fwd", recomputed))
    # the budget only decides feasibility
    assert solve_feng(graph, plan.predicted_peak_bytes).feasible
    tight = solve_feng(graph, plan.predicted_peak_bytes - 1)
    assert not tight.feasible and tight.stages == plan.stages


def test_registry_and_min_budget():
    graph = Graph.chain([10, 30, 20, 40, 10, 50, 30])
    assert get_solver("feng") is solve_feng
    assert min_budget(graph, "feng") == solve_feng(graph).predicted_peak_bytes


def test_densenet_201_size_plan_is_valid_and_smaller():
    graph = densenet_like_graph()
    assert 650 <= len(graph) <= 750
    plan = solve_feng(graph)
    plan.validate(graph)
    assert plan.predicted_peak_bytes < plain_plan(graph).predicted_peak_bytes


# ---- on a linear graph the paper's s and t are its first and last vertex -------------------


def test_the_papers_example_on_a_chain_stores_an_optimal_set():
    # Eq. 1 with s = v0 and t = v6 stored and counted: {v2, v5} would cost 33; the optimum is 32.
    costs = [3, 4, 8, 8, 4, 1, 9]
    plan = solve_feng(Graph.chain(costs), None)
    stored = tuple(sorted(int(v[1:]) for v in plan.stored))
    assert {0, len(costs) - 1} <= set(stored)
    assert chain_objective(costs, stored, pin_ends=True) == brute_force_chain(costs, True) == 32


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=2, max_size=9))
def test_feng_on_random_chains_is_optimal_for_eq_1(costs):
    plan = solve_feng(Graph.chain(costs), None)
    plan.validate(Graph.chain(costs))
    stored = tuple(sorted(int(v[1:]) for v in plan.stored))
    assert chain_objective(costs, stored, pin_ends=True) == brute_force_chain(costs, True)
