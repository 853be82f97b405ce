"""Offloading activations to host memory: Beaumont, Eyraud-Dubois and Shilova, "Optimal GPU-CPU
Offloading Strategies for Deep Neural Network Training" (Euro-Par 2020;
docs/design.md section 4.5).

Length: the lower bound, GREEDY, DYNPROG and the vDNN baseline all read the same chain model
and are all scored by the same no-wait schedule simulator, so the paper's section 5 stays in
one module.

The model (paper section 3.1): a chain of forward ops ``F_0 .. F_{n-1}`` and backward ops
``B_{n-1} .. B_0``. ``F_i`` reads activation ``x_i`` and produces ``x_{i+1}``; ``B_i`` reads
``x_i``, ``x_{i+1}`` and the gradient ``y_{i+1}`` and produces ``y_i``. Ops need the temporary
bytes ``ex_F``/``ex_B``. Activations may be copied to the host at bandwidth ``beta`` (one
transfer at a time, overlapping compute, memory released when an offload completes and reserved
when a prefetch starts: assumptions (A)-(E)).

What lives here:

- :class:`Chain` and :func:`chain_from_graph` (the chain of a :class:`Graph`);
- :func:`lower_bound` (Proposition 3), :func:`peak_memory` (``M_peak``), :func:`min_memory`;
- :func:`simulate_schedule`: the no-wait, ordered schedule of a set of offloaded activations
  (Proposition 1, Lemma 3): its makespan, idle time and peak;
- :func:`greedy_offload` (Theorem 2 rounded up to whole activations, and the fractional form);
- :func:`dynprog_offload` (Algorithm 1 with equations (1)-(10), the discretisation and the
  iterative rounding fix of section 5.3.2);
- :func:`vdnn_offload` (the vDNN-style baseline of section 6.1);
- the registry wrappers ``solve_lower_bound``, ``solve_greedy``, ``solve_dynprog`` and
  ``solve_vdnn`` (``fn(graph, budget_bytes, **options) -> Plan``).

Indices follow the paper: ``x`` and ``y`` have ``n + 1`` entries, ``u_F``/``u_B``/``ex_F``/
``ex_B`` have ``n``. ``x_n`` (the last output) is never offloaded: its backward reads it at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lightning_remat.budget import format_bytes
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.simulate import make_plan

__all__ = [
    "Chain", "Schedule", "chain_from_graph", "articulation_stages", "lower_bound", "peak_memory",
    "min_memory", "simulate_schedule", "greedy_offload", "greedy_fractional_amounts",
    "dynprog_offload", "vdnn_offload", "solve_lower_bound", "solve_greedy", "solve_dynprog",
    "solve_vdnn",
]

_REL_EPS = 1e-9


# =============================================================================================
# The chain model (section 3.1)
# =============================================================================================
@dataclass
class Chain:
    """A training chain in the paper's notation (section 3.1). Times in seconds, sizes in
    bytes, ``beta`` in bytes per second."""

    u_F: list[float]
    u_B: list[float]
    x: list[float]
    """``|x_0| .. |x_n|``: ``x_i`` is the input of ``F_i``, kept until ``B_{i-1}`` has run."""
    y: list[float]
    """``|y_0| .. |y_n|``: ``y_i`` is the gradient ``B_i`` produces (``y_n`` comes from the
    loss)."""
    ex_F: list[float]
    ex_B: list[float]
    M_GPU: float
    beta: float
    stages: list[list[str]] | None = field(default=None, compare=False)
    """Graph vertex ids of each op, when the chain came from a graph."""

    def __post_init__(self) -> None:
        n = len(self.u_F)
        expected = {"u_B": n, "x": n + 1, "y": n + 1, "ex_F": n, "ex_B": n}
        for name, length in expected.items():
            if len(getattr(self, name)) != length:
                raise ValueError(
                    f"Chain.{name} has {len(getattr(self, name))} entries; a chain of {n} ops "
                    f"needs {length} (x and y have one more entry than u_F)"
                )
        for name in ("u_F", "u_B", "x", "y", "ex_F", "ex_B"):
            if any(v < 0 or math.isnan(v) for v in getattr(self, name)):
                raise ValueError(f"Chain.{name} has a negative or NaN entry")
        if not self.beta > 0:
            raise ValueError(f"Chain.beta={self.beta} must be a positive bandwidth (bytes/s)")
        if not self.M_GPU > 0:
            raise ValueError(f"Chain.M_GPU={self.M_GPU} must be positive")

    @property
    def n(self) -> int:
        return len(self.u_F)

    @property
    def compute_time(self) -> float:
        """``sum_i u_F_i + u_B_i``: the makespan without any idle time."""
        return float(sum(self.u_F) + sum(self.u_B))

    def with_memory(self, M_GPU: float) -> Chain:
        return Chain(list(self.u_F), list(self.u_B), list(self.x), list(self.y), list(self.ex_F),
                     list(self.ex_B), float(M_GPU), self.beta, self.stages)

    def offloadable(self) -> list[int]:
        """Indices that may be offloaded: every ``x_i`` but the last output, with a size."""
        return [i for i in range(self.n) if self.x[i] > 0]


def articulation_stages(graph: Graph) -> list[list[str]]:
    """Cut the graph into the chain of its articulation segments: a stage ends after the
    vertex at position ``p`` when no edge runs from a vertex before ``p`` to one after it,
    so ``p``'s value is the only one crossing the cut (the paper's "virtual layers",
    section 6.1: each non-linear part of the network becomes one op of the chain)."""
    stages: list[list[str]] = []
    current: list[str] = []
    reach = -1  # furthest successor position of the vertices before p
    for p, nid in enumerate(graph.ids):
        current.append(nid)
        if reach <= p:
            stages.append(current)
            current = []
        reach = max([reach, *(graph.position(w) for w in graph.successors(nid))])
    if current:
        stages.append(current)
    return stages


def _stored_bytes_by_stage(graph: Graph, stages: list[list[str]]) -> tuple[list[float], set[str]]:
    """Bytes each stage keeps for the backward, each storage counted once and charged to the
    stage that produced it (``meta.saved_refs`` when present, else each node's
    ``saved``), and the ids whose values are kept."""
    stage_of = {nid: k for k, stage in enumerate(stages) for nid in stage}
    stored = [0.0] * len(stages)
    saved_refs = graph.meta.saved_refs
    kept_values: set[str] = set()
    if saved_refs is None:
        for nid in graph.ids:
            stored[stage_of[nid]] += graph[nid].saved
        return stored, kept_values
    for nid in graph.ids:
        refs = [r for r in dict.fromkeys(saved_refs.get(nid, [])) if r in graph]
        extra = max(graph[nid].saved - sum(graph[r].mem for r in refs), 0)
        stored[stage_of[nid]] += extra
        for r in refs:
            if r not in kept_values:
                kept_values.add(r)
                stored[stage_of[r]] += graph[r].mem
    return stored, kept_values


def chain_from_graph(
    graph: Graph,
    stages: Sequence[Stage] | Sequence[Sequence[str]] | None = None,
    bandwidth: float | None = None,
    M_GPU: float | None = None,
) -> Chain:
    """The chain model of a graph (section 3.1 / 6.1).

    ``stages``: the stage cut of a plan (``Stage`` objects or lists of ids, in forward order);
    by default the graph's articulation chain (:func:`articulation_stages`).
    ``bandwidth``: bytes per second; by default ``graph.meta.bandwidth_bytes_per_s``.

    Op ``i`` is stage ``i``: ``u_F``/``u_B`` are the sums of its vertices' times; ``x_{i+1}``
    is what stage ``i`` keeps for the backward (so offloading ``x_{i+1}`` is offloading stage
    ``i``); ``x_0 = 0`` (the step's input is resident and not part of the budget); ``y_{i+1}``
    is the gradient of stage ``i``'s last vertex and ``y_0 = 0``; ``ex_F`` is the largest
    forward workspace plus the stage's values nobody keeps (and its input when not kept),
    ``ex_B`` the largest backward workspace plus the gradients of the stage's inner values
    (upper bounds: the chain never under-counts the graph's transient memory).
    """
    if bandwidth is None:
        bandwidth = graph.meta.bandwidth_bytes_per_s
        if bandwidth is None:
            raise ValueError(
                "the offloading solvers need the host-device bandwidth: set "
                "graph.meta.bandwidth_bytes_per_s (measured once per device) or pass "
                "bandwidth=<bytes per second>"
            )
    bandwidth = float(bandwidth)
    if not bandwidth > 0:
        raise ValueError(f"bandwidth {bandwidth!r} must be a positive number of bytes per second")
    if len(graph) == 0:
        raise ValueError("the graph is empty: there is no chain to offload")
    if stages is None:
        stage_ids = articulation_stages(graph)
    else:
        stage_ids = [list(s.nodes) if isinstance(s, Stage) else list(s) for s in stages]
        stage_ids = [sorted(s, key=graph.position) for s in stage_ids if s]
        flat = [nid for s in stage_ids for nid in s]
        if sorted(flat) != sorted(graph.ids) or len(set(flat)) != len(flat):
            raise ValueError("stages must cover every vertex of the graph exactly once")
        for a, b in zip(stage_ids, stage_ids[1:]):
            if graph.position(a[-1]) > graph.position(b[0]):
                raise ValueError("stages must be in forward order and not interleave")
    stored, kept_values = _stored_bytes_by_stage(graph, stage_ids)
    u_F = [graph.total("t_fwd", s) for s in stage_ids]
    u_B = [graph.total("t_bwd", s) for s in stage_ids]
    x = [0.0] + [float(v) for v in stored]
    y = [0.0] + [float(graph[s[-1]].mem) for s in stage_ids]
    ex_F: list[float] = []
    ex_B: list[float] = []
    for k, s in enumerate(stage_ids):
        inner = s[:-1]
        transient = sum(graph[v].mem for v in inner if v not in kept_values)
        if kept_values and k > 0 and stage_ids[k - 1][-1] not in kept_values:
            transient += graph[stage_ids[k - 1][-1]].mem  # the input F_k reads
        ex_F.append(float(max(graph[v].ws_fwd for v in s) + transient))
        ex_B.append(float(max(graph[v].ws_bwd for v in s) + sum(graph[v].mem for v in inner)))
    chain = Chain(u_F, u_B, x, y, ex_F, ex_B, M_GPU=float(M_GPU or math.inf), beta=bandwidth,
                  stages=stage_ids)
    return chain


# =============================================================================================
# Memory figures and the lower bound (section 3.2)
# =============================================================================================
def op_memory(chain: Chain) -> tuple[list[float], list[float]]:
    """``m_F_i`` and ``m_B_i`` (section 3.2): the bytes (device and host together) needed
    while running ``F_i`` and ``B_i`` when nothing is offloaded."""
    prefix = [0.0]
    for v in chain.x:
        prefix.append(prefix[-1] + v)
    m_F = [chain.ex_F[i] + prefix[i + 2] for i in range(chain.n)]
    m_B = [chain.ex_B[i] + chain.y[i] + chain.y[i + 1] + prefix[i + 2] for i in range(chain.n)]
    return m_F, m_B


def peak_memory(chain: Chain) -> float:
    """``M_peak`` (section 3.2): the peak of the schedule that offloads nothing."""
    m_F, m_B = op_memory(chain)
    return max(m_F + m_B)


def min_memory(chain: Chain) -> float:
    """The smallest ``M_GPU`` for which some schedule exists: every op with only its own
    inputs and outputs resident (everything else offloaded)."""
    x, y = chain.x, chain.y
    need = []
    for i in range(chain.n):
        need.append(chain.ex_F[i] + x[i] + x[i + 1])
        need.append(chain.ex_B[i] + y[i] + y[i + 1] + x[i] + x[i + 1])
    return max(need)


def lower_bound(chain: Chain) -> float:
    """Proposition 3: ``LB = max(sum(u_F + u_B), 2 (M_peak - M_GPU) / beta)``."""
    return max(chain.compute_time, 2.0 * max(peak_memory(chain) - chain.M_GPU, 0.0) / chain.beta)


# =============================================================================================
# The no-wait, ordered schedule of a set of offloaded activations (Proposition 1, Lemma 3)
# =============================================================================================
@dataclass
class Schedule:
    """One simulated no-wait ordered schedule."""

    amounts: list[float]
    """Bytes of each ``x_i`` offloaded (0: kept on the device)."""
    feasible: bool
    makespan: float
    """Seconds from the start of ``F_0`` to the end of ``B_0`` (inf when infeasible)."""
    idle: float
    """``makespan - sum(u_F + u_B)``: time the device waits for memory or data."""
    peak_bytes: float
    """Largest device memory in use at any instant."""
    reason: str = ""
    """Why it is infeasible."""
    op_start: dict[str, float] = field(default_factory=dict, repr=False)
    transfers: list[tuple[str, int, float, float]] = field(default_factory=list, repr=False)
    """``(kind, i, start, end)`` of each offload / prefetch."""

    @property
    def offloaded(self) -> list[int]:
        return [i for i, a in enumerate(self.amounts) if a > 0]

    @property
    def offloaded_bytes(self) -> float:
        return float(sum(self.amounts))


def _infeasible(amounts: list[float], reason: str) -> Schedule:
    return Schedule(amounts, False, math.inf, math.inf, math.inf, reason)


def _amounts_of(chain: Chain, offload: Iterable[int], amounts: Sequence[float] | None) -> list[float]:
    if amounts is not None:
        if len(amounts) != chain.n + 1:
            raise ValueError(f"amounts has {len(amounts)} entries; the chain has {chain.n + 1} "
                             "activations")
        out = [min(max(float(v), 0.0), chain.x[i]) for i, v in enumerate(amounts)]
    else:
        out = [0.0] * (chain.n + 1)
        for i in offload:
            if not 0 <= int(i) < chain.n:
                raise ValueError(f"cannot offload x_{i}: offloadable indices are 0..{chain.n - 1}")
            out[int(i)] = float(chain.x[int(i)])
    out[chain.n] = 0.0
    return out


def simulate_schedule(
    chain: Chain,
    offload: Iterable[int] = (),
    amounts: Sequence[float] | None = None,
    fractional: bool = False,
) -> Schedule:
    """The no-wait, ordered schedule (Proposition 1; Lemma 3) that offloads the activations
    ``offload`` (indices), or ``amounts[i]`` bytes of each ``x_i`` (a prefix of an activation
    may be offloaded in the fractional relaxation of section 4).

    ``fractional``: offloaded memory is released as it is transferred (section 4) instead of
    when the transfer completes (assumption (E)). Prefetches always reserve their bytes when
    they start.

    Rules: offloads run in increasing index order, each as soon as its activation exists and
    the link is free; prefetches run after every offload, in decreasing order, each as soon
    as the link is free and reserving its bytes leaves room for every op up to its consumer;
    an op starts as soon as its predecessor is done, its inputs are on the device and its
    memory fits (waiting for offloads to release memory when needed).
    """
    return _NoWaitSchedule(chain, _amounts_of(chain, offload, amounts), fractional).run()


class _NoWaitSchedule:
    """:func:`simulate_schedule` step by step: every op alone with the rest offloaded, the
    forward with its offloads, the backward with its prefetches, then the peak. A step that
    finds the schedule infeasible returns why (None when it is not).

    Phases ``0 .. n-1`` are ``F_0 .. F_{n-1}``; phase ``n + k`` is ``B_{n-1-k}``."""

    def __init__(self, chain: Chain, amounts: list[float], fractional: bool) -> None:
        self.chain = chain
        self.amounts = amounts
        self.fractional = fractional
        M = chain.M_GPU
        self.tol = _REL_EPS * max(M if math.isfinite(M) else 0.0, sum(chain.x), 1.0)
        self.kept_prefix = [0.0]
        for i in range(chain.n + 1):
            self.kept_prefix.append(self.kept_prefix[-1] + chain.x[i] - amounts[i])
        self.items: list[tuple[int, float, float, float]] = []  # offloads (i, start, end, bytes)
        self.transfers: list[tuple[str, int, float, float]] = []
        self.op_start: dict[str, float] = {}
        self.link_free = 0.0
        self.offload_end = 0.0  # when the last offload ends
        self.t = 0.0  # when the last op scheduled ends
        self.phase_end: list[float] = []
        self.prefetch_start: dict[int, float] = {}
        self.prefetch_end: dict[int, float] = {}
        self.prefetch_phase: dict[int, int] = {}  # the first phase that runs with x_j reserved

    def run(self) -> Schedule:
        reason = self._check_ops_alone() or self._forward() or self._backward()
        if reason:
            return _infeasible(self.amounts, reason)
        n = self.chain.n
        starts = ([self.op_start[f"F{i}"] for i in range(n)]
                  + [self.op_start[f"B{i}"] for i in range(n - 1, -1, -1)])
        peak = max(self._device_bytes(k, s) for k, s in enumerate(starts))
        return Schedule(self.amounts, True, self.t, self.t - self.chain.compute_time, peak, "",
                        self.op_start, self.transfers)

    # ---- each op with, of the offloaded data, only its own inputs/outputs resident ----------
    def _base_F(self, i: int) -> float:
        amounts = self.amounts
        return self.kept_prefix[i + 2] + amounts[i] + amounts[i + 1] + self.chain.ex_F[i]

    def _base_B(self, i: int) -> float:
        amounts, y = self.amounts, self.chain.y
        return (self.kept_prefix[i + 2] + amounts[i] + amounts[i + 1] + self.chain.ex_B[i] + y[i]
                + y[i + 1])

    def _check_ops_alone(self) -> str | None:
        M = self.chain.M_GPU
        for i in range(self.chain.n):
            for name, need in ((f"F_{i}", self._base_F(i)), (f"B_{i}", self._base_B(i))):
                if need > M + self.tol:
                    return (f"{name} needs {format_bytes(need)} with everything else offloaded "
                            f"(M_GPU {format_bytes(M)})")
        return None

    # ---- offloads ----------------------------------------------------------------------------
    def _released(self, upto: int, at: float) -> float:
        """Bytes of ``x_0 .. x_{upto-1}`` the offloads have released by time ``at``."""
        total = 0.0
        for i, s, e, a in self.items:
            if i >= upto or s >= at:
                break
            if at >= e:
                total += a
            elif self.fractional:
                total += a * (at - s) / (e - s)
        return total

    def _when_released(self, upto: int, need: float, after: float) -> float | None:
        """Earliest time >= ``after`` by which ``need`` bytes of ``x_<upto`` are released."""
        if need <= self.tol:
            return after
        cum = 0.0
        for i, s, e, a in self.items:
            if i >= upto:
                break
            if cum + a >= need - self.tol:
                at = s + max(need - cum, 0.0) / self.chain.beta if self.fractional else e
                return max(at, after)
            cum += a
        return None

    def _start_offload(self, i: int, ready: float) -> None:
        amount = self.amounts[i]
        if amount > 0:
            start = max(ready, self.link_free)
            end = start + amount / self.chain.beta
            self.items.append((i, start, end, amount))
            self.transfers.append(("offload", i, start, end))
            self.link_free = end

    # ---- forward -----------------------------------------------------------------------------
    def _forward(self) -> str | None:
        chain, x = self.chain, self.chain.x
        self._start_offload(0, 0.0)
        used = x[0]  # device bytes before offload releases
        for i in range(chain.n):
            start = self._when_released(i, used + x[i + 1] + chain.ex_F[i] - chain.M_GPU, self.t)
            if start is None:
                return f"F_{i} cannot fit: offloading x_<{i} frees too little"
            self.op_start[f"F{i}"] = start
            self.t = start + chain.u_F[i]
            self.phase_end.append(self.t)
            used += x[i + 1]
            if i + 1 < chain.n:
                self._start_offload(i + 1, self.t)
        self.offload_end = self.link_free
        return None

    # ---- backward ----------------------------------------------------------------------------
    def _backward(self) -> str | None:
        n = self.chain.n
        pending = sorted((i for i in range(n) if self.amounts[i] > 0), reverse=True)
        for i in range(n - 1, -1, -1):
            phase = 2 * n - 1 - i
            while pending and pending[0] >= i:
                j = pending.pop(0)
                if not self._schedule_prefetch(j, phase):
                    return f"no room to prefetch x_{j} before B_{j}"
            start = self._backward_start(i)
            if start is None:
                return f"B_{i} cannot fit while offloads are in flight"
            self.op_start[f"B{i}"] = start
            self.t = start + self.chain.u_B[i]
            self.phase_end.append(self.t)
        return None

    def _backward_start(self, i: int) -> float | None:
        """When ``B_i`` can start: after its predecessor and its inputs' prefetches, and
        once the memory it needs is free."""
        prefetched = (self.prefetch_end[m] for m in (i, i + 1) if m in self.prefetch_end)
        start = max([self.t, *prefetched])
        if start >= self.offload_end:
            return start
        # Offloads still in flight (eq. (9)'s case): B_i may wait for them to release.
        chain, y = self.chain, self.chain.y
        nominal = (self.kept_prefix[i + 2] + sum(self.amounts[: i + 2]) + y[i] + y[i + 1]
                   + chain.ex_B[i])
        return self._when_released(i + 2, nominal - chain.M_GPU, start)

    def _static_need(self, phase: int, resident: Iterable[int]) -> float:
        n = self.chain.n
        i = phase if phase < n else 2 * n - 1 - phase
        base = self._base_F(i) if phase < n else self._base_B(i)
        return base + sum(self.amounts[m] for m in resident if m < i)

    def _schedule_prefetch(self, j: int, consumer: int) -> bool:
        """Start the prefetch of x_j at the first phase from which reserving it leaves room
        for every op up to its consumer ``B_j`` (phase ``consumer``)."""
        ready = max(self.link_free, self.offload_end)
        first = next((k for k, end in enumerate(self.phase_end) if end > ready),
                     len(self.phase_end))
        resident = [*self.prefetch_start, j]
        needs = [self._static_need(q, resident) for q in range(first, consumer + 1)]
        for k in range(first, consumer + 1):
            if max(needs[k - first:]) <= self.chain.M_GPU + self.tol:
                start = max(ready, self.phase_end[k - 1]) if k > first else ready
                end = start + self.amounts[j] / self.chain.beta
                self.prefetch_start[j] = start
                self.prefetch_phase[j] = k
                self.prefetch_end[j] = end
                self.transfers.append(("prefetch", j, start, end))
                self.link_free = end
                return True
        return False

    # ---- peak: device bytes at every op start, counting each prefetch from its phase on ----
    def _share(self, m: int, phase: int, at: float) -> float:
        """Bytes of offloaded x_m on the device during ``phase`` (started at ``at``)."""
        if m in self.prefetch_phase and phase >= self.prefetch_phase[m]:
            return self.amounts[m]
        return self.amounts[m] - self._released(m + 1, at) + self._released(m, at)

    def _device_bytes(self, phase: int, at: float) -> float:
        chain, amounts, n = self.chain, self.amounts, self.chain.n
        i = phase if phase < n else 2 * n - 1 - phase
        data = self.kept_prefix[i + 2] + sum(
            self._share(m, phase, at) for m in range(i + 2) if amounts[m] > 0)
        return data + (chain.ex_F[i] if phase < n else chain.ex_B[i] + chain.y[i] + chain.y[i + 1])


# =============================================================================================
# GREEDY (section 4.2, Theorem 2)
# =============================================================================================
def greedy_fractional_amounts(chain: Chain) -> list[float]:
    """Theorem 2: offload exactly ``M_peak - M_GPU`` bytes, the first activations first (the
    last one partly): optimal when transfers may be split."""
    need = max(peak_memory(chain) - chain.M_GPU, 0.0)
    amounts = [0.0] * (chain.n + 1)
    for i in chain.offloadable():
        if need <= 0:
            break
        amounts[i] = min(chain.x[i], need)
        need -= amounts[i]
    return amounts


def greedy_offload(chain: Chain) -> list[int]:
    """GREEDY (section 4.2): the first ``k`` activations, ``k`` the smallest with
    ``sum_{i<=k} |x_i| >= M_peak - M_GPU`` (Theorem 2 rounded up to whole activations)."""
    need = peak_memory(chain) - chain.M_GPU
    chosen: list[int] = []
    for i in chain.offloadable():
        if need <= 0:
            break
        chosen.append(i)
        need -= chain.x[i]
    return chosen


# =============================================================================================
# vDNN-style baseline (section 6.1)
# =============================================================================================
def vdnn_offload(chain: Chain) -> list[int]:
    """The vDNN-style heuristic of section 6.1: for every threshold on ``u_F_i / |x_i|``,
    offload all inputs whose ratio reaches it, or every other one of them; keep the best
    simulated schedule (feasible first, then the shortest)."""
    if peak_memory(chain) <= chain.M_GPU:
        return []
    candidates = chain.offloadable()
    ratio = {i: chain.u_F[i] / chain.x[i] for i in candidates}
    best: tuple[bool, float, list[int]] = (False, math.inf, [])
    seen: set[tuple[int, ...]] = set()
    for threshold in sorted(set(ratio.values()), reverse=True):
        chosen = [i for i in candidates if ratio[i] >= threshold]
        for subset in (chosen, chosen[::2]):
            key = tuple(subset)
            if key in seen:
                continue
            seen.add(key)
            sched = simulate_schedule(chain, subset)
            if (sched.feasible, -sched.makespan) > (best[0], -best[1]):
                best = (sched.feasible, sched.makespan, list(subset))
    return best[2]


# =============================================================================================
# DYNPROG (section 5.3, Algorithm 1)
# =============================================================================================
@dataclass
class _Discrete:
    """The chain in memory slots of size ``M_GPU / S`` (section 5.3.2); times as bytes
    transferable in that time (``u * beta``), also in slots."""

    x: list[int]
    y: list[int]
    ex_F: list[int]
    ex_B: list[int]
    uF: list[int]
    uB: list[int]
    S: int


def _discretize(chain: Chain, S: int, x_slots: list[int] | None = None) -> _Discrete:
    scale = S / chain.M_GPU

    def up(v: float) -> int:
        return int(math.ceil(v * scale - 1e-9))

    def from_partial_sums(values: Sequence[float], round_up: bool) -> list[int]:
        # Section 5.3.2: round the partial sums, then take differences.
        out: list[int] = []
        prev = 0
        acc = 0.0
        for v in values:
            acc += v
            cur = int(math.ceil(acc * scale - 1e-9)) if round_up else int(math.floor(acc * scale + 1e-9))
            out.append(cur - prev)
            prev = cur
        return out

    x = x_slots if x_slots is not None else from_partial_sums(chain.x, round_up=True)
    return _Discrete(
        x=list(x), y=[up(v) for v in chain.y], ex_F=[up(v) for v in chain.ex_F],
        ex_B=[up(v) for v in chain.ex_B],
        uF=from_partial_sums([u * chain.beta for u in chain.u_F], round_up=False),
        uB=from_partial_sums([u * chain.beta for u in chain.u_B], round_up=False), S=S,
    )


def _prune_dominated(table: dict) -> dict:
    """Drop states another state dominates: same ``(M_F, Delta_F)``, no larger ``Delta_B``
    and no larger idle time. Every quantity downstream ((6)-(10)) is non-decreasing in
    ``Delta_B``, so a dominated state never leads to a better schedule."""
    fronts: dict[tuple[int, int], list[tuple[int, float, tuple[int, int, int]]]] = {}
    for key, value in table.items():
        fronts.setdefault(key[:2], []).append((key[2], value[0], key))
    kept = {}
    for front in fronts.values():
        front.sort()
        best = math.inf
        for _, idle, key in front:
            if idle < best:
                kept[key] = table[key]
                best = idle
    return kept


def _dynprog_core(chain: Chain, d: _Discrete, top: int = 1) -> list[tuple[list[int], float]] | None:
    """Algorithm 1 on the discretised chain: the ``top`` offload sets with the smallest total
    idle time over final states ``(M_F, Delta_F, Delta_B)``, best first, each with its idle
    time in seconds as the programme predicts it; None when no state survives the memory
    checks."""
    n, S = len(d.uF), d.S
    offloadable = set(chain.offloadable())
    # Negative Delta values (time the link has been idle, in slots) are forgotten by (2)/(7)
    # and only compared, in (9)/(10), with amounts that fit in the memory (at most S) or with
    # terms that are <= S - U_j: clamping them at -S keeps every comparison's outcome.
    floor = -(S + 1)
    # table: state -> (idle, back-pointer)
    layers: list[dict[tuple[int, int, int], tuple[float, tuple[int, int, int] | None, bool]]] = []
    layers.append({(d.x[0], 0, 0): (0.0, None, False)})
    for i in range(n):
        nxt: dict[tuple[int, int, int], tuple[float, tuple[int, int, int] | None, bool]] = {}
        for state, (idle, _, _) in layers[i].items():
            MF, dF, dB = state
            dFp, dBp = max(dF, 0), max(dB, 0)
            MB = d.y[i] + dBp + MF - dFp  # Algorithm 1
            if MF + d.ex_F[i] - dFp + d.x[i + 1] > S:
                continue
            if MB + d.ex_B[i] + d.x[i + 1] + d.y[i + 1] - dBp > S:
                continue
            eps_F = max(0, MF + d.ex_F[i] + d.x[i + 1] - S)  # (1)
            eps_B = max(0, MB + d.ex_B[i] + d.x[i + 1] + d.y[i + 1] - S)  # (6)
            span_F = eps_F + d.uF[i]
            span_B = eps_B + d.uB[i]
            cost = idle + eps_F + eps_B
            choices = [False]
            if i in offloadable and d.x[i] > 0:
                choices.append(True)
            for off in choices:
                if off:
                    nF = dFp + d.x[i] - span_F  # (2)
                    nM = MF + d.x[i + 1] - min(dFp + d.x[i], span_F)  # (3)
                    nB = d.x[i] + max(0, dB - span_B)  # (7)
                else:
                    nF = dF - span_F  # (4)
                    nM = MF + d.x[i + 1] - min(dFp, span_F)  # (5)
                    nB = dB - span_B  # (8)
                key = (nM, max(nF, floor), max(nB, floor))
                old = nxt.get(key)
                if old is None or cost < old[0]:
                    nxt[key] = (cost, state, off)
        if not nxt:
            return None
        layers.append(_prune_dominated(nxt))

    # eps_G between the phases: equations (9) and (10).
    U_B = [0] * (n + 1)  # U_B[j] = sum_{i>j} uB_i
    U_F = [0] * (n + 1)
    for j in range(n - 1, -1, -1):
        U_B[j] = U_B[j + 1] + (d.uB[j + 1] if j + 1 < n else 0)
        U_F[j] = U_F[j + 1] + (d.uF[j + 1] if j + 1 < n else 0)
    x_after = [0] * (n + 2)  # sum_{i > j+1} x_i
    for j in range(n - 1, -1, -1):
        x_after[j] = x_after[j + 1] + (d.x[j + 2] if j + 2 <= n else 0)

    totals: list[tuple[float, tuple[int, int, int]]] = []
    for state, (idle, _, _) in layers[n].items():
        MF, dF, dB = state
        if dF <= 0 and dB <= 0:
            eps_G = 0.0
        elif dF > 0 and dB > 0:
            eps_G = float(dF + dB)
        elif dF > 0:
            av_B = -dB
            eps_G = float(max(0, dF - av_B))  # (9)
            for j in range(n):
                if U_B[j] < av_B:
                    R = d.ex_B[j] + d.y[j] + d.y[j + 1] - x_after[j]
                    eps_G = max(eps_G, R + MF - S - U_B[j])
        else:
            av_F = -dF
            MB = d.y[n] + max(dB, 0) + MF - max(dF, 0)
            eps_G = float(max(0, dB - av_F))  # (10)
            for j in range(n):
                if U_F[j] < av_F:
                    R = d.ex_F[j] - x_after[j]
                    eps_G = max(eps_G, R + MB - S - U_F[j])
        totals.append((idle + eps_G, state))
    totals.sort()
    # Backtrack (Algorithm 1, last line) from the best final states.
    results: list[tuple[list[int], float]] = []
    seen: set[tuple[int, ...]] = set()
    for total, final in totals:
        chosen: list[int] = []
        state: tuple[int, int, int] | None = final
        for i in range(n, 0, -1):
            assert state is not None
            _, prev, off = layers[i][state]
            if off:
                chosen.append(i - 1)
            state = prev
        key = tuple(sorted(chosen))
        if key not in seen:
            seen.add(key)
            results.append((sorted(chosen), total * chain.M_GPU / S / chain.beta))
            if len(results) >= top:
                break
    return results or None


def dynprog_offload(
    chain: Chain, slots: int = 500, max_fixes: int | None = None, top: int = 32,
    polish_passes: int = 2,
) -> list[int]:
    """DYNPROG (section 5.3): the offload set Algorithm 1 finds on the chain discretised into
    ``slots`` memory slots, simulated as a no-wait ordered schedule.

    Section 5.3.2's rounding: ``ex``, ``y`` up; ``u * beta`` by partial sums rounded down;
    ``x`` optimistically by partial sums rounded up, then, while the simulated schedule is
    infeasible, the discretised ``x_i`` furthest below its true value goes up by one slot.
    The programme's model of a schedule is not exact for whole transfers (it is for
    interruptible ones), so the ``top`` best final states of the table are backtracked and
    simulated, and GREEDY's set and "offload everything" are candidates too (both are points
    of the programme's space that the rounded programme may miss); the best simulated
    schedule is then improved by ``polish_passes`` rounds of one-activation local search on
    the simulator (:func:`_polish`; 0 turns it off) and returned.
    """
    if peak_memory(chain) <= chain.M_GPU:
        return []
    if slots < 2:
        raise ValueError(f"slots={slots}: DYNPROG needs at least 2 memory slots (default 500)")
    scale = slots / chain.M_GPU
    d = _discretize(chain, slots)
    candidates: list[list[int]] = [greedy_offload(chain), chain.offloadable()]
    fixes = max_fixes if max_fixes is not None else 2 * chain.n + 2
    x_slots = list(d.x)
    for _ in range(fixes + 1):
        result = _dynprog_core(chain, _discretize(chain, slots, x_slots), top)
        if result is not None:
            candidates[:0] = [chosen for chosen, _ in result]
            if any(simulate_schedule(chain, chosen).feasible for chosen, _ in result):
                break
        # Iterative fix (5.3.2): raise the rounded-down x_i closest to its true value.
        below = [(chain.x[i] * scale - x_slots[i], i) for i in range(chain.n + 1)
                 if x_slots[i] < chain.x[i] * scale - 1e-9]
        if not below:
            break
        _, i = min(below)
        x_slots[i] += 1
    best: tuple[bool, float, list[int]] = (False, math.inf, candidates[-1])
    for chosen in candidates:
        sched = simulate_schedule(chain, chosen)
        if (sched.feasible, -sched.makespan) > (best[0], -best[1]):
            best = (sched.feasible, sched.makespan, chosen)
    if polish_passes and best[0]:
        best = _polish(chain, best[2], best[1], polish_passes)
    return best[2]


def _polish(chain: Chain, chosen: list[int], makespan: float, passes: int
            ) -> tuple[bool, float, list[int]]:
    """Local search on the simulated schedule (not in the paper): add or drop one activation
    at a time while that shortens the simulated makespan. It repairs the cases where the
    programme's interruptible-transfer model is optimistic for whole transfers."""
    current = set(chosen)
    for _ in range(passes):
        improved = False
        for i in chain.offloadable():
            trial = sorted(current ^ {i})
            sched = simulate_schedule(chain, trial)
            if sched.feasible and sched.makespan < makespan * (1 - 1e-9):
                current, makespan, improved = set(trial), sched.makespan, True
        if not improved:
            break
    return True, makespan, sorted(current)


# =============================================================================================
# Registry wrappers: graph + budget -> Plan
# =============================================================================================
def _plan_from_chain(
    graph: Graph, chain: Chain, chosen: list[int], solver: str, budget_bytes: int | None,
    notes: list[str],
) -> Plan:
    assert chain.stages is not None
    offloaded_stages = {i - 1 for i in chosen if i >= 1}  # x_{k+1} is what stage k keeps
    if 0 in chosen and chain.x[0] > 0:
        notes.append("x_0 (the step's input) offloaded: not representable as a stage action")
    stages = [Stage(list(ids), "offload" if k in offloaded_stages else "keep")
              for k, ids in enumerate(chain.stages)]
    sched = simulate_schedule(chain, chosen)
    extra = sched.makespan - chain.compute_time if sched.feasible else math.inf
    notes = list(notes)
    notes.append(
        f"chain of {chain.n} stages, beta={chain.beta:.3g} B/s, M_GPU="
        f"{'unlimited' if not math.isfinite(chain.M_GPU) else format_bytes(chain.M_GPU)}; "
        f"offloaded {len(offloaded_stages)} stages ({format_bytes(sched.offloaded_bytes)}); "
        f"makespan {sched.makespan:.6g} s, LB {lower_bound(chain):.6g} s, "
        f"chain-model peak {format_bytes(sched.peak_bytes) if sched.feasible else 'n/a'}"
    )
    if not sched.feasible:
        notes.append(f"infeasible in the offloading model: {sched.reason}")
    plan = make_plan(graph, stages, solver, budget_bytes,
                     extra_seconds=extra if math.isfinite(extra) else 0.0, notes=notes)
    if plan.feasible != sched.feasible:
        plan.notes.append(
            f"feasible={sched.feasible} from the offloading schedule model (the graph simulator "
            f"predicts a peak of {format_bytes(plan.predicted_peak_bytes)} and says "
            f"{plan.feasible}; its model keeps nothing of an offloaded stage on the device)"
        )
        plan.feasible = sched.feasible
    return plan


def _chain_for(graph: Graph, budget_bytes: int | None, options: dict) -> Chain:
    chain = chain_from_graph(graph, stages=options.pop("stages", None),
                             bandwidth=options.pop("bandwidth", None))
    return chain.with_memory(math.inf if budget_bytes is None else float(budget_bytes))


def _check_options(options: dict, allowed: set[str], solver: str) -> None:
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"solver {solver!r} got unknown options {unknown}; allowed: {sorted(allowed)}")


