"""The batch-size search on real models: at a byte budget where plain training fits batch
``B``, the largest batch ``find_max_batch_size`` finds for plain training and under
``RematStrategy(memory_budget=<bytes>)``, in how many measured trials and how long.

The target (the product's promise; a benchmark target, not a timed test): at such a budget
remat's answer is larger than ``B`` on every model whose smallest budget is under 75% of
plain, found in at most 4 measured trials.

Models: Hugging Face GPT-2, Qwen2, T5 and BERT (``tests/hf_architectures.py`` ``build()``:
small random-init configs with their defaults kept: the cache, the attention implementation
and dropout as the config ships them) and the zoo's timm/torchvision vision models
(``tests/test_zoo_vision.py``), each in a LightningModule with a ``batch_size`` attribute
and a ``train_dataloader`` of synthetic data. For each, in a fresh process:

1. plain training's peak at ``B`` (``--batch``): a plain ``Trainer`` runs two steps, each
   one's forward and backward (Lightning's optimizer closure) measured with
   ``lightning_remat.measure.peak.peak_bytes``, gradients freed before it; the budget is the
   larger reading, so plain training fits exactly ``B``;
2. ``find_max_batch_size(Trainer(strategy=RematStrategy(memory_budget=<budget>)), ...)``
   with its defaults (``compare_plain``: plain training's search, solver ``"plain"``, then
   remat's, in one call): each search's answer, the trials it measured, its wall time and
   its predictions (the sizes it measured first); *search s* is the whole call (the
   profiles of the shape family, the predictions and both searches);
3. remat's answer trained by a fresh ``Trainer`` under the same strategy for ``--steps``
   steps, every step after the first (which plans) measured as in 1, against the budget;
4. our smallest feasible budget at ``B``: a ``Trainer`` under the strategy plans one step
   at ``B`` (its own cache), and ``min_budget(graph, "auto")`` on the graph it planned is
   divided by the measured plain peak of 1.

CPU, one torch thread per worker (the 2-core machines this runs on are shared). Results go
to ``benchmarks/results/batch_search/<tag>.json`` with the machine, date and commit.

    python benchmarks/batch_search.py                  # every model, under 15 minutes on 2 cores
    python benchmarks/batch_search.py --models gpt2 vit --tag try
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, ahead of an installed one
RESULTS = ROOT / "benchmarks" / "results" / "batch_search"
MiB = 2**20
HF_MODELS = ("gpt2", "qwen2", "t5", "bert")
VISION_MODELS = ("vit", "swin", "efficientnet", "resnet50", "mobilenet_v3")
"""The zoo's (tests/test_zoo_vision.py ``ZOO``), at its sizes."""
MODELS = (*HF_MODELS, *VISION_MODELS)
TARGET_FRACTION = 0.75
TARGET_TRIALS = 4
SEQUENCE = 64
"""Tokens per sample of the language models."""
DATASET_MULTIPLE = 4
"""The synthetic dataset holds this many times ``max_val`` samples (every batch is full)."""


