"""Plans scored by the simulator: every solver turns its stages into a :class:`Plan` with
:func:`make_plan`, which fills in the predicted peak (``solvers.simulate``), the margin the
model of a step leaves (docs/design.md section 4.7) and the extra time (Kusumoto et al.'s
eq. 1 for what the schedule recomputes, plus the executor's own time).
"""

from __future__ import annotations

import mmap

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan, Stage, boundary
from lightning_remat.solvers.schedule import Schedule, make_schedule, rewrite_seconds
from lightning_remat.solvers.simulate import plain_simulated, shared_steps, simulate

__all__ = [
    "CUDA_BLOCK_BYTES", "CUDA_UNSPLIT_BYTES", "HEAP_BYTES_PER_MAPPED_BUFFER", "HEAP_BYTES_PER_VERTEX",
    "SMALL_TENSOR_BYTES", "executor_seconds",
    "expandable_segments", "make_plan", "model_margin",
    "plain_plan", "recomputed_seconds", "solve_plain", "stage_overhead_seconds",
]


def make_plan(
    graph: Graph,
    stages: list[Stage] | list[tuple[list[str], str]],
    solver: str,
    budget_bytes: int | None = None,
    stored: list[str] | None = None,
    extra_seconds: float | None = None,
    notes: list[str] | None = None,
    *,
    whole_stages: bool = False,
) -> Plan:
    """A Plan with its derived fields filled in: stages ordered topologically inside,
    ``stored`` (default: the boundary plus every vertex of a kept stage), the simulator's
    predicted peak and margin, the recomputation time (default: the forward time of what
    the executor runs again, ``Schedule.recomputed``) and ``feasible`` (predicted peak
    plus margin within the budget; True without a budget). ``whole_stages``: as
    :func:`simulate`'s."""
    stage_list = [s if isinstance(s, Stage) else Stage(list(s[0]), s[1]) for s in stages]
    for s in stage_list:
        s.nodes = sorted(s.nodes, key=graph.position)
    if stored is None:
        crossing = set(boundary(graph, stage_list))
        kept = {nid for s in stage_list if s.action != "recompute" for nid in s.nodes}
        stored = [nid for nid in graph.ids if nid in crossing or nid in kept]
    plan = Plan(
        stages=stage_list,
        stored=list(stored),
        predicted_peak_bytes=0,
        predicted_extra_seconds=float(extra_seconds or 0.0),
        solver=solver,
        feasible=True,
        notes=list(notes or []),
    )
    plan.validate(graph)
    schedule = make_schedule(graph, plan, whole_stages=whole_stages, parts=shared_steps(graph).parts)
    if extra_seconds is None:
        plan.predicted_extra_seconds = recomputed_seconds(graph, schedule) + executor_seconds(graph, schedule)
    plan.predicted_peak_bytes = simulate(graph, plan, schedule=schedule).peak_bytes
    plan.margin_bytes = model_margin(graph)
    plan.feasible = budget_bytes is None or plan.guaranteed_peak_bytes <= budget_bytes
    return plan


SMALL_TENSOR_BYTES = 64
"""Per vertex, on the CPU: the small tensors a step makes that no vertex's cost holds (a
scalar loss, a BatchNorm's ``num_batches_tracked`` update, statistics rounded to storage
sizes). The CPU meter counts every storage (docs/design.md section 6); measured on the
tests' models the simulator is within a few hundred bytes of it."""

HEAP_BYTES_PER_VERTEX = 512
"""Per vertex, on the CPU: what the C library's heap holds for each op's objects beside
its storages (the tensor and storage structs, autograd's node and its saved variables),
which the resident memory the kernel counts includes and no storage meter sees
(docs/design.md section 4.7)."""

HEAP_BYTES_PER_MAPPED_BUFFER = 1024
"""Per buffer the C library maps on its own pages that the simulated plain step holds at
once (``Timeline.mapped_buffers``), on the CPU: the heap's records of a large live tensor beyond ``HEAP_BYTES_PER_VERTEX`` (its saved
variables in autograd's nodes, the Python objects that hold it). A generated convolution
model of 63 vertices and 36 such buffers measured 154.7 and 187.5 KB over its prediction at
the allocator's edge in two CI runs, where its pages accounted for 147.5 KB and its
vertices' allowance 36.3 KB."""

CUDA_BLOCK_BYTES = 512
"""The CUDA caching allocator rounds every allocation up to a multiple of 512 bytes."""

CUDA_UNSPLIT_BYTES = 2**20
"""The CUDA caching allocator hands a cached block of the large pool (requests over 1 MiB)
out whole when what would be left after splitting it is under 1 MiB: a request can take up
to 1 MiB more than it asked for. With ``expandable_segments:True`` blocks are mapped to
fit instead, and this does not happen."""


