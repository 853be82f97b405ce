"""The division tree of Feng & Huang (Definitions 3-9, Algorithms 2-4; docs/design.md
section 4.2): each closed set is type 1 (splitting vertices: divided into the linear run of
its pieces), type 2 (branches: divided into its branches) or type 3 (divided into its
maximal split).

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

import contextlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from lightning_remat.graph.ir import Graph

__all__ = ["AugmentedDag", "DivisionNode", "TreeBuilder", "deep_recursion", "division_tree"]


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
def deep_recursion(vertices: int):
    """The division tree nests as deep as the graph's closed sets do (a few frames per
    level); allow that for the duration of a solve."""
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(max(previous, 8 * vertices + 1000))
    try:
        yield
    finally:
        sys.setrecursionlimit(previous)


class AugmentedDag:
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


class TreeBuilder:
    def __init__(self, dag: AugmentedDag) -> None:
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
    dag = AugmentedDag(graph)
    with deep_recursion(len(graph)):
        return TreeBuilder(dag).build(
            dag.source, dag.target, list(range(1, len(graph) + 1)), len(graph) == 0
        )
