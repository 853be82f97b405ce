"""``RematBatchSizeFinder``: the largest batch that fits the budget, re-planning for each size.

Lightning's ``BatchSizeFinder`` doubles the batch until an OOM and bisects; it cannot know
that another rematerialization plan would make a bigger batch fit. This callback runs the
same kind of search (an Optuna study, see :mod:`lightning_remat.tuning`) where a trial at
batch size ``b`` is what ``Trainer(strategy=RematStrategy(...))`` would do at ``b``: trace,
profile, solve for the budget and apply the plan (:class:`~lightning_remat.planner.Planner`),
then run ``steps_per_trial`` training steps as Lightning's loop runs them (the strategy's
``training_step``, ``backward`` and optimizer step, so the DDP wrapper, the precision plugin
with its GradScaler, and gradient clipping take part) and measure their peak
(:func:`~lightning_remat.meter.peak_bytes`). A trial is feasible when a plan
exists, nothing runs out of memory and the measured peak is within the budget. The same
search with solver ``"plain"`` (no rematerialization) gives plain training's maximum for
the report. The weights, optimizer state, BatchNorm statistics and RNG are restored after
every trial: the search does not train the model.

Conventions follow ``pytorch_lightning.callbacks.BatchSizeFinder``: ``batch_arg_name``
names an attribute of the model, its ``hparams`` or the datamodule (found with Lightning's
``lightning_hasattr``), the search runs in ``on_fit_start`` and the largest feasible size is
written back with ``lightning_setattr``.

Under ``remat_ddp`` and ``remat_fsdp`` the search spans the ranks
(:func:`~lightning_remat.tuning.run_search_across_ranks`): one study on rank zero, every
rank runs each trial's steps, a size fits only when it fits on every rank (the worst peak
over ranks), and every rank writes the same answer, so every rank's dataloader gets it.
Lightning's ``BatchSizeFinder`` refuses distributed strategies because the ranks would have
to agree on an out-of-memory error; here each rank measures, and the ranks compare.

Length: the trial, its verdict and the callback that drives it read the same Trainer state;
apart, each would import the other's private helpers. Lightning's private names used (each
commented where used) are ones its own ``BatchSizeFinder`` uses: ``fit_loop._data_source``,
``fit_loop._combined_loader`` and ``_TunerExitException``;
pyproject.toml bounds ``pytorch-lightning`` to the versions tested, and a test fails when one
is gone.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks.callback import Callback
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.utilities.exceptions import MisconfigurationException, _TunerExitException
from pytorch_lightning.utilities.parsing import (
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.utils import _pytree as pytree

from lightning_remat.budget import parse_budget
from lightning_remat.cache import PlanCache, default_cache_dir
from lightning_remat.device import (
    default_budget,
    move_to_device,
    preserved_state,
    preserved_training_state,
)
from lightning_remat.graph.ir import Graph
from lightning_remat.graph.profile import profile_module
from lightning_remat.graph.scale import check_family, derive_graph
from lightning_remat.graph.trace import Traced, default_loss, local_bytes, trace_module
from lightning_remat.lightning.strategy import RematHooks, forward_routed
from lightning_remat.messages import DistributedRanks, world_size
from lightning_remat.meter import collector_settled, peak_bytes
from lightning_remat.planner import (
    Planned,
    Planner,
    PlanSettings,
    planning_summary,
    solver_options,
)
from lightning_remat.report import BatchSizeReport
from lightning_remat.runtime.module import measure_recompute_overhead
from lightning_remat.solvers import SOLVERS, min_budget, simulate, solve
from lightning_remat.solvers.scoring import model_margin
from lightning_remat.tuning import (
    SearchResult,
    TrialFn,
    TrialResult,
    check_search_args,
    default_storage,
    predict_largest,
    predict_largest_by_projection,
    run_search,
    run_search_across_ranks,
    study_name_for,
)

PLAIN = "plain"


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

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("captured")
        self.args, self.kwargs = args, kwargs


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


def _sample_shape(batch: Any) -> str:
    shapes: list[str] = []

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            shapes.append("x".join(str(s) for s in value.shape[1:]) or "scalar")
        elif isinstance(value, Mapping):
            for k in sorted(value, key=str):
                visit(value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    visit(batch)
    return ",".join(shapes)


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
        # The strategy's own choice (under remat_fsdp the outermost sharded unit).
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
        def capture(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            raise _Captured(args, kwargs)

        # A pre-hook ahead of any other (an FSDP unit's would gather its parameters first).
        handle = self.target.register_forward_pre_hook(capture, prepend=True, with_kwargs=True)
        try:
            self.model.training_step(batch, 0)
        except _Captured as call:
            return call.args, call.kwargs
        finally:
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
        family's but for the batch. Its output was checked against the module's at two
        sizes with the same graph, and fx code is shape-generic, so checking it again at
        each trial's size (two forwards at that size) would only cost time."""
        if self.family_traced is not None and _batchless(args, kwargs) == self._family_inputs:
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
            loss = out["loss"] if isinstance(out, Mapping) else out
            if not model.automatic_optimization or loss is None:
                return None  # manual: training_step ran its own backward and step
            strategy.backward(loss, getattr(optimizer, "optimizer", optimizer))  # the torch one
            return loss.detach()

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
            _strategy_planning_paused(trainer.strategy),
        ):
            model.train()
            batch = self.batch(batch_size)
            self._size = batch_size
            self._loss = self.loss_fn(batch)
            routed: contextlib.AbstractContextManager = contextlib.nullcontext()
            if self.solver != PLAIN:
                args, kwargs = self._capture_call(batch)
                planner = Planner(
                    self.target, dataclasses.replace(self.settings.plan, solver=self.solver),
                    cache=PlanCache(self.settings.cache_dir / "plans.sqlite"),
                    ranks=DistributedRanks() if world_size() > 1 else None,  # rank zero plans
                    profiler=self._graph_for_trial if self.family else None,
                    loss_fn=self._loss,
                    tracer=self._trace_for_trial if self.family else None,
                )
                planned = planner.planned_for(args, kwargs)  # RematInfeasibleError: no plan
                routed = forward_routed(self.target, planner)
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
                for _ in range(self.steps_per_trial):
                    self._run_step(batch, measured)
                    if self.device.type == "cuda":  # CUDA only: the step's time; reserved beside allocated
                        torch.cuda.synchronize(self.device)
                        reserved.append(int(torch.cuda.max_memory_reserved(self.device)))
                    seconds.append(time.perf_counter() - measured[-1][2])
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