# ---- the models ----------------------------------------------------------------------------------
def build(name: str, samples: int) -> Any:
    """The LightningModule for ``name`` (seeded), with ``samples`` synthetic samples."""
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    if name in HF_MODELS:
        from tests.hf_architectures import build as build_hf

        net, batch = build_hf(name, batch=samples, length=SEQUENCE)
        # build() pads the first row's last quarter; every fourth sample padded the same way.
        mask = torch.ones_like(batch["input_ids"])
        mask[::4, -SEQUENCE // 4:] = 0
        batch["attention_mask"] = mask
        batch["labels"] = batch["input_ids"].masked_fill(mask == 0, -100)
        data: Any = [{k: v[i] for k, v in batch.items()} for i in range(samples)]
    else:
        from tests.test_zoo_vision import ZOO

        net, x = ZOO[name]()
        g = torch.Generator().manual_seed(1)
        images = torch.randn(samples, *x.shape[1:], generator=g)
        labels = torch.randint(0, 10, (samples,), generator=g)
        data = list(zip(images, labels))

    class Wrapped(pl.LightningModule):
        """``net`` trained on the synthetic data; ``peaks`` collects each metered step's
        peak (forward and backward, gradients freed before it)."""

        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.batch_size = 8
            self.peaks: list[int] = []
            self.metered = False
            self.unmetered = 0  # the first steps of a fit, unmetered (a planning step)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if isinstance(batch, dict):
                return self.net(**batch).loss
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return DataLoader(data, batch_size=self.batch_size, shuffle=False)

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            if not self.metered or self.unmetered > 0:
                self.unmetered -= self.metered
                return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
            from lightning_remat.measure.peak import peak_bytes

            def metered() -> Any:
                self.zero_grad(set_to_none=True)  # the step allocates its gradients
                result: list[Any] = [None]

                def step() -> None:
                    result[0] = optimizer_closure()

                self.peaks.append(peak_bytes(step))
                return result[0]

            optimizer.step(closure=metered)

    return Wrapped()


def trainer(root: Path, strategy: Any, **kwargs: Any) -> Any:
    import pytorch_lightning as pl

    return pl.Trainer(default_root_dir=str(root), accelerator="cpu", devices=1, strategy=strategy,
                      logger=False, enable_checkpointing=False, enable_model_summary=False,
                      enable_progress_bar=False, **kwargs)


def metered_steps(model: Any, root: Path, strategy: Any, batch: int, steps: int, unmetered: int = 0) -> list[int]:
    """Train ``steps`` steps at ``batch``; the measured peak of each after the first
    ``unmetered`` (under a remat strategy the first step plans: its profiler and the meter
    would disturb each other)."""
    model.batch_size, model.peaks, model.metered, model.unmetered = batch, [], True, unmetered
    try:
        trainer(root, strategy, max_steps=steps).fit(model)
    finally:
        model.metered = False
    return list(model.peaks)


def capture_of(notes: list[str]) -> str:
    for note in notes:
        found = re.match(r"capture: (.+?), \d+ vertices", note)
        if found:
            return found.group(1)
    return "unknown"


# ---- one model, in its worker ------------------------------------------------------------------------
def measure(name: str, batch: int, init_val: int, max_val: int, steps_per_trial: int, steps: int,
            root: Path) -> dict[str, Any]:
    """The row of one model (``root``: a fresh folder for its caches and studies)."""
    from lightning_remat import RematStrategy, find_max_batch_size
    from lightning_remat.lightning.batch_size import RematBatchSizeFinder
    from lightning_remat.solvers import min_budget

    model = build(name, DATASET_MULTIPLE * max_val)
    row: dict[str, Any] = {"batch": batch, "init_val": init_val, "max_val": max_val,
                           "steps_per_trial": steps_per_trial}
    # 1. plain training's peak at B: the budget.
    plain_peaks = metered_steps(model, root / "plain", "auto", batch, 2)
    budget = max(plain_peaks)
    row.update(plain_peaks=plain_peaks, budget_bytes=budget)

    # 2. the searches, each one timed and its predictions kept.
    searches: dict[str, dict[str, Any]] = {}
    predicted: list[Any] = []
    search, predict = RematBatchSizeFinder._search, RematBatchSizeFinder._predict

    def timed_search(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = search(self, *args, **kwargs)
        searches[result.label] = {"seconds": time.perf_counter() - start}
        return result

    def kept_predict(self: Any, trial: Any, solver: str, *args: Any, **kwargs: Any) -> Any:
        value = predict(self, trial, solver, *args, **kwargs)
        predicted.append({"solver": solver, "predicted": value})
        return value

    RematBatchSizeFinder._search, RematBatchSizeFinder._predict = timed_search, kept_predict  # type: ignore[method-assign]
    model.batch_size = batch
    start = time.perf_counter()
    try:
        report = find_max_batch_size(
            trainer(root / "search", RematStrategy(memory_budget=budget), max_epochs=1), model,
            init_val=init_val, max_val=max_val, steps_per_trial=steps_per_trial, progress_bar=False)
    except Exception as exc:  # a crash is a finding: the row says what it was
        row.update(search_error=f"{type(exc).__name__}: {str(exc)[:600]}",
                   search_seconds=time.perf_counter() - start)
        return row
    finally:
        RematBatchSizeFinder._search, RematBatchSizeFinder._predict = search, predict  # type: ignore[method-assign]
    row["search_seconds"] = time.perf_counter() - start
    row["predictions"] = predicted
    for result in (report.plain, report.remat):
        if result is None:
            continue
        searches.setdefault(result.label, {}).update(
            solver=result.solver, largest_feasible=result.largest_feasible,
            smallest_infeasible=result.smallest_infeasible, trials_run=result.trials_run,
            finished=result.finished, monotone=result.monotone,
            trials=[{"batch": r.batch_size, "feasible": r.feasible, "peak_bytes": r.peak_bytes,
                     "predicted_peak_bytes": r.predicted_peak_bytes, "solver": r.solver,
                     "reason": r.reason[:300]} for r in result.trials])
    row["searches"] = searches
    row["report"] = report.table()

    # 3. remat's answer trains within the budget.
    answer = report.batch_size
    if answer:
        strategy = RematStrategy(memory_budget=budget)
        try:
            peaks = metered_steps(model, root / "search", strategy, answer, steps, unmetered=1)
            entry = next(iter(strategy.planner.planned.values()))
            row["check"] = {"batch": answer, "peaks": peaks, "within_budget": max(peaks) <= budget, "solver": entry.plan.solver,
                            "predicted_peak_bytes": entry.plan.predicted_peak_bytes,
                            "from_cache": entry.from_cache}
        except Exception as exc:
            row["check"] = {"batch": answer, "error": f"{type(exc).__name__}: {str(exc)[:600]}"}

    # 4. our smallest feasible budget at B, on the graph the strategy plans there.
    strategy = RematStrategy(memory_budget=budget)
    start = time.perf_counter()
    metered_steps(model, root / "at_b", strategy, batch, 1, unmetered=1)
    entry = next(iter(strategy.planner.planned.values()))
    least = min_budget(entry.graph, "auto")
    row["least"] = {"min_budget_bytes": least, "fraction": least / budget,
                    "planning_seconds": time.perf_counter() - start, "vertices": len(entry.graph),
                    "capture": capture_of(entry.plan.notes),
                    "predicted_plain_bytes": entry.graph.meta.plain_peak_bytes}
    return row


def verdict(row: dict[str, Any]) -> str:
    """Whether the target holds on this row: ``holds``, ``misses`` (with why), or ``n/a``
    (the smallest budget is not under 75% of plain)."""
    if "search_error" in row:
        return "misses: the search crashed"
    least = row.get("least", {}).get("fraction")
    remat = row["searches"].get("remat", {})
    why = []
    if not remat.get("largest_feasible") or remat["largest_feasible"] <= row["batch"]:
        why.append(f"remat's answer {remat.get('largest_feasible')} not above B")
    if remat.get("trials_run", 99) > TARGET_TRIALS:
        why.append(f"{remat.get('trials_run')} trials")
    check = row.get("check", {})
    if not check.get("within_budget"):
        why.append("its steps go over the budget" if "peaks" in check else "its check failed")
    if least is None or least >= TARGET_FRACTION:
        return "n/a" + (f" ({'; '.join(why)})" if why else "")
    return "misses: " + "; ".join(why) if why else "holds"


# ---- orchestration ------------------------------------------------------------------------------
def spawn(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", name, str(args.batch), str(args.init_val),
           str(args.max_val), str(args.steps_per_trial), str(args.steps)]
    started = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s", "seconds": time.time() - started}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            row = json.loads(line)
            row["seconds"] = time.time() - started
            return row
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300],
            "seconds": time.time() - started}


