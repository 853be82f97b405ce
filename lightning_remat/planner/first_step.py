"""The first planned step of each input, measured before it is trusted (docs/design.md
section 4.7): off CUDA one metered step run as the last part of planning, on CUDA the
caller's own first step; a step over its prediction is planned again with the margin
raised by the excess (at most :data:`STEP_REPLANS` times), then refused over the budget.
Its time too: off the prediction by more than the noise, the graph's times are corrected
and the plan chosen again, once per input.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.autograd import _profiler_enabled
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _len_torch_dispatch_stack

from lightning_remat.budget import format_bytes, with_room
from lightning_remat.device import module_device
from lightning_remat.errors import RematInfeasibleError, warn_caller
from lightning_remat.graph.effects import preserved_state
from lightning_remat.graph.ir import Graph
from lightning_remat.graph.trace import CHILDREN, Traced, loop_loss
from lightning_remat.measure.peak import CudaPeak, peak_bytes
from lightning_remat.messages import world_size
from lightning_remat.planner.settings import Planned
from lightning_remat.runtime.module import Variant, build_traced_variant
from lightning_remat.runtime.overhead import CALIBRATION_STEPS, calibrate_on_model
from lightning_remat.runtime.stepcheck import (
    StepTimes,
    correct_times,
    metered_step,
    pooled,
    predicted_extra_seconds,
    time_error,
    timed_rotation,
    timed_steps,
    undecided,
    watch_backward,
)
from lightning_remat.solvers.plan import Plan
from lightning_remat.solvers.policy import (
    per_submodule_plan,
    smallest_budget,
    solve_within,
    solver_options,
)

__all__ = ["STEP_REPLANS", "FirstStepCheck"]

STEP_REPLANS = 2
"""How many times an input whose first planned step measured over its prediction is
planned again, each new plan's step measured in turn, before a step still over its budget
is refused (docs/design.md section 4.7)."""


def _times_of(graph: Graph) -> tuple[list[tuple[float, float]], float | None, float | None]:
    """The graph's times a correction may change: each vertex's, and the executor's own."""
    meta = graph.meta
    return ([(n.t_fwd, n.t_bwd) for n in graph.nodes], meta.recompute_stage_seconds,
            meta.recompute_vertex_seconds)


def _set_times(graph: Graph, times: tuple[list[tuple[float, float]], float | None, float | None]) -> None:
    """Put back what :func:`_times_of` read."""
    vertices, graph.meta.recompute_stage_seconds, graph.meta.recompute_vertex_seconds = times
    for node, (forward, backward) in zip(graph.nodes, vertices):
        node.t_fwd, node.t_bwd = forward, backward


