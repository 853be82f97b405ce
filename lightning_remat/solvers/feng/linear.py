"""Feng and Huang's Algorithm 1, the LCG solver: eq. 1's optimum on a linear computation graph
(Feng & Huang, "Optimal Gradient Checkpoint Search for Arbitrary Computation Graphs",
CVPR 2021; docs/design.md section 4.2).

For each candidate max term C the accessibility graph has an edge v_i -> v_j when
l(v_i, v_j) <= C; the shortest path from source to target is the cheapest stored set under
C. When the solution under C has actual max term B < C, every max term in [B, C) gives the
same solution, so the next C tried is the largest candidate below B. The accessibility
graph of a chain is a DAG whose in-edges of v_j come from a contiguous range of
predecessors, so each shortest path is a sliding-window minimum, O(N).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

__all__ = ["accessibility_shortest_path", "chain_max_term", "prefix_sums", "solve_linear"]


def prefix_sums(values: Sequence[int]) -> list[int]:
    out = [0] * (len(values) + 1)
    for k, v in enumerate(values):
        out[k + 1] = out[k] + v
    return out


def accessibility_shortest_path(
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
    vprefix, gprefix = prefixes if prefixes is not None else (prefix_sums(vertex_costs), prefix_sums(gap_costs))
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


def chain_max_term(vertex_costs: Sequence[int], path: Sequence[int]) -> int:
    """Largest re-forward cost l(v_r, v_m) between consecutive stored vertices of a chain."""
    return max(
        (sum(vertex_costs[r + 1:m]) for r, m in zip(path, path[1:])), default=0
    )


def solve_linear(costs: Sequence[int], pin_ends: bool = False) -> tuple[int, list[int]]:
    """Algorithm 1 on a linear graph with vertex costs ``costs``: the minimum of eq. 1 and
    the indices of the stored vertices (checkpoints).

    By default the chain sits between a virtual source and target of cost 0 (the package
    docstring), so any subset of the vertices may be stored. With ``pin_ends`` the first
    and last vertex are the paper's source and target, always stored and charged."""
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
        found = accessibility_shortest_path(chain, gaps, limit)
        assert found is not None  # gaps are 0: the path through every vertex always exists
        stored_cost, path = found
        max_term = chain_max_term(chain, path)
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