def table(record: dict[str, Any]) -> list[str]:
    """The Markdown table of one run."""
    out = ["| model | B | budget MiB | plain: size (trials, s) | remat: size (trials, s) | search s "
           "| remat's size trained: peak/budget | smallest budget /plain | target |",
           "|---|---:|---:|---|---|---:|---|---:|---|"]
    for name, row in record["rows"].items():
        if "error" in row:
            out.append(f"| {name} | | | worker failed: {row['error']} | | | | | |")
            continue
        budget = row["budget_bytes"]
        if "search_error" in row:
            out.append(f"| {name} | {row['batch']} | {budget / MiB:.2f} | search crashed: "
                       f"{row['search_error'][:160]} | | {row['search_seconds']:.0f} | | | misses |")
            continue

        def cell(label: str, row: dict[str, Any] = row) -> str:
            s = row["searches"].get(label, {})
            return (f"{s.get('largest_feasible')} ({s.get('trials_run')}, {s.get('seconds', 0):.0f})"
                    if s else "-")

        check = row.get("check", {})
        checked = (f"{max(check['peaks']) / budget:.3f} at {check['batch']}" if "peaks" in check
                   else check.get("error", "-")[:120])
        least = row.get("least", {}).get("fraction")
        out.append(f"| {name} | {row['batch']} | {budget / MiB:.2f} | {cell('plain')} | {cell('remat')} | "
                   f"{row['search_seconds']:.0f} | {checked} | "
                   f"{'-' if least is None else f'{least:.2f}'} | {verdict(row)} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--batch", type=int, default=8, help="B: plain training's peak here is the budget")
    p.add_argument("--init-val", type=int, default=8, help="the search's init_val")
    p.add_argument("--max-val", type=int, default=64)
    p.add_argument("--steps-per-trial", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps of the check at remat's answer")
    p.add_argument("--timeout", type=int, default=600, help="seconds per model's worker")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args(argv)
    import torch

    from benchmarks.run import git_commit

    started = time.time()
    record: dict[str, Any] = {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores", "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(args.allow_dirty, ROOT),
        "settings": {k: getattr(args, k) for k in ("batch", "init_val", "max_val", "steps_per_trial", "steps")},
        "rows": {}}
    for name in args.models:
        row = record["rows"][name] = spawn(name, args)
        if "searches" in row:
            row["target"] = verdict(row)
        print(name, json.dumps({k: v for k, v in row.items() if k != "report"}), flush=True)
        record["seconds"] = time.time() - started
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.tag}.json").write_text(json.dumps(record, indent=1))
    print(f"\n{record['machine']}, torch {record['torch']}, {record['date']}, commit {record['commit']}, "
          f"{record['seconds']:.0f} s\n")
    print("\n".join(table(record)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        name, batch, init_val, max_val, steps_per_trial, steps = sys.argv[2:8]
        import torch

        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(measure(name, int(batch), int(init_val), int(max_val), int(steps_per_trial),
                                     int(steps), Path(folder))))
        raise SystemExit(0)
    raise SystemExit(main())