class FirstStepCheck:
    """The first-step checks of :class:`~lightning_remat.planner.Planner`, which holds the
    state they read (its module, settings, stores and the variants it runs)."""

    def _checks(self, planned: Planned | None) -> bool:
        """Whether ``planned``'s first step is still to be measured. Single-process only:
        ranks must change their plans together."""
        return (planned is not None and not planned.checked and self.check_first_step
                and planned.budget_bytes is not None and world_size() <= 1 and self.sharding == "none")

    def _check_step(self, variant: Variant, args: tuple, kwargs: dict, run: Callable[[Variant], Any]) -> Any:
        """Run a training call (``run(variant)``). On CUDA the first one under each plan is
        measured (:mod:`~lightning_remat.runtime.stepcheck`), from its forward to the end of
        the backward its outputs start (the caller's loss included), and a step over the
        plan's prediction (its margin included) has the next call with that input plan
        again (:meth:`_over_prediction`), whose first step is measured in turn. After the
        first step this costs a lookup."""
        planned = self.last
        if planned is None or planned.variant is not variant or self.busy or not self._checks(planned):
            return run(variant)
        device = module_device(self.module, args)
        if device.type != "cuda":
            return run(variant)  # measured when it was planned (:meth:`_check_new_plan`)
        planned.checked = True
        meter = CudaPeak(device)
        meter.start()
        outputs = run(variant)
        watch_backward(outputs, lambda: self._measured(planned, meter.stop()))
        return outputs

    def _check_new_plan(self, planned: Planned, args: tuple, kwargs: dict) -> None:
        """A new plan's first step, run as the last part of planning. Off CUDA its memory:
        one metered step (the CPU meter is thread-local state the autograd engine would put
        back on the caller's thread after its backward, so it is not left running across
        the caller's own step, :mod:`~lightning_remat.runtime.stepcheck`); over the
        prediction (its margin included), the input is planned again at once and the new
        plan's step measured in turn (:meth:`_over_prediction`, at most
        :data:`STEP_REPLANS` times); one warning says so. On every device its time
        (:meth:`_check_time`): off the prediction, the graph's times are corrected and the
        plan chosen again, once per input, its memory then measured again."""
        device = module_device(self.module, args)
        if not self._checks(planned):
            return
        if _len_torch_dispatch_stack() or _profiler_enabled():
            # Planned under a dispatch mode or a profiler (the caller measuring the call,
            # say): a meter inside it would read the caller's, so none is run.
            planned.checked = device.type != "cuda"
            return
        if self.loss_fn is None and not planned.graph.meta.outputs_held:
            planned.checked = True
            return  # planned for a loss this planner no longer has (unpickled)
        if device.type != "cuda":
            self._hold_budget(planned, args, kwargs, device)
        if self._check_time(planned, args, kwargs, device) and device.type != "cuda":
            planned.checked = False
            self._hold_budget(planned, args, kwargs, device)

    def _hold_budget(self, planned: Planned, args: tuple, kwargs: dict, device: torch.device) -> None:
        """Off CUDA: meter the plan's step, plan again while it measures over its
        prediction (:meth:`_over_prediction`), and warn once."""
        planned.checked = True
        said = ""
        while True:
            self._measured(planned, self._metered_step(planned, args, kwargs, device))
            if planned.key not in self._excess:
                break
            said = self._over_prediction(planned, args, kwargs, *self._excess.pop(planned.key)) or said
            if planned.checked:
                break
        planned.checked = True
        if said:
            warn_caller(said)

    def _check_time(self, planned: Planned, args: tuple, kwargs: dict, device: torch.device) -> bool:
        """Time ``planned``'s step against the plain step's, in this process
        (:func:`~lightning_remat.runtime.stepcheck.timed_steps`: the least of a few of
        each, alternating). Where the measured extra time is off the plan's prediction by
        more than :data:`~lightning_remat.runtime.stepcheck.TIME_POINTS` of the plain step
        and by more than the noise (:func:`~lightning_remat.runtime.stepcheck.time_error`;
        where only the noise hides the error, the steps are timed again and read with the
        first timing, :func:`~lightning_remat.runtime.stepcheck.pooled`),
        the graph's times are set to reproduce the measurement
        (:func:`~lightning_remat.runtime.stepcheck.correct_times`) and the plan chosen
        again by the solver with them, taken where its own step, timed the same way before
        it runs, measures faster than the first (one warning says so); else the first plan
        and the profiled times stay, and a note on the plan says why. Once per input key; not for a
        plan that recomputes nothing, one from the cache or a checkpoint (timed when it was
        made, its graph stored with the corrected times), nor a graph profiled op by op
        (safe mode: the plain step may not fit). Whether the plan changed."""
        plan, graph = planned.plan, planned.graph
        if planned.key in self._timed or plan.count("recompute") == 0 or graph.meta.safe \
                or planned.from_cache:  # its graph's times were checked when it was made
            return False
        self._timed.add(planned.key)
        wrapper, mode = self.remat_module, self.remat_module.training
        timer = self.step_times or timed_steps
        predicted = predicted_extra_seconds(graph, plan)
        with preserved_state(self.module, [device]), torch.enable_grad():
            self.module.train()
            wrapper.training = True  # not .train(): the module's own flags are restored above
            try:
                steps = (self._timed_step(planned, args, kwargs, plain=True),
                         self._timed_step(planned, args, kwargs, plain=False))
                measured = timer(*steps, device)
                if undecided(predicted, measured):  # off by more than 5 points, within the noise
                    measured = pooled(measured, timer(*steps, device))
            finally:
                wrapper.training = mode
        if time_error(predicted, measured) is None:
            return False
        profiled = _times_of(graph)
        changed = correct_times(graph, plan, measured.extra_seconds)
        if not changed:
            return False
        options = solver_options(self.settings.solver, device, self.settings.offload)
        budget = planned.budget_bytes
        assert budget is not None
        try:
            again = solve_within(graph, budget, self.settings.solver, options)
        except RematInfeasibleError:
            return False  # the times changed, not the memory: the same budget is met
        if [(s.nodes, s.action) for s in again.stages] == [(s.nodes, s.action) for s in plan.stages]:
            plan.predicted_extra_seconds = again.predicted_extra_seconds  # as now predicted
            if self.cache is not None and planned.basis is not None:
                self.cache.put(planned.basis, graph, plan)  # with the corrected times
            return False
        # The plan chosen again is taken only where its own step measures faster than the
        # step it replaces: the correction rests on one measurement, and where that read far
        # under the prediction (a slow plain step), running ops again looks free
        # (docs/design.md section 4.7, "Time measured on the model itself").
        variant = self._variant_of(planned, args, kwargs, again)
        with preserved_state(self.module, [device]), torch.enable_grad():
            self.module.train()
            wrapper.training = True
            try:
                retimed = (self.step_times or timed_steps)(
                    self._timed_step(planned, args, kwargs, plain=True),
                    self._step_of(variant, graph, args, kwargs), device)
            finally:
                wrapper.training = mode
        plain = measured.plain_seconds
        if retimed.extra_seconds / max(retimed.plain_seconds, 1e-12) >= measured.extra_seconds / plain:
            _set_times(graph, profiled)  # the measurement that moved them is not borne out
            plan.notes.append(
                f"time check: the step measured {measured.extra_seconds / plain:+.1%} over plain, "
                f"predicted {predicted / plain:+.1%}; the plan chosen again on times corrected to that "
                f"({again.count('recompute')} recomputed stages) measured "
                f"{retimed.extra_seconds / max(retimed.plain_seconds, 1e-12):+.1%}, no faster: "
                "this plan and the profiled times kept")
            return False
        said = (f"lightning_remat: the planned step took {measured.extra_seconds / plain:+.1%} over "
                f"the plain step's time, where {predicted / plain:+.1%} was predicted; {changed}, and the plan "
                f"chosen again with those times: {again.solver}, {again.count('recompute')} recomputed "
                f"stages, predicted {again.predicted_extra_seconds / plain:+.1%}, measured "
                f"{retimed.extra_seconds / max(retimed.plain_seconds, 1e-12):+.1%}")
        self._use_variant(planned, variant)
        self._replans.pop(planned.key, None)  # the new plan's memory is measured afresh
        warn_caller(said)
        return True

    def _calibrate_executor(self, graph: Graph, traced: Traced, args: tuple, kwargs: dict,
                            device: torch.device) -> list[str]:
        """Measure what the executor costs per recomputed stage and per vertex under the
        selective policy on this model, before any plan is chosen
        (:func:`~lightning_remat.runtime.overhead.calibrate_on_model`: calibration plans'
        steps timed against the plain step, alternating). Run where the first step's time
        is checked (single process, a profiled plain step, an op-granular capture, no meter
        of the caller's running); returns a line for each figure it set."""
        if (not self.check_first_step or world_size() > 1 or self.sharding != "none" or graph.meta.safe
                or traced.kind == CHILDREN or _len_torch_dispatch_stack() or _profiler_enabled()
                or (self.loss_fn is None and not graph.meta.outputs_held)):
            return []
        wrapper, mode = self.remat_module, self.remat_module.training
        plain = self._step_of(None, graph, args, kwargs)
        if self.step_times is not None:
            injected = self.step_times

            def timer(steps: list[Callable[[], None]]) -> list[StepTimes]:
                return [injected(plain, step, device) for step in steps]
        else:
            timer = partial(timed_rotation, plain, device=device, steps=CALIBRATION_STEPS)

        def planned_step(plan: Plan) -> Callable[[], None]:
            variant = build_traced_variant(traced, plan, wrapper, self.module, graph)
            return self._step_of(variant, graph, args, kwargs)

        with preserved_state(self.module, [device]), torch.enable_grad():
            self.module.train()
            wrapper.training = True  # not .train(): the module's own flags are restored above
            try:
                return calibrate_on_model(graph, timer, planned_step)
            finally:
                wrapper.training = mode

    def _step_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
        """The call's tensors cut off the caller's graph (inputs another module computed, an
        encoder's output that a planned head reads: a measured backward stops at them,
        leaving the caller's graph for its own), and the tensors that take gradients in
        the step (the module's trainable parameters and those inputs)."""
        args, kwargs = pytree.tree_map(
            lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t,
            (args, kwargs))
        holders = [p for p in self.module.parameters() if p.requires_grad]
        holders += [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        return args, kwargs, holders

    def _timed_step(self, planned: Planned, args: tuple, kwargs: dict, plain: bool) -> Callable[[], None]:
        """One training step, plain (the module's own forward) or under ``planned``'s plan,
        as the profile took it; each parameter's gradient as before it (the caller keeps
        the module's state, :func:`~lightning_remat.graph.effects.preserved_state`)."""
        return self._step_of(None if plain else planned.variant, planned.graph, args, kwargs)

    def _step_of(self, variant: Variant | None, graph: Graph, args: tuple, kwargs: dict) -> Callable[[], None]:
        """One training step of ``graph``'s call, plain (``variant`` None: the module's own
        forward) or through ``variant``, as :meth:`_timed_step` describes."""
        loss_fn = self.loss_fn or loop_loss
        args, kwargs, holders = self._step_inputs(args, kwargs)
        wrapper, module = self.remat_module, self.module
        held = bool(graph.meta.outputs_held)

        def forward() -> Any:
            return module(*args, **kwargs) if variant is None else wrapper._run(variant, args, kwargs)

        def run(step: Callable[[], None]) -> int:
            step()
            return 0

        return lambda: metered_step(forward, loss_fn, held, holders, run) and None

    def _metered_step(self, planned: Planned, args: tuple, kwargs: dict, device: torch.device) -> int:
        """One training step of ``planned``'s plan under the meter, as the profile took the
        step (its loss, the outputs held or not), from no gradients; the module's state,
        modes and gradients are as before it. With gradients resident before the step
        (``meta.grads_resident``) the plan counts none allocated: those the metered step
        allocated are taken off its reading (as :func:`plain_peak_bytes` does)."""
        graph = planned.graph
        loss_fn = self.loss_fn or loop_loss
        args, kwargs, holders = self._step_inputs(args, kwargs)
        measure = self.step_peak or peak_bytes
        wrapper = self.remat_module
        mode = wrapper.training
        with preserved_state(self.module, [device]), torch.enable_grad():
            self.module.train()
            wrapper.training = True  # not .train(): the module's own flags are restored above
            try:
                peak = metered_step(lambda: wrapper._run(planned.variant, args, kwargs), loss_fn,
                                    bool(graph.meta.outputs_held), holders, lambda step: measure(step, device))
            finally:
                wrapper.training = mode
        if graph.meta.grads_resident:
            peak -= sum(int(b) for b in (graph.meta.param_bytes or {}).values())
        return max(int(peak), 0)

    def _measured(self, planned: Planned, peak: int) -> None:
        """The first step's reading (on CUDA called when its backward ends)."""
        planned.measured_peak_bytes = int(peak)
        plan = planned.plan
        if peak > plan.guaranteed_peak_bytes:
            self._excess[planned.key] = (int(peak), int(peak) - int(plan.predicted_peak_bytes))

    def _over_prediction(self, planned: Planned, args: tuple, kwargs: dict, peak: int, excess: int) -> str:
        """A first step measured ``peak``, ``excess`` over its plan's prediction and over
        the prediction with its margin. Planned again (:meth:`_plan_again`, the margin raised
        by the excess: the budget handed to the solver lowered by that much), at most
        :data:`STEP_REPLANS` times per input, with ``planned.checked`` False so that the new
        plan's first step is measured in turn. Where no plan fits with that margin, or the
        last new plan measured over too: kept if the step measured within the budget,
        otherwise refused (:class:`~lightning_remat.errors.RematInfeasibleError` with the
        measured peak and the smallest budget that holds with the margin raised; the input
        keeps no plan). Returns the line to warn ("" when there is none)."""
        budget = planned.budget_bytes
        assert budget is not None
        old = planned.plan
        said = (f"lightning_remat: the first training step under the plan measured "
                f"{format_bytes(peak)}, {format_bytes(excess)} over its prediction of "
                f"{format_bytes(old.predicted_peak_bytes)}")
        replans = self._replans.get(planned.key, 0)
        plan = self._plan_again(planned, args, kwargs, excess) if replans < STEP_REPLANS else None
        if plan is not None:
            self._replans[planned.key] = replans + 1
            planned.checked = False  # the new plan's first step is measured too
            times = "" if replans == 0 else f" ({replans + 1} times)"
            return (f"{said}; planned again{times} with the model's margin raised by that much: "
                    f"{plan.solver}, predicted {format_bytes(plan.guaranteed_peak_bytes)} within "
                    f"{format_bytes(budget)}")
        planned.checked = True
        if peak <= budget:
            return f"{said}, within the budget of {format_bytes(budget)}: the plan stays"
        self._refuse(planned, args, peak)
        raise AssertionError("unreachable")

    def _refuse(self, planned: Planned, args: tuple, peak: int) -> None:
        """Raise the refusal of a step measured over its budget: the input's plan is taken
        out (its next call plans it again, and the message is met again unless the budget
        changed), and the error names the smallest budget that holds with the margin raised
        by what the step measured over."""
        budget = planned.budget_bytes
        assert budget is not None
        self.planned.pop(planned.key, None)
        self.remat_module.variants.pop(planned.key, None)
        if self.last is planned:
            self.last = None
        self._replans.pop(planned.key, None)
        device = module_device(self.module, args)
        options = solver_options(self.settings.solver, device, self.settings.offload)
        try:
            least = smallest_budget(planned.graph, self.settings.solver, options, planned.variant.hooked is not None)
        except RematInfeasibleError:
            least = None
        if least is not None:
            # Given that budget, a new planner runs its own first plan, and the margin it
            # raises is what that plan measured over: a step's excess varies between plans
            # by bytes to pages, so the budget named holds that variation too.
            least = with_room(max(int(least), int(peak)))
        cause = planned.traced.coarse_cause() if planned.traced is not None else ""
        raise RematInfeasibleError(budget, least, measured_peak_bytes=peak, cause=cause)

    def plan_again(self, planned: Planned, args: tuple, kwargs: dict, measured_peak: int) -> bool:
        """Plan ``planned``'s input again after a step of it measured ``measured_peak``, over
        its prediction: the model's margin raised by the excess, solved for the same budget
        and run from the next call on (the batch-size search's trials, which measure their
        steps themselves). False where no plan fits with that margin."""
        excess = int(measured_peak) - int(planned.plan.predicted_peak_bytes)
        if excess <= 0 or planned.budget_bytes is None:
            return False
        return self._plan_again(planned, args, kwargs, excess) is not None

    def _plan_again(self, planned: Planned, args: tuple, kwargs: dict, excess: int) -> Plan | None:
        """Solve ``planned``'s graph again with the model's margin raised by what its first
        step measured above the prediction (``meta.measured_excess_bytes``), and run the new
        plan from this call on; None (the plan unchanged) where no plan fits with it."""
        graph, budget = planned.graph, planned.budget_bytes
        assert budget is not None
        graph.meta.measured_excess_bytes = max(int(graph.meta.measured_excess_bytes or 0), excess)
        device = module_device(self.module, args)
        try:
            plan = solve_within(graph, budget, self.settings.solver, solver_options(self.settings.solver, device, self.settings.offload))
        except RematInfeasibleError:
            return None
        self._use_plan(planned, args, kwargs, plan)
        return plan

    def _use_plan(self, planned: Planned, args: tuple, kwargs: dict, plan: Plan) -> None:
        """Run ``plan`` (made for ``planned``'s graph and budget) for ``planned``'s input
        from this call on, and store it in the cache in place of the old."""
        self._use_variant(planned, self._variant_of(planned, args, kwargs, plan))

    def _variant_of(self, planned: Planned, args: tuple, kwargs: dict, plan: Plan) -> Variant:
        """``plan`` (made for ``planned``'s graph and budget) built to run ``planned``'s
        input; nothing is installed."""
        graph, budget = planned.graph, planned.budget_bytes
        device = module_device(self.module, args)
        with preserved_state(self.module, [device]):
            traced = self._trace(self.module, args, kwargs)
        if traced.kind == CHILDREN:
            plan = per_submodule_plan(graph, plan, budget)
        if not any(note.startswith("capture: ") for note in plan.notes):
            plan.notes.insert(0, traced.granularity())
        variant = build_traced_variant(traced, plan, self.remat_module, self.module, graph)
        variant.budget_bytes = budget
        return variant

    def _use_variant(self, planned: Planned, variant: Variant) -> None:
        """Run ``variant`` for ``planned``'s input from this call on, its plan stored in the
        cache in place of the old."""
        graph, plan = planned.graph, variant.plan
        planned.variant = variant
        if planned.key in self.remat_module.variants:
            self.remat_module.variants[planned.key] = variant
        if self.cache is not None and planned.basis is not None:
            self.cache.put(planned.basis, graph, plan)
