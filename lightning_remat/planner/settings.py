"""What decides a plan besides the module and its inputs (:class:`PlanSettings`), and what
a plan made for one input gives (:class:`Planned`): the planner's vocabulary
(:mod:`lightning_remat.planner`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_remat.budget import Budget
from lightning_remat.cache import PlanBasis
from lightning_remat.device import default_budget, module_device, move_to_device
from lightning_remat.graph.effects import preserved_state
from lightning_remat.graph.ir import Graph
from lightning_remat.graph.trace import Traced, loop_loss
from lightning_remat.inputs import InputKey
from lightning_remat.measure.timeline import StepRecorder, TimelinePoint, aligned, tensors_in
from lightning_remat.runtime.module import RematModule, Variant
from lightning_remat.runtime.stepcheck import StepTimes
from lightning_remat.solvers import SOLVERS, simulate
from lightning_remat.solvers.policy import plain_peak_bytes
from lightning_remat.solvers.step_memory import Timeline

__all__ = ["PlanSettings", "Planned", "Profiler", "StepTimer", "Tracer", "grads_resident",
           "parameter_dtypes", "planning_summary"]


def grads_resident(module: nn.Module) -> bool:
    """Whether every parameter that trains already has a gradient (the loop keeps them
    between steps)."""
    training = [p for p in module.parameters() if p.requires_grad]
    return bool(training) and all(p.grad is not None for p in training)

def parameter_dtypes(module: nn.Module) -> str:
    """The module's parameter dtypes, e.g. ``"torch.float32"`` (sorted, comma separated)."""
    return ",".join(sorted({str(p.dtype) for p in module.parameters()})) or "none"

@dataclass(frozen=True)
class PlanSettings:
    """What decides a plan besides the module and its inputs."""

    memory_budget: int | float | str | None = None
    """Bytes, a size string (``"4GiB"``), a fraction of the plain peak (``"60%"``, 0.6) or
    None (free device memory less a margin on CUDA, no limit elsewhere)."""
    solver: str = "auto"
    profile_repeats: int = 3
    """The most timed steps when profiling (a second runs only while op times vary)."""
    safe_profile: bool = False
    """Profile op by op, so profiling fits where a plain step would not."""
    offload: bool = True
    """Let ``solver="auto"`` fall back to offloading (on CUDA only)."""

    def __post_init__(self) -> None:
        Budget.of(self.memory_budget)  # a malformed budget fails before any profiling
        if self.solver not in SOLVERS:
            raise ValueError(f"solver={self.solver!r}: choose one of {sorted(SOLVERS)}")
        if isinstance(self.profile_repeats, bool) or not isinstance(self.profile_repeats, int) \
                or self.profile_repeats < 1:
            raise ValueError(f"profile_repeats={self.profile_repeats!r} must be an int >= 1")

    def budget_bytes(self, graph: Graph, device: torch.device,
                     free_memory: Callable[[torch.device], int | None] | None = None) -> int | None:
        """The budget in bytes for the input ``graph`` was profiled on. ``free_memory``:
        reads the device's memory for a budget of None (default: :func:`default_budget`)."""
        return Budget.of(self.memory_budget).resolve(
            lambda: plain_peak_bytes(graph), lambda: (free_memory or default_budget)(device))


