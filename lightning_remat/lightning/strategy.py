"""``Trainer(strategy="remat")``: plan at the first training step, apply, keep training.

The strategy wraps the forward of its target (the LightningModule's ``forward`` by default,
or a named submodule). The first training-mode call with a new input shape profiles the
target on the real device (``profile_steps`` measured repeats, the module's parameters,
gradients and buffers restored afterwards), solves for the budget, applies the plan and then
runs that very call through it, so no batch is lost and no optimizer step is taken twice.
Evaluation and ``no_grad`` calls run the original forward. Plans are cached in SQLite and
stored in Lightning checkpoints, so a restart or a resume skips profiling.

``import lightning_remat`` registers ``"remat"`` and ``"remat_ddp"`` in pytorch-lightning's
strategy registry, and in ``lightning.pytorch``'s when that package is installed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from pathlib import Path
from typing import Any

import torch

from lightning_remat.budget import validate_budget
from lightning_remat.cache import PlanCache
from lightning_remat.graph.ir import Graph
from lightning_remat.planner import PlannedModule, ShapePlanner, summary
from lightning_remat.solvers import SOLVERS
from lightning_remat.solvers.plan import Plan

CHECKPOINT_KEY = "lightning_remat"


class _RematLogic:
    """What the single-device and DDP strategies share (composed into both classes)."""

    def _remat_init(
        self,
        memory_budget: int | float | str | None,
        solver: str,
        profile_steps: int,
        target: str | None,
        offload: bool,
        cache_dir: str | os.PathLike | None,
        safe_profile: bool,
    ) -> None:
        validate_budget(memory_budget)  # a malformed budget fails at construction
        if solver not in SOLVERS:
            raise ValueError(f"RematStrategy(solver={solver!r}): choose one of {sorted(SOLVERS)}")
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(f"RematStrategy(profile_steps={profile_steps!r}) must be an int >= 1")
        if target is not None and not isinstance(target, str):
            raise ValueError(f"RematStrategy(target={target!r}) must be a submodule name such as 'backbone'")
        self.memory_budget = memory_budget
        self.solver = solver
        self.profile_steps = profile_steps
        self.target = target
        self.offload = offload
        self.cache_dir = cache_dir
        self.safe_profile = safe_profile
        self.planner: ShapePlanner | None = None
        self._target_module: torch.nn.Module | None = None
        self._restored: dict[str, tuple[str, str]] = {}
        self._in_training_step = False

    # ---- installing the wrapper --------------------------------------------------------
    def _remat_install(self, trainer: Any) -> None:
        module = self.lightning_module
        if self.target:
            try:
                module = module.get_submodule(self.target)
            except AttributeError:
                names = [n for n, _ in self.lightning_module.named_children()]
                raise ValueError(
                    f"RematStrategy(target={self.target!r}): the LightningModule has no such "
                    f"submodule; its children are {names}"
                ) from None
        cache_dir = self.cache_dir
        if cache_dir is None:
            cache_dir = Path(trainer.default_root_dir) / "lightning_remat"
        cache = PlanCache(Path(cache_dir) / "plans.sqlite")
        broadcast = self.broadcast if getattr(self, "world_size", 1) > 1 else None
        dashboards = self._add_dashboards(trainer)
        self.planner = ShapePlanner(
            module, self.memory_budget, self.solver, cache=cache,
            profile_repeats=self.profile_steps, safe_profile=self.safe_profile,
            broadcast=broadcast, on_plan=self._on_plan, restored=self._restored,
            keep_example=dashboards, solver_options=self._solver_options(),
        )
        original_forward = module.forward
        strategy = self

        @functools.wraps(type(module).forward)  # tracing reads the real signature
        def forward(_self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            planner = strategy.planner
            if (
                planner is None or planner.busy or not strategy._in_training_step
                or not _self.training or not torch.is_grad_enabled()
            ):
                return original_forward(*args, **kwargs)
            return planner(*args, **kwargs)

        module.forward = types.MethodType(forward, module)
        self._target_module = module

    def _solver_options(self) -> dict[str, Any]:
        from lightning_remat.runtime.module import auto_options

        return auto_options(self.solver, self.root_device, self.offload)

    @staticmethod
    def _add_dashboards(trainer: Any) -> bool:
        """Add a MemoryTimelineLogger when a TensorBoard logger is attached and none is."""
        from lightning_remat.lightning.memory_timeline import MemoryTimelineLogger

        if not any(type(lg).__name__ == "TensorBoardLogger" for lg in trainer.loggers):
            return False
        if not any(isinstance(cb, MemoryTimelineLogger) for cb in trainer.callbacks):
            trainer.callbacks.append(MemoryTimelineLogger())
        return True

    def _remat_uninstall(self) -> None:
        if self._target_module is not None and "forward" in self._target_module.__dict__:
            del self._target_module.forward
        self._target_module = None

    def _on_plan(self, entry: PlannedModule, key: tuple) -> None:
        from pytorch_lightning.utilities import rank_zero_info

        rank_zero_info(summary(entry, key))

    @contextlib.contextmanager
    def _training_step_scope(self) -> Any:
        self._in_training_step = True
        try:
            yield
        finally:
            self._in_training_step = False

    # ---- checkpoints ---------------------------------------------------------------------
    def _remat_checkpoint_state(self) -> dict[str, Any]:
        if self.planner is None:
            return {}
        return {
            repr(key): (entry.graph.to_json(), entry.plan.to_json())
            for key, entry in self.planner.planned.items()
        }

    def _remat_restore(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(CHECKPOINT_KEY) or {}
        restored = {}
        for key, (graph_json, plan_json) in state.get("plans", {}).items():
            try:
                Plan.from_json(plan_json).validate(Graph.from_json(graph_json))
            except ValueError:
                continue  # a stale plan is re-made, never trusted
            restored[key] = (graph_json, plan_json)
        self._restored.clear()
        self._restored.update(restored)

    @property
    def plans(self) -> dict[tuple, Plan]:
        """The plan in use for each input shape seen so far."""
        return {} if self.planner is None else {k: e.plan for k, e in self.planner.planned.items()}


def _make_strategy_classes(pl: Any) -> tuple[type, type]:
    """RematStrategy and RematDDPStrategy for one Lightning namespace (``pytorch_lightning``
    or ``lightning.pytorch``), so both registries get classes of their own kind."""

    def with_lifecycle(base: type) -> type:
        class _Lifecycle(_RematLogic, base):  # type: ignore[valid-type, misc]
            def setup(self, trainer: Any) -> None:
                super().setup(trainer)
                self._remat_install(trainer)

            def training_step(self, *args: Any, **kwargs: Any) -> Any:
                with self._training_step_scope():
                    return super().training_step(*args, **kwargs)

            def teardown(self) -> None:
                self._remat_uninstall()
                super().teardown()

            def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
                checkpoint[CHECKPOINT_KEY] = {"plans": self._remat_checkpoint_state()}
                super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

            def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
                checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
                self._remat_restore(checkpoint)
                return checkpoint

        return _Lifecycle

    class RematStrategy(with_lifecycle(pl.strategies.SingleDeviceStrategy)):  # type: ignore[misc]
        """Single-device training within a memory budget.

        Args:
            memory_budget: bytes, ``"6GiB"``, ``"512MB"`` or ``"60%"`` of the plain step's
                peak; ``None``: free device memory less 10% on CUDA, no limit on CPU.
            solver: a name from ``lightning_remat.solvers.SOLVERS`` (``"auto"`` tries
                time-centric DP, then memory-centric DP, then offloading).
            profile_steps: measured repeats when profiling.
            target: the submodule to rematerialize (default: the LightningModule's forward).
            offload: allow the offloading fallback of ``solver="auto"``.
            cache_dir: where plans are cached (default: ``<default_root_dir>/lightning_remat``).
            safe_profile: profile vertex by vertex so profiling fits where a plain step would not.
        """

        strategy_name = "remat"

        def __init__(
            self,
            memory_budget: int | float | str | None = None,
            solver: str = "auto",
            profile_steps: int = 3,
            target: str | None = None,
            offload: bool = True,
            cache_dir: str | os.PathLike | None = None,
            safe_profile: bool = False,
            device: str | torch.device | None = None,
            **kwargs: Any,
        ) -> None:
            super().__init__(device=device or "cpu", **kwargs)
            self._device_given = device is not None
            self.parallel_devices: list[torch.device] = []  # filled in by the Trainer
            self._remat_init(memory_budget, solver, profile_steps, target, offload, cache_dir, safe_profile)

        @property
        def root_device(self) -> torch.device:
            if not self._device_given and self.parallel_devices:
                return self.parallel_devices[0]
            return self._root_device

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            strategy_registry.register("remat", cls, description=cls.__doc__.splitlines()[0])

    class RematDDPStrategy(with_lifecycle(pl.strategies.DDPStrategy)):  # type: ignore[misc]
        """Distributed data parallel within a memory budget: rank zero plans, every rank
        applies the same plan. Arguments as :class:`RematStrategy`, plus DDPStrategy's."""

        strategy_name = "remat_ddp"

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
            super().__init__(**kwargs)
            self._remat_init(memory_budget, solver, profile_steps, target, offload, cache_dir, safe_profile)

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            strategy_registry.register("remat_ddp", cls, description=cls.__doc__.splitlines()[0])

    return RematStrategy, RematDDPStrategy


def _register(pl: Any, prefix: str = "") -> tuple[type, type]:
    single, ddp = _make_strategy_classes(pl)
    for cls in (single, ddp):
        # Importable by name, so spawned processes can unpickle the strategy.
        cls.__name__ = cls.__qualname__ = prefix + cls.__name__
        cls.__module__ = __name__
    registry = pl.strategies.StrategyRegistry
    for cls in (single, ddp):
        if cls.strategy_name in registry:
            registry.remove(cls.strategy_name)
        cls.register_strategies(registry)
    return single, ddp


import pytorch_lightning as _pl  # noqa: E402

RematStrategy, RematDDPStrategy = _register(_pl)

try:  # the unified `lightning` package has registries of its own
    import lightning.pytorch as _lpl  # noqa: E402

    LightningRematStrategy, LightningRematDDPStrategy = _register(_lpl, prefix="Lightning")
except ImportError:
    pass
