"""What a plan for a budget is, decided once for every caller (``remat()``, the strategies,
the batch-size search, the benchmarks): the solver's plan, ``auto``'s plain plan where the
plain step was measured to fit, a model that could not be traced held to one vertex per
stage (the tracing fallback checkpoints each submodule on its own), and the smallest budget
that very rule accepts, so a budget an error names is one it then accepts.

Pure functions over a graph, like the solvers: no torch, no planner state.
"""

from __future__ import annotations

from typing import Any

from lightning_remat.budget import format_bytes
from lightning_remat.errors import RematInfeasibleError, SolverDeclinedError
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers import SOLVERS, fits, min_budget, plain_plan, simulate, solve
from lightning_remat.solvers.kusumoto import solve_in_forward_order
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.schedule import order_note
from lightning_remat.solvers.scoring import make_plan
from lightning_remat.solvers.simulate import unchanged

__all__ = [
    "accepted_plan", "check_solver_for_device", "every_submodule_recomputed", "has_host_memory",
    "in_forward_order", "per_submodule_plan", "plain_peak_bytes", "plan_for", "smallest_budget", "solve_within",
    "solver_options",
]


def plain_peak_bytes(graph: Graph) -> int:
    """The plain step's peak: measured by the profiler, else simulated. The profiler
    measures steps that allocate the parameters' gradients; where they are resident before
    the step (``meta.grads_resident``) they are taken off, down to no less than the
    simulated peak with resident gradients."""
    measured = graph.meta.plain_peak_bytes
    if not measured:
        return int(simulate(graph).peak_bytes)
    if graph.meta.grads_resident:
        gradients = sum(int(b) for b in (graph.meta.param_bytes or {}).values())
        return max(int(measured) - gradients, int(simulate(graph).peak_bytes))
    return int(measured)


def _device_type(device: Any) -> str:
    """``"cuda"`` for ``torch.device("cuda:1")`` or ``"cuda:1"``."""
    return str(getattr(device, "type", device)).split(":")[0]


def has_host_memory(device: Any) -> bool:
    """Whether ``device`` (a ``torch.device`` or its name) has a memory apart from the
    host's, so offloading frees some."""
    return _device_type(device) == "cuda"


def check_solver_for_device(solver: str, device: Any) -> None:
    """Refuse an offloading solver where offloading frees nothing (the CPU: "offloaded"
    bytes stay in the same RAM, and the copies only add time and memory)."""
    entry = SOLVERS.get(solver)
    if entry is not None and entry.offloads and not has_host_memory(device):
        recomputing = sorted(name for name, other in SOLVERS.items() if not other.offloads)
        raise ValueError(
            f"solver={solver!r} offloads saved tensors to host memory, but the model is on "
            f"{_device_type(device)}, whose memory is the host's: offloading frees nothing "
            f"there. Choose a recomputation solver ({', '.join(recomputing)}), or train on a "
            "CUDA device"
        )


def solver_options(solver: str, device: Any, offload: bool = True) -> dict[str, Any]:
    """Options of ``solver="auto"`` on a device: offloading only where a host memory apart
    from the device's exists (on the CPU, "offloaded" bytes stay in the same RAM)."""
    if solver != "auto":
        return {}
    return {"allow_offload": offload and has_host_memory(device)}


def solve_within(graph: Graph, budget: int, solver: str, options: dict[str, Any]) -> Plan:
    """The solver's plan; for ``auto``, where the plain step's measured peak (with what a
    first step measured over its prediction) is within the budget, the plain plan: nothing
    to recompute, and the measurement is what any prediction is held to (docs/design.md
    section 4.7)."""
    measured = graph.meta.plain_peak_bytes
    excess = int(graph.meta.measured_excess_bytes or 0)
    if solver == "auto" and measured and plain_peak_bytes(graph) + excess <= budget:
        plan = plain_plan(graph)
        plan.solver, plan.feasible = "auto:plain", True
        plan.notes.append(f"the plain step measured {format_bytes(plain_peak_bytes(graph))}, "
                          f"within {format_bytes(budget)}: nothing recomputed")
        return plan
    return in_forward_order(graph, solve(graph, budget, solver, **options), budget)


