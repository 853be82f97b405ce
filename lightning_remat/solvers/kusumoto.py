"""Kusumoto et al. 2019, "A Graph Theoretic Framework of Recomputation Algorithms for
Memory-Efficient Backpropagation" (Kusumoto, Inoue, Watanabe, Akiba and Koyama, NeurIPS 2019).

docs/design.md section 4.4 states the paper's formulas in this package's notation, and this
module follows that statement exactly (paper equation numbers in brackets):

- a strategy is an increasing sequence of lower sets ``{} = L0 < L1 < ... < Lk = V``; stage
  ``i`` computes ``Vi = Li \\ L(i-1)``;
- extra time [eq. 1]: ``T = sum over i < k of time(Vi \\ B(Li))`` with ``time = t_fwd`` (the
  last stage is never recomputed), plus, where the profile measured it, the executor's own
  time per recomputed stage, ``c_stage + c_vertex * |Vi|`` (docs/design.md section 4.7):
  TC minimises that sum, the time the step takes; MC maximises eq. 1 alone, its aim being
  the coarse partition, and both report the sum;
- cache after stage i: ``U(i) = U(i-1) + mem(B(Li) \\ L(i-1))``;
- stage memory: not eq. 2 (which has no liveness and no parameter gradients) but the
  simulator's, the one model of a step (docs/design.md sections 4.4 and 4.7): the peak is
  ``max over i of U(i-1) + f(L(i-1), Li)`` with ``f`` the stage's own peak above the cache
  (``simulate.stage_costs``) and the cache additive, ``U(i) = U(i-1) + kept(L(i-1), Li)``
  (the stage's kept boundary values and their extra saved outputs). The exact DP, and the
  approximate one where simulating every pair is cheap, take ``f`` and ``kept`` from the
  simulator (exact). Otherwise the approximate DP uses an upper bound, vectorised:
  ``f <= mem(Vi) + extra(Vi) + max over v in Vi of grad(v)``, ``grad(v)`` being the gradient
  and transient bytes at v's backward peak, the same under every plan; a view allocates
  nothing (its base's storage is counted where the base is), other storage shared between
  vertices (in-place ops, which a plan may give storage of their own; gradients passed
  through ``add``) is counted per vertex, a random op's boundary value (recomputed, held by its readers) as kept, and the
  loss's measured peak on top of the last stage. Where
  that bound finds no strategy for a budget and simulating every pair stays affordable
  (``_TIGHTER_WORK``), the simulator's own costs are used, so a tight budget is decided by
  the model and not by the bound's looseness, and ``min_budget`` is the smallest budget
  ``solve`` then accepts. So a DP-feasible plan fits by construction; a strategy is feasible for a budget M when its
  peak plus the plan's margin is at most M;
- DP (section 4.2, Appendix A Algorithm 1): a state is ``(L, t)`` holding the least cache
  ``m`` of any prefix that ends in L with extra time t; from ``(L, t, m)`` go to every lower
  set ``L' > L`` of the family with ``m + stage_memory(L, L') <= M``.
- Exact DP: the family of all lower sets (section 4.2). Approximate DP: ``{}``, ``V`` and,
  for each vertex v, v with all its ancestors, n + 2 sets (section 4.3), less those of
  views and of values an in-place op overwrites (``_approximate_sets``).
- Time-centric (TC): least T among final states. Memory-centric (MC, section 4.4): largest
  feasible T, the coarse partition that gives liveness analysis the most room.
- The smallest budget with any solution is found by binary search on M (section 5.1).

Implementation choices (why):

- Lower sets are bitsets (Python ints, bit i = the i-th vertex in topological order) while
  enumerating, and a boolean membership matrix plus packed 64-bit words for the DP, so that
  the per-pair quantities (subset test, ``mem(B(L') & L)``) are numpy operations over all
  sources of a target at once.
- Dominated states are pruned: for TC, ``(t1, m1)`` dominates ``(t2, m2)`` at the same L when
  ``t1 <= t2`` and ``m1 <= m2`` (every continuation of the second is feasible from the first
  and no slower); for MC when ``t1 >= t2`` and ``m1 <= m2``. This keeps the paper's optimum.
- Time discretisation: when every ``t_fwd`` is a whole number (tests, Kusumoto's own costs of
  1 and 10) times are exact and the DP is exact. Otherwise states are bucketed by
  ``floor(t / unit)`` and only the least ``m`` per ``(L, bucket)`` is kept (the paper's
  discretised table); the result's T may then exceed the optimum by up to one ``unit`` per
  stage. MC uses ``unit = total forward time / time_steps``. TC first runs a coarse pass
  (32 buckets over the whole forward time); its strategy's exact T bounds the fine pass
  (slower states are dropped, which keeps the optimum) and sets its ``unit = T / time_steps``,
  so the resolution follows the extra time that is actually at stake. The T reported is
  always computed exactly from the chosen sequence.
- Further pruning that keeps the optimum: ``g(L)``, the least budget above the held cache
  with which the strategy can still be finished from L (one backward pass), drops states
  with ``m + g(L) > M``; ``g({})`` is also the smallest budget with any strategy.
- The plan's ``feasible`` is the DP's own verdict, which the simulator's figure confirms
  (by construction); the DP's peak and the simulator's peak both go into ``plan.notes``.

Length: the exact and the approximate DP, time- and memory-centric, share the lower-set
families, the stage costs, the DP over (L, t) and the plan construction: one module, one
public function per variant.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_remat.graph.ir import Graph
from lightning_remat.graph.ops import random_vertices
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.schedule import data_edges
from lightning_remat.solvers.simulate import (
    SharedSteps,
    make_plan,
    model_margin,
    stage_cost,
    stage_overhead_seconds,
    vertex_costs,
)

__all__ = [
    "DEFAULT_MAX_LOWER_SETS", "DEFAULT_TIME_STEPS", "LowerSetFamily", "evaluate_sequence",
    "min_budget_solve_approx_mc", "min_budget_solve_approx_tc", "min_budget_solve_exact_mc",
    "min_budget_solve_exact_tc", "solve_approx_mc", "solve_approx_tc", "solve_exact_mc",
    "solve_exact_tc",
]

DEFAULT_MAX_LOWER_SETS = 100_000
DEFAULT_TIME_STEPS = 500
_INF = np.iinfo(np.int64).max
# Cache per-target transition arrays while their total size stays under this many entries.
_TRANSITION_CACHE_ENTRIES = 5_000_000
# The approximate DP simulates every pair of its lower sets while pairs x vertices stays
# under this (about a second); above it, it uses the vectorised upper bound.
_SIMULATED_WORK = 100_000
# Where the upper bound finds no strategy for a budget, the simulator's own stage costs are
# tried while pairs x vertices stays under this (seconds on a 100-vertex graph): the bound
# is loose on shared storage, and a tight budget is where that decides feasibility.
_TIGHTER_WORK = 2_000_000


# ---- graph as bitsets -------------------------------------------------------------------------
@dataclass
class _GraphBits:
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

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def full(self) -> int:
        return (1 << self.n) - 1


def _graph_bits(graph: Graph) -> _GraphBits:
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
    return _GraphBits(
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
    )


def _ancestor_sets(bits: _GraphBits) -> list[int]:
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


def _approximate_sets(bits: _GraphBits, simulated: bool = True) -> list[int]:
    """The approximate family less two kinds of ancestor sets that other members dominate
    (docs/design.md section 4.4), which cuts the pairs the DP simulates:

    - a view's: it allocates nothing and runs in next to no time, so a stage that ends just
      after one keeps the storage a stage ending at its base keeps, for the same
      recomputation (a transformer is about half views: reshapes, transposes, a split's
      parts);
    - that of a vertex whose only reader overwrites it in place (a BatchNorm before an
      in-place ReLU): a stage ending there keeps its storage and makes the reader, now in
      the next stage, run out of place in a storage of its own (``simulate.
      rewritten_inplace``), where ending after the reader keeps the one storage. That holds
      for the simulator's stage costs (``simulated``), not for the upper bound, which
      counts an in-place op's storage at each of its vertices."""
    return [s for i, s in enumerate(_ancestor_sets(bits))
            if not (bits.view[i] or (simulated and bits.overwritten[i]))]


