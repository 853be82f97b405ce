"""``Trainer(strategy="remat_fsdp")``: Lightning's fully sharded training with a plan per rank.

:class:`RematFSDPStrategy` is Lightning's ``ModelParallelStrategy`` (torch FSDP2,
``fully_shard``, applied by the LightningModule's ``configure_model`` exactly as there) with
the planning of :class:`~lightning_remat.lightning.strategy.RematHooks` inside it
(docs/design.md section 7, "Sharded training"):

- the planned module is the outermost ``fully_shard`` unit (or ``target``); inside it each
  sharded unit is one vertex, kept, recomputed or offloaded whole, so a recomputed unit runs
  FSDP's own hooks again: it gathers its parameters a second time, and that gather is in the
  unit's measured time and memory, so the plan counts it;
- a new input is planned before the unit's own forward hooks run (a forward pre-hook), so
  profiling runs whole FSDP steps of the sharded module: parameters and gradients at their
  sharded size, gather buffers as FSDP holds them; ``"60%"`` is 60% of that step's peak;
- every rank traces and profiles together (FSDP's collectives), rank zero plans and
  broadcasts, every rank runs the same plan.

Lightning's ``FSDPStrategy`` (FSDP1, ``FullyShardedDataParallel``) is not subclassed here:
torch refuses FSDP1 on a machine without an accelerator, so no test could run it; see
docs/usage.md for what is supported where.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import ModelParallelStrategy
from pytorch_lightning.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from pytorch_lightning.trainer.states import TrainerFn
from typing_extensions import override

from lightning_remat.graph.trace import is_sharded_unit
from lightning_remat.lightning.strategy import RematHooks

__all__ = ["RematFSDPStrategy", "SpawnedShardsLauncher", "outermost_sharded_unit"]


class SpawnedShardsLauncher(_MultiProcessingLauncher):
    """Lightning's launcher of processes started from this one, for a sharded module: rank
    zero sends back the full weights (gathered from every rank's shards), which the main
    process's model, never sharded, loads as it does after ``DDPStrategy(start_method=...)``."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        # A collective: every rank takes part in gathering the shards.
        state_dict = get_model_state_dict(trainer.lightning_module,
                                          options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # The worker ends here: its ranks leave the gloo group together (one exiting first can
        # abort the other while it still holds the connection).
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))


def outermost_sharded_unit(module: torch.nn.Module) -> torch.nn.Module | None:
    """The one ``fully_shard`` unit that holds every other one in ``module`` (``module`` itself
    when it is sharded); None when there is no unit, or several with no common sharded root."""
    if is_sharded_unit(module):
        return module
    tops = []
    for name, sub in module.named_modules():
        if is_sharded_unit(sub) and not any(name.startswith(top + ".") for top, _ in tops):
            tops.append((name, sub))
    return tops[0][1] if len(tops) == 1 else None


class RematFSDPStrategy(RematHooks, ModelParallelStrategy):
    """Fully sharded data parallel (torch FSDP2 ``fully_shard``, applied in the
    LightningModule's ``configure_model`` as for Lightning's ``ModelParallelStrategy``) within
    a memory budget per rank.

    Args: as :class:`~lightning_remat.lightning.strategy.RematStrategy` (``target`` defaults
    to the outermost ``fully_shard`` unit), plus ``ModelParallelStrategy``'s with its own
    defaults (``"auto"``: ``data_parallel_size`` the number of nodes, ``tensor_parallel_size``
    the processes per node; so the same ``Trainer`` arguments build the same device mesh,
    the same ``DistributedSampler`` and the same training as ``ModelParallelStrategy``, and
    sharding over every process takes ``data_parallel_size=N, tensor_parallel_size=1`` as
    there), and ``start_method``: ``"popen"`` (Lightning's default: the script runs again per
    rank) or ``"spawn"``/``"fork"``/``"forkserver"`` (processes started from this one, as
    ``DDPStrategy(start_method=...)``; for notebooks and tests).
    """

    strategy_name = "remat_fsdp"
    plans_what_the_step_runs = False  # the outermost sharded unit: see target_module

    def __init__(
        self,
        *args: Any,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         **kwargs)
        self._start_method = start_method
        self._plan_hook: Any = None

    @override
    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = SpawnedShardsLauncher(self, start_method=self._start_method)

    @override
    def target_module(self, lightning_module: pl.LightningModule) -> torch.nn.Module:
        """``target`` when given, else the outermost ``fully_shard`` unit (the plan must run
        inside it: its hooks gather the parameters its own forward reads), else the
        LightningModule."""
        if self.target:
            return super().target_module(lightning_module)
        return outermost_sharded_unit(lightning_module) or lightning_module

    @override
    def _install(self, trainer: pl.Trainer) -> None:
        super()._install(trainer)
        module = self._target_module
        assert module is not None

        def plan_before_gathering(unit: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            # Planned before FSDP's own pre-forward hook, so the profile's steps are whole
            # FSDP steps of the sharded unit, not steps nested in its forward.
            if self.plans_call(unit):
                assert self.planner is not None
                self.planner.planned_for(args, kwargs)

        self._plan_hook = module.register_forward_pre_hook(plan_before_gathering, prepend=True,
                                                           with_kwargs=True)

    @override
    def _uninstall(self) -> None:
        if self._plan_hook is not None:
            self._plan_hook.remove()
            self._plan_hook = None
        super()._uninstall()

