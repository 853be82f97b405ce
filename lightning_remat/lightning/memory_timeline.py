"""TensorBoard dashboards: per-step memory scalars and a step's timeline, measured beside
predicted (issue 8).

Tags written (all under ``remat/``):

- per step: ``remat/peak_bytes``, ``remat/reserved_bytes`` (CUDA), ``remat/budget_bytes``,
  ``remat/predicted_peak_bytes``, ``remat/step_seconds``, ``remat/extra_time_ratio``
  (step time over the profiled plain step);
- whenever a plan is made: the figure ``remat/timeline`` (matplotlib), the scalar series
  ``remat/timeline/measured`` and ``remat/timeline/predicted`` (x: op index), the text
  ``remat/plan`` (markdown table), hparams, and a custom-scalars layout that puts measured,
  predicted and the budget on one chart.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lightning_remat import meter as memory
from lightning_remat.errors import format_bytes

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover - pytorch-lightning is a dependency
    pl = None  # type: ignore[assignment]

TAG = "remat"


def plan_markdown(entry: Any) -> str:
    """The plan as a markdown table: stages, actions, bytes stored, predicted extra time."""
    graph, plan = entry.graph, entry.plan
    stored = set(plan.stored)
    rows = [
        f"**solver** {plan.solver} · **predicted peak** {format_bytes(plan.predicted_peak_bytes)} · "
        f"**budget** {format_bytes(entry.budget_bytes) if entry.budget_bytes else 'none'} · "
        f"**predicted extra** {plan.predicted_extra_seconds * 1e3:.2f} ms",
        "",
        "| stage | action | vertices | first .. last | bytes stored | forward ms re-run |",
        "|---:|:---|---:|:---|---:|---:|",
    ]
    for k, stage in enumerate(plan.stages):
        kept = graph.total("mem", [n for n in stage.nodes if n in stored])
        extra = graph.total("t_fwd", stage.nodes) * 1e3 if stage.action == "recompute" else 0.0
        rows.append(
            f"| {k} | {stage.action} | {len(stage.nodes)} | `{stage.nodes[0]}` .. `{stage.nodes[-1]}` "
            f"| {format_bytes(kept)} | {extra:.2f} |"
        )
    return "\n".join(rows)


def timeline_figure(measured: list[int], predicted: Any, budget: int | None, title: str):
    """Measured and predicted live bytes per op, forward and backward shaded, stage
    boundaries drawn, the budget as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    mib = 2**20
    events = predicted.events
    ax.plot(range(len(events)), [e.live_bytes / mib for e in events], label="predicted", color="tab:orange")
    if measured:
        ax.plot(range(len(measured)), [m / mib for m in measured], label="measured", color="tab:blue")
    if budget:
        ax.axhline(budget / mib, color="tab:red", linestyle="--", label="budget")
    n_forward = sum(1 for e in events if e.phase == "forward")
    ax.axvspan(0, n_forward, color="0.92", zorder=0, label="forward")
    for i in range(1, len(events)):
        if events[i].stage != events[i - 1].stage:
            ax.axvline(i, color="0.6", linewidth=0.6, zorder=1)
    ax.set_xlabel("op index (forward, then backward)")
    ax.set_ylabel("live MiB above the step's start")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


class MemoryTimelineLogger(pl.Callback if pl is not None else object):  # type: ignore[misc]
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
        self._base = 0
        self._layout_written = False

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
        device = pl_module.device
        if memory.is_cuda(device):
            torch.cuda.synchronize(device)
            self._base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            memory.set_mmap_threshold()
            memory.trim_heap()  # heap memory freed before would be reused unseen
            memory.reset_high_water_mark()
            self._base = memory.resident_bytes()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        device = pl_module.device
        if memory.is_cuda(device):
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - self._base
            reserved = torch.cuda.memory_reserved(device)
        else:
            peak = memory.high_water_mark() - self._base
            reserved = None
        seconds = time.perf_counter() - self._t0
        writer = self._writer(trainer)
        if writer is None or not trainer.is_global_zero:
            return
        step = trainer.global_step
        planner = self._planner(trainer)
        entry = None
        if planner is not None and planner.planned:
            entry = planner.last
            if id(entry) not in self._logged_plans:
                self._logged_plans.add(id(entry))
                self._log_plan(trainer, writer, entry, step)
        if step % self.log_every_n_steps:
            return
        writer.add_scalar(f"{TAG}/peak_bytes", peak, step)
        writer.add_scalar(f"{TAG}/step_seconds", seconds, step)
        if reserved is not None:
            writer.add_scalar(f"{TAG}/reserved_bytes", reserved, step)
        if entry is not None:
            if entry.budget_bytes:
                writer.add_scalar(f"{TAG}/budget_bytes", entry.budget_bytes, step)
            writer.add_scalar(f"{TAG}/predicted_peak_bytes", entry.plan.predicted_peak_bytes, step)
            plain_step = entry.graph.meta.step_seconds
            if plain_step:
                writer.add_scalar(f"{TAG}/extra_time_ratio", seconds / plain_step, step)

    def _log_plan(self, trainer: Any, writer: Any, entry: Any, step: int) -> None:
        predicted = entry.predicted_timeline()
        measured: list[int] = []
        if self.timeline and entry.example is not None:
            measured = [p.live_bytes for p in entry.measure_timeline()]
        for i, e in enumerate(predicted.events):
            writer.add_scalar(f"{TAG}/timeline/predicted", e.live_bytes, i)
        for i, value in enumerate(measured):
            writer.add_scalar(f"{TAG}/timeline/measured", value, i)
        if entry.budget_bytes:
            for i in (0, max(len(predicted.events) - 1, 0)):
                writer.add_scalar(f"{TAG}/timeline/budget", entry.budget_bytes, i)
        title = f"{entry.plan.solver}: step {step}, {len(entry.plan.stages)} stages"
        writer.add_figure(f"{TAG}/timeline", timeline_figure(measured, predicted, entry.budget_bytes, title), step)
        writer.add_text(f"{TAG}/plan", plan_markdown(entry), step)
        measured_peak = max(measured) if measured else -1
        writer.add_hparams(
            {"batch_size": int(entry.graph.meta.batch_size or 0),
             "budget_bytes": int(entry.budget_bytes or 0), "solver": entry.plan.solver},
            {"hparam/predicted_peak_bytes": entry.plan.predicted_peak_bytes,
             "hparam/measured_peak_bytes": measured_peak},
            run_name=".",
        )
        if not self._layout_written:
            writer.add_custom_scalars({
                "lightning-remat": {
                    "timeline: measured vs predicted vs budget": [
                        "Multiline", [f"{TAG}/timeline/measured", f"{TAG}/timeline/predicted", f"{TAG}/timeline/budget"]],
                    "step peak vs budget": [
                        "Multiline", [f"{TAG}/peak_bytes", f"{TAG}/predicted_peak_bytes", f"{TAG}/budget_bytes"]],
                }
            })
            self._layout_written = True
        writer.flush()
