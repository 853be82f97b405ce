"""Feng and Huang, re-forwarding: memory-optimal gradient checkpoints. "The paper": Feng &
Huang, "Cutting Down Training Memory by Re-forwarding" (2018); "the supplement": the
supplementary material of Feng & Huang, "Optimal Gradient Checkpoint Search for Arbitrary
Computation Graphs" (CVPR 2021). See docs/design.md section 4.2.

Length: the paper's algorithms build on each other (the linear solver of Algorithm 1 is run
on every segment the division tree of Algorithms 2-4 yields, and Algorithm 5 combines them),
so they are kept in one module, one function per algorithm.

Objective (paper eq. 1): a set of stored vertices V_R is kept from the first forward; the
vertices between stored ones are re-forwarded segment by segment during the backward. The
memory cost is

    sum_{v in V_R} l(v)  +  max_segments l(segment),

where l(v) is the vertex's ``mem`` and a segment's cost is the sum of the costs of its
non-stored vertices. The paper's graphs have one source ``s`` and one target ``t`` that are
always stored and counted in eq. 1. On a linear graph :func:`solve_feng` solves exactly that
form (Algorithm 1 with ``pin_ends``): s and t are the chain's first and last vertex. A DAG
may have several sources and sinks, and its inputs and parameters lie outside the graph
(resident, not counted), so on other graphs this module adds a virtual source (the step's
inputs, cost 0) before the vertices without predecessors and a virtual target (the loss,
cost 0) after the vertices without successors; every real vertex may then be stored or
not. ``solve_linear(costs)`` solves a chain in that form too.

Arbitrary graphs (paper section 4): with V_R fixed, a segment is a connected set of
non-stored vertices; the paper's optimality claim assumes (section 4.1, assumption 1) that
every segment of the solution has exactly one source and one target endpoint, i.e. is a
closed set (Definition 1) between two stored vertices. ``two_endpoint_segments`` tests that
condition; ``objective`` evaluates eq. 1 for any stored set (segments = connected components
of the non-stored vertices).

Algorithms:

- Algorithm 1 (LCG solver): for each candidate max term C the accessibility graph has an
  edge v_i -> v_j when l(v_i, v_j) <= C; the shortest path from source to target is the
  cheapest stored set under C. When the solution under C has actual max term B < C, every
  max term in [B, C) gives the same solution, so the next C tried is the largest candidate
  below B. The accessibility graph of a chain is a DAG whose in-edges of v_j come from a
  contiguous range of predecessors, so each shortest path is a sliding-window minimum, O(N).
- Division tree (Definitions 3-9, Algorithms 2-4): each closed set is type 1 (splitting
  vertices: divided into the linear run of its pieces), type 2 (branches: divided into its
  branches) or type 3 (divided into its maximal split).
- Algorithm 5 (ACG solver) in the supplement's faster form (its Algorithms 5-6): the
  division tree is built once; for each max term C a recursion never expands a closed set
  whose cost is within C, stores the endpoints of the pieces it must expand, and runs the
  LCG solver under the constraint C on the linear runs of type-1 sets. The same max-term
  skipping as Algorithm 1 applies, and each tree node caches its solution for the range of
  C over which it stays optimal.

How the three divisions are computed here (the paper's text leaves room; see the notes on
each function): splitting vertices are the vertices no edge jumps over in a topological
order of the closed set (Algorithm 2's condition); branches are the connected components of
the interior plus the direct edge (Algorithm 3); the maximal split's members are, for each
vertex, the largest proper closed set around it, found among the pairs (dominator,
post-dominator) of that vertex, a closed set between p and q being a union of connected
components of the graph without p and q that p dominates and q post-dominates. Algorithm 4
as printed forms the set of *all* vertices between p and q and drops the pair when one of
them has an outside edge; that misses closed sets made of some of those vertices (a branch
next to a leaking one), so the component form is used.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import sys
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.simulate import make_plan

__all__ = [
    "DivisionNode", "FengSolution", "Segment", "division_tree", "objective", "segments", "solve_arbitrary",
    "solve_feng", "solve_linear", "two_endpoint_segments",
]


# ---- Algorithm 1: linear computation graphs ----------------------------------------------


def _prefix(values: Sequence[int]) -> list[int]:
    out = [0] * (len(values) + 1)
    for k, v in enumerate(values):
        out[k + 1] = out[k] + v
    return out


def _accessibility_shortest_path(
    vertex_costs: Sequence[int],
    gap_costs: Sequence[int],
    limit: int,
    first: int = 0,
    last: int | None = None,
    prefixes: tuple[list[int], list[int]] | None = None,
) -> tuple[int, list[int]] | None:
    """Shortest path from vertex ``first`` to vertex ``last`` of a chain in its accessibility
    graph under max term ``limit`` (Algorithm 1, lines 3-4). Both ends are stored and not
    charged.

    ``gap_costs[k]`` is extra cost between vertex k and k+1 (the interior of a closed set the
    chain leaps over; 0 for a plain chain). Accessibility edge r -> m iff
    l(v_r, v_m) = sum(vertex_costs[r+1:m]) + sum(gap_costs[r:m]) <= limit. Returns (cost of
    the stored vertices between the ends, the path's vertex indices) or None when no path
    exists. The graph is a DAG whose edges into m come from a contiguous range [lo, m-1]
    (l grows as r falls), so the shortest path is a sliding-window minimum, O(last - first).
    ``prefixes`` are the prefix sums of both cost lists, when the caller keeps them."""
    if last is None:
        last = len(vertex_costs) - 1
    if last == first:
        return 0, [first]
    vprefix, gprefix = prefixes if prefixes is not None else (_prefix(vertex_costs), _prefix(gap_costs))
    size = last - first + 1
    dist = [0] * size  # local index: vertex - first
    parent = [0] * size
    window: deque[int] = deque()
    lo = first
    for m in range(first + 1, last + 1):
        prev = m - first - 1
        while window and dist[window[-1]] >= dist[prev]:
            window.pop()
        window.append(prev)
        reach = vprefix[m] + gprefix[m] - limit
        while lo < m and vprefix[lo + 1] + gprefix[lo] < reach:
            lo += 1
        if lo == m:
            return None
        low = lo - first
        while window[0] < low:
            window.popleft()
        best = window[0]
        dist[m - first] = dist[best] + (vertex_costs[m] if m != last else 0)
        parent[m - first] = best
    path = [last - first]
    while path[-1] != 0:
        path.append(parent[path[-1]])
    path = [first + j for j in reversed(path)]
    return dist[last - first], path


def _chain_max_term(vertex_costs: Sequence[int], path: Sequence[int]) -> int:
    """Largest re-forward cost l(v_r, v_m) between consecutive stored vertices of a chain."""
    return max(
        (sum(vertex_costs[r + 1:m]) for r, m in zip(path, path[1:])), default=0
    )


def solve_linear(costs: Sequence[int], pin_ends: bool = False) -> tuple[int, list[int]]:
    """Algorithm 1 on a linear graph with vertex costs ``costs``: the minimum of eq. 1 and
    the indices of the stored vertices (checkpoints).

    By default the chain sits between a virtual source and target of cost 0 (module
    docstring), so any subset of the vertices may be stored. With ``pin_ends`` the first and
    last vertex are the paper's source and target, always stored and charged."""
    costs = [int(c) for c in costs]
    if any(c < 0 for c in costs):
        raise ValueError(f"vertex costs must be non-negative, got {costs}")
    n = len(costs)
    if n == 0:
        return 0, []
    if pin_ends:
        if n == 1:
            return costs[0], [0]
        chain, base, offset = costs, costs[0] + costs[-1], 0
    else:
        chain, base, offset = [0, *costs, 0], 0, -1
    gaps = [0] * (len(chain) - 1)
    # Line 1-2: every vertex pair's l(v_i, v_j) is a candidate max term.
    prefix = [0]
    for c in chain:
        prefix.append(prefix[-1] + c)
    candidates = sorted({prefix[j] - prefix[i + 1] for i in range(len(chain)) for j in range(i + 1, len(chain))})
    best: tuple[int, list[int]] | None = None
    limit = candidates[-1]
    while True:
        found = _accessibility_shortest_path(chain, gaps, limit)
        assert found is not None  # gaps are 0: the path through every vertex always exists
        stored_cost, path = found
        max_term = _chain_max_term(chain, path)
        total = base + stored_cost + max_term
        if best is None or total < best[0]:
            best = (total, path)
        # Line 7: max terms in [B, C) give this same solution; jump below B.
        below = bisect.bisect_left(candidates, max_term) - 1
        if below < 0:
            break
        limit = candidates[below]
    total, path = best
    if pin_ends:
        return total, list(path)
    return total, [k + offset for k in path[1:-1]]


# ---- the paper's objective on any graph ----------------------------------------------------

_SOURCE = "<inputs>"
_TARGET = "<loss>"


@dataclass
class Segment:
    """A connected set of non-stored vertices and the stored vertices around it."""

    nodes: list[str]
    cost: int
    sources: set[str]
    """Stored vertices with an edge into the segment (``<inputs>`` for the step's inputs)."""
    targets: set[str]
    """Stored vertices the segment has an edge into (``<loss>`` for the loss)."""


def segments(graph: Graph, stored: Iterable[str]) -> list[Segment]:
    """The re-forward segments of a stored set: connected components (through edges in
    either direction) of the vertices not stored, in topological order of their first
    vertex."""
    stored_set = set(stored)
    unknown = stored_set - set(graph.ids)
    if unknown:
        raise ValueError(f"stored names vertices not in the graph: {sorted(unknown)[:8]}")
    seen: set[str] = set()
    found: list[Segment] = []
    for start in graph.ids:
        if start in stored_set or start in seen:
            continue
        seen.add(start)
        members = [start]
        sources: set[str] = set()
        targets: set[str] = set()
        stack = [start]
        while stack:
            v = stack.pop()
            preds = graph.predecessors(v)
            succs = graph.successors(v)
            if not preds:
                sources.add(_SOURCE)
            if not succs:
                targets.add(_TARGET)
            for u in preds:
                if u in stored_set:
                    sources.add(u)
                elif u not in seen:
                    seen.add(u)
                    members.append(u)
                    stack.append(u)
            for w in succs:
                if w in stored_set:
                    targets.add(w)
                elif w not in seen:
                    seen.add(w)
                    members.append(w)
                    stack.append(w)
        members.sort(key=graph.position)
        found.append(Segment(members, int(graph.total("mem", members)), sources, targets))
    found.sort(key=lambda s: graph.position(s.nodes[0]))
    return found


def objective(graph: Graph, stored: Iterable[str]) -> int:
    """Eq. 1 for a stored set: the stored vertices' ``mem`` plus the largest segment cost."""
    stored_set = set(stored)
    largest = max((s.cost for s in segments(graph, stored_set)), default=0)
    return int(graph.total("mem", stored_set)) + largest


def two_endpoint_segments(graph: Graph, stored: Iterable[str]) -> bool:
    """Whether every segment has one source and one target (the paper's assumption 1,
    section 4.1: the segments are closed sets between two stored vertices)."""
    return all(len(s.sources) == 1 and len(s.targets) == 1 for s in segments(graph, stored))


# ---- division tree (Definitions 1-9, Algorithms 2-4) -------------------------------------


@dataclass(eq=False)
class DivisionNode:
    """A closed set s_pq of the division tree: its endpoints, its interior vertices (indices
    into the augmented graph: 0 is the virtual source, n+1 the virtual target, k the k-th
    vertex in topological order) and its division."""

    entry: int
    exit: int
    interior: list[int]
    direct: bool
    """Whether the set holds the edge entry -> exit (Definition 1, property 2)."""
    kind: str = "leaf"
    """``leaf`` (no interior vertex), ``splittable`` (type 1), ``branched`` (type 2) or
    ``nonbranched`` (type 3)."""
    cost: int = 0
    """l(s_pq): the sum of the interior's costs."""
    spread: int = 0
    """The largest segment the set forms when left unexpanded between its stored endpoints
    (its cost, or its largest branch's for type 2)."""
    children: list[DivisionNode] = field(default_factory=list)
    """The division's members. Types 2 and 3 leave out the members that are bare edges (they
    cost nothing and are never expanded); type 1 keeps every piece, bare edges as leaves,
    so that piece k lies between ``splitting[k]`` and ``splitting[k + 1]``."""
    splitting: list[int] = field(default_factory=list)
    """Type 1: entry, the splitting vertices in order, exit; child k lies between the k-th
    and (k+1)-th of these."""
    connecting: list[int] = field(default_factory=list)
    """Type 3: interior vertices that are endpoints of the maximal split's members."""

    def walk(self) -> Iterable[DivisionNode]:
        """This node and every node below it, depth first."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))


@contextlib.contextmanager
def _deep_recursion(vertices: int):
    """The division tree nests as deep as the graph's closed sets do (a few frames per
    level); allow that for the duration of a solve."""
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(max(previous, 8 * vertices + 1000))
    try:
        yield
    finally:
        sys.setrecursionlimit(previous)


class _AugmentedDag:
    """The graph with a virtual source and target, vertices as integers in topological
    order."""

    def __init__(self, graph: Graph) -> None:
        self.ids = graph.ids
        n = len(self.ids)
        self.source, self.target = 0, n + 1
        self.cost = [0] + [int(graph[i].mem) for i in self.ids] + [0]
        self.succ: list[list[int]] = [[] for _ in range(n + 2)]
        self.pred: list[list[int]] = [[] for _ in range(n + 2)]
        for u, v in graph.edges:
            self._add(graph.position(u) + 1, graph.position(v) + 1)
        for k in range(1, n + 1):
            if not self.pred[k]:
                self._add(0, k)
            if not self.succ[k]:
                self._add(k, n + 1)
        if n == 0:
            self._add(0, 1)
        self.succ_set = [set(s) for s in self.succ]

    def _add(self, u: int, v: int) -> None:
        self.succ[u].append(v)
        self.pred[v].append(u)


class _TreeBuilder:
    def __init__(self, dag: _AugmentedDag) -> None:
        self.dag = dag

    def build(self, entry: int, exit_: int, interior: list[int], direct: bool) -> DivisionNode:
        dag = self.dag
        node = DivisionNode(entry, exit_, interior, direct,
                            cost=sum(dag.cost[v] for v in interior))
        if not interior:
            return node
        inside = set(interior)
        components = self._components(interior, inside)
        if direct or len(components) > 1:
            # Type 2 (Definition 5, Algorithm 3): the edge entry->exit or a second component
            # makes a branch; the division is the branches.
            node.kind = "branched"
            node.children = [self.build(entry, exit_, comp, False) for comp in components]
            node.spread = max(child.spread for child in node.children)
            return node
        node.spread = node.cost
        order = [entry, *interior, exit_]
        local = {v: k for k, v in enumerate(order)}
        split_positions = self._splitting_positions(order, local)
        if len(split_positions) > 2:
            # Type 1 (Definition 4): divided into the linear run of pieces between splitting
            # vertices (Definition 8).
            node.kind = "splittable"
            node.splitting = [order[k] for k in split_positions]
            for a, b in zip(split_positions, split_positions[1:]):
                node.children.append(self.build(
                    order[a], order[b], order[a + 1:b], order[b] in dag.succ_set[order[a]]
                ))
            return node
        node.kind = "nonbranched"
        self._maximal_split(node, order, local)
        return node

    def _components(self, interior: list[int], inside: set[int]) -> list[list[int]]:
        """Connected components of the interior (Algorithm 3's growing step), each sorted."""
        dag = self.dag
        seen: set[int] = set()
        components = []
        for start in interior:
            if start in seen:
                continue
            seen.add(start)
            comp = [start]
            stack = [start]
            while stack:
                v = stack.pop()
                for w in dag.succ[v] + dag.pred[v]:
                    if w in inside and w not in seen:
                        seen.add(w)
                        comp.append(w)
                        stack.append(w)
            comp.sort()
            components.append(comp)
        return components

    def _splitting_positions(self, order: list[int], local: dict[int, int]) -> list[int]:
        """Local positions of entry, the splitting vertices and exit (Algorithm 2 for every
        vertex at once). Every vertex of a closed set lies on an entry->exit path, so v is a
        splitting vertex (all paths pass through it; its ancestors and descendants cover the
        set with no edge between them) iff no edge jumps over it in topological order."""
        succ = self.dag.succ
        positions = [0]
        reach = 0
        last = len(order) - 1
        for k, v in enumerate(order[:-1]):
            if 0 < k and reach == k:
                positions.append(k)
            for w in succ[v]:
                pw = local.get(w)
                if k == 0 and pw == last:
                    continue  # the edge entry->exit is not in a set without branches
                if pw is not None and pw > reach:
                    reach = pw
        positions.append(last)
        return positions

    def _dominators(self, order: list[int], local: dict[int, int], forward: bool) -> list[int]:
        """Immediate (post-)dominators inside a closed set, as local positions, computed in
        (reverse) topological order: idom(v) = the common dominator of v's predecessors."""
        dag = self.dag
        n = len(order)
        idom = [0] * n
        depth = [0] * n
        sequence = range(1, n) if forward else range(n - 2, -1, -1)
        if not forward:
            idom[n - 1] = n - 1
        for k in sequence:
            v = order[k]
            around = dag.pred[v] if forward else dag.succ[v]
            common = -1
            for u in around:
                pu = local.get(u)
                if pu is None or (forward and pu >= k) or (not forward and pu <= k):
                    continue
                if (forward and k == n - 1 and pu == 0) or (not forward and k == 0 and pu == n - 1):
                    # The direct edge entry->exit belongs to the set only when `direct`;
                    # type 3 sets never have it.
                    continue
                if common < 0:
                    common = pu
                    continue
                a, b = common, pu
                while a != b:
                    if depth[a] < depth[b]:
                        a, b = b, a
                    a = idom[a]
                common = a
            idom[k] = common
            depth[k] = depth[common] + 1
        return idom

    @staticmethod
    def _intervals(parent: list[int], root: int) -> tuple[list[int], list[int]]:
        n = len(parent)
        children: list[list[int]] = [[] for _ in range(n)]
        for k in range(n):
            if k != root:
                children[parent[k]].append(k)
        tin, tout = [0] * n, [0] * n
        clock = 0
        stack = [(root, False)]
        while stack:
            k, done = stack.pop()
            if done:
                tout[k] = clock
                continue
            tin[k] = clock
            clock += 1
            stack.append((k, True))
            stack.extend((c, False) for c in children[k])
        return tin, tout

    def _maximal_split(self, node: DivisionNode, order: list[int], local: dict[int, int]) -> None:
        """Type 3 (Definitions 6-7, Algorithm 4): the members of the maximal split are the
        maximal proper closed subsets (Lemma 6). A closed set around v between p and q has p
        dominating and q post-dominating all of it; between p and q, the closed sets are the
        unions of the connected components of the set without p and q that stay among the
        vertices p dominates and q post-dominates."""
        dag = self.dag
        n = len(order)
        last = n - 1
        idom = self._dominators(order, local, forward=True)
        ipdom = self._dominators(order, local, forward=False)
        dtin, dtout = self._intervals(idom, 0)
        ptin, ptout = self._intervals(ipdom, last)

        def inside_region(k: int, p: int, q: int) -> bool:
            """k strictly dominated by p and strictly post-dominated by q."""
            return (k != p and dtin[p] <= dtin[k] < dtout[p]
                    and k != q and ptin[q] <= ptin[k] < ptout[q])

        def grow(start: int, p: int, q: int) -> list[int] | None:
            """The component of `start` in the set without p, q, or None if it leaves the
            region of (p, q) (then it is not a closed set)."""
            comp = [start]
            seen = {start}
            stack = [start]
            while stack:
                v = order[stack.pop()]
                for w in dag.succ[v] + dag.pred[v]:
                    kw = local.get(w)
                    if kw is None or kw == p or kw == q or kw in seen:
                        continue
                    if not inside_region(kw, p, q):
                        return None
                    seen.add(kw)
                    comp.append(kw)
                    stack.append(kw)
            return comp

        assigned = [False] * n
        members: list[DivisionNode] = []
        for k in range(1, last):
            if assigned[k]:
                continue
            best: tuple[int, int, int] | None = None
            p = idom[k]
            while True:
                q = ipdom[k]
                while True:
                    if not (p == 0 and q == last):
                        comp = grow(k, p, q)
                        if comp is not None and (best is None or len(comp) > best[2]):
                            best = (p, q, len(comp))
                    if q == last:
                        break
                    q = ipdom[q]
                if p == 0:
                    break
                p = idom[p]
            if best is None:
                continue  # a connecting vertex
            p, q, _ = best
            # The largest closed set s_pq: every good component between p and q.
            region = [j for j in range(1, last) if inside_region(j, p, q)]
            taken: set[int] = set()
            member: list[int] = []
            for j in region:
                if j in taken:
                    continue
                comp = grow(j, p, q)
                if comp is None:
                    continue
                taken.update(comp)
                member.extend(comp)
            for j in member:
                assigned[j] = True
            member.sort()
            members.append(self.build(
                order[p], order[q], [order[j] for j in member], order[q] in dag.succ_set[order[p]]
            ))
        node.children = members
        node.connecting = [order[k] for k in range(1, last) if not assigned[k]]


def division_tree(graph: Graph) -> DivisionNode:
    """The division tree (Definition 9) of the graph with its virtual source and target: the
    root is the whole graph, a closed set between the source (0) and the target (n+1)."""
    dag = _AugmentedDag(graph)
    with _deep_recursion(len(graph)):
        return _TreeBuilder(dag).build(
            dag.source, dag.target, list(range(1, len(graph) + 1)), len(graph) == 0
        )


# ---- Algorithm 5 (the supplement's recursion under a max term) ---------------------------


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
            prepared = (node_costs, piece_costs, _prefix(node_costs), _prefix(piece_costs))
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
            found = _accessibility_shortest_path(
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


def _solve_tree(graph: Graph, every_term: bool) -> tuple[FengSolution, DivisionNode]:
    with _deep_recursion(len(graph)):
        return _solve_tree_inner(graph, every_term)


def _solve_tree_inner(graph: Graph, every_term: bool) -> tuple[FengSolution, DivisionNode]:
    dag = _AugmentedDag(graph)
    root = _TreeBuilder(dag).build(
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
    solution, _ = _solve_tree(graph, every_term)
    return solution.objective, solution.stored


# ---- the plan -----------------------------------------------------------------------------


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
    ready = [(first[g], g) for g in range(count) if indegree[g] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, g = heapq.heappop(ready)
        order.append(g)
        for h in after[g]:
            indegree[h] -= 1
            if indegree[h] == 0:
                heapq.heappush(ready, (first[h], h))
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
                                _chain_max_term(costs, indices), 0)
        structure = "linear computation graph (Algorithm 1): s and t are its first and last vertex"
    else:
        solution, root = _solve_tree(graph, bool(options.get("every_term", False)))
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