def _all_lower_sets(bits: _GraphBits, max_lower_sets: int) -> list[int]:
    """Every lower set, without duplicates: decide vertices in topological order; a vertex
    may join only when all its predecessors are in. The partial lists only grow, so the
    limit is checked as they do."""
    sets = [0]
    for i in range(bits.n):
        pred = bits.pred_bits[i]
        bit = 1 << i
        sets += [s | bit for s in sets if pred & ~s == 0]
        if len(sets) > max_lower_sets:
            raise ValueError(
                f"the graph ({bits.n} vertices) has more than {max_lower_sets} lower sets; "
                "raise max_lower_sets or use the approximate DP (solver 'kusumoto-tc' / "
                "'kusumoto-mc')"
            )
    return sets


# ---- the family of lower sets with its per-set quantities ------------------------------------
def _reduce_columns(matrix: np.ndarray, keys: np.ndarray, n: int) -> np.ndarray:
    """OR the columns of ``matrix`` (one per edge) into one column per vertex ``keys[e]``."""
    out = np.zeros((matrix.shape[0], n), dtype=bool)
    if keys.size == 0:
        return out
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    out[:, sorted_keys[starts]] = np.logical_or.reduceat(matrix[:, order], starts, axis=1)
    return out


@dataclass
class LowerSetFamily:
    """Lower sets sorted by size (index 0 is {}, the last is V) with what the DP needs of
    each: ``mem(L)``, ``time(L)``, the boundary ``B(L)``, what a stage ending in L keeps."""

    bits: _GraphBits
    sets: list[int]
    simulated: bool = False
    """Stage costs from the simulator itself, one simulation per pair of lower sets (the
    exact DP on small graphs); else the vectorised upper bound (module docstring)."""
    member: np.ndarray = field(init=False)  # K x n bool
    words: np.ndarray = field(init=False)  # K x W uint64, packed membership
    mem_set: np.ndarray = field(init=False)
    time_set: np.ndarray = field(init=False)
    mem_boundary: np.ndarray = field(init=False)
    time_boundary: np.ndarray = field(init=False)
    fixed: np.ndarray = field(init=False)
    boundary_idx: list[np.ndarray] = field(init=False)
    _cache: dict[int, tuple[np.ndarray, ...]] = field(init=False, default_factory=dict)
    _cached_entries: int = field(init=False, default=0)
    _finish_need: np.ndarray | None = field(init=False, default=None)
    _shared: SharedSteps | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        bits = self.bits
        n = bits.n
        self.sets = sorted(set(self.sets) | {0, bits.full}, key=lambda s: (s.bit_count(), s))
        nbytes = max(8, ((n + 63) // 64) * 8)
        buffer = b"".join(s.to_bytes(nbytes, "little") for s in self.sets)
        raw = np.frombuffer(buffer, dtype=np.uint8).reshape(len(self.sets), nbytes)
        self.words = raw.view("<u8").astype(np.uint64)
        self.member = np.unpackbits(raw, axis=1, bitorder="little")[:, :n].astype(bool)
        member = self.member
        mem, t_fwd = bits.mem, bits.t_fwd
        self.mem_set = member.astype(np.int64) @ mem
        self.time_set = member.astype(np.float64) @ t_fwd
        # An edge (u, w) crosses out of L when u is in L and w is not.
        in_tail = member[:, bits.src]
        crossing = in_tail & ~member[:, bits.dst]
        boundary = _reduce_columns(crossing, bits.src, n)  # B(L)
        out_all = _reduce_columns(in_tail, bits.dst, n)  # out(L)
        out_outside = out_all & ~member  # out(L) \ L: gradients arriving from later stages
        # in(out(L)) \ L \ out(L): tails u of edges into out(L) \ L, outside L and out(L).
        needed_edge = out_outside[:, bits.dst] & ~member[:, bits.src] & ~out_all[:, bits.src]
        needed = _reduce_columns(needed_edge, bits.src, n)
        self.mem_boundary = boundary.astype(np.int64) @ mem
        self.time_boundary = boundary.astype(np.float64) @ t_fwd
        self.fixed = out_outside.astype(np.int64) @ mem + needed.astype(np.int64) @ mem
        self.boundary_idx = [np.flatnonzero(row) for row in boundary]
        # What the executor keeps: B(L) and the model outputs in L (docs/design.md section 5).
        kept = boundary | (member & bits.output)
        self.kept_idx = [np.flatnonzero(row) for row in kept]
        self.size_set = member.astype(np.int64) @ bits.allocated
        self.extra_set = member.astype(np.int64) @ bits.extra
        self.held_kept = kept.astype(np.int64) @ (bits.size + bits.extra)
        self.time_kept = kept.astype(np.float64) @ bits.keepable_time
        self.count_set = member.sum(axis=1, dtype=np.int64)

    @property
    def size(self) -> int:
        return len(self.sets)

    def transitions(self, j: int) -> tuple[np.ndarray, ...]:
        """For target set j: its proper sub-lower-sets in the family (indices), and per
        source L: the stage's peak above the cache the earlier stages hold, the cache it
        adds (its kept boundary values with their extra saved outputs), its extra time,
        the forward time of what it recomputes (eq. 1: ``time(Vi \\ B(Li))``, 0 for the last
        stage), and the executor's own time for the stage (``simulate.stage_overhead_seconds``,
        0 for the last). See the module docstring for the stage memory."""
        hit = self._cache.get(j)
        if hit is not None:
            return hit
        words = self.words
        sources = np.flatnonzero(np.all((words[:j] & ~words[j]) == 0, axis=1))
        bits = self.bits
        kept_idx = self.kept_idx[j]
        if kept_idx.size:
            inside = self.member[np.ix_(sources, kept_idx)]
            kept_before = inside.astype(np.int64) @ (bits.size + bits.extra)[kept_idx]
            time_before = inside.astype(np.float64) @ bits.keepable_time[kept_idx]
        else:
            kept_before = np.zeros(sources.size, dtype=np.int64)
            time_before = np.zeros(sources.size, dtype=np.float64)
        last = j == self.size - 1
        if self.simulated:
            stage_mem, cache_add = self._simulated_costs(sources, j)
        else:
            # Every value of the stage and every extra block its ops save, plus the most
            # gradient (and transient) bytes any of its ops meets in the backward, which
            # are the same under every plan (module docstring).
            inside = self.member[j] & ~self.member[sources]
            stage_mem = (self.size_set[j] - self.size_set[sources]
                         + (self.extra_set[j] - self.extra_set[sources])
                         + np.where(inside, bits.gradients, 0).max(axis=1, initial=0))
            cache_add = self.held_kept[j] - kept_before
            if last:  # the loss runs on top of the last stage's forward
                stage_mem = stage_mem + int(bits.graph.meta.loss_peak_bytes or 0)
        if last:
            extra_time = np.zeros(sources.size, dtype=np.float64)  # the last stage: no recompute
            overhead = extra_time
        else:
            stage_time = self.time_set[j] - self.time_set[sources]
            extra_time = np.maximum(stage_time - (self.time_kept[j] - time_before), 0.0)
            # Every recomputed stage runs under checkpoint: the executor's own time.
            per_vertex = stage_overhead_seconds(bits.graph, 1) - stage_overhead_seconds(bits.graph, 0)
            overhead = (stage_overhead_seconds(bits.graph, 0)
                        + (self.count_set[j] - self.count_set[sources]) * per_vertex)
        result = (sources, stage_mem.astype(np.int64), cache_add.astype(np.int64), extra_time, overhead)
        if self._cached_entries + sources.size <= _TRANSITION_CACHE_ENTRIES:
            self._cache[j] = result
            self._cached_entries += sources.size
        return result

    def _simulated_costs(self, sources: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
        """The simulator's own stage costs (``simulate.stage_costs``) for each source L and
        target L': the plan [L recomputed, L' less L, the rest kept] is simulated and the
        middle stage's cost read off; it does not depend on how L itself is staged."""
        graph, ids = self.bits.graph, self.bits.ids
        last = j == self.size - 1
        after = [ids[i] for i in np.flatnonzero(~self.member[j])]
        stage_mem = np.zeros(sources.size, dtype=np.int64)
        cache_add = np.zeros(sources.size, dtype=np.int64)
        if self._shared is None:
            self._shared = SharedSteps(graph)
        for position, source in enumerate(sources):
            before = [ids[i] for i in np.flatnonzero(self.member[source])]
            middle = [ids[i] for i in np.flatnonzero(self.member[j] & ~self.member[source])]
            stages = [Stage(before, "recompute")] if before else []
            stages.append(Stage(middle, "keep" if last else "recompute"))
            if after:
                stages.append(Stage(after, "keep"))
            cost = stage_cost(graph, Plan(stages, [], 0, 0.0, "", True), 1 if before else 0, self._shared)
            stage_mem[position] = cost.peak_above_cache
            cache_add[position] = cost.cache_bytes
        return stage_mem, cache_add

    # ---- DP ---------------------------------------------------------------------------------
    def feasible(self, budget: int) -> bool:
        """Whether any strategy over the family has peak <= budget: the least cache per
        lower set suffices, since every constraint and every cache only grows with it."""
        best = np.full(self.size, _INF, dtype=np.int64)
        best[0] = 0
        for j in range(1, self.size):
            sources, stage_mem, cache_add, *_ = self.transitions(j)
            cache = best[sources]
            ok = (cache != _INF) & (cache + stage_mem <= budget)
            if ok.any():
                best[j] = int((cache[ok] + cache_add[ok]).min())
        return bool(best[-1] != _INF)

    def evaluate(self, sequence: list[int]) -> tuple[int, float]:
        """The DP's peak (its stage memory, with the cache) and extra time [eq. 1] of a
        sequence of family indices."""
        cache, peak, extra = 0, 0, 0.0
        for before, after in zip(sequence, sequence[1:]):
            sources, stage_mem, cache_add, extra_time, overhead = self.transitions(after)
            k = int(np.searchsorted(sources, before))
            peak = max(peak, cache + int(stage_mem[k]))
            cache += int(cache_add[k])
            extra += float(extra_time[k]) + float(overhead[k])
        return peak, extra

    def finish_need(self) -> np.ndarray:
        """For each lower set L, the least budget above the cache already held with which
        the strategy can still be finished from L: ``g(V) = 0`` and ``g(L) = min over L' >
        L of max(stage_memory(L, L'), cache_added(L, L') + g(L'))``. A state (L, m) can
        reach V exactly when ``m + g(L) <= M``, and ``g({})`` is the smallest budget with
        any strategy. Computed once, backwards over the family."""
        if self._finish_need is None:
            need = np.full(self.size, _INF, dtype=np.int64)
            need[-1] = 0
            for j in range(self.size - 1, 0, -1):
                if need[j] == _INF:
                    continue
                sources, stage_mem, cache_add, *_ = self.transitions(j)
                through_j = np.maximum(stage_mem, cache_add + need[j])
                need[sources] = np.minimum(need[sources], through_j)
            self._finish_need = need
        return self._finish_need

    def min_budget(self) -> int:
        """The smallest budget with any strategy: ``g({})`` of :meth:`finish_need`, the
        same value Kusumoto's binary search on M finds (section 5.1;
        :meth:`min_budget_by_bisection` does that search, the tests compare them)."""
        return int(self.finish_need()[0])

    def min_budget_by_bisection(self) -> int:
        """Binary search on M over :meth:`feasible` (the paper's method). The one-stage
        strategy's stage memory is always enough."""
        hi = int(self.transitions(self.size - 1)[1][0])
        if self.feasible(0):
            return 0
        lo = 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.feasible(mid):
                hi = mid
            else:
                lo = mid
        return hi

    def time_unit(self, time_steps: int) -> float:
        """Width of the time buckets: 1 (exact) for whole-number times, else the total
        forward time / ``time_steps``."""
        if self.bits.integer_times:
            return 1.0
        return max(float(self.bits.t_fwd.sum()), 1e-300) / time_steps

    def solve(self, budget: int | None, objective: str, unit: float,
              bound: float | None = None) -> tuple[list[int], float] | None:
        """Algorithm 1: the best sequence of family indices (0 first, the last index last)
        for the objective ``"tc"`` (least T) or ``"mc"`` (largest T) with its T, or None.
        States are bucketed by ``floor(t / unit)``. Pruned as well (keeping the optimum):
        states that cannot finish within the budget (``m + g(L) > M``), and for TC states
        slower than ``bound``, the T of a strategy already known to fit."""
        limit = _INF if budget is None else int(budget)
        need = self.finish_need()
        slack = math.inf if bound is None else bound + 1e-9 * max(abs(bound), 1.0)
        cap = 1024
        st_t = np.zeros(cap)
        st_m = np.zeros(cap, dtype=np.int64)
        st_parent = np.full(cap, -1, dtype=np.int64)
        key_m = np.zeros(cap, dtype=np.complex128)  # (owner, -m), sorted: see below
        key_t = np.zeros(cap, dtype=np.complex128)  # (owner, t)
        # States are appended target by target, so each lower set's states are one range.
        first = np.zeros(self.size, dtype=np.int64)
        stop = np.zeros(self.size, dtype=np.int64)
        least_m = np.full(self.size, _INF, dtype=np.int64)
        stop[0], least_m[0] = 1, 0  # state 0: ({}, t=0, m=0)
        count = 1
        for j in range(1, self.size):
            sources, stage_mem, cache_add, extra_time, overhead = self.transitions(j)
            if objective == "tc":  # the time that is minimised is the time the step takes
                extra_time = extra_time + overhead
            # Sources none of whose states can afford the stage are skipped before gathering.
            # A state (L, t, m) may take this step when m + stage <= M and the new cache can
            # still finish (m + added + g(L') <= M): one cap on m per source.
            m_cap = np.minimum(limit - stage_mem, limit - need[j] - cache_add)
            usable = np.flatnonzero(least_m[sources] <= m_cap)
            if usable.size == 0:
                continue
            src = sources[usable]
            # Each source's states are one range with m strictly decreasing (and for TC t
            # increasing), so the states that pass the caps are one interval per source,
            # found by binary search on (owner, -m) and (owner, t) keys.
            lo = np.searchsorted(key_m[:count], src - 1j * m_cap[usable].astype(np.float64))
            hi = stop[src]
            if objective == "tc" and bound is not None:
                t_cap = slack - extra_time[usable]
                hi = np.minimum(hi, np.searchsorted(key_t[:count], src + 1j * t_cap, side="right"))
            lengths = np.maximum(hi - lo, 0)
            total = int(lengths.sum())
            if total == 0:
                continue
            ends = np.cumsum(lengths)
            chosen = np.repeat(lo - ends + lengths, lengths) + np.arange(total)
            slot = np.repeat(usable, lengths)
            cache = st_m[chosen]
            # The same tests in exact integers (the keys are floats).
            ok = cache <= m_cap[slot]
            chosen, slot, cache = chosen[ok], slot[ok], cache[ok]
            new_m = cache + cache_add[slot]
            new_t = st_t[chosen] + extra_time[slot]
            if objective == "tc" and bound is not None:
                alive = new_t <= slack
                chosen, new_m, new_t = chosen[alive], new_m[alive], new_t[alive]
            if chosen.size == 0:
                continue
            keep = _undominated(new_t, new_m, unit, objective)
            k = keep.size
            if count + k > cap:
                cap = max(cap * 2, count + k)
                st_t = np.resize(st_t, cap)
                st_m = np.resize(st_m, cap)
                st_parent = np.resize(st_parent, cap)
                key_m = np.resize(key_m, cap)
                key_t = np.resize(key_t, cap)
            st_t[count:count + k] = new_t[keep]
            key_m[count:count + k] = j - 1j * new_m[keep].astype(np.float64)
            key_t[count:count + k] = j + 1j * new_t[keep]
            st_m[count:count + k] = new_m[keep]
            st_parent[count:count + k] = chosen[keep]
            first[j], stop[j] = count, count + k
            least_m[j] = int(new_m[keep].min())
            count += k
        owner = np.zeros(count, dtype=np.int64)
        for j in np.flatnonzero(stop > first):
            owner[first[j]:stop[j]] = j
        if self.size == 1:
            return [0], 0.0
        final = np.arange(first[-1], stop[-1])
        if final.size == 0:
            return None
        t_final, m_final = st_t[final], st_m[final]
        sign = 1.0 if objective == "tc" else -1.0
        best = final[np.lexsort((m_final, sign * t_final))[0]]
        sequence = []
        state = int(best)
        while state >= 0:
            sequence.append(int(owner[state]))
            state = int(st_parent[state])
        return sequence[::-1], float(st_t[best])


def _undominated(t: np.ndarray, m: np.ndarray, unit: float, objective: str) -> np.ndarray:
    """Indices of the states to keep at one lower set: the least m per time bucket, then only
    those no other state dominates (TC: no faster state with no more cache; MC: no slower
    state with no more cache). Linear time: a scatter-min per bucket instead of a sort."""
    bucket = np.floor(t / unit + 1e-9).astype(np.int64)
    low = int(bucket.min())
    bucket -= low
    buckets = int(bucket.max()) + 1
    least = np.full(buckets, _INF, dtype=np.int64)
    np.minimum.at(least, bucket, m)
    winners = np.flatnonzero(m == least[bucket])
    representative = np.full(buckets, -1, dtype=np.int64)
    representative[bucket[winners]] = winners  # one state per bucket among those with least m
    occupied = np.flatnonzero(representative >= 0)
    if objective != "tc":
        occupied = occupied[::-1]  # MC: the slowest bucket first
    best = least[occupied]
    best_before = np.r_[_INF, np.minimum.accumulate(best)[:-1]]
    return representative[occupied[best < best_before]]


# ---- the paper's own formulas, for reference ---------------------------------------------------
def evaluate_sequence(graph: Graph, stages: list[list[str]]) -> tuple[int, float]:
    """Peak [eq. 2 as printed] and extra time [eq. 1] of the canonical strategy whose stages
    (forward order) are given; each prefix union must be a lower set. A reference for
    comparisons: the DP itself uses the simulator's stage memory (module docstring)."""
    done: set[str] = set()
    cache = 0
    peak = 0
    extra = 0.0
    for k, stage in enumerate(stages):
        previous = set(done)
        done |= set(stage)
        out = {w for v in done for w in graph.successors(v)}
        arriving = out - done
        needed = {u for w in out for u in graph.predecessors(w)} - done - out
        stage_peak = (cache + 2 * graph.total("mem", stage) + graph.total("mem", arriving)
                      + graph.total("mem", needed))
        peak = max(peak, int(stage_peak))
        boundary = {v for v in done if any(w not in done for w in graph.successors(v))}
        if k < len(stages) - 1:
            extra += graph.total("t_fwd", [v for v in stage if v not in boundary])
        cache += int(graph.total("mem", boundary - previous))
    return peak, extra


# ---- public solvers --------------------------------------------------------------------------
def _check_budget(budget_bytes: Any) -> int | None:
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)):
        raise ValueError(
            f"budget_bytes={budget_bytes!r} is not a whole number of bytes; pass an int "
            "(lightning_remat.parse_budget turns '4GiB' or '60%' into one) or None for no limit"
        )
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes} is negative; pass bytes >= 0 or None")
    return int(budget_bytes)


