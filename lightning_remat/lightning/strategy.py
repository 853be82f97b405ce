"""``Trainer(strategy="remat")``: plan at the first training step, apply, keep training.

The strategy plans what ``training_step`` runs: each outermost module whose forward the first
training step calls in training mode with grad (``self(x)`` plans the LightningModule,
``self.model(x)`` the submodule, an encoder and a head called in turn each of them), or the
submodule named by ``target``; a first step that runs none of them warns. It routes each
planned module's calls through its planner (:func:`forward_routed`). The first training-mode
call with a new input profiles the module on the real device (its parameters, gradients and buffers
restored afterwards), solves for the budget, applies the plan and then runs that very call
through it, so no batch is lost and no optimizer step is taken twice. Evaluation and
``no_grad`` calls run the original forward. Plans are cached in SQLite and stored in
Lightning checkpoints, so a restart or a resume skips profiling. All of it is :class:`~lightning_remat.planner.Planner`'s work; the strategy
adds Lightning's hooks, rank-zero logging and, under DDP, the ranks' agreement on new inputs.

The classes are ``pytorch_lightning`` strategies; :mod:`lightning_remat.unified` runs this
source for ``lightning.pytorch``, and :mod:`lightning_remat.registration` registers
``"remat"`` and ``"remat_ddp"`` in both packages' ``StrategyRegistry``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_remat.cache import PlanCache, StoredPlan, default_cache_dir
from lightning_remat.device import training_budget
from lightning_remat.inputs import shapes_of, stored_key
from lightning_remat.lightning.memory_timeline import MemoryTimelineLogger
from lightning_remat.messages import DistributedRanks
from lightning_remat.planner import Planned, Planner, PlanSettings
from lightning_remat.report import format_plan
from lightning_remat.solvers.plan import Plan
from lightning_remat.step_budget import StepBudget, named_refusal

__all__ = ["CHECKPOINT_KEY", "RematDDPStrategy", "RematHooks", "RematStrategy", "forward_routed"]

CHECKPOINT_KEY = "lightning_remat"
"""Where a checkpoint keeps the plans (graph and plan JSON and what decided them, by input
key)."""


@contextlib.contextmanager
def forward_routed(module: torch.nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """Inside, every call of ``module`` runs ``forward(*args, **kwargs)`` (its hooks still
    around it); on exit the module is as it was, with whatever instance-level ``forward`` it
    had before (routes nest, innermost first).

    The one place that sets and removes a module's ``forward`` (the strategy's route and
    the batch-size search's alike). Composition cannot do it: the calls planned are the
    LightningModule's own ``self(x)`` (or ``self.backbone(x)``) inside ``training_step``,
    which reach ``forward`` through the module's own ``__call__``; a wrapper around the
    module, as DDP's around ``strategy.model``, sees only the loop's call of
    ``training_step`` (Lightning's own DDP strategy reroutes that call by setting the
    LightningModule's ``forward`` in the same way, its ``_ForwardRedirection``), and a forward
    hook cannot skip the forward it precedes. Only the instance attribute changes: the
    class, the parameters and the ``state_dict`` are untouched, and fx tracing reads the
    class's ``forward``.
    """
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    own = module.forward

    @functools.wraps(own)  # inspect.signature(module.forward) stays the real one
    def routed(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    module.forward = routed  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            module.forward = previous  # type: ignore[method-assign]
        else:
            module.__dict__.pop("forward", None)


def progress_lines(trainer: pl.Trainer) -> Callable[[str], None] | None:
    """Where planning reports its phases: one info line each on rank zero (Lightning's own
    ``rank_zero_info``, as its "GPU available" lines), or nowhere when the Trainer shows no
    progress bar."""
    bar = trainer.progress_bar_callback
    if bar is None or bar.is_disabled:
        return None
    return lambda line: rank_zero_info(f"lightning-remat: {line}")


class RematHooks:
    """The loop hooks the single-device and DDP strategies share (a mixin placed before the
    Lightning strategy class, whose hooks it extends)."""

    remat_settings: PlanSettings
    """What decides a plan: budget, solver, profiling, offloading."""
    target: str | None
    """The submodule planned (None: the modules the first training step runs)."""
    cache_dir: str | os.PathLike | None
    planners: dict[str, Planner]
    """The planner of each planned module, by its name in the LightningModule (``""``: the
    LightningModule itself), in the order the training step first ran them."""
    plans_what_the_step_runs: bool = True
    """Without ``target``, plan the modules the first training step runs (a strategy that
    plans one module of its own choosing sets False and overrides :meth:`target_module`)."""

    def __init__(
        self,
        memory_budget: int | float | str | None = None,
        solver: str = "auto",
        profile_steps: int = 3,
        target: str | None = None,
        offload: bool = True,
        cache_dir: str | os.PathLike | None = None,
        safe_profile: bool = False,
        **kwargs: Any,
    ) -> None:
        """The planning arguments of every remat strategy (:class:`RematStrategy` documents
        them); ``kwargs`` go to the Lightning strategy the mixin is placed before."""
        super().__init__(**kwargs)
        try:
            self.remat_settings = PlanSettings(memory_budget, solver, profile_steps, safe_profile, offload)
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}".replace("profile_repeats", "profile_steps")) from None
        if target is not None and not isinstance(target, str):
            raise ValueError(f"{type(self).__name__}(target={target!r}) must be a submodule name such as 'backbone'")
        self.target = target
        self.cache_dir = cache_dir
        self.planners = {}
        self._planned_modules: dict[str, torch.nn.Module] = {}
        self._target_module: torch.nn.Module | None = None
        self._route = contextlib.ExitStack()
        self._planner_options: dict[str, Any] = {}
        self._detecting = False
        self._ran_unplanned: dict[str, str] = {}
        self._depth = 0
        self._restored: dict[str, dict[str, StoredPlan]] = {}
        self._in_training_step = False
        self._planning_paused = False
        self._step_budget = StepBudget(memory_budget)  # the step's modules share one budget

    def __repr__(self) -> str:
        # Lightning's Trainer names a strategy it refuses (one of the other Lightning
        # package's) by its repr: this one says which Trainer takes which class.
        mine = pl.__name__.replace(".pytorch", "")  # "pytorch_lightning" or "lightning"
        other, ours = (("lightning", "lightning_remat.unified") if mine == "pytorch_lightning"
                       else ("pytorch_lightning", "lightning_remat.lightning"))
        return (f"{type(self).__name__}(memory_budget={self.remat_settings.memory_budget!r}), the "
                f"strategy of {mine}.Trainer; {other}.Trainer takes {ours}.{type(self).__name__}")

    @property
    def planner(self) -> Planner | None:
        """The planner of the planned module (with several, of the first the step ran)."""
        return next(iter(self.planners.values()), None)

    @property
    def memory_budget(self) -> int | float | str | None:
        return self.remat_settings.memory_budget

    @property
    def solver(self) -> str:
        return self.remat_settings.solver

    @property
    def plans(self) -> dict[tuple, Plan]:
        """The plan in use for each input seen so far; keyed by input when one module is
        planned, by ``(module name, input)`` when several are."""
        several = len(self.planners) > 1
        return {((name, key) if several else key): entry.plan
                for name, planner in self.planners.items() for key, entry in planner.planned.items()}

    # ---- Lightning hooks ----------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        self._install(trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._training_step_scope():
            return super().training_step(*args, **kwargs)  # type: ignore[misc]

    @override
    def teardown(self) -> None:
        self._uninstall()
        super().teardown()  # type: ignore[misc]

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        checkpoint[CHECKPOINT_KEY] = self._checkpoint_state()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        self._restore(checkpoint)
        return checkpoint

    # ---- installing the wrapper --------------------------------------------------------
    def target_module(self, lightning_module: pl.LightningModule) -> torch.nn.Module:
        """The submodule named by ``target``, else the LightningModule."""
        if not self.target:
            return lightning_module
        try:
            return lightning_module.get_submodule(self.target)
        except AttributeError:
            names = [n for n, _ in lightning_module.named_children()]
            raise ValueError(
                f"{type(self).__name__}(target={self.target!r}): the LightningModule has no "
                f"such submodule; its children are {names}"
            ) from None

    def _install(self, trainer: pl.Trainer) -> None:
        cache_dir = self.cache_dir
        if cache_dir is None:
            cache_dir = default_cache_dir(trainer.default_root_dir)
        world_size = getattr(self, "world_size", 1)
        self._planner_options = dict(
            cache=PlanCache(Path(cache_dir) / "plans.sqlite"),
            ranks=DistributedRanks() if world_size > 1 else None, on_plan=self._on_plan,
            keep_example=self._add_dashboards(trainer), progress=progress_lines(trainer),
            free_memory=lambda device: training_budget(device, trainer.optimizers),
        )
        lightning_module = self.lightning_module  # type: ignore[attr-defined]
        if self.target or not self.plans_what_the_step_runs:
            module = self.target_module(lightning_module)
            name = next((n for n, m in lightning_module.named_modules() if m is module), self.target or "")
            self._add_planner(name, module)
            self._route.enter_context(forward_routed(module, self._planned_route(name, module)))
            self._target_module = module
            return
        # Which modules the training step runs shows only when it runs: until the first
        # step ends, every module's calls pass through a route that plans the outermost
        # ones (the first call of each goes to its planner, so no batch runs unplanned).
        self._detecting = True
        self._step_budget.detecting = True
        for name, module in lightning_module.named_modules():
            self._route.enter_context(forward_routed(module, self._detecting_route(name, module)))

    def _add_planner(self, name: str, module: torch.nn.Module) -> Planner:
        restored = self._restored.setdefault(name, {})
        planner = Planner(module, self.remat_settings, restored=restored, **self._planner_options)
        self._step_budget.add(name, planner)
        self.planners[name] = planner
        self._planned_modules[name] = module
        return planner

    def _planned_route(self, name: str, module: torch.nn.Module) -> Callable[..., Any]:
        original_forward = module.forward

        def route(*args: Any, **kwargs: Any) -> Any:
            planner = self.planners[name]
            run = planner if self._depth == 0 and self.plans_call(module) else original_forward
            self._depth += 1
            try:
                return named_refusal(run, name)(*args, **kwargs) if run is planner else run(*args, **kwargs)
            finally:
                self._depth -= 1

        return route

    def _detecting_route(self, name: str, module: torch.nn.Module) -> Callable[..., Any]:
        original_forward = module.forward

        def route(*args: Any, **kwargs: Any) -> Any:
            run = original_forward
            if self._detecting and self._depth == 0 and self._in_training_step and not self._planning_paused:
                if module.training and torch.is_grad_enabled():  # an outermost module of the step
                    planner = self.planners.get(name) or self._add_planner(name, module)
                    if self.plans_call(module):
                        run = named_refusal(planner, name)
                else:
                    label = name or "the LightningModule"
                    self._ran_unplanned[label] = "in eval mode" if not module.training else "without grad"
            self._depth += 1
            try:
                return run(*args, **kwargs)
            finally:
                self._depth -= 1

        return route

    def _end_detection(self, check: bool = True) -> None:
        """After the first training step: keep the routes of the modules it ran, or warn
        that it ran none the strategy could plan; with ``check`` (it ended without an error)
        hold their plans to the step's budget together (``StepBudget.check``)."""
        self._detecting = False
        self._route.close()
        for name, module in self._planned_modules.items():
            self._route.enter_context(forward_routed(module, self._planned_route(name, module)))
        if not check:
            self._step_budget.detecting, self._step_budget.deferred = False, {}
            return
        self._step_budget.check()  # the modules the step ran hold its budget together
        if not self.planners:
            ran = "; ".join(f"{n} ({why})" for n, why in self._ran_unplanned.items()) or (
                "no module's forward, the LightningModule's or a submodule's")
            rank_zero_warn(
                "lightning-remat: the first training_step ran nothing the strategy can plan (it "
                f"plans a module whose forward the step calls in training mode with grad; it ran: {ran}), "
                "so nothing is planned. Call self(x) or a submodule in training_step, or name "
                "the module with target=")

    def plans_call(self, module: torch.nn.Module) -> bool:
        """Whether a call of the planned ``module`` now goes to its planner: a training-mode,
        grad-enabled call inside the strategy's ``training_step``, while no planner is itself
        running a module and planning is not paused (:meth:`planning_paused`)."""
        planner = next((self.planners[n] for n, m in self._planned_modules.items() if m is module), None)
        return (planner is not None and not any(p.busy for p in self.planners.values())
                and self._in_training_step and not self._planning_paused and module.training
                and torch.is_grad_enabled())

    @contextlib.contextmanager
    def planning_paused(self) -> Iterator[None]:
        """Inside, the strategy plans nothing: the planned module runs its own forward, or
        whatever forward a caller routes it to (the batch-size search runs its trials'
        steps through the strategy's ``training_step`` with planners of its own)."""
        paused = self._planning_paused
        self._planning_paused = True
        try:
            yield
        finally:
            self._planning_paused = paused

    @staticmethod
    def _add_dashboards(trainer: pl.Trainer) -> bool:
        """Add a MemoryTimelineLogger when a TensorBoard logger is attached and none is."""
        if not any(type(lg).__name__ == "TensorBoardLogger" for lg in trainer.loggers):
            return False
        if not any(isinstance(cb, MemoryTimelineLogger) for cb in trainer.callbacks):
            trainer.callbacks.append(MemoryTimelineLogger())
        return True

    def _uninstall(self) -> None:
        self._detecting = False
        self._route.close()
        self._target_module = None

    def _on_plan(self, entry: Planned) -> None:
        name = next((n for n, p in self.planners.items() if entry.module is p.remat_module), None)
        title = "lightning-remat plan" + (f" of {name or 'the LightningModule'}" if name is not None else "")
        title += " (from cache)" if entry.from_cache else ""
        rank_zero_info(format_plan(entry.graph, entry.plan, budget_bytes=entry.budget_bytes,
                                   title=title, shapes=shapes_of(entry.key)))

    @contextlib.contextmanager
    def _training_step_scope(self) -> Iterator[None]:
        self._in_training_step = True
        ended = False
        try:
            yield
            ended = True
        finally:
            self._in_training_step = False
            if self._detecting and not self._planning_paused:  # the batch-size search's steps do not count
                self._end_detection(check=ended)

    # ---- checkpoints ---------------------------------------------------------------------
    def _checkpoint_state(self) -> dict[str, Any]:
        """Each planned module's plans with what decided them, by the module's name; plans
        restored and not replaced in this run are kept, so a resume that has not yet seen
        an input loses nothing."""
        modules: dict[str, dict[str, dict[str, Any]]] = {
            name: {key: stored.to_dict() for key, stored in restored.items()}
            for name, restored in self._restored.items()}
        for name, planner in self.planners.items():
            state = modules.setdefault(name, {})
            for key, entry in planner.planned.items():
                state[stored_key(key)] = StoredPlan(entry.graph.to_json(), entry.plan.to_json(), entry.basis).to_dict()
        return {"modules": modules}

    def _restore(self, checkpoint: dict[str, Any]) -> None:
        by_module = (checkpoint.get(CHECKPOINT_KEY) or {}).get("modules")
        self._restored.clear()
        for name, plans in (by_module if isinstance(by_module, dict) else {}).items():
            restored = self._restored.setdefault(name, {})
            for key, value in (plans or {}).items():
                try:
                    restored[key] = StoredPlan.from_stored(value)
                except (ValueError, KeyError, TypeError):
                    continue  # a damaged plan is re-made, never trusted
        for name, planner in self.planners.items():  # planners made before the load
            planner.restored.clear()
            planner.restored.update(self._restored.get(name, {}))


class RematStrategy(RematHooks, SingleDeviceStrategy):
    """Single-device training within a memory budget.

    Args:
        memory_budget: bytes, ``"6GiB"``, ``"512MB"`` or ``"60%"`` of the plain step's peak
            (for each input shape, of its own plain peak); ``None``: free device memory less
            10% on CUDA, no limit on CPU.
        solver: a name from ``lightning_remat.solvers.SOLVERS`` (``"auto"`` tries the
            time-centric DP, then the memory-centric DP, then offloading).
        profile_steps: measured repeats when profiling.
        target: the submodule to rematerialize (default: the modules whose forward the first
            training step runs, outermost first: the LightningModule for ``self(x)``,
            ``model`` for ``self.model(x)``, each of several called in turn).
        offload: allow the offloading fallback of ``solver="auto"``.
        cache_dir: where plans are cached (default: ``<default_root_dir>/lightning_remat_cache``).
        safe_profile: profile op by op so profiling fits where a plain step would not.
        device: the device to train on (default: the Trainer's).

    Examples::

        >>> import tempfile
        >>> import pytorch_lightning as pl
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from lightning_remat import RematStrategy
        >>> class Regressor(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(32, 32), nn.Tanh())])
        ...     def forward(self, x):
        ...         return self.net(x)
        ...     def training_step(self, batch, batch_idx):
        ...         x, y = batch
        ...         return nn.functional.mse_loss(self(x), y)
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.01)
        >>> data = DataLoader(TensorDataset(torch.randn(1024, 32), torch.randn(1024, 32)), batch_size=512)
        >>> strategy = RematStrategy(memory_budget="50%")  # Trainer(strategy="remat"): no budget
        >>> with tempfile.TemporaryDirectory() as root:
        ...     trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_epochs=1,
        ...                          default_root_dir=root, logger=False, enable_checkpointing=False,
        ...                          enable_progress_bar=False, enable_model_summary=False)
        ...     trainer.fit(Regressor(), data)
        >>> (plan,) = strategy.plans.values()  # one input shape, one plan
        >>> plan.solver  # doctest: +ELLIPSIS
        'auto:...'
        >>> plan.count("recompute") > 0
        True
    """

    strategy_name = "remat"

    def __init__(self, *args: Any, device: str | torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(*args, device=device or "cpu", **kwargs)
        self._device_given = device is not None
        self.parallel_devices: list[torch.device] = []  # filled in by the Trainer

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._device_given and self.parallel_devices:
            return self.parallel_devices[0]
        return self._root_device


class RematDDPStrategy(RematHooks, DDPStrategy):
    """Distributed data parallel within a memory budget: the ranks agree on every new input,
    and each applies the plan made for its own input. Arguments as :class:`RematStrategy`,
    plus DDPStrategy's."""

    strategy_name = "remat_ddp"

