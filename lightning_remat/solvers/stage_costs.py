"""A step's peak as a fold over the stages of a plan, and the per-vertex figures the
simulator charges: what Kusumoto et al.'s DP ("A Graph Theoretic Framework of Recomputation
Algorithms for Memory-Efficient Backpropagation", 2019) and the solvers' upper bounds read
from the one model of a step (``solvers.simulate``, docs/design.md section 4.7).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan
from lightning_remat.solvers.schedule import make_schedule
from lightning_remat.solvers.simulate import SharedSteps, StepSimulation
from lightning_remat.solvers.step_memory import Timeline

__all__ = ["StageCost", "VertexCosts", "stage_cost", "stage_costs", "vertex_costs"]

_PREFIX_STATES = 4096  # forward states kept per graph (each about its kept boundary's size)


@dataclass
class VertexCosts:
    """What the simulator charges each vertex (for solvers that bound its figures)."""

    size: dict[str, int]
    """Bytes the output allocates (0 for a view of an input or parameter)."""
    gradients: dict[str, int]
    """Bytes of gradients (of values and of parameters) and transients live at the peak of
    the vertex's backward, or its forward workspace if larger. Every plan back-propagates in
    the same order, so this does not depend on the plan."""
    extra: dict[str, int]
    """Bytes the op saves besides forward values."""
    param_bytes: dict[str, int]
    """Bytes of the gradients of the op's parameters."""
    views: set[str] = field(default_factory=set)
    """Vertices whose output is a view of another vertex's storage: they allocate nothing
    under any plan (an in-place op may get a storage of its own, ``Schedule.rewritten``)."""
    storage: dict[str, int] = field(default_factory=dict)
    """Bytes of the storage each vertex's output lives in: its base's for a view (a kept
    slice holds the whole tensor it was cut from)."""


def vertex_costs(graph: Graph) -> VertexCosts:
    """The per-vertex figures the simulator works with, from the graph's costs and meta."""
    sim = StepSimulation(graph, None)
    if graph.ids:
        sim.run()
    gradients = {v: max(sim.gradient_peak.get(v, 0), graph[v].ws_fwd) for v in graph.ids}
    views = {v for v in graph.ids if sim.base[v] != v and v not in sim.shared.inplace}
    storage = {v: max(sim.size[sim.base[v]], sim.size[v]) if v in views else sim.size[v] for v in graph.ids}
    return VertexCosts(dict(sim.size), gradients, dict(sim.extra), dict(sim.param_bytes), views, storage)


@dataclass
class StageCost:
    """One stage's part of a step's peak (docs/design.md section 4.7): the step's peak is
    ``max over stages of (cache before the stage + peak_above_cache)``, the cache before
    stage i being the sum of ``cache_bytes`` of the stages before it (Kusumoto et al.'s
    ``U(i-1)``)."""

    peak_above_cache: int
    """The highest live bytes during the stage's forward, recomputation and backward, less
    the cache the earlier stages hold."""
    cache_bytes: int
    """What the stage holds from its forward to its recomputation: its kept boundary values
    and their extra saved outputs."""


def stage_costs(graph: Graph, plan: Plan) -> list[StageCost]:
    """The step's peak under ``plan`` as a fold over its stages (see :class:`StageCost`).
    A stage's ``peak_above_cache`` depends only on the stage's vertices and what came before
    it as a set, not on how the earlier vertices were staged, so Kusumoto et al.'s DP over
    lower sets can use it (``solvers.kusumoto``). Every recomputed stage keeps its boundary
    (``make_schedule``'s ``keep_boundaries``): a boundary a stage leaves to plain checkpoint
    is held by its readers instead, for no longer, and the fold needs it in the cache."""
    sim = StepSimulation(graph, plan, schedule=make_schedule(graph, plan, keep_boundaries=True))
    timeline = sim.run() if graph.ids else Timeline()
    peaks = [0] * len(sim.stages)
    for event in timeline.events:
        peaks[event.stage] = max(peaks[event.stage], event.peak_bytes)
    costs: list[StageCost] = []
    cache = 0
    for k, peak in enumerate(peaks):
        costs.append(StageCost(peak - cache, sim.kept_bytes[k]))
        cache += sim.kept_bytes[k]
    return costs


def stage_cost(graph: Graph, plan: Plan, k: int, shared: SharedSteps | None = None) -> StageCost:
    """``stage_costs(graph, plan)[k]``, simulating only what can change its figures: up to
    the end of stage k's backward, and where every later stage is kept, not those stages
    either (they leave stage k's backward only their gradients,
    :meth:`SharedSteps.tail_gradients`; what they held of earlier values is gone by then)."""
    shared = shared if shared is not None else SharedSteps(graph)
    sim = StepSimulation(graph, plan, shared=shared,
                         schedule=make_schedule(graph, plan, parts=shared.parts, keep_boundaries=True))
    peak = 0
    if graph.ids:
        if k > 0:
            # The forward of the stages before k is the same for every plan that begins
            # with them and rewrites the same in-place ops (the DP's sources).
            key = (tuple((tuple(s), a) for s, a in zip(sim.stages[:k], sim.actions)),
                   frozenset(sim.own_storage))
            state = shared.prefixes.get(key)
            if state is None:
                for j in range(k):
                    sim.forward_stage(j)
                if len(shared.prefixes) >= _PREFIX_STATES:
                    shared.prefixes.clear()
                state = shared.prefixes[key] = sim.forward_state()
            sim.resume_forward(state)
            sim.timeline = Timeline()
        tail = plan.stages[k + 1:]
        skip = bool(tail) and all(s.action == "keep" for s in tail)
        for event in sim.run(stop_after=k, skip_tail=skip).events:
            if event.stage == k:
                peak = max(peak, event.peak_bytes)
    return StageCost(peak - sum(sim.kept_bytes[:k]), sim.kept_bytes[k])