def _batchless(args: tuple, kwargs: dict) -> object:
    """A call's inputs as a trace depends on them: their structure, each tensor's dtype,
    device and shape but for the first (batch) dimension, each other leaf's value."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return str(spec), [(t.dtype, t.device, tuple(t.shape[1:])) if isinstance(t, torch.Tensor) else repr(t)
                       for t in leaves]


class RematBatchSizeFinder(Callback):
    """Finds the largest batch size that trains within the memory budget with
    rematerialization, and plain training's largest beside it.

    Args:
        memory_budget: bytes or a size string (``"6GiB"``); default: the RematStrategy's
            budget, else free device memory less 10% on CUDA. Required on CPU (nothing else
            limits memory there). A relative budget (``"60%"``) is refused: it would grow
            with the batch.
        solver: default: the RematStrategy's solver, else ``"auto"``.
        batch_arg_name: the attribute holding the batch size, on the model, its ``hparams``
            or the datamodule (as ``BatchSizeFinder``).
        init_val: the first size tried; the search doubles from it.
        max_val: the largest size tried.
        steps_per_trial: measured training steps per trial.
        max_trials: at most this many trials per search in one call.
        granularity: stop when the largest feasible and smallest infeasible size are this
            close (1: the exact maximum).
        compare_plain: also search plain training's maximum (solver ``"plain"``) for the report.
        storage: an Optuna storage URL; default ``sqlite:///<default_root_dir>/lightning_remat_cache/batch_size.db``,
            so an interrupted search resumes.
        study_name: prefix of the study names (default: model class, device, budget, solver,
            input shape).
        progress_bar: show a tqdm bar per search.

    After the search, ``report`` holds the :class:`~lightning_remat.tuning.BatchSizeReport`
    (``print(finder.report)`` shows the table) and ``optimal_batch_size`` the size written.

    Example::

        finder = RematBatchSizeFinder(init_val=8, steps_per_trial=2)
        trainer = Trainer(strategy=RematStrategy(memory_budget="20GiB"), callbacks=[finder])
        trainer.fit(model)  # searches, sets model.batch_size, then trains with it
    """

    def __init__(
        self,
        memory_budget: int | str | None = None,
        solver: str | None = None,
        batch_arg_name: str = "batch_size",
        init_val: int = 2,
        max_val: int = 8192,
        steps_per_trial: int = 3,
        max_trials: int = 25,
        granularity: int = 1,
        compare_plain: bool = True,
        storage: str | None = None,
        study_name: str | None = None,
        progress_bar: bool = True,
    ) -> None:
        check_search_args(init_val, max_val, granularity)
        if not isinstance(steps_per_trial, int) or steps_per_trial < 1:
            raise ValueError(f"steps_per_trial={steps_per_trial!r} must be an int >= 1")
        if solver is not None and solver not in SOLVERS:
            raise ValueError(f"solver={solver!r}: choose one of {sorted(SOLVERS)}")
        _absolute_budget(memory_budget)
        self.memory_budget = memory_budget
        self.solver = solver
        self.batch_arg_name = batch_arg_name
        self.init_val, self.max_val = init_val, max_val
        self.steps_per_trial, self.max_trials, self.granularity = steps_per_trial, max_trials, granularity
        self.compare_plain = compare_plain
        self.storage = storage
        self.study_name = study_name
        self.progress_bar = progress_bar
        self.report: BatchSizeReport | None = None
        self.optimal_batch_size: int | None = None
        self._early_exit = False

    # ---- Lightning hooks ------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str | None = None) -> None:
        if isinstance(trainer.strategy, ParallelStrategy) and not isinstance(trainer.strategy, RematHooks):
            raise MisconfigurationException(
                f"RematBatchSizeFinder does not support {type(trainer.strategy).__name__}; across ranks "
                "it runs under strategy='remat_ddp' or 'remat_fsdp'")
        # Private, as in BatchSizeFinder.setup: whether fit's dataloader comes from a module.
        if stage == "fit" and not trainer.fit_loop._data_source.is_module():
            raise MisconfigurationException(
                "RematBatchSizeFinder cannot change the batch size of dataloaders passed directly to "
                "`.fit()`: define train_dataloader in the LightningModule or a LightningDataModule"
            )
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise MisconfigurationException(
                f"Field {self.batch_arg_name} not found in `model`, `datamodule`, nor their `hparams` "
                "attributes: add it, or pass batch_arg_name="
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.scale_batch_size(trainer, pl_module)

    # ---- the search -----------------------------------------------------------------------
    def _settings(self, trainer: pl.Trainer) -> SearchSettings:
        """The search's settings: this callback's arguments, else the RematStrategy's."""
        strategy = trainer.strategy
        remat_strategy = strategy if isinstance(strategy, RematHooks) else None
        budget = self.memory_budget
        plan = PlanSettings(solver=self.solver or "auto")
        if remat_strategy is not None:
            if budget is None:
                budget = remat_strategy.memory_budget
            plan = dataclasses.replace(remat_strategy.remat_settings, solver=self.solver or remat_strategy.solver)
        device = strategy.root_device
        budget_bytes = _absolute_budget(budget)
        if budget_bytes is None:
            budget_bytes = default_budget(device)
        if budget_bytes is None:
            raise MisconfigurationException(
                "RematBatchSizeFinder on CPU needs memory_budget= (bytes or '512MiB'): nothing "
                "raises out-of-memory there, so only the budget can bound the batch size"
            )
        # The planner gets the budget as written, None included (so its plan-cache key
        # matches the strategy's and training at the found size reuses the trial's plan).
        plan = dataclasses.replace(plan, memory_budget=budget)
        cache_dir = remat_strategy.cache_dir if remat_strategy is not None else None
        return SearchSettings(
            plan=plan, budget_bytes=budget_bytes, device=device,
            target=remat_strategy.target if remat_strategy is not None else None,
            cache_dir=Path(cache_dir or default_cache_dir(trainer.default_root_dir)),
            budget_from_device=_absolute_budget(budget) is None,
        )

    def _search(self, trainer: pl.Trainer, pl_module: pl.LightningModule, trial_fn: TrialFn,
                solver: str, label: str, settings: SearchSettings, init_val: int, sample_shape: str,
                hint: int | list[int] | None = None) -> SearchResult:
        storage = self.storage or default_storage(trainer.default_root_dir)
        name = study_name_for(pl_module, settings.device, settings.budget_bytes, solver, sample_shape)
        if self.study_name:
            name = f"{self.study_name}|{name}"
        search_args = dict(
            init_val=init_val, max_val=self.max_val, granularity=self.granularity,
            max_trials=self.max_trials, storage=storage, study_name=name, label=label,
            solver=solver, progress_bar=self.progress_bar, hint=hint,
        )
        if world_size() > 1:
            return run_search_across_ranks(trial_fn, DistributedRanks(), **search_args)
        return run_search(trial_fn, **search_args)

    def _predict(self, trial: TrialFn, solver: str, settings: SearchSettings, init_val: int) -> int | None:
        """The largest size predicted to fit, from the graphs the shape family gives each
        size (None without a family): plain training by the plain peak fitted to the
        profiles, a solver by where its smallest budget on the derived graphs crosses the
        budget (:func:`~lightning_remat.tuning.predict_largest_by_projection`)."""
        if not isinstance(trial, LightningTrial) or not trial.family:
            return None
        budget = settings.budget_bytes
        options = solver_options(solver, settings.device, settings.plan.offload)

        if solver == PLAIN:
            def plain_fits(size: int) -> bool:
                graph = trial.derived(size)
                return (graph.meta.plain_peak_bytes or simulate(graph).peak_bytes) <= budget

            return predict_largest(plain_fits, init_val, self.max_val, self.granularity)
        # A solver's smallest budget, and the plan that has it run at larger sizes, give the
        # crossing in a few solves, where a search on fits-or-not solves at every size it
        # doubles to.
        def least_at(size: int) -> tuple[int, Callable[[int], int]]:
            graph = trial.derived(size)
            least = min_budget(graph, solver, **options)
            plan = solve(graph, least, solver, **options)

            def peak(other: int) -> int:
                derived = trial.derived(other)
                return simulate(derived, plan).peak_bytes + model_margin(derived)

            return least, peak

        return predict_largest_by_projection(least_at, budget, init_val, self.max_val, self.granularity)

    def family_sizes(self) -> list[int]:
        """The batch sizes the shape family is profiled at: ``init_val`` and half of it (2
        when ``init_val`` is 1), so the two profiles give each cost's line."""
        return sorted({self.init_val, max(1, self.init_val // 2) if self.init_val > 1 else 2})

    def _say(self, trainer: pl.Trainer) -> Callable[[str], None]:
        """One info line on rank zero per phase of the search, unless ``progress_bar`` is
        off or the Trainer shows no progress bar."""
        if not self.progress_bar or trainer.progress_bar_callback is None:
            return lambda line: None
        return lambda line: rank_zero_info(f"lightning-remat: {line}")

    def make_trial(self, trainer: pl.Trainer, pl_module: pl.LightningModule, solver: str,
                   settings: SearchSettings) -> TrialFn:
        """The trial function for one solver (override to measure differently)."""
        return LightningTrial(
            trainer, pl_module, batch_arg_name=self.batch_arg_name,
            steps_per_trial=self.steps_per_trial, solver=solver, settings=settings,
        )

    def scale_batch_size(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> BatchSizeReport:
        """Run the searches, write the answer to ``batch_arg_name`` and keep the report."""
        settings = self._settings(trainer)
        original = lightning_getattr(pl_module, self.batch_arg_name)
        bar = trainer.progress_bar_callback
        if bar is not None:
            bar.disable()
        settled = contextlib.ExitStack()
        settled.enter_context(collector_settled())  # the CPU meter collects before every step
        try:
            sample_shape = ""
            with contextlib.suppress(Exception):  # the name is only a label; never fail on it
                loader = trainer.fit_loop._data_source.dataloader()  # private: see LightningTrial.batch
                sample_shape = _sample_shape(next(iter(loader)))
            say = self._say(trainer)
            started = time.perf_counter()
            solver = settings.plan.solver
            remat_trial = self.make_trial(trainer, pl_module, solver, settings)
            family: list[Graph] = []
            # Across ranks every rank must profile together; the shape family is one
            # process's shortcut, so a distributed search profiles each trial instead.
            if isinstance(remat_trial, LightningTrial) and world_size() == 1:
                sizes = self.family_sizes()
                say(f"batch-size search: profiling at batch sizes {sizes} (once for every trial)")
                family = remat_trial.profile_family(sizes)
            plain = None
            init_val = self.init_val
            if self.compare_plain and solver != PLAIN:
                plain_trial = self.make_trial(trainer, pl_module, PLAIN, settings)
                if isinstance(plain_trial, LightningTrial):
                    plain_trial.family = family
                hint = self._predict(plain_trial, PLAIN, settings, self.init_val)
                say(f"batch-size search (plain): predicted largest {hint}; measuring around it")
                plain = self._search(trainer, pl_module, plain_trial, PLAIN, "plain", settings, self.init_val,
                                     sample_shape, hint)
                # Remat fits at least what plain training fits (same budget): start there.
                if plain.largest_feasible and plain.largest_feasible <= self.max_val:
                    init_val = plain.largest_feasible
            # Two predictions: the solver's, then plain training's (its peak is fitted to
            # measured peaks, so it holds even where the simulator and a plan's measured
            # peak disagree; every solver fits at least what plain training fits).
            predicted = self._predict(remat_trial, solver, settings, init_val)
            fallback = self._predict(remat_trial, PLAIN, settings, init_val) if solver != PLAIN else None
            hints = [h for h in (predicted, fallback) if h]
            label = "remat" if solver != PLAIN else PLAIN
            say(f"batch-size search ({label}): predicted largest {predicted}"
                + (f" (plain training: {fallback})" if fallback else "") + "; measuring around it")
            remat = self._search(trainer, pl_module, remat_trial, solver, label, settings, init_val,
                                 sample_shape, hints)
            seconds = time.perf_counter() - started
            trials = remat.trials_run + (plain.trials_run if plain is not None else 0)
            step = family[-1].meta.step_seconds if family else None
            say(f"batch-size search: {trials} trials, largest fit {remat.largest_feasible}; "
                + planning_summary(seconds, step)
                + (f" at batch {family[-1].meta.batch_size}" if step else ""))
        finally:
            settled.close()
            if bar is not None:
                bar.enable()
            lightning_setattr(pl_module, self.batch_arg_name, original)
        self.report = BatchSizeReport(
            model=type(pl_module).__name__, device=str(settings.device),
            budget_bytes=settings.budget_bytes, remat=remat, plain=plain,
        )
        self.optimal_batch_size = remat.largest_feasible
        if remat.largest_feasible is None:
            rank_zero_info("lightning-remat: no batch size fits the budget, not even "
                           f"{remat.smallest_infeasible}; batch size left at {original}")
        else:
            lightning_setattr(pl_module, self.batch_arg_name, remat.largest_feasible)
        if not self._early_exit:  # find_max_batch_size returns the report to its caller instead
            rank_zero_info(self.report.table())
        # Private, as BatchSizeFinder's _reset_dataloaders: a dataloader built before this hook
        # (configure_optimizers reading trainer.estimated_stepping_batches builds one) is
        # dropped, so the fit loop builds it again with the new size.
        trainer.fit_loop._combined_loader = None
        if self._early_exit:
            raise _TunerExitException()  # private: how BatchSizeFinder ends fit after its search
        return self.report


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


def _absolute_budget(budget: int | float | str | None) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, float) or (isinstance(budget, str) and budget.strip().endswith("%")):
        raise ValueError(
            f"memory_budget={budget!r} is relative to the plain peak, which grows with the batch "
            "size; the batch-size search needs an absolute budget such as '6GiB' or 512 * 2**20"
        )
    return parse_budget(budget)


def find_max_batch_size(
    trainer: pl.Trainer,
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule | None = None,
    **finder_kwargs: Any,
) -> BatchSizeReport:
    """Search without adding the callback yourself (as Lightning's ``Tuner.scale_batch_size``):
    runs ``trainer.fit`` up to ``on_fit_start``, searches, writes the largest feasible size to
    ``batch_arg_name`` and returns the report. ``finder_kwargs`` are
    :class:`RematBatchSizeFinder`'s arguments.

    Examples::

        >>> import tempfile
        >>> import pytorch_lightning as pl
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from lightning_remat import RematStrategy, find_max_batch_size
        >>> class Regressor(pl.LightningModule):
        ...     def __init__(self, batch_size=16):
        ...         super().__init__()
        ...         self.batch_size = batch_size  # the search writes the size it finds here
        ...         self.net = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(32, 32), nn.Tanh())])
        ...     def forward(self, x):
        ...         return self.net(x)
        ...     def training_step(self, batch, batch_idx):
        ...         x, y = batch
        ...         return nn.functional.mse_loss(self(x), y)
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.01)
        ...     def train_dataloader(self):
        ...         data = TensorDataset(torch.randn(1024, 32), torch.randn(1024, 32))
        ...         return DataLoader(data, batch_size=self.batch_size)
        >>> model = Regressor()
        >>> with tempfile.TemporaryDirectory() as root:  # the search's SQLite study lives here
        ...     trainer = pl.Trainer(strategy=RematStrategy(memory_budget="256KiB"),
        ...                          accelerator="cpu", max_epochs=1, default_root_dir=root,
        ...                          logger=False, enable_checkpointing=False,
        ...                          enable_progress_bar=False, enable_model_summary=False)
        ...     report = find_max_batch_size(trainer, model, init_val=16, max_val=1024,
        ...                                  steps_per_trial=1, progress_bar=False)
        >>> model.batch_size == report.batch_size
        True
        >>> report.batch_size >= report.plain.largest_feasible  # plain training's largest
        True
        >>> print(report.table())  # doctest: +ELLIPSIS
        lightning-remat batch-size search: Regressor on cpu, budget 256.00 KiB
        ...
    """
    finder = RematBatchSizeFinder(**finder_kwargs)
    finder._early_exit = True
    trainer.callbacks = [finder, *trainer.callbacks]
    try:
        trainer.fit(model, datamodule=datamodule)
    finally:
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is not finder]
    if finder.report is None:
        raise RuntimeError("the batch-size search did not run (is fast_dev_run set, or did fit fail?)")
    return finder.report