def solve_lower_bound(graph: Graph, budget_bytes: int | None, **options: object) -> Plan:
    """Proposition 3's bound as a plan: ``predicted_extra_seconds = LB - sum(u_F + u_B)``.
    It is a bound on every schedule, not a schedule: the stages are all ``keep``."""
    _check_options(options, {"stages", "bandwidth"}, "lower-bound")
    chain = _chain_for(graph, budget_bytes, dict(options))
    assert chain.stages is not None
    feasible = min_memory(chain) <= chain.M_GPU
    plan = make_plan(graph, [Stage(list(s), "keep") for s in chain.stages], "lower-bound",
                     budget_bytes, extra_seconds=lower_bound(chain) - chain.compute_time,
                     notes=[f"lower bound (Proposition 3), not a schedule: LB = "
                            f"{lower_bound(chain):.6g} s over {chain.n} stages"])
    plan.feasible = feasible
    return plan


def solve_greedy(graph: Graph, budget_bytes: int | None, **options: object) -> Plan:
    """GREEDY (Theorem 2 rounded up to whole activations) on the graph's chain."""
    _check_options(options, {"stages", "bandwidth"}, "greedy")
    chain = _chain_for(graph, budget_bytes, dict(options))
    return _plan_from_chain(graph, chain, greedy_offload(chain), "greedy", budget_bytes,
                            ["GREEDY: the first activations until M_peak - M_GPU is covered"])