def _prefix_stages(graph: Graph, plan: Plan, later: bool) -> list[tuple[list[str], str]]:
    """``plan``'s stages with each boundary moved to the forward's order: after the last
    vertex (``later``) or before the first vertex not yet run (else) of the stages up to
    it. Each stage keeps its action; a stage left empty is dropped."""
    ids = graph.ids
    run: set[str] = set()
    cuts = []
    for stage in plan.stages[:-1]:
        run |= set(stage.nodes)
        if later:
            cuts.append(max(graph.position(v) for v in run) + 1)
        else:
            cuts.append(next((k for k, v in enumerate(ids) if v not in run), len(ids)))
    bounds = [0, *cuts, len(ids)]
    bounds = [max(bounds[: k + 1]) for k in range(len(bounds))]  # nondecreasing
    stages = [(ids[a:b], stage.action) for (a, b), stage in zip(zip(bounds, bounds[1:]), plan.stages)]
    return [(nodes, action) for nodes, action in stages if nodes]


def in_forward_order(graph: Graph, plan: Plan, budget: int | None) -> Plan:
    """``plan``, or, where its stages run ops out of the forward's order and a plan whose
    stages keep it fits ``budget``, that plan: the backward then sums every gradient in
    plain training's order, to the bit (docs/design.md section 5, "Plain's order"). The
    candidates: ``plan``'s stage boundaries moved to the forward's order, all later or all
    earlier, the actions kept; and Kusumoto's approximate DP over the prefixes of the
    forward's order (:func:`~lightning_remat.solvers.kusumoto.solve_in_forward_order`, with
    ``plan``'s objective). The one with the least predicted extra time is taken. A plan that
    offloads is left as it is (its time has the copies, which these candidates' would not
    weigh)."""
    if not order_note(graph, plan) or any(s.action == "offload" for s in plan.stages):
        return plan
    candidates = [make_plan(graph, _prefix_stages(graph, plan, later), plan.solver, budget, notes=list(plan.notes))
                  for later in (True, False)]
    solved = solve_in_forward_order(graph, budget, "mc" if plan.solver.endswith("-mc") else "tc")
    solved.solver = plan.solver
    candidates.append(solved)
    fitting = [c for c in candidates if fits(c, budget) and not order_note(graph, c)]
    if not fitting:
        return plan
    chosen = min(fitting, key=lambda p: (p.predicted_extra_seconds, p.guaranteed_peak_bytes))
    chosen.notes.append(
        f"in the forward's order: the solver's {len(plan.stages)} stages ran ops out of it (gradients "
        f"summed otherwise than plain's); {len(chosen.stages)} stages cut at the forward's order fit, "
        f"predicted {chosen.predicted_extra_seconds * 1e3:.2f} ms extra against "
        f"{plan.predicted_extra_seconds * 1e3:.2f} ms")
    return chosen


def plan_for(graph: Graph, budget: int | None, solver: str, options: dict[str, Any],
             per_submodule: bool = False) -> Plan:
    """The plan for ``budget`` (None: the plain plan); ``per_submodule``: the model could not
    be traced, and each submodule is checkpointed on its own (:func:`per_submodule_plan`)."""
    plan = plain_plan(graph) if budget is None else solve_within(graph, budget, solver, options)
    if per_submodule:
        plan = per_submodule_plan(graph, plan, budget)
    return plan


def accepted_plan(graph: Graph, budget: int | None, solver: str, options: dict[str, Any],
                  per_submodule: bool = False) -> Plan:
    """:func:`plan_for`; where there is none,
    :class:`~lightning_remat.errors.RematInfeasibleError` naming the smallest budget this very
    function accepts (:func:`smallest_budget`), so that budget, given, is."""
    try:
        with unchanged(graph):
            return plan_for(graph, budget, solver, options, per_submodule)
    except SolverDeclinedError:
        raise  # no budget makes the solver plan this graph; the error names another
    except RematInfeasibleError as exc:
        assert budget is not None
        with unchanged(graph):
            least = smallest_budget(graph, solver, options, per_submodule)
        raise RematInfeasibleError(budget, least, exc.tried) from None