def expandable_segments() -> bool:
    """Whether the CUDA caching allocator runs with ``expandable_segments:True``
    (``PYTORCH_CUDA_ALLOC_CONF``, or ``PYTORCH_ALLOC_CONF`` in newer torch)."""
    import os

    conf = ",".join(os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def model_margin(graph: Graph, expandable: bool | None = None) -> int:
    """The known error of the model of a step, which a budget must cover beyond the
    predicted peak (docs/design.md section 4.7): on CUDA the allocator's rounding, up to one
    block for each storage that can be live at once (each vertex's value, its saved state
    and its gradient, and each parameter gradient), plus, unless the allocator's segments
    are expandable (``expandable``; None: read from the environment), up to
    :data:`CUDA_UNSPLIT_BYTES` for each vertex value of the large pool, which may get a
    cached block that large beyond its size; on other devices ``SMALL_TENSOR_BYTES`` and
    ``HEAP_BYTES_PER_VERTEX`` per vertex, ``HEAP_BYTES_PER_MAPPED_BUFFER`` for each buffer the C library maps on its own that the plain step holds, and a page for each buffer it may map on its own that can be live
    at once (``meta.mapped_buffer_bytes``, a page of ``meta.page_bytes``). A graph no profile measured (no
    ``meta.device``) is its own exact model: no margin. Plus what a real step under a plan of the graph measured above its prediction
    (``meta.measured_excess_bytes``)."""
    measured_excess = int(graph.meta.measured_excess_bytes or 0)
    if graph.meta.device is None:
        return measured_excess
    device = str(graph.meta.device)
    n = len(graph)
    if device.startswith("cuda"):
        params = sum(1 for b in (graph.meta.param_bytes or {}).values() if b)
        margin = CUDA_BLOCK_BYTES * (3 * n + params)
        if not (expandable_segments() if expandable is None else expandable):
            margin += CUDA_UNSPLIT_BYTES * sum(1 for node in graph.nodes if node.mem > CUDA_UNSPLIT_BYTES)
        return margin + measured_excess
    held = plain_simulated(graph).mapped_buffers
    page = int(graph.meta.page_bytes or mmap.PAGESIZE)
    return ((SMALL_TENSOR_BYTES + HEAP_BYTES_PER_VERTEX) * n + page * _mapped_buffers(graph, held)
            + HEAP_BYTES_PER_MAPPED_BUFFER * held + measured_excess)


def _mapped_buffers(graph: Graph, held: int) -> int:
    """How many buffers the C library may map on its own pages a CPU step holds at once:
    the most storages of at least ``meta.mapped_buffer_bytes`` live at once in the
    plain step (a plan holds no more of them: it frees what it recomputes), and those one
    op allocates and holds at once, as the profile counted them (``meta.scratch_buffers``;
    absent: one for its forward's scratch and one for its backward's)."""
    scratch = graph.meta.scratch_buffers
    return held + (2 if scratch is None else max(int(scratch), 2))


def recomputed_seconds(graph: Graph, schedule: Schedule) -> float:
    """The forward time of what the executor recomputes (``Schedule.recomputed``):
    Kusumoto et al.'s eq. 1 for the plan's stages."""
    return float(sum(graph.total("t_fwd", vs) for vs in schedule.recomputed))


def stage_overhead_seconds(graph: Graph, n_vertices: int) -> float:
    """The executor's own time for one recomputed stage of ``n_vertices`` vertices, beyond
    the ops it runs again (docs/design.md section 4.7): ``meta.recompute_stage_seconds +
    n_vertices * meta.recompute_vertex_seconds``, 0 where the profile has neither."""
    meta = graph.meta
    return float(meta.recompute_stage_seconds or 0.0) + n_vertices * float(meta.recompute_vertex_seconds or 0.0)


def executor_seconds(graph: Graph, schedule: Schedule) -> float:
    """The executor's own time under a schedule: :func:`stage_overhead_seconds` for each
    recomputed stage, with its vertices where it keeps values (its selective policy sees
    every op of it), with none where it keeps nothing (plain checkpoint runs no Python per
    op); and for each in-place op it runs out of place, :func:`~.schedule.rewrite_seconds`
    each time the op runs (in the forward, and again where its stage recomputes it)."""
    policy = sum(stage_overhead_seconds(graph, len(s.vertices) if s.kept else 0) for s in schedule.stages
                 if s.action == "recompute")
    rewrites = sum(rewrite_seconds(graph, v) * (1 + (v in s.recomputed))
                   for s in schedule.stages for v in s.rewritten)
    return policy + rewrites


def plain_plan(graph: Graph, budget_bytes: int | None = None) -> Plan:
    """Keep everything: the plan of ordinary training."""
    return make_plan(graph, [Stage(graph.ids, "keep")], "plain", budget_bytes)


def solve_plain(graph: Graph, budget_bytes: int | None = None, **_: object) -> Plan:
    return plain_plan(graph, budget_bytes)