_FAMILY_CACHE: OrderedDict[tuple, LowerSetFamily] = OrderedDict()
_FAMILY_CACHE_SIZE = 8


def _family(graph: Graph, exact: bool, max_lower_sets: int, simulated: bool = False) -> LowerSetFamily:
    """The family of lower sets for a graph, reused across calls on the same graph and
    costs (auto, min-budget searches and benchmarks call the DP several times);
    ``simulated`` asks for the simulator's stage costs whatever they cost."""
    if isinstance(max_lower_sets, bool) or not isinstance(max_lower_sets, int) or max_lower_sets < 1:
        raise ValueError(f"max_lower_sets={max_lower_sets!r} must be an int of at least 1")
    key = (exact, simulated, _cost_key(graph))
    family = _FAMILY_CACHE.get(key)
    if family is not None and (not exact or family.size <= max_lower_sets):
        _FAMILY_CACHE.move_to_end(key)
        return family
    bits = _graph_bits(graph)
    sets = _all_lower_sets(bits, max_lower_sets) if exact else _approximate_sets(bits, simulated)
    # The approximate family too takes the simulator's own stage costs where simulating
    # every pair is cheap (a simulation is O(n)): its plans are then as tight as the model.
    pairs = len(set(sets) | {0, bits.full}) ** 2 // 2
    simulated = exact or simulated or pairs * max(bits.n, 1) <= _SIMULATED_WORK
    if simulated and not exact:
        sets = _approximate_sets(bits, True)
    family = LowerSetFamily(bits, sets, simulated=simulated)
    _FAMILY_CACHE[key] = family
    while len(_FAMILY_CACHE) > _FAMILY_CACHE_SIZE:
        _FAMILY_CACHE.popitem(last=False)
    return family


