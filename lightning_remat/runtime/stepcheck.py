"""The first real training step under a plan, measured against the plan's prediction
(docs/design.md section 4.7: predicted against measured, a gap is a bug in the model).

On CUDA the user's own step is measured, from the module's forward to the end of the
backward its outputs start (the caller's loss included): the caching allocator's peak
counter costs the step nothing and leaves nothing running. The end of the backward is
where autograd runs the callbacks queued while it ran
(``Variable._execution_engine.queue_callback``, queued when the first of the outputs'
gradients is computed, ``torch.autograd.graph.register_multi_grad_hook``).

Elsewhere the CPU meter is a profiler or a dispatch mode: thread-local state, which the
autograd engine copies into the backward it runs and restores when the backward returns.
Entered in the forward, it could not be left at the end of the caller's backward (the
engine would put it back on the caller's thread), so it would stay on until the module's
next call. Instead, as the last part of planning, one metered step of the new plan runs
(:func:`metered_step`): the plan's forward, the loss the plan was made for and its
backward, with the meter entered and left around exactly that step; the module's state
(buffers, RNG, modes) and its gradients are as before it.

Its time is measured too (:func:`timed_steps`): the least of a few planned steps against
the least of as many plain steps, alternating, in the same process. Where the planned
step's extra time is off the plan's prediction by more than :data:`TIME_POINTS` of the
plain step, and by more than the steps' own noise, :func:`correct_times` sets the graph's
times so that the model reproduces the measurement, and the planner chooses the plan again
(docs/design.md section 4.7).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.schedule import make_schedule
from lightning_remat.solvers.scoring import make_plan

__all__ = [
    "TIMED_STEPS", "TIME_POINTS", "StepTimes", "correct_times", "metered_step", "pooled",
    "predicted_extra_seconds", "time_error", "timed_rotation", "timed_steps", "undecided", "watch_backward",
]

TIME_POINTS = 0.05
"""How far, as a share of the plain step, the measured extra time of a plan may be off its
prediction before the graph's times are corrected (5 points)."""

TIMED_STEPS = 3
"""Plain and planned steps timed each, alternating; the least of each is taken."""


def watch_backward(outputs: Any, on_end: Callable[[], None]) -> bool:
    """Call ``on_end()`` when the backward that ``outputs`` start has ended; False (and
    no call) when no output requires a gradient. The hook goes with the outputs, or once
    it has run."""
    tensors = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return False
    handle: list[Any] = []

    def started(_: Any) -> None:
        if handle:
            handle.pop().remove()
        torch.autograd.Variable._execution_engine.queue_callback(on_end)

    handle.append(torch.autograd.graph.register_multi_grad_hook(tensors, started, mode="any"))
    return True


def metered_step(forward: Callable[[], Any], loss_fn: Callable[[Any], torch.Tensor], outputs_held: bool,
                 grad_holders: list[torch.Tensor],
                 measure: Callable[[Callable[[], None]], int]) -> int:
    """The peak bytes of one training step, ``forward()``, ``loss_fn`` of its outputs and
    the backward, as ``measure(step)`` reads it (the project's meter:
    :func:`~lightning_remat.measure.peak.peak_bytes`). ``outputs_held``: the step holds its
    outputs until the backward has ended (the loop people write) rather than dropping them
    once the loss has read them. The step starts from no gradients on ``grad_holders`` (the
    parameters, the inputs that require one), as the profile's steps do, and the gradients
    it makes are dropped: each holder's is as before. The caller restores the module's
    state (:func:`~lightning_remat.graph.effects.preserved_state`)."""

    def step() -> None:
        outputs = forward()
        loss = loss_fn(outputs)
        if not outputs_held:
            del outputs
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(f"the step's loss must be a scalar that requires grad, got {loss!r:.80}")
        loss.backward()

    kept = [(t, t.grad) for t in grad_holders]
    for t in grad_holders:
        t.grad = None
    try:
        return int(measure(step))
    finally:
        for t, grad in kept:
            t.grad = grad


