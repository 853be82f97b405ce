"""Every rendering of a plan or a run, in one place: the plan table (text for logs and the
CLI, markdown for TensorBoard), the batch-size report, the memory timeline figure, and a
run's TensorBoard events read back (``lightning-remat report RUN_DIR``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_remat.budget import format_bytes
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan

if TYPE_CHECKING:  # only annotations: rendering a plan (the CLI's solve) loads no Optuna or torch
    from lightning_remat.tuning.search import SearchResult

__all__ = [
    "MIB", "STEP_MEMORY", "TAG", "TIMELINE", "BatchSizeReport", "RunReport", "format_plan", "read_run",
    "timeline_figure", "write_png",
]

TAG = "remat"
"""The prefix of every TensorBoard tag the package writes."""
MIB = 2**20
"""Bytes per MiB, the unit of every memory scalar the dashboards write: TensorBoard's axes
carry no unit, and bytes read as 1.1e+08 on them (docs/design.md section 7)."""
TIMELINE = {kind: f"{TAG}/timeline/{kind}_MiB" for kind in ("measured", "predicted", "budget")}
"""A plan's timeline as scalar series in MiB (x: the op's index in the predicted timeline)."""
STEP_MEMORY = {kind: f"{TAG}/{kind}_MiB" for kind in ("peak", "reserved", "budget", "predicted_peak")}
"""Each logged step's memory scalars in MiB."""
_BYTES_TAGS = {"measured": f"{TAG}/timeline/measured", "predicted": f"{TAG}/timeline/predicted",
               "budget": f"{TAG}/timeline/budget", "peak": f"{TAG}/peak_bytes"}
"""The same series in bytes, as logs written before MiB hold them (read back by :func:`read_run`)."""


# ---- a plan ------------------------------------------------------------------------------------
_STAGE_COLUMNS = ("stage", "action", "vertices", "first .. last", "bytes stored", "forward ms re-run")


def _stage_rows(graph: Graph, plan: Plan) -> list[tuple[str, ...]]:
    stored = set(plan.stored)
    rows = []
    for k, stage in enumerate(plan.stages):
        kept = graph.total("mem", [n for n in stage.nodes if n in stored])
        rerun = graph.total("t_fwd", stage.nodes) * 1e3 if stage.action == "recompute" else 0.0
        rows.append((str(k), stage.action, str(len(stage.nodes)),
                     f"{stage.nodes[0]} .. {stage.nodes[-1]}", format_bytes(kept), f"{rerun:.2f}"))
    return rows


def format_plan(
    graph: Graph,
    plan: Plan,
    *,
    budget_bytes: int | None = None,
    title: str = "lightning-remat plan",
    shapes: Sequence[Sequence[int]] | None = None,
    markdown: bool = False,
) -> str:
    """A plan on one screen: what it was made for, what it predicts, and one row per stage.
    ``markdown``: a pipe table for TensorBoard's text plugin; else aligned plain text."""
    plain = graph.meta.plain_peak_bytes
    facts = [("solver", plan.solver)]
    if shapes is not None:
        facts.append(("input shapes", str([list(s) for s in shapes])))
    facts += [
        ("plain peak", format_bytes(plain) if plain else "not measured"),
        ("budget", f"{format_bytes(budget_bytes)} ({budget_bytes} bytes)" if budget_bytes else "none"),
        ("predicted peak", format_bytes(plan.predicted_peak_bytes)),
        ("margin", f"{format_bytes(plan.margin_bytes)} (known error of the prediction, within the budget)"),
        ("feasible", "yes" if plan.feasible else "no"),
        ("stages", f"{len(plan.stages)} ({plan.count('recompute')} recomputed, "
                   f"{plan.count('offload')} offloaded, {plan.count('keep')} kept)"),
    ]
    extra = f"{plan.predicted_extra_seconds * 1e3:.2f} ms per step"
    step = graph.meta.step_seconds
    if step:
        extra += f" ({100 * plan.predicted_extra_seconds / step:.1f}% of the profiled step)"
    facts.append(("predicted extra", extra))
    rows = _stage_rows(graph, plan)
    if markdown:
        lines = [f"**{title}**", "", _FACTS_SEPARATOR.join(f"**{k}** {v}" for k, v in facts), "",
                 "| " + " | ".join(_STAGE_COLUMNS) + " |",
                 "|---:|:---|---:|:---|---:|---:|"]
        lines += ["| " + " | ".join(f"`{c}`" if i == 3 else c for i, c in enumerate(row)) + " |"
                  for row in rows]
        lines += [f"- note: {note}" for note in plan.notes]
        return "\n".join(lines)
    return _plain_plan(title, facts, rows, plan.notes)


