"""Beaumont, Eyraud-Dubois and Shilova, "Optimal GPU-CPU Offloading Strategies for Deep Neural
Network Training" (Euro-Par 2020; docs/design.md section 4.5): the chain model (section 3.1), its memory figures and
the lower bound (section 3.2).

The model (paper section 3.1): a chain of forward ops ``F_0 .. F_{n-1}`` and backward ops
``B_{n-1} .. B_0``. ``F_i`` reads activation ``x_i`` and produces ``x_{i+1}``; ``B_i`` reads
``x_i``, ``x_{i+1}`` and the gradient ``y_{i+1}`` and produces ``y_i``. Ops need the temporary
bytes ``ex_F``/``ex_B``. Activations may be copied to the host at bandwidth ``beta`` (one
transfer at a time, overlapping compute, memory released when an offload completes and reserved
when a prefetch starts: assumptions (A)-(E)).

Indices follow the paper: ``x`` and ``y`` have ``n + 1`` entries, ``u_F``/``u_B``/``ex_F``/
``ex_B`` have ``n``. ``x_n`` (the last output) is never offloaded: its backward reads it at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Stage

__all__ = [
    "Chain", "articulation_stages", "chain_from_graph", "lower_bound", "min_memory", "op_memory",
    "peak_memory",
]


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
    _add_other_outputs(graph, stage_ids, kept_values, ex_F, ex_B)
    chain = Chain(u_F, u_B, x, y, ex_F, ex_B, M_GPU=float(M_GPU or math.inf), beta=bandwidth,
                  stages=stage_ids)
    return chain


def _add_other_outputs(graph: Graph, stage_ids: list[list[str]], kept_values: set[str],
                       ex_F: list[float], ex_B: list[float]) -> None:
    """The paper's chain has one output, the last op's. A step's other outputs (a skip
    connection leaving the traced part, an auxiliary head) are held by the loss until the
    backward starts and their gradients from then until their own op's backward, as the
    simulator counts them: each is transient memory of the ops in between, in ``ex_F`` (its
    value, unless a stage keeps it) and ``ex_B`` (its gradient, shared out as the simulator
    does where the loss's gradients were measured). Upper bounds, like the rest of ``ex``."""
    meta = graph.meta
    last = graph.ids[-1]
    outputs = [o for o in dict.fromkeys(meta.outputs or [last]) if o in graph]
    sizes = sum(graph[o].mem for o in outputs)
    share = (1.0 if meta.output_grad_bytes is None or not sizes
             else min(meta.output_grad_bytes / sizes, 1.0))
    requires = meta.requires_grad or {}
    stage_of = {nid: k for k, stage in enumerate(stage_ids) for nid in stage}
    for o in outputs:
        if o == last:
            continue
        for j in range(stage_of[o] + 1, len(stage_ids)):
            if o not in kept_values:
                ex_F[j] += graph[o].mem
            if requires.get(o, True):
                ex_B[j] += graph[o].mem * share


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