@dataclass(frozen=True)
class StepTimes:
    """A plan's step timed against the plain step's in the same process."""

    plain_seconds: float
    """The least of the plain steps."""
    planned_seconds: float
    """The least of the planned steps."""
    noise_seconds: float = 0.0
    """How far the second-least step of a kind lay above the least, the larger of the two
    kinds: a difference within it is not told apart from noise."""
    plain_samples: tuple[float, ...] = ()
    """Every plain step's time (empty where only the least was kept)."""
    planned_samples: tuple[float, ...] = ()
    """Every planned step's time (empty where only the least was kept)."""

    @property
    def extra_seconds(self) -> float:
        """The planned step's time beyond the plain step's."""
        return self.planned_seconds - self.plain_seconds


def timed_steps(plain: Callable[[], None], planned: Callable[[], None], device: torch.device,
                steps: int = TIMED_STEPS) -> StepTimes:
    """Time ``steps`` runs each of ``plain()`` and ``planned()``, alternating (a slow spell
    of the machine falls on both kinds), each synchronised with the device; the least of
    each kind, and the noise (:attr:`StepTimes.noise_seconds`)."""
    return timed_rotation(plain, [planned], device, steps)[0]


def timed_rotation(plain: Callable[[], None], others: Sequence[Callable[[], None]], device: torch.device,
                   steps: int = TIMED_STEPS) -> list[StepTimes]:
    """:func:`timed_steps` for several steps against one plain step: ``plain()`` and each
    of ``others`` in turn, ``steps`` rounds; per other, its times against the plain
    step's."""
    sync = (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else (lambda: None)
    runs = [plain, *others]
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(max(int(steps), 2)):
        for taken, run in zip(times, runs):
            sync()
            start = time.perf_counter()
            run()
            sync()
            taken.append(time.perf_counter() - start)
    return [_least(times[0], other) for other in times[1:]]


def _least(plain: Sequence[float], planned: Sequence[float]) -> StepTimes:
    """The least of each kind's step times, and the noise (:attr:`StepTimes.noise_seconds`)."""
    p, q = sorted(plain), sorted(planned)
    noise = max(p[1] - p[0], q[1] - q[0]) if len(p) > 1 and len(q) > 1 else 0.0
    return StepTimes(p[0], q[0], noise, tuple(plain), tuple(planned))


def pooled(first: StepTimes, more: StepTimes) -> StepTimes:
    """Two timings of the same pair of steps read as one, from all their steps (the noise
    of the least of more steps is smaller); ``more`` alone where either kept no steps."""
    if not (first.plain_samples and first.planned_samples and more.plain_samples and more.planned_samples):
        return more
    return _least(first.plain_samples + more.plain_samples, first.planned_samples + more.planned_samples)


def undecided(predicted_extra_seconds: float, measured: StepTimes) -> bool:
    """Whether the measured extra time is off the prediction by more than
    :data:`TIME_POINTS` of the plain step but not by more than twice the noise: the error
    :func:`time_error` would act on, were the noise smaller. Timing more steps
    (:func:`pooled`) tells the two apart."""
    off = abs(measured.extra_seconds - float(predicted_extra_seconds))
    return measured.plain_seconds > 0 and TIME_POINTS * measured.plain_seconds < off <= 2 * measured.noise_seconds


def time_error(predicted_extra_seconds: float, measured: StepTimes) -> float | None:
    """How far the measured extra time is off the prediction, in seconds (positive: the
    step is slower than predicted), where that is more than :data:`TIME_POINTS` of the
    plain step and more than twice the noise; None where it is within either."""
    off = measured.extra_seconds - float(predicted_extra_seconds)
    if measured.plain_seconds <= 0:
        return None
    if abs(off) <= TIME_POINTS * measured.plain_seconds or abs(off) <= 2 * measured.noise_seconds:
        return None
    return off


def predicted_extra_seconds(graph: Graph, plan: Plan) -> float:
    """``plan``'s extra time as the model of ``graph`` (its times as they are now) gives it:
    the plan's stages scored again (:func:`~lightning_remat.solvers.scoring.make_plan`)."""
    stages = [Stage(list(s.nodes), s.action) for s in plan.stages]
    return float(make_plan(graph, stages, plan.solver, stored=list(plan.stored)).predicted_extra_seconds)


def correct_times(graph: Graph, plan: Plan, measured_extra_seconds: float) -> str:
    """Set ``graph``'s times so that the model gives ``plan`` the extra time its step
    measured, and say what changed. The model is ``a * R + k * c_stage + n * c_vertex``
    (docs/design.md section 4.7): ``R`` the forward time of what the plan runs again, ``k``
    its recomputed stages and ``n`` the vertices of those that run under the selective
    policy (``Schedule``: those that keep values), ``c_stage`` and ``c_vertex`` the
    executor's own time (``meta.recompute_stage_seconds``, ``meta.recompute_vertex_seconds``)
    and ``a`` a scale of the vertices' times, 1 as profiled. A step slower than predicted
    charges the difference to each recomputed stage (what the executor costs beyond the ops
    it runs again, which the calibration chain measured on other ops than these); a faster
    one takes it off the stage's time, then the vertex's, and what is left off every
    vertex's forward time (the profile's op times were high). Where the stage's time was
    measured on the model (``meta.recompute_stage_measured``) and the plan has stages that
    keep values, the difference goes to their vertices' time first. The plan's stages, scored
    again, then predict the measured extra time. A plan that recomputes nothing is not
    corrected ("" returned)."""
    meta = graph.meta
    stage0, vertex0 = float(meta.recompute_stage_seconds or 0.0), float(meta.recompute_vertex_seconds or 0.0)
    # k and n as the executor runs the plan: which stages run under the selective policy
    # is the schedule's choice (``make_schedule``), so the counts are read off it.
    schedule = make_schedule(graph, plan)
    recomputing = [s for s in schedule.stages if s.action == "recompute"]
    k, n = len(recomputing), sum(len(s.vertices) for s in recomputing if s.kept)
    if k <= 0:
        return ""
    predicted = predicted_extra_seconds(graph, plan)
    recomputed = predicted - k * stage0 - n * vertex0
    off = float(measured_extra_seconds) - predicted
    if meta.recompute_stage_measured and n:
        # The stage's time was measured on this model (stages under plain checkpoint,
        # ``runtime.overhead``): what is off is the stages that keep values, per vertex.
        vertex = vertex0 + off / n
        if vertex >= 0:
            meta.recompute_vertex_seconds = vertex
            return (f"the executor's time per vertex of a stage that keeps values set from "
                    f"{vertex0 * 1e3:.3f} ms to {vertex * 1e3:.3f} ms")
        off += vertex0 * n  # still to take off once the vertex's time is 0
        meta.recompute_vertex_seconds = vertex0 = 0.0
    stage = stage0 + off / k
    if stage >= 0:
        meta.recompute_stage_seconds = stage
        return (f"the executor's time per recomputed stage set from {stage0 * 1e3:.3f} ms to "
                f"{stage * 1e3:.3f} ms")
    left = -stage * k  # still to take off once the stage's time is 0
    meta.recompute_stage_seconds = 0.0
    vertex = vertex0 - left / n if n else -1.0
    if vertex >= 0:
        meta.recompute_vertex_seconds = vertex
        return (f"the executor's time per recomputed stage set from {stage0 * 1e3:.3f} ms to 0 and per "
                f"vertex from {vertex0 * 1e3:.3f} ms to {vertex * 1e3:.3f} ms")
    left -= vertex0 * n
    meta.recompute_vertex_seconds = 0.0
    scale = max(recomputed - left, 0.0) / recomputed if recomputed > 0 else 1.0
    scale = max(scale, 0.01)  # a time model of no time at all would recompute anything
    for node in graph.nodes:
        node.t_fwd *= scale
    return (f"the executor's own time set to 0 and every op's forward time scaled by {scale:.3f}")
