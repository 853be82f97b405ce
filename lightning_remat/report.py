"""Read a run's TensorBoard events back: the timeline as a PNG and the plan as text, for
people who read logs in a terminal or CI (``lightning-remat report RUN_DIR``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lightning_remat.lightning.memory_timeline import TAG


@dataclass
class RunReport:
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


def read_run(run_dir: str | Path) -> RunReport:
    """The latest plan's timeline and table from a log dir, with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dirs = find_event_dirs(run_dir)
    for event_dir in reversed(dirs):
        acc = EventAccumulator(str(event_dir), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        scalars = set(acc.Tags().get("scalars", []))
        if f"{TAG}/timeline/predicted" not in scalars:
            continue
        report = RunReport(event_dir)
        report.predicted = [e.value for e in acc.Scalars(f"{TAG}/timeline/predicted")]
        if f"{TAG}/timeline/measured" in scalars:
            report.measured = [e.value for e in acc.Scalars(f"{TAG}/timeline/measured")]
        if f"{TAG}/timeline/budget" in scalars:
            report.budget = acc.Scalars(f"{TAG}/timeline/budget")[-1].value
        if f"{TAG}/peak_bytes" in scalars:
            report.step_peaks = [e.value for e in acc.Scalars(f"{TAG}/peak_bytes")]
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot([v / mib for v in report.predicted], label="predicted", color="tab:orange")
    if report.measured:
        ax.plot([v / mib for v in report.measured], label="measured", color="tab:blue")
    if report.budget:
        ax.axhline(report.budget / mib, color="tab:red", linestyle="--", label="budget")
    ax.set_xlabel("op index (forward, then backward)")
    ax.set_ylabel("live MiB above the step's start")
    ax.set_title(f"lightning-remat timeline: {report.event_dir}")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
