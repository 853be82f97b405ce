"""``LightningTrial``: one trial of the batch-size search, measured on a fitting Trainer.

A trial at batch size ``b`` is what ``Trainer(strategy=RematStrategy(...))`` would do at
``b``: trace, profile, solve for the budget and apply the plan
(:class:`~lightning_remat.planner.Planner`), then run ``steps_per_trial`` training steps as
Lightning's loop runs them (the strategy's ``training_step``, ``backward`` and optimizer
step, so the DDP wrapper, the precision plugin with its GradScaler, and gradient clipping
take part) and measure their peak (:func:`~lightning_remat.measure.peak.peak_bytes`). A trial is
feasible when a plan exists, nothing runs out of memory and the measured peak is within the
budget; a reading no training step can have is a :class:`MeasurementError`, never a fit. With
solver ``"plain"`` (no rematerialization) the model's own forward runs: plain training's
trial. The weights, optimizer state, BatchNorm statistics, RNG and the precision plugin's
state are restored after every trial, and no callback sees its steps: the search does not
train the model.

The callback that drives the trials, :class:`~lightning_remat.lightning.batch_size.RematBatchSizeFinder`,
builds the :class:`SearchSettings` and may first profile a shape family
(:meth:`LightningTrial.profile_family`), from which each trial derives its graph instead of
profiling.

Lightning's private name used (commented where used) is one its own ``BatchSizeFinder``
reads: ``fit_loop._data_source``; pyproject.toml bounds ``pytorch-lightning`` to the versions
tested, and a test fails when it is gone.

Length: one trial is one sequence (plan, run the steps, measure, restore, agree across
ranks with the collectives bounded in time), and each part reads the state the others save
or restore; split, the restore would sit apart from what it undoes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loops.optimization.automatic import ClosureResult
from pytorch_lightning.utilities.parsing import lightning_setattr
from torch import nn
from torch.utils import _pytree as pytree

from lightning_remat.cache import PlanCache
from lightning_remat.device import (
    default_budget,
    move_to_device,
    training_budget,
)
from lightning_remat.graph.calls import cache_configs, caches_off
from lightning_remat.graph.effects import preserved_state, preserved_training_state
from lightning_remat.graph.ir import Graph
from lightning_remat.graph.profile import profile_module
from lightning_remat.graph.scale import check_family, derive_graph
from lightning_remat.graph.trace import EXPORT, Traced, default_loss, trace_module
from lightning_remat.graph.vertices import local_bytes
from lightning_remat.lightning.strategy import RematHooks, forward_routed
from lightning_remat.measure.peak import peak_bytes
from lightning_remat.messages import DistributedRanks, world_size
from lightning_remat.planner import Planned, Planner, PlanSettings
from lightning_remat.runtime.overhead import measure_recompute_overhead
from lightning_remat.tuning.search import TrialResult

PLAIN = "plain"
"""The solver name of plain training: the trial runs the model's own forward, unplanned."""


@dataclass(frozen=True)
class SearchSettings:
    """What a batch-size search measures against."""

    plan: PlanSettings
    """How each trial plans (its budget as the strategy wrote it, or bytes)."""
    budget_bytes: int
    """The budget a trial's measured peak must meet."""
    device: torch.device
    target: str | None
    """The submodule planned (None: the LightningModule's forward)."""
    cache_dir: Path
    """Where the trials' plans are cached (the strategy's cache, so training reuses them)."""
    budget_from_device: bool = False
    """No budget given: a trial reads the free device memory once its optimizer state exists."""


class _Captured(Exception):
    """Raised by a temporary forward to capture the arguments of the first call."""

    def __init__(self, args: tuple, kwargs: dict, module: nn.Module | None = None) -> None:
        super().__init__("captured")
        self.args, self.kwargs, self.module = args, kwargs, module


@contextlib.contextmanager
def _strategy_planning_paused(strategy: Any) -> Iterator[None]:
    """A remat strategy plans nothing while a trial runs its steps through it (the trial
    routes the target to a planner of its own, or to nothing for plain training)."""
    with strategy.planning_paused() if isinstance(strategy, RematHooks) else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _trainer_kept(trainer: pl.Trainer) -> Iterator[None]:
    """No callback sees a trial's steps (the strategy's backward and optimizer step call
    their hooks; Lightning's batch-size search sets them aside too), and the precision
    plugin's state (a GradScaler's scale) is restored after it."""
    callbacks, precision = trainer.callbacks, copy.deepcopy(trainer.precision_plugin.state_dict())
    trainer.callbacks = []
    try:
        yield
    finally:
        trainer.callbacks = callbacks
        trainer.precision_plugin.load_state_dict(precision)