_FACTS_SEPARATOR = " · "


def _plain_plan(title: str, facts: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]],
                notes: Sequence[str]) -> str:
    """The aligned plain-text form of a plan table (a terminal's)."""
    lines = [title] + [f"  {k}: {v}" for k, v in facts]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_STAGE_COLUMNS)]
    lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(_STAGE_COLUMNS, widths)))
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines += [f"  note: {note}" for note in notes]
    return "\n".join(lines)


def plan_text_for_terminal(markdown: str) -> str:
    """A plan table logged for TensorBoard (``format_plan(..., markdown=True)``) as
    :func:`format_plan` prints it for a terminal; text in any other form as it is."""
    lines = markdown.splitlines()
    if len(lines) < 5 or not (lines[0].startswith("**") and lines[0].endswith("**")):
        return markdown
    facts = []
    for part in lines[2].split(_FACTS_SEPARATOR):
        key, _, value = part.removeprefix("**").partition("** ")
        facts.append((key, value))
    rows = [[cell.strip().strip("`") for cell in line.strip().strip("|").split(" | ")]
            for line in lines[6:] if line.startswith("| ")]
    notes = [line.removeprefix("- note: ") for line in lines if line.startswith("- note: ")]
    return _plain_plan(lines[0].strip("*"), facts, rows, notes)


