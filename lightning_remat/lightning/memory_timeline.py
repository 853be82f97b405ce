"""TensorBoard dashboards: per-step memory scalars and a step's timeline, measured beside
predicted (docs/design.md section 7).

Tags written (all under ``remat/``; memory in MiB, :data:`~lightning_remat.report.MIB`):

- per step: ``remat/peak_MiB``, ``remat/reserved_MiB`` (CUDA), ``remat/budget_MiB``,
  ``remat/predicted_peak_MiB``, ``remat/step_seconds``, ``remat/extra_time_ratio``
  (step time over the profiled plain step);
- whenever a plan is made: the figure ``remat/timeline`` (matplotlib), the scalar series
  ``remat/timeline/measured_MiB`` and ``remat/timeline/predicted_MiB`` (x: the op's index
  in the predicted timeline, one point per op of its forward, recomputations and backward;
  y: the highest MiB during each op, so each series' maximum is that step's peak) and
  ``remat/timeline/budget_MiB``, the text ``remat/plan`` (markdown table), and a
  custom-scalars layout that puts measured, predicted and the budget on one chart;
- when the fit starts, with ``RematStrategy``: the run's HParams row, the budget as given
  (``remat/memory_budget``) and the solver (``remat/solver``) beside the hyperparameters
  Lightning logs, with the budget, the predicted and the measured step peak (MiB) as its
  metrics (:meth:`MemoryTimelineLogger.on_fit_start`).

The measured timeline replays the planned call op by op in one process. Across ranks
(DDP, FSDP) or in a sharded module no rank replays alone: the module's collectives (FSDP's
gathers, a SyncBatchNorm) need every rank, and the replay runs outside FSDP's root unit. There
the plan is logged after the first step that runs it, whose measured peak is that step's
``remat/peak_MiB``, with the predicted timeline.
"""

from __future__ import annotations

import time
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_remat.measure import peak as measured
from lightning_remat.report import MIB, STEP_MEMORY, TAG, TIMELINE, format_plan, timeline_figure

__all__ = ["MemoryTimelineLogger"]