@contextlib.contextmanager
def _resharded_after_error(model: nn.Module) -> Iterator[None]:
    """After an error inside a step (out of memory in the middle of FSDP's forward), each
    root torch FSDP unit resets its iteration (``FSDPModule.reset_iter_state``: waits for
    its pending collectives, reshards every unit, clears its per-step state), so the
    trial's state is restored into the sharded parameters and the next trial starts clean."""
    try:
        yield
    except BaseException:
        from torch.distributed.fsdp import FSDPModule

        units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        roots = [name for name in units
                 if not any(name.startswith(f"{other}.") or (other == "" and name) for other in units)]
        for name in roots:
            model.get_submodule(name).reset_iter_state()
        raise


@contextlib.contextmanager
def _logging_muted(model: pl.LightningModule) -> Iterator[None]:
    """``self.log`` outside the loop's control flow raises; trials log nothing."""
    model.log = lambda *a, **k: None  # type: ignore[method-assign]
    model.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.log
        del model.log_dict


@contextlib.contextmanager
def _optimizers_preserved(optimizers: list[torch.optim.Optimizer]) -> Iterator[None]:
    # On the host, off the trial's budget (load_state_dict moves it back to the device).
    states = [move_to_device(copy.deepcopy(opt.state_dict()), torch.device("cpu")) for opt in optimizers]
    try:
        yield
    finally:
        for opt, state in zip(optimizers, states):
            opt.load_state_dict(state)


def _step_groups(strategy: Any) -> list[Any]:
    """The process groups a training step's collectives run on: the default group (DDP, a
    model's own collectives) and the groups of the strategy's device mesh (FSDP's)."""
    import torch.distributed as dist

    groups = [dist.group.WORLD]
    mesh = getattr(strategy, "device_mesh", None)
    with contextlib.suppress(Exception):  # no mesh, or not yet made: the default group only
        groups += [g for g in mesh.get_all_groups() if g not in groups]
    return groups


