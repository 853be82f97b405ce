"""What planning costs a user before training starts, in plain training steps.

For each model, in one process: the median plain training step (forward, loss, backward,
optimizer step) after a warm-up, then the wall time of

- ``trace``: ``graph.trace.trace_module``;
- ``profile``: ``graph.profile.profile_module`` as the planner runs it (its default warm-up
  and repeats);
- ``solve``: ``solvers.solve(graph, 75% of the plain peak, "auto")`` on that profile;
- ``remat``: the whole ``lightning_remat.remat()`` call at 75% (trace, profile, solve, apply);

both at ``auto``'s smallest budget instead where 75% is below it (noted in the table);

each in seconds and in plain steps. With ``--search``, the batch-size search too: our
``find_max_batch_size`` (solver ``auto``, no plain comparison) and Lightning's
``BatchSizeFinder(mode="binsearch")`` on the same model and the same memory cap (the plain
step's measured peak at twice the base batch), with the trials each ran, the training steps
those trials ran, the whole search's wall time in plain steps of the base batch (ours
includes profiling the shape family and every solve), and the size each found. On the CPU
nothing raises out-of-memory, so Lightning's finder is given one where a step's measured
peak exceeds the cap, measured with the same meter as ours.

Goals (docs/design.md section 3 and 7): profile at most 5 plain steps on the CPU, the
search at most 30, with fewer trials than BatchSizeFinder to the same or a larger size.

Run: ``python benchmarks/planning.py [--models gpt unet] [--search] [--out PATH]`` (the
vision models need torchvision). Prints a table with the machine, torch version and date,
and writes the figures as JSON (default ``benchmarks/results/planning/<device>.json``),
which ``benchmarks/render.py`` puts into RESULTS.md as the planning-cost table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.run import SIZES, build  # noqa: E402

MODELS = ["resnet50", "unet", "gpt"]
OUT_DIR = ROOT / "benchmarks" / "results" / "planning"


def _plain_step_seconds(model: Any, x: Any, repeats: int = 5) -> tuple[float, float]:
    """The median plain step: wall seconds and this process's CPU seconds."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: kernels and the optimizer's state
    seconds, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(seconds), statistics.median(cpu)


