"""Hong et al., "GPU Memory Usage Optimization for Backward Propagation in Deep Network
Training" (Hong, Tsai, Wang, Liu and Wu; docs/design.md section 4.3).

Two memory-optimal checkpoint selections on a chain of data sizes ``d_0, ..., d_n``
(``d_0`` is the step's input, ``d_n`` the output; both are always checkpoints, section 3.1):

- :func:`checkpoint_selection_cubic`: Algorithm 3, O(n^3). The *checkpoint selection
  problem*: minimise eq. 6, the sum of the checkpoints plus the largest segment (the memory
  model of Algorithm 2, Chen et al.'s).
- :func:`dynamic_checkpoint_selection_linear`: Algorithm 6, O(n). The *dynamic checkpoint
  selection problem*: minimise the peak of eq. 12 over the checkpoints, the memory model of
  Algorithm 4 (PyTorch: a tensor is freed as soon as it is dead, and the output-gradient
  buffer of a segment is as large as its largest tensor, so that tensor counts twice).
- :func:`dynamic_checkpoint_selection_quadratic`: Algorithm 5, O(n^2), the plain form of
  the same recursion (eq. 13), kept as a second reference for the tests.

:func:`classic_objective` and :func:`dynamic_objective` evaluate any checkpoint set straight
from the equations; the tests hold the algorithms to them by brute force.

On a graph, the solvers work on the chain of *articulation vertices* (the vertices every
path from the inputs to the outputs passes through, :func:`articulation_chain`). Each part
between two consecutive articulation vertices is contracted together with the articulation
vertex that closes it into one chain element whose size is that vertex's ``mem``: only
articulation vertices can be checkpoints (a cut there leaves exactly one tensor crossing),
and the paper's model has one tensor per layer. The interior tensors of a block (a residual
branch, say) are therefore not in the objective; the simulator's predicted peak, which the
budget is checked against, does count them.

Choices where the paper is ambiguous (each also said where it is implemented):

1. Algorithm 3 as printed reads the head of the queue before adding ``i`` to it, so eq. 8's
   term ``j = i`` (``d_i`` itself a checkpoint) is never considered and the queue can be
   empty when ``d_i > s``; here ``i`` enters the queue first.
2. Algorithm 3 returns ``min_s (s + M(n, s))``, which lets ``d_n`` sit inside the last
   segment, while section 3.1 makes ``d_n`` a checkpoint; here ``d_n`` is a checkpoint
   (the answer is ``min_s (s + d_n + M(n - 1, s))``), so the result is eq. 6's optimum.
3. Eq. 13 ranges over ``i < j < n`` but Algorithm 5 over ``i < j <= n``; ``j = n`` is
   needed (it is the only choice for ``i = n - 1``), so ``j <= n``.
4. The boundary case, read off Algorithm 5: it sets ``M(n) = d_n`` before the loop, so the
   last layer is a checkpoint and M at the end of the chain is ``d_n`` alone (nothing after
   it to recompute or to hold a gradient for); the loop then runs ``i`` from ``n - 1`` down
   and every ``M(i)`` counts ``d_i``, its own checkpoint. Algorithms 5 and 6 index the layers
   ``d_1..d_n`` and return ``M(1)``; here the chain is indexed ``d_0..d_n`` and the answer is
   ``M(0)``: the first element is a checkpoint and counted, as the paper's first layer is.
   On a graph (:func:`_solve_on_graph`) that chain is the graph's articulation vertices, so
   the first and the last of them are always checkpoints, and eq. 12 is evaluated on their
   ``mem`` exactly as written.
5. Algorithm 6 claims O(1) updates of ``max_{i<=k<j} d_k`` while ``j`` moves down, which
   a running maximum cannot do (a maximum cannot be "un-extended"). Here the range maximum
   comes from a union-find over the prefix maxima of ``d_i, d_{i+1}, ...`` (the classic
   offline range-maximum method: the left end only moves left), with path compression, so
   the whole algorithm is O(n) up to the union-find's near-constant factor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.scoring import make_plan

__all__ = [
    "articulation_chain",
    "checkpoint_selection_cubic",
    "classic_objective",
    "dynamic_checkpoint_selection_linear",
    "dynamic_checkpoint_selection_quadratic",
    "dynamic_objective",
    "min_budget_solve_hong_cubic",
    "min_budget_solve_hong_linear",
    "solve_hong_cubic",
    "solve_hong_linear",
]

Number = int | float


# ---- input checks -----------------------------------------------------------------------
def _check_sizes(d: Sequence[Number]) -> list[Number]:
    sizes = list(d)
    if not sizes:
        raise ValueError("the chain of data sizes is empty; give at least d_0 (the input)")
    for k, value in enumerate(sizes):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"data size d_{k}={value!r} is not a number")
        if value < 0 or math.isinf(value):
            raise ValueError(f"data size d_{k}={value!r} must be finite and non-negative")
    return sizes


def _check_checkpoints(d: Sequence[Number], checkpoints: Sequence[int]) -> list[int]:
    n = len(d) - 1
    chosen = sorted(set(checkpoints))
    if len(chosen) != len(checkpoints):
        raise ValueError(f"checkpoints {list(checkpoints)} repeat an index")
    if not chosen or chosen[0] != 0 or chosen[-1] != n:
        raise ValueError(
            f"checkpoints {list(checkpoints)} must include 0 (the input) and {n} (the output): "
            "section 3.1 of the paper makes both checkpoints"
        )
    return chosen


# ---- objectives straight from the equations ---------------------------------------------
def classic_objective(d: Sequence[Number], checkpoints: Sequence[int]) -> Number:
    """Eq. 6: the sum of the checkpoints plus the largest segment sum, where a segment is the
    data strictly between two consecutive checkpoints (possibly empty)."""
    sizes = _check_sizes(d)
    chosen = _check_checkpoints(sizes, checkpoints)
    checkpoint_memory = sum(sizes[c] for c in chosen)
    segment_memory = max(
        (sum(sizes[h + 1:i]) for h, i in zip(chosen, chosen[1:])), default=0
    )
    return checkpoint_memory + segment_memory


def _segment_cost(sizes: Sequence[Number], h: int, i: int) -> Number:
    """Eq. 11: s(h, i), the recomputed segment d_{h+1..i-1} plus the output-gradient buffer
    max(d_h..d_{i-1})."""
    return sum(sizes[h + 1:i]) + max(sizes[h:i])


def dynamic_objective(d: Sequence[Number], checkpoints: Sequence[int]) -> Number:
    """The peak of eq. 12 (Algorithm 4's memory model): for every checkpoint ``i`` after the
    first, with previous checkpoint ``h``, m(i) = (checkpoints up to i) + s(h, i); the peak
    is the largest m(i) (just ``d_0`` when the chain has one element)."""
    sizes = _check_sizes(d)
    chosen = _check_checkpoints(sizes, checkpoints)
    peak: Number = sizes[0]
    checkpoints_so_far = sizes[0]
    for h, i in zip(chosen, chosen[1:]):
        checkpoints_so_far += sizes[i]
        peak = max(peak, checkpoints_so_far + _segment_cost(sizes, h, i))
    return peak


# ---- Algorithm 3 ------------------------------------------------------------------------
def _min_checkpoint_memory(
    sizes: Sequence[Number], segment_limit: Number
) -> tuple[Number, list[int]]:
    """Eq. 7-8 for one segment limit s with Algorithm 3's monotone queue: the least
    checkpoint memory of a selection whose segments are all <= s, and the argmin ``j`` of
    eq. 8 for each prefix (to rebuild the selection). O(n)."""
    n = len(sizes) - 1
    best_prefix = [0] * n  # M(i, s) for i < n
    last_checkpoint = [0] * n  # the j achieving M(i, s)
    # value(j) = d_j + M(j - 1, s), with M(-1, s) = 0: j is the last checkpoint of the prefix.
    value = [0] * n
    queue: list[int] = []
    head = 0
    window_start = 0  # l(i): the least j with sum(d_{j+1..i}) <= s (eq. 7)
    window_sum: Number = 0  # sum(d_{window_start+1..i})
    for i in range(n):
        value[i] = sizes[i] + (best_prefix[i - 1] if i else 0)
        # Choice 1 of the module docstring: i enters before the head is read (eq. 8 has j = i).
        while len(queue) > head and value[queue[-1]] > value[i]:
            queue.pop()
        queue.append(i)
        if i:
            window_sum += sizes[i]
        while window_sum > segment_limit:
            window_start += 1
            window_sum -= sizes[window_start]
        while queue[head] < window_start:
            head += 1
        best_prefix[i] = value[queue[head]]
        last_checkpoint[i] = queue[head]
    return sizes[n] + best_prefix[n - 1], last_checkpoint


def checkpoint_selection_cubic(d: Sequence[Number]) -> tuple[Number, list[int]]:
    """Algorithm 3: the least eq. 6 over all checkpoint sets containing 0 and n, and one set
    that reaches it (sorted indices). O(n^3): O(n^2) candidate segment limits (every sum of
    consecutive interior sizes, and 0), O(n) each.

    Candidates are tried in increasing order and the search stops once ``s + d_0 + d_n``
    reaches the best total, since no larger ``s`` can beat it (exact, and it saves most of
    the work on real chains)."""
    sizes = _check_sizes(d)
    n = len(sizes) - 1
    if n == 0:
        return sizes[0], [0]
    candidates = {0}
    for a in range(1, n):
        running: Number = 0
        for b in range(a, n):
            running += sizes[b]
            candidates.add(running)
    best_total = math.inf
    best_limit: Number = 0
    for limit in sorted(candidates):
        if limit + sizes[0] + sizes[n] >= best_total:
            break
        checkpoint_memory, _ = _min_checkpoint_memory(sizes, limit)
        if limit + checkpoint_memory < best_total:
            best_total, best_limit = limit + checkpoint_memory, limit
    _, last_checkpoint = _min_checkpoint_memory(sizes, best_limit)
    chosen = [n]
    i = n - 1
    while True:
        j = last_checkpoint[i]
        chosen.append(j)
        if j == 0:
            break
        i = j - 1
    chosen.reverse()
    # Report eq. 6 of the set itself: its largest segment may be below the limit it was
    # found under, and then it is at least as good (the limit's total is already minimal).
    return classic_objective(sizes, chosen), chosen


# ---- Algorithms 5 and 6 -----------------------------------------------------------------
def _follow(next_checkpoint: Sequence[int], n: int) -> list[int]:
    chosen = [0]
    while chosen[-1] != n:
        chosen.append(next_checkpoint[chosen[-1]])
    return chosen


def dynamic_checkpoint_selection_quadratic(d: Sequence[Number]) -> tuple[Number, list[int]]:
    """Algorithm 5: eq. 13 evaluated directly, O(n^2). M(i) is the least peak of the suffix
    starting at checkpoint i (counting d_i), M(n) = d_n; the answer is M(0)."""
    sizes = _check_sizes(d)
    n = len(sizes) - 1
    best = [0] * (n + 1)
    next_checkpoint = [n] * (n + 1)
    best[n] = sizes[n]
    for i in range(n - 1, -1, -1):
        running_sum: Number = 0  # sum(d_{i+1..j-1})
        running_max: Number = sizes[i]  # max(d_i..d_{j-1})
        best_here = math.inf
        for j in range(i + 1, n + 1):
            candidate = max(best[j], running_sum + running_max + sizes[j])  # eq. 14-15
            if candidate <= best_here:  # ties: the later j (fewer checkpoints)
                best_here, next_checkpoint[i] = candidate, j
            running_sum += sizes[j]
            running_max = max(running_max, sizes[j])
        best[i] = sizes[i] + best_here
    return best[0], _follow(next_checkpoint, n)


def dynamic_checkpoint_selection_linear(d: Sequence[Number]) -> tuple[Number, list[int]]:
    """Algorithm 6: the least peak of eq. 12 over all checkpoint sets containing 0 and n, and
    one set that reaches it (sorted indices), in O(n).

    Eq. 16: M(i) = d_i + min_{i<j<=n} max(M(j), U(i, j)), U(i, j) = s(i, j) + d_j (eq. 15).
    Only the j of a monotone queue matter (Lemma 3: a smaller j with M no larger dominates),
    along which M falls and U(i, .) rises (Lemma 1), so the minimum is at their crossover;
    the crossover only moves towards smaller j as i falls (Lemma 4), except when the queue
    drops the element it stood on."""
    sizes = _check_sizes(d)
    n = len(sizes) - 1
    prefix = [0] * (n + 2)  # prefix[x] = d_0 + ... + d_{x-1}
    for k, value in enumerate(sizes):
        prefix[k + 1] = prefix[k] + value

    # Range maximum max(d_i..d_x) for the current i (choice 5 of the module docstring):
    # parent links lead from x to the position of that maximum, the latest prefix maximum
    # of d_i, d_{i+1}, ... at or before x.
    parent = list(range(n + 1))
    prefix_maxima: list[int] = []  # positions, the smallest (i) on top

    def argmax_from_current(x: int) -> int:
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    def u_value(base: Number, j: int) -> Number:
        # U(i, j) = sum(d_{i+1..j}) + max(d_i..d_{j-1}) (eq. 11, 15); base = prefix[i + 1].
        return prefix[j + 1] - base + sizes[argmax_from_current(j - 1)]

    best = [0] * (n + 1)  # M(i)
    next_checkpoint = [n] * (n + 1)
    best[n] = sizes[n]
    prefix_maxima.append(n)
    # The monotone queue Q as a list: position 0 holds the largest j, the end holds the head
    # (the smallest j); M strictly falls as j grows, so it rises along the list.
    queue = [n]
    # All queue positions <= crossover have U(i, j) >= M(j); position crossover + 1 (if any)
    # has U < M. -1: no position has U >= M yet.
    crossover = -1
    for i in range(n - 1, -1, -1):
        while prefix_maxima and sizes[prefix_maxima[-1]] <= sizes[i]:
            parent[prefix_maxima.pop()] = i
        prefix_maxima.append(i)
        base = prefix[i + 1]
        while crossover + 1 < len(queue) and u_value(base, queue[crossover + 1]) >= best[queue[crossover + 1]]:
            crossover += 1
        best_here = math.inf
        if crossover >= 0:  # the smallest j with U >= M: there max(M, U) = U
            best_here, next_checkpoint[i] = u_value(base, queue[crossover]), queue[crossover]
        if crossover + 1 < len(queue):  # the largest j with U < M: there max(M, U) = M
            j = queue[crossover + 1]
            if best[j] < best_here:  # ties keep the later j (fewer checkpoints)
                best_here, next_checkpoint[i] = best[j], j
        best[i] = sizes[i] + best_here
        # Lemma 3: i dominates every queued j with M(j) >= M(i).
        while queue and best[queue[-1]] >= best[i]:
            queue.pop()
        if crossover >= len(queue):
            # The crossover element left; the survivors all had U >= M, so still do.
            crossover = len(queue) - 1
        queue.append(i)
    return best[0], _follow(next_checkpoint, n)


# ---- graphs -----------------------------------------------------------------------------
def articulation_chain(graph: Graph) -> list[str]:
    """The vertices every path from the inputs to the outputs passes through, in
    topological order.

    Paths start at the sources that read the step's inputs (``meta.input_consumers``
    when it names sources; otherwise every source) and end at any sink. Vertices on no such
    path (a constant computed from nothing, say) cannot be cut vertices and do not break
    the chain. A vertex v on such paths is on all of them exactly when no edge of the
    path-carrying subgraph jumps over it in the topological order (an edge u -> w with
    pos(u) < pos(v) < pos(w), counting edges from a virtual source and to a virtual sink);
    one sweep over the edges finds them, O(V + E)."""
    ids = graph.ids
    count = len(ids)
    if not count:
        return []
    position = {nid: k for k, nid in enumerate(ids)}
    edges = [(position[u], position[w]) for u, w in graph.edges]
    successors: list[list[int]] = [[] for _ in range(count)]
    has_predecessor = [False] * count
    for u, w in edges:
        successors[u].append(w)
        has_predecessor[w] = True
    sources = [k for k in range(count) if not has_predecessor[k]]
    consumers = {position[v] for v in graph.meta.input_consumers or [] if v in position}
    starts = [k for k in sources if k in consumers] or sources
    sinks = [k for k in range(count) if not successors[k]]

    reachable = [False] * count
    for k in starts:
        reachable[k] = True
    for k in range(count):  # topological order: predecessors first
        if reachable[k]:
            for w in successors[k]:
                reachable[w] = True
    # Every vertex of a DAG reaches some sink, so the vertices on input-to-output paths are
    # the ones reachable from the starts.
    on_paths = reachable

    cover = [0] * (count + 1)  # difference array: how many edges jump over a position
    jumps = [(u, w) for u, w in edges if on_paths[u] and on_paths[w]]
    jumps += [(-1, k) for k in starts if on_paths[k]]  # from the virtual source
    jumps += [(k, count) for k in sinks if on_paths[k]]  # to the virtual sink
    for u, w in jumps:
        if w - u > 1:
            cover[u + 1] += 1
            cover[w] -= 1
    chain = []
    covered = 0
    for k in range(count):
        covered += cover[k]
        if covered == 0 and on_paths[k]:
            chain.append(ids[k])
    return chain


_NO_OPTIONS: frozenset[str] = frozenset()


def _solve_on_graph(
    graph: Graph,
    budget_bytes: int | None,
    options: dict[str, Any],
    solver_name: str,
    select: Callable[[list[Number]], tuple[Number, list[int]]],
    description: str,
    objective_name: str,
) -> Plan:
    unknown = sorted(set(options) - _NO_OPTIONS)
    if unknown:
        raise ValueError(f"solver {solver_name!r} takes no options; got {unknown}")
    ids = graph.ids
    if not ids:
        return make_plan(graph, [], solver_name, budget_bytes,
                         notes=["empty graph: nothing to plan"])
    chain = articulation_chain(graph)
    if not chain:
        return make_plan(graph, [Stage(ids, "keep")], solver_name, budget_bytes, notes=[
            f"{description}: no vertex lies on every input-to-output path, so there is no "
            "chain to select checkpoints on: one kept stage"])
    # The paper's chain d_0..d_n: the first and the last element are checkpoints (choice 4).
    sizes = [graph[v].mem for v in chain]
    objective, checkpoints = select(sizes)
    checkpoint_ids = [chain[c] for c in checkpoints]
    notes = []
    if graph.is_chain():
        notes.append(f"{description} on the graph's chain of {len(chain)} vertices "
                     "(d_0 its first vertex, d_n its last)")
    else:
        notes.append(
            f"{description} on the chain of the graph's {len(chain)} articulation vertices "
            f"(of {len(ids)}): the part between two articulation vertices is contracted with "
            "the one closing it into one chain element of that vertex's mem; only "
            "articulation vertices can be checkpoints (d_0 the first of them, d_n the last)"
        )
    notes.append(f"objective ({objective_name}) = {objective} bytes on that chain")
    notes.append(f"checkpoints: {checkpoint_ids if len(checkpoint_ids) <= 20 else checkpoint_ids[:20] + ['...']}")

    # Split after every checkpoint but the last (the output end of the chain): the stages
    # before it are recomputed, the last one is kept (its backward follows its forward). A
    # stage holding nothing but a checkpoint has nothing to recompute: it is kept.
    cut_positions = [graph.position(v) for v in checkpoint_ids[:-1]]
    stored = set(checkpoint_ids)
    stages: list[Stage] = []
    start = 0
    for cut in cut_positions:
        nodes = ids[start:cut + 1]
        stages.append(Stage(nodes, "keep" if stored.issuperset(nodes) else "recompute"))
        start = cut + 1
    if start < len(ids):
        stages.append(Stage(ids[start:], "keep"))
    plan = make_plan(graph, stages, solver_name, budget_bytes, stored=checkpoint_ids,
                     notes=notes)
    if not plan.feasible:
        plan.notes.append(
            f"the selection minimises peak memory whatever the budget: its predicted peak "
            f"{plan.predicted_peak_bytes} bytes is the smallest budget this solver meets"
        )
    return plan


def solve_hong_cubic(graph: Graph, budget_bytes: int | None = None, **options: Any) -> Plan:
    """Hong et al. Algorithm 3 (eq. 6, Chen et al.'s memory model) on the graph's chain of
    articulation vertices. The selection does not depend on the budget; ``feasible`` says
    whether the simulator's predicted peak fits it."""
    return _solve_on_graph(graph, budget_bytes, options, "hong-cubic", checkpoint_selection_cubic,
                           "Hong et al. Algorithm 3 (checkpoint selection, O(n^3))",
                           "eq. 6: checkpoints + largest segment")


def solve_hong_linear(graph: Graph, budget_bytes: int | None = None, **options: Any) -> Plan:
    """Hong et al. Algorithm 6 (eq. 11-16, the PyTorch memory model) on the graph's chain of
    articulation vertices. The selection does not depend on the budget; ``feasible`` says
    whether the simulator's predicted peak fits it."""
    return _solve_on_graph(graph, budget_bytes, options, "hong-linear",
                           dynamic_checkpoint_selection_linear,
                           "Hong et al. Algorithm 6 (dynamic checkpoint selection, O(n))",
                           "eq. 12 peak: checkpoints so far + segment + largest gradient")


def min_budget_solve_hong_cubic(graph: Graph, **options: Any) -> int:
    """The plan does not depend on the budget, so the smallest feasible budget is its
    predicted peak (used by ``solvers.min_budget`` instead of a binary search)."""
    return solve_hong_cubic(graph, None, **options).predicted_peak_bytes


def min_budget_solve_hong_linear(graph: Graph, **options: Any) -> int:
    """As :func:`min_budget_solve_hong_cubic`, for Algorithm 6."""
    return solve_hong_linear(graph, None, **options).predicted_peak_bytes
