"""What the executor itself costs per recomputed stage and per vertex of one, for the time
model (docs/design.md section 4.7): measured once per device on a chain of small ops
(:func:`measure_recompute_overhead`), then on the model's own step
(:func:`calibrate_on_model`) where that differs from the chain's by more than the step's
noise: on a ResNet-50 on the CPU a recomputed stage costs milliseconds beyond its ops, on
the chain a fifth of one."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch import nn

from lightning_remat.graph.ir import Graph
from lightning_remat.imports import sympy_imported
from lightning_remat.runtime.module import apply_plan
from lightning_remat.runtime.stepcheck import StepTimes
from lightning_remat.solvers.chen import candidate_cuts
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.schedule import ScheduleParts, make_schedule
from lightning_remat.solvers.scoring import make_plan, plain_plan, recomputed_seconds

__all__ = [
    "CALIBRATION_STAGES", "CALIBRATION_STEPS", "NEGLIGIBLE", "calibrate_on_model", "calibration_plan",
    "measure_recompute_overhead", "measured_stage_seconds", "measured_vertex_seconds",
]


class _SineChain(nn.Module):
    """``length`` element-wise ops in a row, each saving its input for the backward (so a
    recomputed stage's backward does recompute)."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.length):
            x = torch.sin(x)
        return x


_OVERHEAD_CACHE: dict[str, tuple[float, float]] = {}
_CHAIN_LENGTH = 32
_SHORT, _LONG = 2, 8  # vertices per recomputed stage in the two calibration plans


def measure_recompute_overhead(device: str | torch.device | None = None, *, rounds: int = 3,
                               steps: int = 4, refresh: bool = False) -> tuple[float, float]:
    """``(seconds per recomputed stage, seconds per vertex of one)``: what this executor
    costs beyond the ops it runs again (checkpoint's frame, the RNG state, the
    selective-checkpoint policy every op passes in the forward and in the recomputation;
    docs/design.md section 4.7), measured once per device and cached.

    A chain of ``_CHAIN_LENGTH`` small ops runs plainly and under two plans, recomputed
    stages of ``_SHORT`` and of ``_LONG`` vertices (each keeping its last), the least step
    time of ``rounds`` rounds of ``steps`` steps each. Each stage's excess over the plain
    step, less the forward time of the vertices it runs again, is ``c_stage + c_vertex *
    |Vi|``; the two stage lengths give both. The graph keeps them as
    ``meta.recompute_stage_seconds`` and ``meta.recompute_vertex_seconds``."""
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    key = str(dev)
    if key in _OVERHEAD_CACHE and not refresh:
        return _OVERHEAD_CACHE[key]
    chain = fx.symbolic_trace(_SineChain(_CHAIN_LENGTH))
    ids = [n.name for n in chain.graph.nodes if n.op == "call_function"]
    x = torch.full((64,), 0.5, device=dev, requires_grad=True)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def staged(length: int) -> nn.Module:
        stages = [Stage(ids[i:i + length], "recompute") for i in range(0, len(ids), length)]
        stages[-1].action = "keep"
        return apply_plan(chain, Plan(stages, [], 0, 0.0, "calibration", True))

    def least_step(run: Callable[[], Any]) -> float:
        best = float("inf")
        for _ in range(rounds + 1):  # the first round warms up
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                run()
            sync()
            best = min(best, (time.perf_counter() - start) / steps)
        return best

    def step(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            module(x).sum().backward()
            x.grad = None
        return run

    def forward_only() -> None:
        with torch.no_grad():
            chain(x)

    with sympy_imported(), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        op_seconds = least_step(forward_only) / _CHAIN_LENGTH
        plain = least_step(step(chain))
        per_stage = []
        for length in (_SHORT, _LONG):
            stages = _CHAIN_LENGTH // length - 1  # the last stage is kept
            excess = (least_step(step(staged(length))) - plain) / stages
            per_stage.append(excess - (length - 1) * op_seconds)  # all but the kept last run again
    vertex = max((per_stage[1] - per_stage[0]) / (_LONG - _SHORT), 0.0)
    stage = max(per_stage[0] - _SHORT * vertex, 0.0)
    _OVERHEAD_CACHE[key] = (stage, vertex)
    return stage, vertex


CALIBRATION_STAGES = 24
"""The most recomputed stages of a plan that measures the executor's cost on the model:
enough that their cost stands out of a step's noise."""

NEGLIGIBLE = 0.01
"""A difference in the stages' total cost below this share of the plain step changes no
plan worth measuring: the chain's figure stands."""

CALIBRATION_STEPS = 3
"""Rounds of the plain step and each calibration plan's step, timed in turn."""

StepsTimer = Callable[[list[Callable[[], None]]], list[StepTimes]]
"""Times steps against the plain step, in turn: ``timer([a, b])`` is each one's
:class:`~lightning_remat.runtime.stepcheck.StepTimes`."""


def calibration_plan(graph: Graph, stages: int = CALIBRATION_STAGES, *, policy: bool = False) -> Plan | None:
    """A plan whose step measures what the executor costs on ``graph``'s model.

    ``policy=False``: up to ``stages`` ops that save only what they read (a linear layer, a
    convolution, a matrix product), spread evenly over the graph's order, each recomputed as
    a stage of its own, the rest kept: its recomputation packs the op's inputs again and
    stops before the op computes (``Schedule``'s **packed only**), so the step's time beyond
    plain is each stage's own cost and nothing else. Where the step's extra time also held
    ops run again, the stage's figure was what was left of a difference many times its size,
    and the step's noise swung it from 0 to 2.4 ms per stage between two plannings of one
    GPT (2-core CPU, 2026-12-07). Without two such ops, :func:`_cut_plan`'s stages, which
    recompute their ops: their time is taken off the measured extra time.
    ``policy=True``: :func:`_cut_plan` at boundaries made by an op that saves its output (a
    tanh, a softmax): plain checkpoint would run that op again, so the stage keeps it under
    the selective policy, whose time per vertex the step then shows too. None where the
    graph has fewer than two such boundaries."""
    if not policy:
        plan = _packed_plan(graph, stages)
        if plan is not None:
            return plan
    return _cut_plan(graph, stages, policy)


def _packed_plan(graph: Graph, stages: int) -> Plan | None:
    """Each of up to ``stages`` ops that save only their inputs (no model output) a
    recomputed stage of its own, the others kept; None with fewer than two such ops, where
    a stage would keep a value (then the selective policy's time would be in it), or where
    the plan is predicted to peak above the plain step."""
    parts = ScheduleParts.of(graph)
    ids = graph.ids
    # Not the last op: the last part is kept, as in every plan the solvers make.
    candidates = [i for i, v in enumerate(ids[:-1])
                  if v in parts.saves_inputs_only and v in parts.saving and v not in parts.outputs]
    if len(candidates) < 2:
        return None
    count = min(int(stages), len(candidates))
    chosen = sorted({candidates[round(i * (len(candidates) - 1) / max(count - 1, 1))] for i in range(count)})
    segments, start = [], 0
    for p in chosen:
        if start < p:
            segments.append(Stage(ids[start:p], "keep"))
        segments.append(Stage([ids[p]], "recompute"))
        start = p + 1
    segments.append(Stage(ids[start:], "keep"))
    plan = make_plan(graph, segments, "calibration")
    schedule = make_schedule(graph, plan)
    if any(s.kept or s.recomputed for s in schedule.stages if s.action == "recompute"):
        return None
    # Its stages save what the plain step saves: its step fits where the profiled plain
    # step did, unless the kept stages' calls hold their inputs longer than plain would.
    if plan.predicted_peak_bytes > plain_plan(graph).predicted_peak_bytes:
        return None
    return plan


def _cut_plan(graph: Graph, stages: int, policy: bool) -> Plan | None:
    """The graph's order cut at up to ``stages`` single-tensor boundaries
    (:func:`~lightning_remat.solvers.chen.candidate_cuts`, spread evenly), every part but
    the last recomputed, as Chen et al.'s segments are: at boundaries made by an op that
    saves its output where ``policy``, else by one that saves nothing it computes (any
    boundary where there are fewer than two such)."""
    cuts = candidate_cuts(graph)
    parts = ScheduleParts.of(graph)
    own = [p for p in cuts if (graph.ids[p] in parts.saving and graph.ids[p] not in parts.saves_inputs_only) == policy]
    cuts = own if len(own) >= 2 or policy else cuts
    if len(cuts) < 2:
        return None
    count = min(int(stages), len(cuts))
    chosen = sorted({cuts[round(i * (len(cuts) - 1) / max(count - 1, 1))] for i in range(count)})
    ids, segments, start = graph.ids, [], 0
    for p in chosen:
        segments.append(Stage(ids[start:p + 1], "recompute"))
        start = p + 1
    segments.append(Stage(ids[start:], "keep"))
    return make_plan(graph, [s for s in segments if s.nodes], "calibration")


def _counts(graph: Graph, plan: Plan) -> tuple[int, int, float]:
    """(recomputed stages, vertices of those under the policy, forward time of what runs
    again) as the executor runs ``plan``."""
    schedule = make_schedule(graph, plan)
    recomputing = [s for s in schedule.stages if s.action == "recompute"]
    return (len(recomputing), sum(len(s.vertices) for s in recomputing if s.kept),
            recomputed_seconds(graph, schedule))


def _beyond_noise(difference: float, measured: StepTimes) -> bool:
    return abs(difference) > max(2 * measured.noise_seconds, NEGLIGIBLE * measured.plain_seconds)


def measured_stage_seconds(graph: Graph, plan: Plan, measured: StepTimes) -> float | None:
    """The executor's own time per recomputed stage that ``measured`` (``plan``'s step
    against the plain step, :func:`~lightning_remat.runtime.stepcheck.timed_steps`) shows:
    the extra time less the forward time of what the schedule runs again (Kusumoto et al.'s
    eq. 1) and the policy's per-vertex time, over the recomputed stages; at least 0. None
    where that differs from ``meta.recompute_stage_seconds`` over all stages by no more
    than twice the steps' noise or :data:`NEGLIGIBLE` of the plain step (the chain's figure
    stands)."""
    return _measured_per(graph, plan, measured, per_stage=True)


def measured_vertex_seconds(graph: Graph, plan: Plan, measured: StepTimes) -> float | None:
    """The selective policy's own time per vertex of a stage under it that ``measured``
    shows: the extra time less the ops run again and each stage's time
    (``meta.recompute_stage_seconds``), over those vertices; at least 0. None where the
    plan has no such vertex, or where that differs from ``meta.recompute_vertex_seconds``
    by no more than the noise (:func:`measured_stage_seconds`)."""
    return _measured_per(graph, plan, measured, per_stage=False)


def _measured_per(graph: Graph, plan: Plan, measured: StepTimes, per_stage: bool) -> float | None:
    """The extra time ``measured`` shows beyond the ops run again and the other figure,
    per recomputed stage (``per_stage``) or per vertex under the policy."""
    stages, vertices, again = _counts(graph, plan)
    stage_now = float(graph.meta.recompute_stage_seconds or 0.0)
    vertex_now = float(graph.meta.recompute_vertex_seconds or 0.0)
    count, now, other = (stages, stage_now, vertices * vertex_now) if per_stage \
        else (vertices, vertex_now, stages * stage_now)
    if not count:
        return None
    beyond = measured.extra_seconds - again - other
    if not _beyond_noise(beyond - now * count, measured):
        return None
    return max(beyond / count, 0.0)


def _op_times_within_step(graph: Graph, measured: list[StepTimes]) -> str:
    """Scale every op's times so that they sum to no more than the plain step they are part
    of, where the profile's sum exceeds it by more than twice the noise; a line saying so, or
    "". The profiler times each op from the interpreter that runs it, with its hooks inside
    the op's interval, and on small ops that is much of the time: a 151-op Qwen2 of hidden
    32 profiled 13.7 ms of op times, where its plain step took 11.7 ms (2026-12-07, 2-core
    CPU). With op times too high, the ops a calibration plan runs again take too much of
    its measured extra time, and the executor's own time per stage reads too little (0 at
    worst), so the solver splits stages for less than they cost."""
    if not measured:
        return ""
    plain = min(m.plain_seconds for m in measured)
    noise = max(m.noise_seconds for m in measured)
    ops = graph.total("t_fwd", graph.ids) + graph.total("t_bwd", graph.ids)
    if plain <= 0 or ops <= plain + 2 * noise:
        return ""
    scale = plain / ops
    for node in graph.nodes:
        node.t_fwd *= scale
        node.t_bwd *= scale
    return (f"the profile's op times sum to {ops * 1e3:.3f} ms, more than the plain step's "
            f"{plain * 1e3:.3f} ms they are part of: every op's time scaled by {scale:.3f}")


def calibrate_on_model(graph: Graph, timer: StepsTimer,
                       planned_step: Callable[[Plan], Callable[[], None]]) -> list[str]:
    """Measure the executor's time per recomputed stage and per vertex under the policy on
    the model's own step, before a plan is chosen (docs/design.md section 4.7): the steps of
    :func:`calibration_plan` (stages under plain checkpoint) and of
    ``calibration_plan(policy=True)`` timed against the plain step by ``timer``, in turn;
    the first gives the stage's time, the second then the vertex's.
    ``planned_step(plan)``: one training step under ``plan``. Op times that sum to more than
    the plain step are first scaled to it (:func:`_op_times_within_step`). Each figure that differs from
    the calibration chain's by more than the noise replaces it in ``graph.meta``
    (``recompute_stage_measured``, ``recompute_vertex_measured``); returns a line for each."""
    meta, said = graph.meta, []
    stages, policy = calibration_plan(graph), calibration_plan(graph, policy=True)
    if policy is not None and not _counts(graph, policy)[1]:
        policy = None  # its stages run under plain checkpoint too: nothing of the policy's to see
    plans = [p for p in (stages, policy) if p is not None]
    if not plans:
        return said
    measured = dict(zip(map(id, plans), timer([planned_step(p) for p in plans])))
    scaled = _op_times_within_step(graph, list(measured.values()))
    if scaled:
        said.append(scaled)
    # The stage's figure first: the vertex's is what is left beyond it.
    for plan, per_stage, figure, what in (
            (stages, True, "recompute_stage", "the executor's time per recomputed stage measured on the model"),
            (policy, False, "recompute_vertex", "its time per vertex of a stage under the selective policy")):
        value = None if plan is None else _measured_per(graph, plan, measured[id(plan)], per_stage)
        if value is not None:
            chain = float(getattr(meta, f"{figure}_seconds") or 0.0)
            said.append(f"{what}: {value * 1e3:.3f} ms (the calibration chain's: {chain * 1e3:.3f} ms)")
            setattr(meta, f"{figure}_seconds", value)
            setattr(meta, f"{figure}_measured", True)
    return said