def _timed(row: dict[str, Any], key: str, fn: Any) -> Any:
    """Run ``fn``; ``row[key]``: its wall seconds, ``row[key + "_cpu"]``: this process's CPU
    seconds (on a shared machine the CPU time is what other processes disturb least)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    value = fn()
    row[key] = time.perf_counter() - start
    row[f"{key}_cpu"] = time.process_time() - start_cpu
    return value


def planning_costs(name: str) -> dict[str, Any]:
    """Seconds of each planning phase and of a plain step, for one model at its CPU size."""
    import copy

    import lightning_remat
    from lightning_remat.errors import RematInfeasibleError
    from lightning_remat.graph.profile import profile_module
    from lightning_remat.graph.trace import trace_module
    from lightning_remat.solvers import solve
    from lightning_remat.solvers.policy import plain_peak_bytes

    batch, size = SIZES["cpu"][name]
    model, x, _ = build(name, "cpu", batch, size)
    row: dict[str, Any] = {"model": name, "batch": batch, "size": size}
    row["plain_step"], row["plain_step_cpu"] = _plain_step_seconds(copy.deepcopy(model), x)
    traced = _timed(row, "trace", lambda: trace_module(model, x))
    graph = _timed(row, "profile", lambda: profile_module(model, x, traced=traced))
    plain = plain_peak_bytes(graph)
    budget: int | str = int(0.75 * plain)
    try:
        plan = _timed(row, "solve", lambda: solve(graph, budget, "auto"))
        budget = "75%"
    except RematInfeasibleError as exc:
        # 75% is below what auto reaches on this model: both at its smallest budget instead.
        if exc.min_budget_bytes is None:
            raise
        budget = exc.min_budget_bytes
        row["budget_fraction"] = budget / plain
        plan = _timed(row, "solve", lambda: solve(graph, budget, "auto"))
    row["solver"] = plan.solver
    _timed(row, "remat", lambda: lightning_remat.remat(copy.deepcopy(model), x, memory_budget=budget))
    return row


def batch_search_costs(name: str) -> dict[str, Any]:
    """Our search and Lightning's binsearch on the same model and cap: trials, steps, time."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import BatchSizeFinder
    from pytorch_lightning.tuner import batch_size_scaling

    import lightning_remat
    from lightning_remat.lightning.synthetic import SyntheticTask
    from lightning_remat.measure.peak import peak_bytes

    batch, size = SIZES["cpu"][name]
    model, x, _ = build(name, "cpu", batch, size)
    sample_shape = tuple(x.shape[1:])
    dtype = "long" if not x.is_floating_point() else "float"
    vocab = int(x.max()) + 1 if dtype == "long" else 1000

    def task(batch_size: int) -> SyntheticTask:
        return SyntheticTask(build(name, "cpu", batch, size)[0], sample_shape, batch_size, dtype, vocab)

    def trainer(root: Path, callbacks: list[Any] | None = None) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, default_root_dir=str(root),
                          logger=False, enable_checkpointing=False, enable_model_summary=False,
                          enable_progress_bar=False, callbacks=callbacks or [])

    big = task(2 * batch)
    probe = big.train_dataloader()
    xb = next(iter(probe))
    cap = peak_bytes(lambda: big.training_step(xb, 0).backward())
    row: dict[str, Any] = {"model": name, "cap_bytes": cap, "base_batch": batch}
    row["plain_step"], row["plain_step_cpu"] = _plain_step_seconds(model, x)
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"lightning_remat_planning_{os.getpid()}"

    report = _timed(row, "ours_seconds", lambda: lightning_remat.find_max_batch_size(
        trainer(root / "ours"), task(batch), memory_budget=cap, init_val=batch, steps_per_trial=1,
        compare_plain=False, progress_bar=False, storage=None,
    ))
    row["ours_trials"] = len(report.remat.trials)
    # One measured step per trial (steps_per_trial=1; the unmeasured warm-up runs on CUDA only).
    row["ours_trial_steps"] = len(report.remat.trials)
    row["ours_found"] = report.remat.largest_feasible
    row["ours_sizes"] = [r.batch_size for r in report.remat.trials]

    sizes_tried: list[int] = []

    def measured_loop_run(trainer: pl.Trainer, params: Any) -> None:
        module = trainer.lightning_module
        sizes_tried.append(module.batch_size)
        data = next(iter(module.train_dataloader()))
        peak = peak_bytes(lambda: module.training_step(data, 0).backward())
        module.zero_grad(set_to_none=True)
        if peak > cap:
            raise RuntimeError("CUDA out of memory. (the step's measured peak is over the cap)")

    original = batch_size_scaling._try_loop_run
    batch_size_scaling._try_loop_run = measured_loop_run
    try:
        finder = BatchSizeFinder(mode="binsearch", init_val=batch, steps_per_trial=1, margin=0.0)
        finder._early_exit = True
        _timed(row, "lightning_seconds", lambda: trainer(root / "lightning", [finder]).fit(task(batch)))
    finally:
        batch_size_scaling._try_loop_run = original
    row["lightning_trials"] = len(sizes_tried)
    row["lightning_trial_steps"] = len(sizes_tried)  # steps_per_trial=1
    row["lightning_found"] = finder.optimal_batch_size
    row["lightning_sizes"] = sizes_tried
    return row


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--search", action="store_true", help="also time the batch-size search")
    parser.add_argument("--out", type=Path, default=OUT_DIR / "cpu.json",
                        help="where to write the figures as JSON (render.py reads them)")
    args = parser.parse_args(argv)
    import torch

    record: dict[str, Any] = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "device": "cpu",
        "torch": torch.__version__, "commit": _commit(), "load_average": os.getloadavg()[0],
        "phases": [], "search": [],
    }
    print(f"date: {record['date']}")
    print(f"machine: {record['machine']}; torch {torch.__version__}; device: cpu; "
          f"load average {record['load_average']:.1f}")
    print()
    header = (f"{'model':10} {'batch':>5} {'plain step':>11} {'trace':>19} {'profile':>19}"
              f" {'solve (auto)':>19} {'remat() 75%':>19}")
    print(header)
    print("-" * len(header))
    for name in args.models:
        try:
            row = planning_costs(name)
        except ImportError as exc:
            print(f"{name:10} skipped: {exc}")
            continue
        record["phases"].append(row)
        step = row["plain_step"]

        def cell(key: str, row: dict[str, Any] = row, step: float = step) -> str:
            return f"{row[key]:6.2f}s {row[key] / step:4.1f}x {row[key + '_cpu'] / row['plain_step_cpu']:4.1f}c"

        at = f"  (both at {row['budget_fraction']:.2f} of plain)" if "budget_fraction" in row else ""
        print(f"{name:10} {row['batch']:>5} {step:10.3f}s {cell('trace'):>19} {cell('profile'):>19}"
              f" {cell('solve'):>19} {cell('remat'):>19}{at}")
    print("(Nx: wall seconds over the median plain training step at the same batch; Nc: the same "
          "in this process's CPU seconds)")
    if args.search:
        print()
        header = (f"{'model':10} {'cap':>10} {'ours: trials':>12} {'steps':>5} {'found':>6} {'time':>16}"
                  f" {'lightning: trials':>18} {'steps':>5} {'found':>6} {'time':>16}")
        print(header)
        print("-" * len(header))
        for name in args.models:
            try:
                row = batch_search_costs(name)
            except ImportError as exc:
                print(f"{name:10} skipped: {exc}")
                continue
            record["search"].append(row)
            step = row["plain_step"]
            print(f"{name:10} {row['cap_bytes'] / 2**20:8.1f}Mi {row['ours_trials']:>12}"
                  f" {row['ours_trial_steps']:>5} {row['ours_found']!s:>6} {row['ours_seconds'] / step:8.1f}x"
                  f" {row['ours_seconds_cpu'] / row['plain_step_cpu']:6.1f}c"
                  f" {row['lightning_trials']:>18} {row['lightning_trial_steps']:>5}"
                  f" {row['lightning_found']!s:>6} {row['lightning_seconds'] / step:8.1f}x"
                  f" {row['lightning_seconds_cpu'] / row['plain_step_cpu']:6.1f}c")
        print("(steps: training steps the trials ran; time: the whole search's wall time over the "
              "median plain step at the base batch, x, and the same in CPU time, c)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