class MemoryTimelineLogger(pl.Callback):
    """Logs each training step's memory and the timeline of every new plan to TensorBoard.

    Works with ``RematStrategy`` (plans and predictions come from it) and alone with any
    model (then only the measured scalars and timeline are logged).

    Args:
        log_every_n_steps: how often the per-step scalars are written.
        timeline: record and log the measured timeline whenever a plan is made (one extra
            forward and backward whose effects on the weights are undone).
    """

    def __init__(self, log_every_n_steps: int = 1, timeline: bool = True) -> None:
        super().__init__()
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be >= 1")
        self.log_every_n_steps = log_every_n_steps
        self.timeline = timeline
        self._logged_plans: set[int] = set()
        self._t0 = 0.0
        self._cuda_peak: measured.CudaPeak | None = None
        self._meter: measured.StepMeter | None = None
        self._layout_written = False
        self._logging = False
        self._pending: Any = None
        """A plan made across ranks, logged with the peak of the first step that runs it."""

    # ---- helpers ------------------------------------------------------------------------
    @staticmethod
    def _writer(trainer: Any) -> Any:
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if experiment is not None and hasattr(experiment, "add_scalar") and hasattr(experiment, "add_figure"):
                return experiment
        return None

    @staticmethod
    def _planner(trainer: Any) -> Any:
        return getattr(trainer.strategy, "planner", None)

    # ---- hooks --------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._logging = trainer.global_step % self.log_every_n_steps == 0
        if not self._logging:
            return  # counters are read on logging steps only
        device = pl_module.device
        if measured.is_cuda(device):
            self._cuda_peak = measured.CudaPeak(device, synchronize=False)
            self._cuda_peak.start()
        else:  # every allocation the step makes (docs/design.md section 6)
            self._stop_meter()
            self._meter = measured.step_meter(torch.device(device).type)
            self._meter.__enter__()
        self._t0 = time.perf_counter()

    def _stop_meter(self) -> int:
        """Leave the CPU step's meter (if one is running); its peak."""
        running, self._meter = self._meter, None
        if running is None:
            return 0
        running.__exit__(None, None, None)
        return running.peak

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """The run's HParams row: the budget and the solver beside the hyperparameters
        Lightning logs, with the budget, the predicted and the measured step peak as its
        metric columns (their last values). TensorBoard's HParams dashboard reads a run's
        first hparams record only (the first summary metadata of each tag), and Lightning
        writes its own right after the callbacks' ``on_fit_start`` (``Trainer._run``), so
        this one comes first and holds Lightning's hyperparameters too; Lightning's record
        after it changes nothing shown (docs/design.md section 7)."""
        strategy = trainer.strategy
        writer = self._writer(trainer)
        if writer is None or not trainer.is_global_zero or not hasattr(strategy, "memory_budget"):
            return
        params = _lightning_hparams(trainer) if getattr(trainer, "enable_autolog_hparams", True) else {}
        params[f"{TAG}/memory_budget"] = str(strategy.memory_budget)
        params[f"{TAG}/solver"] = str(strategy.solver)
        metrics = ["hp_metric", STEP_MEMORY["budget"], STEP_MEMORY["predicted_peak"], STEP_MEMORY["peak"]]
        if type(writer).__module__.startswith("tensorboardX"):
            from tensorboardX.summary import hparams
        else:
            from torch.utils.tensorboard.summary import hparams
        # The run's own file, where Lightning writes its record (add_hparams would open another).
        file_writer = writer._get_file_writer()
        for summary in hparams(params, dict.fromkeys(metrics, 0.0)):
            file_writer.add_summary(summary)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        pending, self._pending = self._pending, None
        writer = self._writer(trainer)
        if pending is not None and writer is not None:  # no step ran the plan after it was made
            self._log_plan(trainer, writer, pending, trainer.global_step)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop_meter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._logging:
            if self._new_plan(trainer):
                self._log_new_plan(trainer)
            return
        device = pl_module.device
        if measured.is_cuda(device):
            peak = self._cuda_peak.stop()
            reserved = torch.cuda.memory_reserved(device)  # CUDA only
        else:
            peak = self._stop_meter()
            reserved = None
        # Without a sync this is the host's time, which a full launch queue ties to the
        # device's; on CUDA it is a lower bound for a step the host got ahead of.
        seconds = time.perf_counter() - self._t0
        writer = self._writer(trainer)
        if writer is None or not trainer.is_global_zero:
            return
        step = trainer.global_step
        pending, self._pending = self._pending, None
        if pending is not None:
            self._log_plan(trainer, writer, pending, step)
        entry = self._log_new_plan(trainer)
        writer.add_scalar(STEP_MEMORY["peak"], peak / MIB, step)
        writer.add_scalar(f"{TAG}/step_seconds", seconds, step)
        if reserved is not None:
            writer.add_scalar(STEP_MEMORY["reserved"], reserved / MIB, step)
        if entry is not None:
            if entry.budget_bytes:
                writer.add_scalar(STEP_MEMORY["budget"], entry.budget_bytes / MIB, step)
            writer.add_scalar(STEP_MEMORY["predicted_peak"], entry.plan.predicted_peak_bytes / MIB, step)
            plain_step = entry.graph.meta.step_seconds
            if plain_step:
                writer.add_scalar(f"{TAG}/extra_time_ratio", seconds / plain_step, step)

    def _log_new_plan(self, trainer: Any) -> Any:
        """Log the plan of the latest step if it is new; the plan in use (None: none)."""
        planner = self._planner(trainer)
        if planner is None or not planner.planned:
            return None
        entry = planner.last
        writer = self._writer(trainer)
        if id(entry) not in self._logged_plans and writer is not None and trainer.is_global_zero:
            self._logged_plans.add(id(entry))
            if self._replays(trainer):
                self._log_plan(trainer, writer, entry, trainer.global_step)
            else:  # this step planned: its peak is the profile's; the next one runs the plan
                self._pending = entry
        return entry

    @staticmethod
    def _replays(trainer: Any) -> bool:
        """Whether the planned call may be replayed on this rank alone: one process, no
        sharded module (see the module docstring)."""
        planner = MemoryTimelineLogger._planner(trainer)
        return trainer.world_size == 1 and getattr(planner, "sharding", "none") == "none"

    def _new_plan(self, trainer: Any) -> bool:
        planner = self._planner(trainer)
        return bool(planner is not None and planner.planned and id(planner.last) not in self._logged_plans)

    def _log_plan(self, trainer: Any, writer: Any, entry: Any, step: int) -> None:
        predicted = entry.predicted_timeline()
        measured: list[int] = []
        # Each op's highest bytes (not what is live after it): the series' maxima are the
        # step's peaks, the plan summary's predicted peak and the step's measured one.
        if self.timeline and entry.example is not None and self._replays(trainer):
            # One point per op of the predicted line, on its x axis (Planned.measure_timeline).
            loss_fn = getattr(self._planner(trainer), "loss_fn", None)
            measured = [p.peak_bytes for p in entry.measure_timeline(loss_fn)]
        for i, e in enumerate(predicted.events):
            writer.add_scalar(TIMELINE["predicted"], e.peak_bytes / MIB, i)
        for i, value in enumerate(measured):
            writer.add_scalar(TIMELINE["measured"], value / MIB, i)
        if entry.budget_bytes:
            for i in (0, max(len(predicted.events) - 1, 0)):
                writer.add_scalar(TIMELINE["budget"], entry.budget_bytes / MIB, i)
        title = f"{entry.plan.solver}: step {step}, {len(entry.plan.stages)} stages"
        events = predicted.events
        figure = timeline_figure(
            measured, [e.peak_bytes for e in events], entry.budget_bytes, title,
            n_forward=sum(1 for e in events if e.phase == "forward"),
            stage_starts=[i for i in range(1, len(events)) if events[i].stage != events[i - 1].stage],
        )
        writer.add_figure(f"{TAG}/timeline", figure, step)
        writer.add_text(f"{TAG}/plan", format_plan(entry.graph, entry.plan, budget_bytes=entry.budget_bytes,
                                                   markdown=True), step)
        if not self._layout_written:
            writer.add_custom_scalars({
                "lightning-remat": {
                    "timeline (MiB per op): measured vs predicted vs budget": [
                        "Multiline", [TIMELINE["measured"], TIMELINE["predicted"], TIMELINE["budget"]]],
                    "step peak (MiB): measured vs predicted vs budget": [
                        "Multiline", [STEP_MEMORY["peak"], STEP_MEMORY["predicted_peak"], STEP_MEMORY["budget"]]],
                }
            })
            self._layout_written = True
        writer.flush()


def _lightning_hparams(trainer: Any) -> dict[str, bool | int | float | str]:
    """The hyperparameters Lightning logs when a fit starts: the LightningModule's and the
    datamodule's, where each logs them (``loggers.utilities._log_hyperparams``), flat as its
    TensorBoard logger writes them."""
    params: dict[str, Any] = {}
    for owner in (trainer.lightning_module, getattr(trainer, "datamodule", None)):
        if owner is not None and getattr(owner, "_log_hyperparams", False):
            params.update(owner.hparams_initial)
    params.pop("_class_path", None)  # LightningCLI's own, which Lightning does not log
    return _flat(params)


def _flat(params: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """Nested mappings and namespaces as ``a/b`` keys; values TensorBoard's hparams take
    kept, one-element tensors as their number, anything else as its text."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Namespace):
            value = vars(value)
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{name}/"))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            flat[name] = value.item()
        else:
            flat[name] = str(value)
    return flat
