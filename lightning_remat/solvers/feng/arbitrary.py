"""Feng & Huang's Algorithm 5, the ACG solver, in the supplement's faster form (its
Algorithms 5-6; "Supplementary Material of Optimal Gradient Checkpoint Search for Arbitrary
Computation Graphs", CVPR 2021; docs/design.md section 4.2).

The division tree (:mod:`.division`) is built once; for each max term C a recursion never
expands a closed set whose cost is within C, stores the endpoints of the pieces it must
expand, and runs the LCG solver (:mod:`.linear`) under the constraint C on the linear runs
of type-1 sets. The same max-term skipping as Algorithm 1 applies, and each tree node caches
its solution for the range of C over which it stays optimal.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.feng.division import (
    AugmentedDag,
    DivisionNode,
    TreeBuilder,
    deep_recursion,
)
from lightning_remat.solvers.feng.linear import accessibility_shortest_path, prefix_sums

__all__ = ["FengSolution", "solve_arbitrary", "solve_tree"]


class _MaxTermSolver:
    """The cheapest stored set inside a division-tree node whose endpoints are stored, under
    the constraint that every segment costs at most C, and the actual largest segment."""

    def __init__(self, cost: list[int], use_cache: bool) -> None:
        self.cost = cost
        self.use_cache = use_cache
        # node -> (lo, hi, stored cost, max term): the solution found at C = hi has max
        # term lo and stays optimal for every C in [lo, hi] (the skipping argument of
        # Algorithm 1, applied per node).
        self.cache: dict[int, tuple[int, int, int, int]] = {}
        self.chains: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}

    def solve(self, node: DivisionNode, limit: int, out: list[int] | None = None) -> tuple[int, int]:
        if node.kind == "leaf":
            return 0, 0
        if node.kind == "branched":
            # Both endpoints are stored: each branch is independent (Algorithm 5, line 8-9).
            total, largest = 0, 0
            for child in node.children:
                s, m = self.solve(child, limit, out)
                total += s
                largest = max(largest, m)
            return total, largest
        if node.cost <= limit:
            # Never expand a closed set the max term can leap over.
            return 0, node.spread
        if out is None and self.use_cache:
            hit = self.cache.get(id(node))
            if hit is not None and hit[0] <= limit <= hit[1]:
                return hit[2], hit[3]
        if node.kind == "nonbranched":
            # Every segment inside lies within one member (completeness, A.3.3), so all the
            # connecting vertices are stored; members left unexpanded need no change.
            total = sum(self.cost[v] for v in node.connecting)
            largest = 0
            if out is not None:
                out.extend(node.connecting)
            for child in node.children:
                s, m = self.solve(child, limit, out)
                total += s
                largest = max(largest, m)
        else:
            total, largest = self._solve_splittable(node, limit, out)
        if out is None and self.use_cache:
            self.cache[id(node)] = (largest, limit, total, largest)
        return total, largest

    def _solve_splittable(self, node: DivisionNode, limit: int, out: list[int] | None) -> tuple[int, int]:
        """Type 1 (Algorithm 5, lines 4-6): expand the pieces that cost more than C (their
        endpoints must be stored), then solve each linear run between stored vertices with
        the LCG solver under C."""
        cost = self.cost
        chain = node.splitting
        pieces = node.children
        prepared = self.chains.get(id(node))
        if prepared is None:
            node_costs = [cost[v] for v in chain]
            piece_costs = [p.cost for p in pieces]
            prepared = (node_costs, piece_costs, prefix_sums(node_costs), prefix_sums(piece_costs))
            self.chains[id(node)] = prepared
        node_costs, piece_costs, vprefix, gprefix = prepared
        k = len(pieces)
        forced = {0, k}
        total, largest = 0, 0
        for a, piece in enumerate(pieces):
            if piece.cost > limit:
                forced.update((a, a + 1))
                s, m = self.solve(piece, limit, out)
                total += s
                largest = max(largest, m)
        for f in forced:
            if 0 < f < k:
                total += cost[chain[f]]
                if out is not None:
                    out.append(chain[f])
        stops = sorted(forced)
        for x, y in zip(stops, stops[1:]):
            if y == x + 1:
                if pieces[x].cost <= limit:
                    largest = max(largest, pieces[x].spread)
                continue
            found = accessibility_shortest_path(
                node_costs, piece_costs, limit, x, y, (vprefix, gprefix)
            )
            assert found is not None  # every piece in the run is within the limit
            s, path = found
            total += s
            for r, m in zip(path, path[1:]):
                if m == r + 1:
                    seg = pieces[r].spread
                else:
                    seg = (vprefix[m] - vprefix[r + 1]) + (gprefix[m] - gprefix[r])
                largest = max(largest, seg)
            if out is not None:
                out.extend(chain[j] for j in path[1:-1])
        return total, largest


def _max_term_candidates(root: DivisionNode, cost: list[int]) -> list[int]:
    """Algorithm 5, line 1: the costs every segment of a solution can have (a node left
    unexpanded, a branch, or a run of pieces of a type-1 node between two of its splitting
    vertices), ascending."""
    values = {0}
    for node in root.walk():
        values.update((node.cost, node.spread))
        if node.kind == "splittable":
            chain = node.splitting
            for r in range(len(chain) - 1):
                running = 0
                for m in range(r + 1, len(chain)):
                    running += node.children[m - 1].cost
                    values.add(running)
                    running += cost[chain[m]]
    return sorted(values)


@dataclass
class FengSolution:
    objective: int
    stored: list[str]
    max_term: int
    terms_tried: int


def solve_tree(graph: Graph, every_term: bool) -> tuple[FengSolution, DivisionNode]:
    with deep_recursion(len(graph)):
        return _solve_tree_inner(graph, every_term)


def _solve_tree_inner(graph: Graph, every_term: bool) -> tuple[FengSolution, DivisionNode]:
    dag = AugmentedDag(graph)
    root = TreeBuilder(dag).build(
        dag.source, dag.target, list(range(1, len(graph) + 1)), len(graph) == 0
    )
    solver = _MaxTermSolver(dag.cost, use_cache=not every_term)
    best_total, best_max = None, 0
    tried = 0
    if every_term:
        # Algorithm 5 as printed: every candidate max term.
        for limit in reversed(_max_term_candidates(root, dag.cost)):
            s, m = solver.solve(root, limit)
            tried += 1
            if best_total is None or s + m < best_total:
                best_total, best_max = s + m, m
    else:
        # Costs are whole bytes, so "the largest candidate below B" is reached by trying
        # B - 1: no candidate lies strictly between, and the solution is the same.
        limit = root.cost
        while limit >= 0:
            s, m = solver.solve(root, limit)
            tried += 1
            if best_total is None or s + m < best_total:
                best_total, best_max = s + m, m
            limit = m - 1
    # The cheapest stored set under C = the best solution's max term reproduces its total.
    stored: list[int] = []
    s, m = _MaxTermSolver(dag.cost, use_cache=False).solve(root, best_max, stored)
    assert s + m == best_total, (s, m, best_total)
    ids = [dag.ids[v - 1] for v in sorted(set(stored))]
    return FengSolution(int(best_total or 0), ids, m, tried), root


def solve_arbitrary(graph: Graph, every_term: bool = False) -> tuple[int, list[str]]:
    """The ACG solver (Algorithm 5, in the supplement's form): the minimum of eq. 1 over the
    stored sets whose segments have two endpoints, and the stored vertex ids in topological
    order. ``every_term`` tries every candidate max term as the paper's Algorithm 5 does,
    instead of skipping the terms that give the same solution (same result, slower)."""
    solution, _ = solve_tree(graph, every_term)
    return solution.objective, solution.stored