def _accepts(graph: Graph, budget: int, solver: str, options: dict[str, Any], per_submodule: bool) -> bool:
    try:
        plan_for(graph, budget, solver, options, per_submodule)
    except RematInfeasibleError:
        return False
    return True


def smallest_budget(graph: Graph, solver: str, options: dict[str, Any],
                    per_submodule: bool = False) -> int | None:
    """The smallest budget :func:`accepted_plan` accepts for ``graph``: the solver's smallest
    budget (:func:`~lightning_remat.solvers.min_budget`) or, for ``auto``, the measured plain
    peak where that is less (:func:`solve_within` takes the plain plan there). Checkpointing
    each submodule on its own also needs a budget its per-submodule plan fits: found by
    binary search from the budget every submodule recomputed needs, down to the solver's
    (None: no budget found)."""
    least = min_budget(graph, solver, **options)
    if solver == "auto" and graph.meta.plain_peak_bytes:
        least = min(least, plain_peak_bytes(graph) + int(graph.meta.measured_excess_bytes or 0))
    if not per_submodule or _accepts(graph, least, solver, options, per_submodule):
        return int(least)
    hi = max(least, every_submodule_recomputed(graph).guaranteed_peak_bytes)
    for _ in range(8):  # a split solver plan need not fit where a smaller budget's does
        if _accepts(graph, hi, solver, options, per_submodule):
            break
        hi *= 2
    else:
        return None
    lo = least
    while hi - lo > max(1, hi // 100_000):
        mid = (lo + hi) // 2
        if _accepts(graph, mid, solver, options, per_submodule):
            hi = mid
        else:
            lo = mid
    return int(hi)


def per_submodule_plan(graph: Graph, plan: Plan, budget_bytes: int | None) -> Plan:
    """``plan`` with one vertex per stage, as the tracing fallback runs it (each recomputed
    submodule again whole, ``runtime.hooked``), scored by the simulator.
    When that no longer fits the budget, the least recomputation that does: every vertex
    recomputed, then, by decreasing forward time, kept again wherever it still fits. Raises
    :class:`~lightning_remat.errors.RematInfeasibleError` when even that does not fit."""
    actions = plan.action_of()
    split = make_plan(graph, [Stage([v], actions.get(v, "keep")) for v in graph.ids],
                      plan.solver, budget_bytes, whole_stages=True)
    if plan.solver == "auto:plain":
        # The plain step was measured within the budget (solve_within): the measurement,
        # not the prediction and its margin, is what holds it.
        split.feasible = True
        split.notes.extend(plan.notes)
        return split
    if fits(split, budget_bytes):
        return split
    chosen = {v: "recompute" for v in graph.ids}
    best = every_submodule_recomputed(graph, plan.solver, budget_bytes)
    if not fits(best, budget_bytes):
        raise RematInfeasibleError(budget_bytes or 0, best.guaranteed_peak_bytes,
                                   f"{plan.solver}, each submodule checkpointed on its own "
                                   "(the model could not be traced)")
    for v in sorted(graph.ids, key=lambda v: -graph[v].t_fwd):
        chosen[v] = "keep"
        trial = make_plan(graph, [Stage([u], chosen[u]) for u in graph.ids], plan.solver,
                          budget_bytes, whole_stages=True)
        if fits(trial, budget_bytes):
            best = trial
        else:
            chosen[v] = "recompute"
    return best


def every_submodule_recomputed(graph: Graph, solver: str = "per-submodule",
                               budget_bytes: int | None = None) -> Plan:
    """Every vertex (submodule) recomputed on its own, as the fallback runs it: the least
    memory :func:`per_submodule_plan` can reach."""
    return make_plan(graph, [Stage([v], "recompute") for v in graph.ids], solver, budget_bytes,
                     whole_stages=True)