@dataclass
class Planned:
    """A plan made for one input key, and the module that runs it."""

    key: InputKey
    variant: Variant
    module: RematModule
    example: tuple[tuple, dict] | None = field(default=None, repr=False)
    """The call it was planned for, kept on the host (for dashboards that replay it)."""
    basis: PlanBasis | None = None
    """What decided the plan (stored beside it in the cache and in checkpoints)."""
    checked: bool = False
    """Whether the first training step under the plan was measured (or will not be)."""
    measured_peak_bytes: int | None = None
    """The first training step's measured peak (None: not measured)."""
    traced: Traced | None = field(default=None, repr=False, compare=False)
    """The capture the variant was built from, which a plan made again lower for another
    module of the step is built from too (not pickled: None when loaded)."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "traced": None}

    @property
    def graph(self) -> Graph:
        assert self.variant.graph is not None
        return self.variant.graph

    # What the variant holds, read through it (a plan made again replaces the variant).
    plan = property(lambda self: self.variant.plan, doc="The plan the variant runs.")
    budget_bytes = property(lambda self: self.variant.budget_bytes, doc="The budget the plan was made for.")
    from_cache = property(lambda self: self.variant.from_cache,
                          doc="Whether the plan came from the cache or a checkpoint.")

    def predicted_timeline(self) -> Timeline:
        """Live bytes after every op of a step under this plan, as the simulator predicts
        it for the executor that runs it: where the model's own forward runs with its
        submodules checkpointed in place (the capture's fallback), a recomputed stage runs
        again whole, as the plan was scored (docs/design.md section 5). It follows the
        schedule the stages were compiled to, whatever times the graph holds since."""
        return simulate(self.graph, self.plan, whole_stages=self.variant.hooked is not None,
                        schedule=self.variant.schedule)

    def measure_timeline(self, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> list[TimelinePoint]:
        """One real step of the planned module on the planned call, read op by op, on the
        predicted timeline's ops: one point per event of :meth:`predicted_timeline`, in its
        order (:func:`~lightning_remat.measure.timeline.aligned`), each the highest and the
        live bytes of that op in that phase, forward, recomputation or backward. The step
        runs this plan, whatever the selector would pick, through the module's call (its
        call context: a cache its calls turn off stays off), under the autocast it was
        planned in, as the profile took it: ``loss_fn`` (the planner's; by default
        :func:`~lightning_remat.graph.trace.loop_loss`, the outputs held to its end where
        the profile held them), from no gradients unless the profile had them resident.
        Buffers, gradients, modes and the RNG are as before it. Empty without a kept call."""
        if self.example is None:
            return []
        device = module_device(self.module)
        args, kwargs = move_to_device(self.example, device)
        meta = self.graph.meta
        module = self.module
        holders = [] if meta.grads_resident else [p for p in module.parameters() if p.requires_grad]
        holders += [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        recorder = StepRecorder(device)
        variant = self.variant.observed(set(self.graph.ids), recorder.after)
        with module.running(variant), preserved_state(module, [device]), torch.enable_grad(), \
                self._planned_autocast(device):
            module.training = True  # not .train(): the children's own modes are kept
            points = recorder.step(lambda: module(*args, **kwargs), loss_fn or loop_loss,
                                   outputs_held=bool(meta.outputs_held), grad_holders=holders)
        return aligned(points, [(e.phase, e.node) for e in self.predicted_timeline().events])

    def _planned_autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The autocast the plan was made in (its basis), where it was on."""
        state = self.basis.autocast if self.basis is not None else "off"
        if state == "off":
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=getattr(torch, state.removeprefix("torch.")))

Profiler = Callable[[nn.Module, tuple, dict, Traced], Graph]
StepTimer = Callable[[Callable[[], None], Callable[[], None], torch.device], StepTimes]
"""Times a plain and a planned step: ``(plain, planned, device) -> StepTimes``."""
Tracer = Callable[[nn.Module, tuple, dict], Traced]
"""Gives the graph of one call: ``(module, args, kwargs, traced) -> Graph``."""

def planning_summary(seconds: float, step_seconds: float | None, profile_seconds: float | None = None,
                     profile_label: str = "profile") -> str:
    """One line: the time planning took, in seconds and in plain steps (``step_seconds``:
    the plain step's time, None when unknown)."""
    steps = f" ({seconds / step_seconds:.1f} plain steps)" if step_seconds else ""
    parts = f"; {profile_label} {profile_seconds:.1f} s" if profile_seconds is not None else ""
    return f"planning took {seconds:.1f} s{steps}{parts}"