# Meta fields no stage cost reads: the same graph with another bandwidth or run label is the
# same family (the batch-size search predicts on a derived graph the planner then gets with
# the bandwidth and the run's gradient state set).
_COSTLESS_META = ("bandwidth_bytes_per_s", "step_seconds", "plain_peak_bytes")


def _cost_key(graph: Graph) -> str:
    """The graph's JSON less the meta fields stage costs do not read, gradients resident
    or not written as a bool."""
    data = graph.to_dict()
    meta = data["meta"]
    for name in _COSTLESS_META:
        meta.pop(name, None)
    for name in graph.meta.extra:
        meta.pop(name, None)
    meta["grads_resident"] = bool(graph.meta.grads_resident)
    return json.dumps(data)


def _tighter_family(graph: Graph, family: LowerSetFamily) -> LowerSetFamily | None:
    """The same approximate family with the simulator's stage costs, where ``family`` uses
    the upper bound and simulating every pair is affordable (``_TIGHTER_WORK``); else None."""
    if family.simulated or (family.size ** 2 // 2) * max(family.bits.n, 1) > _TIGHTER_WORK:
        return None
    return _family(graph, False, DEFAULT_MAX_LOWER_SETS, simulated=True)


def _plan_from_sequence(
    graph: Graph, family: LowerSetFamily, sequence: list[int], solver: str,
    budget: int | None, notes: list[str], dp_feasible: bool,
) -> Plan:
    ids = family.bits.ids
    stages: list[Stage] = []
    last = len(sequence) - 1
    for position, (before, after) in enumerate(zip(sequence, sequence[1:]), start=1):
        new = np.flatnonzero(family.member[after] & ~family.member[before])
        nodes = [ids[i] for i in new]
        # Every stage but the last recomputes Vi \ B(Li), keeping B(Li) (the executor runs
        # a stage whose vertices are all kept without running anything again).
        stages.append(Stage(nodes, "recompute" if position < last else "keep"))
    dp_peak, extra = family.evaluate(sequence)
    plan = make_plan(graph, stages, solver, budget, extra_seconds=extra, notes=notes)
    model = "the simulator's stage memory" if family.simulated else "its upper bound"
    plan.notes.append(
        f"DP peak ({model}) {dp_peak} bytes; simulator peak {plan.predicted_peak_bytes} bytes; "
        f"{len(stages)} stages over {family.size} lower sets"
    )
    plan.feasible = dp_feasible and (budget is None or plan.guaranteed_peak_bytes <= budget)
    return plan


def _solve(graph: Graph, budget_bytes: int | None, *, exact: bool, objective: str,
           max_lower_sets: int, time_steps: int) -> Plan:
    budget = _check_budget(budget_bytes)
    if time_steps < 1:
        raise ValueError(f"time_steps={time_steps} must be at least 1")
    name = "kusumoto-" + ("exact-" if exact else "") + objective
    family = _family(graph, exact, max_lower_sets)
    notes: list[str] = []
    if not family.bits.integer_times:
        notes.append(f"times bucketed in steps of total forward time / {time_steps}")
    if len(graph) == 0:
        return make_plan(graph, [], name, budget, extra_seconds=0.0, notes=["empty graph"])
    if budget is None and objective == "tc":
        # No limit: least extra time is no recomputation, one stage.
        notes.append("no budget: one stage, nothing recomputed")
        return _plan_from_sequence(graph, family, [0, family.size - 1], name, None, notes, True)
    margin = model_margin(graph)
    # The DP meets the budget less the plan's margin (docs/design.md section 4.7).
    target = None if budget is None else max(budget - margin, 0)
    if target is None:
        target = family.min_budget()
        notes.append(
            f"no budget: memory-centric strategy at the smallest budget with a solution, {target} bytes"
        )
    found = _run(family, target, objective, time_steps)
    if found is not None:
        return _plan_from_sequence(graph, family, found, name, budget, notes, True)
    tighter = _tighter_family(graph, family)
    if tighter is not None:
        family = tighter
        found = _run(family, target, objective, time_steps)
        if found is not None:
            notes.append("no strategy under the stage-memory upper bound; found with the "
                         "simulator's own stage costs")
            return _plan_from_sequence(graph, family, found, name, budget, notes, True)
    smallest = family.min_budget()
    notes.append(
        f"no strategy has peak <= {budget} bytes; the smallest budget with one is "
        f"{smallest + margin} bytes: this is the strategy for that budget"
    )
    found = _run(family, smallest, objective, time_steps)
    assert found is not None  # g({}) is met by construction
    return _plan_from_sequence(graph, family, found, name, budget, notes, False)


_COARSE_STEPS = 32


def _run(family: LowerSetFamily, budget: int | None, objective: str,
         time_steps: int) -> list[int] | None:
    """The DP, for TC preceded by a coarse pass (``_COARSE_STEPS`` time buckets) whose
    strategy's exact T bounds the fine pass: states slower than it cannot lead to the
    optimum, and at generous budgets most of the fine table is such states."""
    if budget is not None and family.min_budget() > budget:
        return None
    unit = family.time_unit(time_steps)
    bound = None
    coarse = None
    if objective == "tc":
        total = float(family.bits.t_fwd.sum())
        coarse_unit = max(unit, total / _COARSE_STEPS)
        if coarse_unit > unit:
            coarse = family.solve(budget, objective, coarse_unit)
            if coarse is None:
                return None
            bound = coarse[1]
            if bound <= 0.0:
                return coarse[0]  # nothing recomputed: nothing is faster
            if not family.bits.integer_times:
                # Buckets relative to the time that matters (at most the bound), not to
                # the whole forward: at generous budgets T is a small part of it.
                unit = max(bound / time_steps, total * 1e-12)
    result = family.solve(budget, objective, unit, bound)
    if result is None and coarse is not None:
        # A bucket keeps its least-cache state, which may be up to a unit slower than the
        # one it stands for, so over many stages every fine path can overrun the coarse
        # strategy's T and be cut; that strategy itself fits the budget.
        return coarse[0]
    return None if result is None else result[0]


def solve_approx_tc(graph: Graph, budget_bytes: int | None, *,
                    max_lower_sets: int = DEFAULT_MAX_LOWER_SETS,
                    time_steps: int = DEFAULT_TIME_STEPS) -> Plan:
    """Approximate DP (section 4.3, at most n + 2 lower sets), time-centric: least extra time among
    strategies with peak <= budget. Budget None: one stage, nothing recomputed.
    ``max_lower_sets`` is accepted for a uniform signature and not used."""
    return _solve(graph, budget_bytes, exact=False, objective="tc",
                  max_lower_sets=max_lower_sets, time_steps=time_steps)


def solve_approx_mc(graph: Graph, budget_bytes: int | None, *,
                    max_lower_sets: int = DEFAULT_MAX_LOWER_SETS,
                    time_steps: int = DEFAULT_TIME_STEPS) -> Plan:
    """Approximate DP (section 4.3), memory-centric (section 4.4): the largest extra time
    among strategies with peak <= budget. Budget None: the smallest budget with a solution
    (the paper's memory-centric strategy)."""
    return _solve(graph, budget_bytes, exact=False, objective="mc",
                  max_lower_sets=max_lower_sets, time_steps=time_steps)


def solve_exact_tc(graph: Graph, budget_bytes: int | None, *,
                   max_lower_sets: int = DEFAULT_MAX_LOWER_SETS,
                   time_steps: int = DEFAULT_TIME_STEPS) -> Plan:
    """Exact DP (section 4.2, all lower sets), time-centric. Raises ValueError when the
    graph has more than ``max_lower_sets`` lower sets."""
    return _solve(graph, budget_bytes, exact=True, objective="tc",
                  max_lower_sets=max_lower_sets, time_steps=time_steps)


def solve_exact_mc(graph: Graph, budget_bytes: int | None, *,
                   max_lower_sets: int = DEFAULT_MAX_LOWER_SETS,
                   time_steps: int = DEFAULT_TIME_STEPS) -> Plan:
    """Exact DP (section 4.2), memory-centric (section 4.4)."""
    return _solve(graph, budget_bytes, exact=True, objective="mc",
                  max_lower_sets=max_lower_sets, time_steps=time_steps)


def _min_budget(graph: Graph, exact: bool, max_lower_sets: int = DEFAULT_MAX_LOWER_SETS,
                **_: Any) -> int:
    if len(graph) == 0:
        return 0
    family = _family(graph, exact, max_lower_sets)
    tighter = None if exact else _tighter_family(graph, family)
    return (tighter or family).min_budget() + model_margin(graph)


def min_budget_solve_approx_tc(graph: Graph, **options: Any) -> int:
    """Smallest budget for which the approximate DP has a strategy (binary search on M over
    the DP's own feasibility, section 5.1). The same for TC and MC."""
    return _min_budget(graph, exact=False, **options)


def min_budget_solve_approx_mc(graph: Graph, **options: Any) -> int:
    """See :func:`min_budget_solve_approx_tc`."""
    return _min_budget(graph, exact=False, **options)


def min_budget_solve_exact_tc(graph: Graph, **options: Any) -> int:
    """Smallest budget for which any canonical strategy exists (exact DP)."""
    return _min_budget(graph, exact=True, **options)


def min_budget_solve_exact_mc(graph: Graph, **options: Any) -> int:
    """See :func:`min_budget_solve_exact_tc`."""
    return _min_budget(graph, exact=True, **options)

