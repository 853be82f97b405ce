"""Kusumoto et al. 2019, "A Graph Theoretic Framework of Recomputation Algorithms for
Memory-Efficient Backpropagation" (NeurIPS 2019; docs/design.md section 4.4): the family of
lower sets with the quantities the DP needs of each, and the DP over (L, t).

A boolean membership matrix plus packed 64-bit words hold the family, so that the per-pair
quantities (subset test, ``mem(B(L') & L)``) are numpy operations over all sources of a
target at once.

- Dominated states are pruned: for TC, ``(t1, m1)`` dominates ``(t2, m2)`` at the same L when
  ``t1 <= t2`` and ``m1 <= m2`` (every continuation of the second is feasible from the first
  and no slower); for MC when ``t1 >= t2`` and ``m1 <= m2``. This keeps the paper's optimum.
- Time discretisation: when every ``t_fwd`` is a whole number (tests, Kusumoto's own costs of
  1 and 10) times are exact and the DP is exact. Otherwise states are bucketed by
  ``floor(t / unit)`` and only the least ``m`` per ``(L, bucket)`` is kept (the paper's
  discretised table); the result's T may then exceed the optimum by up to one ``unit`` per
  stage. MC uses ``unit = total forward time / time_steps``. TC first runs a coarse pass
  (the package's ``_run``: 32 buckets over the whole forward time); its strategy's exact T bounds the fine pass
  (slower states are dropped, which keeps the optimum) and sets its ``unit = T / time_steps``,
  so the resolution follows the extra time that is actually at stake. The T reported is
  always computed exactly from the chosen sequence.
- Further pruning that keeps the optimum: ``g(L)``, the least budget above the held cache
  with which the strategy can still be finished from L (one backward pass), drops states
  with ``m + g(L) > M``; ``g({})`` is also the smallest budget with any strategy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lightning_remat.solvers.kusumoto.bits import GraphBits
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.scoring import stage_overhead_seconds
from lightning_remat.solvers.simulate import SharedSteps
from lightning_remat.solvers.stage_costs import stage_cost

__all__ = ["LowerSetFamily"]

_INF = np.iinfo(np.int64).max
# Cache per-target transition arrays while their total size stays under this many entries.
_TRANSITION_CACHE_ENTRIES = 5_000_000


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
class SimulatedPairs:
    """The simulator's stage costs (``stage_costs.stage_cost``: peak above the cache, cache
    added) per pair of lower sets, keyed by the two sets' bits, with the simulations' shared
    state: one per graph memory (``kusumoto._family``), shared by every family over it. The
    simulator's memory reads no time, so auto's unit-time graph and the measured one share
    it; and a set in several families (the approximate DP's, the exact DP's, the prefixes of
    the forward's order, which on a chain are the same sets) is simulated once."""

    pairs: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    shared: SharedSteps | None = None


@dataclass
class LowerSetFamily:
    """Lower sets sorted by size (index 0 is {}, the last is V) with what the DP needs of
    each: ``mem(L)``, ``time(L)``, the boundary ``B(L)``, what a stage ending in L keeps."""

    bits: GraphBits
    sets: list[int]
    simulated: bool = False
    """Stage costs from the simulator itself, one simulation per pair of lower sets (the
    exact DP on small graphs); else the vectorised upper bound (the package docstring)."""
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
    stage_memory: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """The simulated stage memory per target set (``_simulated_costs``)."""
    simulated_pairs: SimulatedPairs = field(default_factory=SimulatedPairs)
    """Where ``stage_memory`` is read from, pair by pair (shared, ``kusumoto._family``)."""

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
        self.rewrite_kept = kept.astype(np.float64) @ bits.inplace_time
        self.count_set = member.sum(axis=1, dtype=np.int64)
        self.output_set = (member & bits.output).sum(axis=1, dtype=np.int64)

    @property
    def size(self) -> int:
        return len(self.sets)

    def transitions(self, j: int) -> tuple[np.ndarray, ...]:
        """For target set j: its proper sub-lower-sets in the family (indices), and per
        source L: the stage's peak above the cache the earlier stages hold, the cache it
        adds (its kept boundary values with their extra saved outputs), its extra time,
        the forward time of what it recomputes (eq. 1: ``time(Vi \\ B(Li))``, 0 for the last
        stage), and the executor's own time for the stage (``simulate.stage_overhead_seconds``,
        0 for the last). A stage whose kept values cost less to run again than the selective
        policy on its ops (and on its kept in-place ops, which the policy runs out of place) runs under plain checkpoint (``solvers.schedule``): its extra time
        is then the whole stage's, and its own time ``c_stage`` alone. See the package docstring for the stage memory."""
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
            rewrite_before = inside.astype(np.float64) @ bits.inplace_time[kept_idx]
        else:
            kept_before = np.zeros(sources.size, dtype=np.int64)
            time_before = np.zeros(sources.size, dtype=np.float64)
            rewrite_before = time_before
        last = j == self.size - 1
        if self.simulated:
            stage_mem, cache_add = self._simulated_costs(sources, j)
        else:
            # Every value of the stage and every extra block its ops save, plus the most
            # gradient (and transient) bytes any of its ops meets in the backward, which
            # are the same under every plan (the package docstring).
            inside = self.member[j] & ~self.member[sources]
            stage_mem = (self.size_set[j] - self.size_set[sources] - self._in_place_shared(inside, last)
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
            kept_time = self.time_kept[j] - time_before
            # Every recomputed stage runs under checkpoint: the executor's own time. Where
            # running its kept values again costs less than the selective policy on its
            # ops, and none is a model output, it runs under plain checkpoint and runs them
            # again (``solvers.schedule``, as the executor does).
            # The policy's time includes the in-place ops among the kept values, which it
            # runs out of place (``schedule.rewrite_seconds``).
            per_vertex = stage_overhead_seconds(bits.graph, 1) - stage_overhead_seconds(bits.graph, 0)
            policy = ((self.count_set[j] - self.count_set[sources]) * per_vertex
                      + self.rewrite_kept[j] - rewrite_before)
            plain = (self.output_set[j] == self.output_set[sources]) & (kept_time < policy)
            extra_time = np.maximum(stage_time - np.where(plain, 0.0, kept_time), 0.0)
            overhead = stage_overhead_seconds(bits.graph, 0) + np.where(plain, 0.0, policy)
        result = (sources, stage_mem.astype(np.int64), cache_add.astype(np.int64), extra_time, overhead)
        if self._cached_entries + sources.size <= _TRANSITION_CACHE_ENTRIES:
            self._cache[j] = result
            self._cached_entries += sources.size
        return result

    def _in_place_shared(self, inside: np.ndarray, last: bool) -> np.ndarray:
        """Per stage (a row of ``inside``, its vertices): the bytes of its in-place ops that
        run in place whatever the rest of the plan is, so share their storage with the
        value they modify and allocate nothing (``GraphBits.in_place``): each op is in the
        stage with the values of that storage and their readers and, in a recomputed stage,
        with its own readers (else the selective policy may run it out of place,
        ``schedule._rewritten``). The bound counts each other in-place op's storage again."""
        shared = np.zeros(inside.shape[0], dtype=np.int64)
        for v, together, readers in self.bits.in_place:
            runs_in_place = inside[:, v] & inside[:, together].all(axis=1)
            if not last:
                runs_in_place &= inside[:, readers].all(axis=1)
            shared += np.where(runs_in_place, self.bits.allocated[v], 0)
        return shared

    def _simulated_costs(self, sources: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
        """The simulator's own stage costs (``stage_costs.stage_costs``) for each source L and
        target L': the plan [L recomputed, L' less L, the rest kept] is simulated and the
        middle stage's cost read off; it does not depend on how L itself is staged."""
        known = self.stage_memory.get(j)
        if known is not None:
            return known
        graph, ids = self.bits.graph, self.bits.ids
        last = j == self.size - 1
        after = [ids[i] for i in np.flatnonzero(~self.member[j])]
        stage_mem = np.zeros(sources.size, dtype=np.int64)
        cache_add = np.zeros(sources.size, dtype=np.int64)
        simulated = self.simulated_pairs
        if simulated.shared is None:
            simulated.shared = SharedSteps(graph)
        target = self.sets[j]
        for position, source in enumerate(sources):
            key = (self.sets[source], target)
            known = simulated.pairs.get(key)
            if known is None:
                before = [ids[i] for i in np.flatnonzero(self.member[source])]
                middle = [ids[i] for i in np.flatnonzero(self.member[j] & ~self.member[source])]
                stages = [Stage(before, "recompute")] if before else []
                stages.append(Stage(middle, "keep" if last else "recompute"))
                if after:
                    stages.append(Stage(after, "keep"))
                cost = stage_cost(graph, Plan(stages, [], 0, 0.0, "", True), 1 if before else 0,
                                  simulated.shared)
                known = simulated.pairs[key] = (cost.peak_above_cache, cost.cache_bytes)
            stage_mem[position], cache_add[position] = known
        self.stage_memory[j] = stage_mem, cache_add
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
