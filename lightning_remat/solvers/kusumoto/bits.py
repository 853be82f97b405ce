"""Kusumoto et al. 2019, "A Graph Theoretic Framework of Recomputation Algorithms for
Memory-Efficient Backpropagation" (NeurIPS 2019; docs/design.md section 4.4): the graph as
bitsets and the families of lower sets the DPs search.

Lower sets are bitsets (Python ints, bit i = the i-th vertex in topological order) while
enumerating (:func:`all_lower_sets`, the exact DP's family, section 4.2); the approximate
DP's family is, for each vertex v, v with all its ancestors (:func:`ancestor_sets`,
section 4.3), less those of views and of values an in-place op overwrites
(:func:`approximate_sets`). :func:`graph_bits` gathers the per-vertex arrays the family's
quantities are computed from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_remat.errors import SolverDeclinedError
from lightning_remat.graph.ir import Graph
from lightning_remat.graph.ops import random_vertices
from lightning_remat.solvers.schedule import data_edges
from lightning_remat.solvers.simulate import SharedSteps
from lightning_remat.solvers.stage_costs import vertex_costs

__all__ = ["GraphBits", "all_lower_sets", "ancestor_sets", "approximate_sets", "graph_bits", "prefix_sets"]


@dataclass
class GraphBits:
    ids: list[str]
    mem: np.ndarray  # int64 bytes per vertex, topological order
    t_fwd: np.ndarray  # float64 seconds per vertex
    pred_bits: list[int]
    src: np.ndarray  # edge tails (vertex indices)
    dst: np.ndarray  # edge heads
    integer_times: bool
    graph: Graph
    size: np.ndarray  # int64 bytes of the storage each output lives in (its base's for a view)
    allocated: np.ndarray  # int64 the same, 0 for views of other vertices' storage
    extra: np.ndarray  # int64 bytes each op saves besides forward values
    keepable_time: np.ndarray  # float64 t_fwd of vertices a recomputed stage can keep, else 0
    output: np.ndarray  # bool: the vertex leaves the forward
    gradients: np.ndarray  # int64 gradient and transient bytes at each op's backward peak
    view: np.ndarray  # bool: the output is a view of another vertex's storage
    overwritten: np.ndarray  # bool: the only reader of the output is an in-place op on it
    inplace_time: np.ndarray  # float64 t_fwd of in-place ops on a vertex's value, else 0
    in_place: list[tuple[int, np.ndarray, np.ndarray]]
    """Per in-place op on a value made in the step: its index, the vertices whose stage it
    must share to run in place whatever else the plan does (the values in the storage it
    writes and their readers), and its own readers (the bound's ``in_place_shared``)."""

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def full(self) -> int:
        return (1 << self.n) - 1


def graph_bits(graph: Graph) -> GraphBits:
    ids = graph.ids
    index = {nid: i for i, nid in enumerate(ids)}
    pred_bits = [0] * len(ids)
    for u, v in graph.edges:  # every edge orders its ends
        pred_bits[index[v]] |= 1 << index[u]
    # Only edges a value flows through make a boundary or hold memory (schedule.data_edges).
    src, dst = [], []
    for u, v in data_edges(graph):
        src.append(index[u])
        dst.append(index[v])
    times = [float(node.t_fwd) for node in graph.nodes]
    costs = vertex_costs(graph)
    shared = SharedSteps(graph)
    readers, inplace = shared.succ, shared.inplace
    random = random_vertices(graph)
    outputs = set(graph.meta.outputs if graph.meta.outputs is not None else ids[-1:])
    # What a kept value holds: its storage (a view's base's).
    size = np.array([costs.storage[v] for v in ids], dtype=np.int64)
    # A view allocates nothing: its storage is its base's, counted where the base is.
    allocated = np.array([0 if v in costs.views else costs.size[v] for v in ids], dtype=np.int64)
    extra = np.array([costs.extra[v] for v in ids], dtype=np.int64)
    in_place = []
    for v, t in inplace.items():
        if t is None or v in outputs:
            continue
        # Schedule._rewritten's rule: v runs in place under every plan that puts it in one
        # stage with every value of the storage it writes and all their readers, unless
        # that stage is recomputed and v is read outside it (the selective policy).
        held = [x for x in shared.parts.sharing.get(t, (t,)) if shared.position[x] < shared.position[v]] or [t]
        if any(x in outputs for x in held):
            continue
        together = {*held, *(w for x in held for w in readers[x])}
        in_place.append((index[v], np.array(sorted(index[w] for w in together), dtype=np.int64),
                         np.array(sorted(index[w] for w in readers[v]), dtype=np.int64)))
    return GraphBits(
        ids=ids,
        mem=np.array([node.mem for node in graph.nodes], dtype=np.int64),
        t_fwd=np.array(times, dtype=np.float64),
        pred_bits=pred_bits,
        src=np.array(src, dtype=np.int64),
        dst=np.array(dst, dtype=np.int64),
        integer_times=all(t.is_integer() for t in times),
        graph=graph,
        size=size,
        allocated=allocated,
        extra=extra,
        keepable_time=np.array([0.0 if n.id in random else float(n.t_fwd) for n in graph.nodes]),
        output=np.array([v in outputs for v in ids], dtype=bool),
        gradients=np.array([costs.gradients[v] for v in ids], dtype=np.int64),
        view=np.array([v in costs.views for v in ids], dtype=bool),
        overwritten=np.array([v not in outputs and len(readers[v]) == 1 and inplace.get(readers[v][0]) == v
                              for v in ids], dtype=bool),
        inplace_time=np.array([float(n.t_fwd) if inplace.get(n.id) is not None else 0.0 for n in graph.nodes]),
        in_place=in_place,
    )


def ancestor_sets(bits: GraphBits) -> list[int]:
    """For each vertex v, the bitset of v and all its ancestors (section 4.3's family)."""
    anc: list[int] = []
    for i in range(bits.n):
        mask = 1 << i
        pred = bits.pred_bits[i]
        while pred:
            low = pred & -pred
            mask |= anc[low.bit_length() - 1]
            pred ^= low
        anc.append(mask)
    return anc


def approximate_sets(bits: GraphBits, simulated: bool = True) -> list[int]:
    """The approximate family less two kinds of ancestor sets that other members dominate
    (docs/design.md section 4.4), which cuts the pairs the DP simulates:

    - a view's: it allocates nothing and runs in next to no time, so a stage that ends just
      after one keeps the storage a stage ending at its base keeps, for the same
      recomputation (a transformer is about half views: reshapes, transposes, a split's
      parts);
    - that of a vertex whose only reader overwrites it in place (a BatchNorm before an
      in-place ReLU): a stage ending there keeps its storage and makes the reader, now in
      the next stage, run out of place in a storage of its own (``Schedule.
      rewritten``), where ending after the reader keeps the one storage. That holds
      for the simulator's stage costs (``simulated``), not for the upper bound, which
      counts an in-place op's storage at each of its vertices."""
    return [s for i, s in enumerate(ancestor_sets(bits))
            if not (bits.view[i] or (simulated and bits.overwritten[i]))]


def prefix_sets(bits: GraphBits) -> list[int]:
    """The n + 1 prefixes of the graph's order, the forward's: the family whose strategies
    run every op where the forward runs it (docs/design.md section 5, "Plain's order"). A
    prefix of a topological order is a lower set."""
    return [(1 << k) - 1 for k in range(bits.n + 1)]


def all_lower_sets(bits: GraphBits, max_lower_sets: int) -> list[int]:
    """Every lower set, without duplicates: decide vertices in topological order; a vertex
    may join only when all its predecessors are in. The partial lists only grow, so the
    limit is checked as they do."""
    sets = [0]
    for i in range(bits.n):
        pred = bits.pred_bits[i]
        bit = 1 << i
        sets += [s | bit for s in sets if pred & ~s == 0]
        if len(sets) > max_lower_sets:
            # The exact DP's tables grow with the family, which grows exponentially in the
            # graph's width (Kusumoto et al. 2019, section 4.3): decline rather than run
            # for hours or exhaust memory.
            raise SolverDeclinedError(
                None, "kusumoto-exact",
                f"the graph ({bits.n} vertices) has more than {max_lower_sets} lower sets",
                "raise max_lower_sets, or use the approximate DP over n + 2 lower sets "
                "(solver 'auto', 'kusumoto-tc' or 'kusumoto-mc')",
            )
    return sets