def _timeout_of(group: Any) -> timedelta:
    """The timeout ``group``'s collectives run under now: its backend's (private field; the
    backends' defaults where torch does not show it)."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        return group._get_backend(device).options._timeout  # private: torch has no getter
    return dist.default_pg_nccl_timeout if dist.get_backend(group) == "nccl" else dist.default_pg_timeout


@contextlib.contextmanager
def collectives_bounded(strategy: Any, seconds: float) -> Iterator[None]:
    """Inside, a collective of the training step that waits more than ``seconds`` fails
    (``torch.distributed.set_timeout`` on each group the step uses, restored after): a rank
    that ran out of memory before one of them leaves the others waiting in it only that
    long (docs/design.md section 7, "Batch-size search"). Nothing changes on one process."""
    import torch.distributed as dist

    if world_size() == 1:
        yield
        return
    groups = _step_groups(strategy)
    before = [_timeout_of(g) for g in groups]
    for group in groups:
        dist.set_timeout(timedelta(seconds=seconds), group)
    try:
        yield
    finally:
        for group, timeout in zip(groups, before):
            dist.set_timeout(timeout, group)


def resize_batch(batch: Any, batch_size: int) -> Any:
    """``batch`` with every tensor's first dimension cut or tiled to ``batch_size`` (a
    dataset shorter than the batch still gives a batch of the size being measured)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] == batch_size:
            return batch
        if batch.shape[0] > batch_size:
            return batch[:batch_size]
        reps = -(-batch_size // batch.shape[0])
        return batch.repeat(reps, *([1] * (batch.dim() - 1)))[:batch_size]
    if isinstance(batch, Mapping):
        return type(batch)({k: resize_batch(v, batch_size) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(resize_batch(v, batch_size) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(resize_batch(v, batch_size) for v in batch)
    return batch


TRIAL_REPLANS = 1
"""How often a remat trial measured over its budget is planned again (its margin raised by
what it measured over) and measured again before the size is taken as infeasible."""


class LightningTrial:
    """One trial of the search on a fitting Trainer: ``trial(batch_size) -> TrialResult``.

    With ``solver="plain"`` the model's own forward runs; otherwise a
    :class:`~lightning_remat.planner.Planner` for ``solver`` and the search's budget plans
    the target (profiling happens outside the
    measurement) and the steps run the planned module. With a shape family
    (:meth:`profile_family`) the planner is given the graph derived for the trial's size
    (:func:`~lightning_remat.graph.scale.derive_graph`) instead of profiling: a trial costs
    one solve and its measured steps. On CUDA one unmeasured warm-up step runs first; each
    of ``steps_per_trial`` steps is forward + backward inside the meter, then the optimizer
    step; the state is restored afterwards. The steps run as Lightning's automatic
    optimization runs them (:meth:`_run_step`).
    """

    def __init__(
        self, trainer: pl.Trainer, model: pl.LightningModule, *, batch_arg_name: str,
        steps_per_trial: int, solver: str, settings: SearchSettings,
    ) -> None:
        self.trainer, self.model = trainer, model
        self.batch_arg_name = batch_arg_name
        self.steps_per_trial = steps_per_trial
        self.solver = solver
        self.settings = settings
        self.budget_bytes = settings.budget_bytes
        strategy = trainer.strategy
        # The strategy's own choice (under remat_fsdp the outermost sharded unit); where it
        # plans what training_step runs, the module the step runs, found by
        # :meth:`_capture_call` from the step itself as the strategy finds it.
        self._detect = (isinstance(strategy, RematHooks) and not strategy.target
                        and strategy.plans_what_the_step_runs)
        self.target = strategy.target_module(model) if isinstance(strategy, RematHooks) else (
            model.get_submodule(settings.target) if settings.target else model)
        self.device = strategy.root_device
        self.family: list[Graph] = []
        """Profiles of the target at one or two batch sizes (:meth:`profile_family`)."""
        self.family_traced: Traced | None = None
        """The family's trace, and its call's inputs but for the batch (:func:`_batchless`)."""
        self._family_inputs: object = None
        self._size = 0
        self._loss: Callable[[Any], torch.Tensor] | None = None

    def batch(self, batch_size: int) -> Any:
        """A training batch of exactly ``batch_size`` samples on the device."""
        lightning_setattr(self.model, self.batch_arg_name, batch_size)
        # Private: the dataloader fit uses (model's or datamodule's), as BatchSizeFinder reads it.
        loader = self.trainer.fit_loop._data_source.dataloader()
        batch = next(iter(loader))
        batch = resize_batch(batch, batch_size)
        return self.trainer.strategy.batch_to_device(batch, self.device)

    def loss_fn(self, batch: Any) -> Callable[[Any], torch.Tensor] | None:
        """The loss ``training_step`` takes of the target's outputs on ``batch``: the rest
        of the step run on given outputs, so the profile measures the memory of the
        model's own loss (``meta.loss_peak_bytes``). None under manual optimization, whose
        training_step runs its own backward and optimizer step."""
        if not self.model.automatic_optimization:
            return None

        def loss_of(outputs: Any) -> torch.Tensor:
            with forward_routed(self.target, lambda *args, **kwargs: outputs), \
                    self.trainer.precision_plugin.train_step_context():
                out = self.model.training_step(batch, 0)
            loss = out["loss"] if isinstance(out, Mapping) else out
            return loss if isinstance(loss, torch.Tensor) else default_loss(outputs)

        return loss_of

    def _capture_call(self, batch: Any) -> tuple[tuple, dict]:
        """The arguments of the target's first call in ``training_step``. Where the strategy
        plans what the step runs, the target is first set to the outermost module the step
        calls in training mode with grad, the module the strategy's first step plans (its
        ``self(x)``, ``self.model(x)``); with several called in turn, the first of them."""
        def capture(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            if not self._detect or (module.training and torch.is_grad_enabled()):
                raise _Captured(args, kwargs, module)

        planned = getattr(self.trainer.strategy, "_planned_modules", None) or {}
        if self._detect and planned:
            self.target, self._detect = next(iter(planned.values())), False  # found by its fit
        modules = [m for _, m in self.model.named_modules()] if self._detect else [self.target]
        # A pre-hook ahead of any other (an FSDP unit's would gather its parameters first);
        # an outer module's pre-hooks run before those of the modules its forward calls.
        handles = [m.register_forward_pre_hook(capture, prepend=True, with_kwargs=True) for m in modules]
        try:
            self.model.training_step(batch, 0)
        except _Captured as call:
            if self._detect and call.module is not None:
                self.target, self._detect = call.module, False
            return call.args, call.kwargs
        finally:
            for handle in handles:
                handle.remove()
        raise RuntimeError(
            "training_step never called the module being planned; pass target= naming the "
            "submodule that training_step runs"
        )

    def profile_family(self, sizes: list[int]) -> list[Graph]:
        """Profile the target at each of ``sizes`` (the state restored after each), keep the
        profiles as this trial's shape family and return them; none when the traced graph
        differs between the sizes (then every trial profiles its own size)."""
        model = self.model
        family = []
        with (
            preserved_training_state(model), _logging_muted(model),
            _strategy_planning_paused(self.trainer.strategy),
        ):
            model.train()
            for size in sizes:
                batch = self.batch(size)
                args, kwargs = self._capture_call(batch)
                # Captured and profiled as the planner does a call (``Planner._calls``): with
                # a decoder's default cache off, which torch.export cannot capture (with it on
                # the capture fell back to the submodules, and every trial reused that one).
                with caches_off(cache_configs(self.target)):
                    with preserved_state(self.target, [self.device]):
                        traced = trace_module(self.target, args, kwargs)
                    graph = profile_module(
                        self.target, args, example_kwargs=kwargs or None, traced=traced,
                        repeats=self.settings.plan.profile_repeats, safe=self.settings.plan.safe_profile,
                        loss_fn=self.loss_fn(batch))
                # Scaled in the search's own unit: the batch size it sets, whatever the
                # first dimension of the target's input is.
                graph.meta.batch_size = size
                family.append(graph)
                self.family_traced, self._family_inputs = traced, _batchless(args, kwargs)
                del args, kwargs, batch
        try:
            check_family(family)
        except ValueError:
            family = []  # the traced graph changes with the batch size: every trial profiles
            self.family_traced = None
        self.family = family
        return family

    def _trace_for_trial(self, module: nn.Module, args: tuple, kwargs: dict) -> Traced:
        """The planner's tracer in a trial: the family's trace when the call's inputs are the
        family's but for the batch and fx traced it. Its output was checked against the
        module's at two sizes with the same graph, and fx code is shape-generic, so checking
        it again at each trial's size (two forwards at that size) would only cost time. A
        ``torch.export`` capture is not: it bakes the sizes it saw into its views, so each
        trial's size is captured on its own (its costs still come from the family)."""
        if (self.family_traced is not None and self.family_traced.kind != EXPORT
                and _batchless(args, kwargs) == self._family_inputs):
            return self.family_traced
        return trace_module(module, args, kwargs)

    def derived(self, batch_size: int) -> Graph:
        """The graph at ``batch_size`` derived from the shape family."""
        graph = derive_graph(self.family, batch_size)
        # As the planner completes a profile: the executor's own time per recomputed stage.
        (graph.meta.recompute_stage_seconds,
         graph.meta.recompute_vertex_seconds) = measure_recompute_overhead(self.device)
        return graph

    def _graph_for_trial(self, module: nn.Module, args: tuple, kwargs: dict, traced: Traced) -> Graph:
        """The planner's profiler in a trial: the derived graph when the traced forward is
        the family's, a real profile otherwise."""
        if self.family and traced.graph.graph_hash() == self.family[0].graph_hash() \
                and traced.graph.ids == self.family[0].ids:
            graph = self.derived(self._size)
            graph.meta.bandwidth_bytes_per_s = self.family[-1].meta.bandwidth_bytes_per_s
            return graph
        return profile_module(module, args, example_kwargs=kwargs or None, traced=traced,
                              repeats=self.settings.plan.profile_repeats,
                              safe=self.settings.plan.safe_profile, loss_fn=self._loss)

    def _run_step(self, batch: Any, measured: list[tuple[int, int, float]] | None = None) -> None:
        """One training step as Lightning's automatic optimization runs it: the module's
        ``optimizer_step`` hook steps its LightningOptimizer with a closure running the
        strategy's ``training_step`` (precision context, DDP wrapper) and ``backward``
        (precision plugin, GradScaler); the plugin then calls ``on_before_optimizer_step``
        and clips the gradients; then ``optimizer_zero_grad``. Under manual optimization
        ``training_step`` does all of it.

        With ``measured``, forward and backward run inside the meter, and (their peak, the
        bytes of the parameter gradients they allocated, when they started) is appended: the
        gradients are live when the backward ends, so a true reading is never below them
        (docs/design.md section 6); the optimizer's update is outside the meter.
        """
        model, strategy = self.model, self.trainer.strategy
        without_grad = [p for p in model.parameters() if p.grad is None]

        def forward_backward(optimizer: Any) -> torch.Tensor | None:
            out = strategy.training_step(batch, 0)
            if not model.automatic_optimization:
                return None  # manual: training_step ran its own backward and step
            # Lightning's own result of the step, as its closure holds it through the
            # backward: the loss divided by the batches accumulated, and a detached copy.
            result = ClosureResult.from_training_step_output(out, self.trainer.accumulate_grad_batches)
            del out  # Lightning keeps only the result
            if result.closure_loss is None:
                return None
            strategy.backward(result.closure_loss, getattr(optimizer, "optimizer", optimizer))  # the torch one
            return result.loss

        def closure(optimizer: Any = None) -> torch.Tensor | None:
            if measured is None:
                return forward_backward(optimizer)
            result: list[torch.Tensor | None] = [None]
            started = [0.0]

            def step() -> None:
                started[0] = time.perf_counter()
                result[0] = forward_backward(optimizer)

            peak = peak_bytes(step, self.device)
            grad_bytes = sum(local_bytes(p.grad) for p in without_grad if p.grad is not None)
            measured.append((peak, grad_bytes, started[0]))
            return result[0]

        optimizers = model.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        if not model.automatic_optimization or not optimizers:
            closure()
            return
        (optimizer,) = optimizers  # Lightning allows one under automatic optimization
        epoch = self.trainer.current_epoch
        model.optimizer_step(epoch, 0, optimizer, optimizer_closure=functools.partial(closure, optimizer))
        model.optimizer_zero_grad(epoch, 0, optimizer)

    def __call__(self, batch_size: int) -> TrialResult:
        model, trainer = self.model, self.trainer
        planned: Planned | None = None
        with (
            preserved_training_state(model), _optimizers_preserved(list(trainer.optimizers)),
            _trainer_kept(trainer), _logging_muted(model),
            _strategy_planning_paused(trainer.strategy), _resharded_after_error(model),
        ):
            model.train()
            # From no gradients, as a fit's first step at this size has them (and every step
            # under Lightning's default zero_grad, which frees them before the backward): ones
            # left from earlier training would be accumulated into, and neither the plan
            # (``grads_resident``) nor the meter would count the step's own (restored after).
            for p in model.parameters():
                p.grad = None
            batch = self.batch(batch_size)
            self._size = batch_size
            self._loss = self.loss_fn(batch)
            routed: contextlib.AbstractContextManager = contextlib.nullcontext()
            if self.solver != PLAIN:
                args, kwargs = self._capture_call(batch)
                planner = Planner(
                    self.target, dataclasses.replace(self.settings.plan, solver=self.solver),
                    cache=PlanCache(self.settings.cache_dir / "plans.sqlite"),
                    ranks=DistributedRanks(own_group=True) if world_size() > 1 else None,  # rank zero plans
                    profiler=self._graph_for_trial if self.family else None,
                    loss_fn=self._loss,
                    tracer=self._trace_for_trial if self.family else None,
                    free_memory=lambda device: training_budget(device, list(self.trainer.optimizers)),
                    check_first_step=False,  # the trial measures its steps itself
                )
                planned = planner.planned_for(args, kwargs)  # RematInfeasibleError: no plan
                routed = forward_routed(self.target, planner)
                over = _over_budget_somewhere(planned)
                if over:
                    return TrialResult(False, reason=over, solver=planned.plan.solver,
                                       predicted_peak_bytes=planned.plan.predicted_peak_bytes)
            measured: list[tuple[int, int, float]] = []
            reserved, seconds = [0], []
            with routed:
                if self.device.type == "cuda" or self.settings.budget_from_device:
                    # One unmeasured step first on CUDA: the first run of a kernel at a new
                    # shape allocates lasting caches (cuDNN workspaces, the optimizer's
                    # state) that the allocator's counters would take for the step's peak,
                    # and a budget read from free memory must see the optimizer's state. The
                    # CPU meter counts tensor storage only, and the optimizer's state
                    # appears after the measured backward.
                    self._run_step(batch)
                # Once the optimizer state exists, what is left is what a step may use.
                budget_bytes = default_budget(self.device) if self.settings.budget_from_device else self.budget_bytes
                for attempt in range(1 + TRIAL_REPLANS):
                    measured.clear()
                    reserved[1:], seconds[:] = [], []
                    for _ in range(self.steps_per_trial):
                        self._run_step(batch, measured)
                        if self.device.type == "cuda":  # CUDA only: the step's time; reserved beside allocated
                            torch.cuda.synchronize(self.device)
                            reserved.append(int(torch.cuda.max_memory_reserved(self.device)))
                        seconds.append(time.perf_counter() - measured[-1][2])
                    peak = max(m[0] for m in measured)
                    # Every rank plans again, with the highest peak any measured, or none: the
                    # steps are collectives (DDP's reductions, FSDP's gathers), and a rank
                    # stepping again alone leaves the others waiting in them.
                    agreement = DistributedRanks(own_group=True) if world_size() > 1 and planned else None
                    if agreement is not None:
                        peak = max(agreement.gather(peak))
                    done = (planned is None or budget_bytes is None or peak <= budget_bytes
                            or attempt == TRIAL_REPLANS)
                    if agreement is not None:
                        if agreement.any(not done) and not agreement.any(
                                not planner.plan_again(planned, args, kwargs, peak)):
                            continue
                        break
                    if done or not planner.plan_again(planned, args, kwargs, peak):
                        break
                    # Planned again below the budget by what the step measured over its
                    # prediction (the model's margin raised), and measured again.
            del batch
            self._loss = None  # it holds the batch
        peak = max(m[0] for m in measured)
        grad_bytes = max(m[1] for m in measured)
        step_seconds = sorted(seconds)[len(seconds) // 2]  # median
        feasible, reason = _verdict(peak, grad_bytes, budget_bytes)
        return TrialResult(
            feasible=feasible, peak_bytes=peak, seconds=step_seconds, reason=reason,
            reserved_bytes=max(reserved) or None,
            predicted_extra_seconds=planned.plan.predicted_extra_seconds if planned else 0.0,
            predicted_peak_bytes=planned.plan.predicted_peak_bytes if planned else None,
            solver=planned.plan.solver if planned else PLAIN,
        )


def _over_budget_somewhere(planned: Planned) -> str:
    """Across ranks (a collective): why the plan cannot fit the budget some rank read for
    it (its own free memory under ``memory_budget=None``), or "" where it fits on every
    rank. Decided together before any step runs: the steps are collectives (FSDP's gathers,
    DDP's reductions), and a rank that ran out of memory inside one would leave the others
    waiting in it."""
    if world_size() == 1:
        return ""
    budgets = DistributedRanks(own_group=True).gather(planned.budget_bytes)
    # Rank zero made the plan for its budget; a rank with less must fit it on its own.
    made_for, need = budgets[0], planned.plan.guaranteed_peak_bytes
    over = [f"rank {rank}: the plan needs {need} B, over its budget {budget} B"
            for rank, budget in enumerate(budgets)
            if budget is not None and made_for is not None and budget < made_for and need > budget]
    return "; ".join(over)


def _batchless(args: tuple, kwargs: dict) -> object:
    """A call's inputs as a trace depends on them: their structure, each tensor's dtype,
    device and shape but for the first (batch) dimension, each other leaf's value."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return str(spec), [(t.dtype, t.device, tuple(t.shape[1:])) if isinstance(t, torch.Tensor) else repr(t)
                       for t in leaves]


def _verdict(peak: int, grad_bytes: int, budget_bytes: int | None) -> tuple[bool, str]:
    """(feasible, reason) for a trial's measured peak. A peak of zero, or one below the
    parameter gradients the step allocated (live when it ends), is a failed measurement:
    never a fit. The gradients alone decide against a budget below them; otherwise the
    trial cannot be judged and the search stops rather than record a guess."""
    if budget_bytes is not None and grad_bytes > budget_bytes:
        return False, (f"the step's parameter gradients alone take {grad_bytes} B, over the "
                       f"budget {budget_bytes} B (no plan removes them)")
    if peak <= 0 or peak < grad_bytes:
        raise MeasurementError(
            f"the meter read a peak of {peak} B for a step that allocates {grad_bytes} B of "
            "parameter gradients: a failed measurement, not a fit. Run the search again; if "
            "it recurs, report it with the model"
        )
    if budget_bytes is None or peak <= budget_bytes:
        return True, ""
    return False, f"measured peak {peak} B over the budget {budget_bytes} B"


class MeasurementError(RuntimeError):
    """The meter gave a reading no training step can have (zero, or below the parameter
    gradients the step allocated)."""