def solve_dynprog(graph: Graph, budget_bytes: int | None, **options: object) -> Plan:
    """DYNPROG (section 5.3) on the graph's chain; option ``slots`` (default 500)."""
    _check_options(options, {"stages", "bandwidth", "slots"}, "dynprog")
    opts = dict(options)
    slots = int(opts.pop("slots", 500))  # type: ignore[call-overload]
    chain = _chain_for(graph, budget_bytes, opts)
    return _plan_from_chain(graph, chain, dynprog_offload(chain, slots), "dynprog",
                            budget_bytes, [f"DYNPROG with {slots} memory slots"])


def solve_vdnn(graph: Graph, budget_bytes: int | None, **options: object) -> Plan:
    """The vDNN-style baseline (section 6.1) on the graph's chain."""
    _check_options(options, {"stages", "bandwidth"}, "vdnn")
    chain = _chain_for(graph, budget_bytes, dict(options))
    return _plan_from_chain(graph, chain, vdnn_offload(chain), "vdnn", budget_bytes,
                            ["vDNN-style: offload inputs by u_F/|x| threshold"])


def _min_budget_search(graph: Graph, choose, options: dict) -> int:
    chain = _chain_for(graph, None, dict(options))
    lo = min_memory(chain)
    hi = peak_memory(chain)
    if simulate_schedule(chain.with_memory(lo), choose(chain.with_memory(lo))).feasible:
        return int(math.ceil(lo))
    while hi - lo > max(1.0, hi * 1e-5):
        mid = (lo + hi) / 2
        c = chain.with_memory(mid)
        if simulate_schedule(c, choose(c)).feasible:
            hi = mid
        else:
            lo = mid
    return int(math.ceil(hi))


def min_budget_solve_lower_bound(graph: Graph, **options: object) -> int:
    options.pop("slots", None)
    return int(math.ceil(min_memory(_chain_for(graph, None, dict(options)))))


def min_budget_solve_greedy(graph: Graph, **options: object) -> int:
    return _min_budget_search(graph, greedy_offload, dict(options))


def min_budget_solve_dynprog(graph: Graph, **options: object) -> int:
    # "offload everything" is always a DYNPROG candidate, so its minimum is the chain's.
    options.pop("slots", None)
    return int(math.ceil(min_memory(_chain_for(graph, None, dict(options)))))


def min_budget_solve_vdnn(graph: Graph, **options: object) -> int:
    return _min_budget_search(graph, vdnn_offload, dict(options))