# ---- a batch-size search -----------------------------------------------------------------------
@dataclass
class BatchSizeReport:
    """Plain training's maximum beside rematerialization's, for one model, device, budget."""

    model: str
    device: str
    budget_bytes: int | None
    remat: SearchResult
    plain: SearchResult | None = None

    @property
    def batch_size(self) -> int | None:
        """The largest feasible batch size with rematerialization (what the finder writes)."""
        return self.remat.largest_feasible

    def table(self) -> str:
        budget = format_bytes(self.budget_bytes) if self.budget_bytes else "none"
        lines = [f"lightning-remat batch-size search: {self.model} on {self.device}, budget {budget}", ""]
        header = (f"{'mode':<8} {'solver':<12} {'largest fits':>12} {'smallest fails':>14} {'trials':>6}"
                  f" {'peak at max':>12} {'samples/s':>10} {'extra/sample':>13}")
        lines += [header, "-" * len(header)]
        searches = [s for s in (self.plain, self.remat) if s is not None]
        for s in searches:
            best = s.trial_at(s.largest_feasible)
            lines.append(
                f"{s.label:<8} {s.solver or '-':<12} {_cell(s.largest_feasible):>12}"
                f" {_cell(s.smallest_infeasible):>14} {len(s.trials):>6}"
                f" {_cell(best and best.peak_bytes, format_bytes):>12}"
                f" {_cell(best and best.samples_per_second, lambda v: f'{v:.1f}'):>10}"
                f" {_cell(best and best.extra_seconds_per_sample, _ms):>13}"
            )
        if self.plain is not None and self.plain.largest_feasible and self.remat.largest_feasible:
            lines.append(f"rematerialization fits {self.remat.largest_feasible / self.plain.largest_feasible:.2f}x "
                         "plain training's largest batch")
        lines += ["", "trials (in the order run; extra = the plan's predicted recompute/offload time)"]
        header = (f"{'mode':<8} {'#':>3} {'batch':>6} {'fits':>5} {'peak':>12} {'s/step':>9}"
                  f" {'samples/s':>10} {'extra/sample':>13}  note")
        lines += [header, "-" * len(header)]
        for s in searches:
            for r in s.trials:
                lines.append(
                    f"{s.label:<8} {r.number:>3} {r.batch_size:>6} {'yes' if r.feasible else 'no':>5}"
                    f" {_cell(r.peak_bytes, format_bytes):>12} {_cell(r.seconds, lambda v: f'{v:.4f}'):>9}"
                    f" {_cell(r.samples_per_second, lambda v: f'{v:.1f}'):>10}"
                    f" {_cell(r.extra_seconds_per_sample, _ms):>13}  {r.reason}"
                )
        for s in searches:
            if s.pareto:
                front = ", ".join(f"({r.batch_size}, {r.samples_per_second:.1f})" for r in s.pareto)
                lines.append(f"\nPareto front {s.label} (batch size, samples/s): {front}")
            if not s.finished:
                lines.append(f"note: {s.label}: max_trials reached before the bracket closed")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _cell(value: Any, fmt: Callable[[Any], str] = str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt(value)


# ---- a step's memory timeline ------------------------------------------------------------------
def timeline_figure(
    measured: Sequence[float], predicted: Sequence[float], budget: float | None, title: str,
    *, n_forward: int | None = None, stage_starts: Sequence[int] = (),
) -> Any:
    """Measured and predicted bytes per op (each op's highest), the forward shaded, stage
    boundaries drawn, the budget as a line: a matplotlib ``Figure`` made without pyplot, so
    the user's backend and pyplot's figures are left as they were."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5))
    ax = fig.subplots()
    ax.plot([v / MIB for v in predicted], label="predicted", color="tab:orange")
    if measured:
        ax.plot([v / MIB for v in measured], label="measured", color="tab:blue")
    if budget:
        ax.axhline(budget / MIB, color="tab:red", linestyle="--", label="budget")
    if n_forward:
        ax.axvspan(0, n_forward, color="0.92", zorder=0, label="forward")
    for i in stage_starts:
        ax.axvline(i, color="0.6", linewidth=0.6, zorder=1)
    ax.set_xlabel("op index (forward, then backward)")
    ax.set_ylabel("MiB during the op, above the step's start")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


# ---- a run read back from TensorBoard ----------------------------------------------------------
@dataclass
class RunReport:
    """The latest plan of a run as its TensorBoard events hold it."""

    event_dir: Path
    measured: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    budget: float | None = None
    plan_text: str = ""
    step_peaks: list[float] = field(default_factory=list)


def find_event_dirs(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist; give the log dir of a run (e.g. lightning_logs/version_0)")
    return sorted({p.parent for p in root.rglob("events.out.tfevents.*")})


def _in_bytes(acc: Any, kind: str, tag: str) -> list[float]:
    """A series of the events ``acc`` holds, in bytes: its MiB ``tag``, else the bytes tag
    logs written before it used."""
    scalars = set(acc.Tags().get("scalars", []))
    if tag in scalars:
        return [e.value * MIB for e in acc.Scalars(tag)]
    old = _BYTES_TAGS[kind]
    return [e.value for e in acc.Scalars(old)] if old in scalars else []


def read_run(run_dir: str | Path) -> RunReport:
    """The latest plan's timeline and table from a log dir, with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dirs = find_event_dirs(run_dir)
    for event_dir in reversed(dirs):
        acc = EventAccumulator(str(event_dir), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        predicted = _in_bytes(acc, "predicted", TIMELINE["predicted"])
        if not predicted:
            continue
        report = RunReport(event_dir, predicted=predicted)
        report.measured = _in_bytes(acc, "measured", TIMELINE["measured"])
        report.budget = (_in_bytes(acc, "budget", TIMELINE["budget"]) or [None])[-1]
        report.step_peaks = _in_bytes(acc, "peak", STEP_MEMORY["peak"])
        text_tag = f"{TAG}/plan/text_summary"
        if text_tag in acc.Tags().get("tensors", []):
            proto = acc.Tensors(text_tag)[-1].tensor_proto
            report.plan_text = proto.string_val[0].decode()
        return report
    raise FileNotFoundError(
        f"no lightning-remat timeline under {run_dir}: train with a TensorBoardLogger and "
        "strategy='remat' (or the MemoryTimelineLogger callback)"
    )


def write_png(report: RunReport, path: str | Path) -> Path:
    """The run's timeline as a PNG."""
    fig = timeline_figure(report.measured, report.predicted, report.budget,
                          f"lightning-remat timeline: {report.event_dir}")
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path
