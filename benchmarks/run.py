"""The comparison table: every model, every method, measured the same way.

For each model and method: the measured peak of one training step, its time, how far its
gradients and BatchNorm statistics are from the plain model's, and the largest batch whose
measured peak stays within the plain step's peak. Methods: plain training;
``torch.utils.checkpoint.checkpoint_sequential`` at each segment count (where the model has
a sequential form: the ResNets, VGG, DenseNet, the GPT); ``torch.compile`` with
``activation_memory_budget`` 0.5 and 0.25; and lightning-remat's ``auto``, time-centric
(``kusumoto-tc``), memory-centric (``kusumoto-mc``) and offloading (``dynprog``, CUDA only)
plans at budgets of 25/50/75% of the plain peak; beside them each solver's predicted peak,
predicted extra time and own runtime on the same profiled graph.

**At equal memory** (ResNet-50, DenseNet-121, the U-Net, the GPT): each peer configuration's
measured peak becomes the budget of ``auto``, ``kusumoto-tc``, ``kusumoto-mc``, ``feng``,
``hong-linear`` and ``chen``, measured in the same run and harness.

Our plans: the model is profiled once per run (a fresh process, ``plan_all``), with the
executor's time per recomputed stage measured on it as ``remat()`` measures it before it
chooses; every plan of the run (each solver at each budget) is made on that profile as
``remat()`` makes it (without the first step's check, which would change each plan), and
each distinct plan is measured once, in a fresh process, through ``apply_plan``; the graph
and the plans are kept in ``benchmarks/results/run/<tag>/plans/`` (``lightning-remat simulate``
scores them again). Every measured plan's predicted peak and extra time sit beside the
measured ones (``benchmarks/prediction.py`` prints them all and the worst errors).

How it is measured (the same for every method):

- every figure comes from a fresh process (``--worker``), so no method's allocations, caches
  or compiled code disturb another's reading;
- the peak is the step's peak above what was live before it (``lightning_remat/meter.py``: the
  caching allocator's peak on CUDA, every allocation c10's CPU allocator reports on the CPU), with
  gradients freed before the step as Lightning does, so allocating them is part of it; on the
  CPU the same step is measured again at the allocator's edge in a child of its own
  (``benchmarks/edge.py``: every buffer its own mapping, the kernel's resident high-water
  mark), the independent check: ``edge_peak_bytes`` beside ``peak_bytes``;
- the time is the median of ``--repeats`` steps after a warm-up step (compilation, planning
  and the allocator's first calls are outside it), alternating with as many plain steps in
  the same process: *time/plain* is the ratio of the two medians (the meter changes no
  allocator setting, so the timed steps run as a user's would);
- gradient agreement is ``max|g - g_plain| / max|g_plain|`` after one step from the same
  weights on the same batch with the same RNG seed; BatchNorm agreement is the largest
  difference in running statistics after that step;
- the largest batch: the plain step's measured peak at the base batch is the memory cap;
  each method's batch is raised over a grid (base x 1, 1.25, 1.5, 2, ...) while its measured
  peak stays within the cap (ours: with ``memory_budget`` = the cap). "plain" is what
  Lightning's ``BatchSizeFinder`` finds on a device with exactly that much memory.

Results go to ``benchmarks/results/run/<tag>/<model>.json`` with the device, torch version,
date and commit of the run, and ``benchmarks/render.py`` turns every results file into
``benchmarks/RESULTS.md`` and the plots in ``benchmarks/plots/`` (run.py calls it at the end).

    python benchmarks/run.py --quick                  # CPU subset, < 20 minutes on 2 cores
    python benchmarks/run.py                          # every model and method on this device
    python benchmarks/run.py --device cuda --models resnet50 --part peers   # one GPU step
    python benchmarks/gpu/plans.py                    # the GPU commands: benchmarks/gpu/

The script refuses to run from a tree with uncommitted changes (the commit it records would
not be what was measured) unless ``--allow-dirty``; such rows name the commit plus "+dirty".
torchvision models need the ``vision`` extra (``pip install -e .[vision]``).

Length: the workers (one measurement, one profile with its plans) and the orchestration that
spawns them share the method names, the sizes and the sets; one file keeps ``--worker`` a
call of the same script.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "run"
sys.path.insert(0, str(ROOT))

VISION_MODELS = ["resnet50", "resnet101", "resnet152", "vgg19", "densenet121"]
MODELS = [*VISION_MODELS, "unet", "gpt"]
OUR_SOLVERS = ["auto", "kusumoto-tc", "kusumoto-mc", "dynprog"]
BUDGETS = ["25%", "50%", "75%"]
COMPILE_BUDGETS = ["0.5", "0.25"]
SEGMENTS = [2, 4, 8]
# Each solver's prediction on the profiled graph (the "solver figures"), made in the worker
# of PREDICTIONS_AT on the graph it profiled, after its steps are timed.
PREDICTIONS_AT = "remat:auto:75%"
PREDICTED_SOLVERS = ["chen", "chen-greedy", "feng", "hong-linear", "kusumoto-tc", "kusumoto-mc",
                     "dynprog", "auto"]
BATCH_GRID = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8)
SIZE_TOLERANCE = 1.02  # a step within 2% of the cap fits: the meter's run-to-run spread

# Base sizes per device: (batch, image side or sequence length). The CPU sizes keep a step
# around a second on 2 cores (ResNet-50's about four: at batch 16 and 160 px its activations,
# not its parameter gradients, dominate the peak, as the equal-memory comparison needs); the
# CUDA ones are the usual training sizes.
SIZES: dict[str, dict[str, tuple[int, int]]] = {
    "cpu": {"resnet50": (16, 160), "resnet101": (8, 112), "resnet152": (8, 112), "vgg19": (8, 96),
            "densenet121": (8, 112), "unet": (8, 128), "gpt": (8, 256)},
    "cuda": {"resnet50": (64, 224), "resnet101": (64, 224), "resnet152": (32, 224),
             "vgg19": (32, 224), "densenet121": (64, 224), "unet": (16, 256), "gpt": (8, 1024)},
}
GPT_SHAPE = {"cpu": {"vocab": 2000, "width": 256, "depth": 4, "heads": 4},
             "cuda": {"vocab": 50304, "width": 768, "depth": 12, "heads": 12}}
UNET_WIDTH = {"cpu": 16, "cuda": 64}

# The --quick subset: three model families, every kind of method, the 75% budget for the
# single-solver rows (the one all three reach at the CPU sizes); the largest batch for the GPT.
# torch.compile takes one to two and a half minutes per cell on 2 cores with a cold cache, hence
# one budget; "auto" is the time-centric DP wherever that fits, so no separate kusumoto-tc rows.
QUICK = {
    "models": ["resnet50", "unet", "gpt"],
    "sizes": {"resnet50": (8, 112)},  # a quarter of the full set's step, to stay under 20 minutes
    "equal_memory_solvers": ["auto", "kusumoto-tc", "kusumoto-mc"],
    "segments": [2, 4],
    "compile": ["0.5"],
    "solver_budgets": {"auto": BUDGETS, "kusumoto-tc": [], "kusumoto-mc": ["75%"],
                       "dynprog": ["50%"]},
    "largest_batch": ["gpt"],
    "repeats": 3,
}
NO_OFFLOAD = "offloading needs a GPU (on the CPU, host memory is device memory)"

# The equal-memory comparison: at each peer configuration's measured peak, each of these
# solvers with that peak as its budget, planned on the one profile of the model's "ours" part.
EQUAL_MEMORY_SOLVERS = ["auto", "kusumoto-tc", "kusumoto-mc", "feng", "hong-linear", "chen"]
# --set equal-memory: the models of the comparison, every peer configuration, every solver
# at every peer's peak and at the fractional budgets, no largest-batch search (see main's
# --set help for what it costs).
EQUAL_MEMORY_SET = {
    "models": ["resnet50", "densenet121", "unet", "gpt"],
    "solver_budgets": {"auto": BUDGETS, "kusumoto-tc": [], "kusumoto-mc": [], "dynprog": []},
    "largest_batch": [],
    "repeats": 3,
}


# ---- one measurement (a fresh process) -------------------------------------------------------
def step_loss(out: Any) -> Any:
    """The loss every measured step takes, and the one the plans are made for: the sum of
    the output (its gradient is a broadcast scalar, which the profile measures)."""
    return out.float().sum()


def build(model_name: str, device_kind: str, batch: int, size: int):
    """(model, example input, sequential form or None) on the CPU, seeded."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if model_name == "gpt":
        from benchmarks.models import GPT

        shape = GPT_SHAPE[device_kind]
        model = GPT(context=size, **shape)
        return model, torch.randint(0, shape["vocab"], (batch, size)), model.sequential()
    if model_name == "unet":
        from benchmarks.models import UNet

        return UNet(width=UNET_WIDTH[device_kind]), torch.randn(batch, 3, size, size), None
    import torchvision

    model = torchvision.models.get_model(model_name, num_classes=1000 if device_kind == "cuda" else 100)
    sequential = None
    if model_name.startswith("resnet"):
        children = list(model.children())
        sequential = nn.Sequential(*children[:-1], nn.Flatten(1), children[-1])
    elif model_name.startswith("vgg"):
        sequential = nn.Sequential(model.features, model.avgpool, nn.Flatten(1), *model.classifier)
    elif model_name.startswith("densenet"):
        # torchvision's DenseNet.forward: features, ReLU, global average pool, classifier.
        sequential = nn.Sequential(*model.features, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(1),
                                   model.classifier)
    return model, torch.randn(batch, 3, size, size), sequential



def _norm_buffers(model) -> dict[str, Any]:
    import torch

    return {name: b.detach().clone().float() for name, b in model.named_buffers()
            if name.endswith(("running_mean", "running_var"))} | {
        name: b.detach().clone().float() for name, b in model.named_buffers()
        if name.endswith("num_batches_tracked") and b.dtype == torch.long}


def _reset_norms(model) -> None:
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()


def measure(model_name: str, method: str, device_name: str, batch: int, size: int,
            repeats: int, cap_bytes: int | None = None, plans_file: str | None = None,
            edge: bool = False) -> dict[str, Any]:
    """One method on one model: peak, time and agreement with plain (see the module doc).

    ``method``: ``plain``, ``checkpoint_sequential:SEGMENTS``, ``compile:BUDGET``,
    ``remat:SOLVER:BUDGET`` (``remat()``: profile, solve, run), or ``plan:INDEX`` (the
    INDEX-th line of ``plans_file``, written by :func:`plan_all`, run through
    ``apply_plan``); ``cap_bytes`` replaces a remat budget (the largest-batch search). The ``PREDICTIONS_AT`` method also gives every solver's prediction on the graph
    it profiled (``predictions``). On the CPU each row's peak is measured again at the
    allocator's edge (``edge_peak_bytes``, ``benchmarks.edge.edge_check``); ``edge``: this process is
    that child, and returns that figure alone."""
    import torch

    from lightning_remat.measure.peak import peak_bytes

    device = torch.device(device_name)
    kind = "cuda" if device.type == "cuda" else "cpu"
    model, x, sequential = build(model_name, kind, batch, size)
    model, x = model.to(device), x.to(device)
    model.train()

    # The plain model's gradients and BatchNorm statistics after one step on this batch.
    torch.manual_seed(1)
    step_loss(model(x)).backward()
    plain_grads = [p.grad.detach().clone() for p in model.parameters()]
    plain_norms = _norm_buffers(model)
    model.zero_grad(set_to_none=True)
    _reset_norms(model)

    run: Callable[[Any], Any] = model
    row: dict[str, Any] = {}
    if method.startswith("checkpoint_sequential:"):
        if sequential is None:
            return {"skipped": "no sequential form"}
        from torch.utils.checkpoint import checkpoint_sequential

        segments = int(method.split(":")[1])
        if segments > len(sequential):
            return {"skipped": f"{len(sequential)} layers, fewer than {segments} segments"}
        seq = sequential.to(device)

        def run(inp):  # noqa: F811
            return checkpoint_sequential(seq, segments, inp, use_reentrant=False)
    elif method.startswith("compile:"):
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = float(method.split(":")[1])
        run = torch.compile(model)
    elif method.startswith("remat:"):
        import lightning_remat

        _, solver, budget = method.split(":")
        if solver == "dynprog" and device.type != "cuda":
            return {"skipped": NO_OFFLOAD}
        memory_budget: int | str = cap_bytes if cap_bytes is not None else budget
        start = time.perf_counter()
        try:
            run = lightning_remat.remat(model, x, memory_budget=memory_budget, solver=solver,
                                        loss_fn=step_loss)
        except lightning_remat.RematInfeasibleError as exc:
            skipped = {"skipped": "infeasible", "min_budget_bytes": exc.min_budget_bytes}
            if cap_bytes is None and budget.endswith("%"):
                # The budget was this fraction of the plain plan's peak: no second profile.
                skipped["plain_predicted_bytes"] = round(exc.budget_bytes * 100 / float(budget[:-1]))
            if method == PREDICTIONS_AT and cap_bytes is None:
                skipped["predictions"] = predictions(_plain_graph(model, x), device, BUDGETS)
            return skipped
        plan = run.plan
        row.update(planning_seconds=time.perf_counter() - start, solver=plan.solver,
                   recomputed=plan.count("recompute"), offloaded=plan.count("offload"),
                   budget_bytes=run.budget_bytes,
                   predicted_peak_bytes=plan.predicted_peak_bytes,
                   predicted_extra_seconds=plan.predicted_extra_seconds,
                   profiled_step_seconds=run.graph.meta.step_seconds)
    elif method.startswith("plan:"):
        # A plan made by plan_all on this model's profile, run by the package's executor.
        from lightning_remat import Plan, apply_plan
        from lightning_remat.graph.effects import preserved_state
        from lightning_remat.graph.ir import Graph
        from lightning_remat.graph.trace import trace_module

        if plans_file is None:
            raise ValueError("a plan: method needs the plans file")
        plan = Plan.from_json(Path(plans_file).read_text().splitlines()[int(method.split(":")[1])])
        with preserved_state(model, [device]):  # tracing runs the forward: BatchNorm untouched
            traced = trace_module(model, x)
        profiled = Graph.load(graph_path(Path(plans_file)))
        if traced.graph.graph_hash() != profiled.graph_hash():
            return {"error": "the traced graph differs from the profiled one the plan was made on"}
        # The profiled graph's schedule: which stages run under plain checkpoint is chosen
        # by its times (the executor's own included), which the bare trace does not have.
        run = apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=profiled)
    elif method != "plain":
        raise ValueError(f"unknown method {method!r}")

    def step() -> None:
        torch.manual_seed(1)
        step_loss(run(x)).backward()

    try:
        step()  # warm-up: compilation, allocator and oneDNN first-call caches
    except Exception as exc:  # a peer that cannot run this model is reported, not fatal
        if "out of memory" in str(exc).lower():
            return {"skipped": "out of memory"}
        return {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
    scale = max(float(g.abs().max()) for g in plain_grads) or 1.0
    row["grad_rel_diff"] = max(float((p.grad - g).abs().max()) for p, g in
                               zip(model.parameters(), plain_grads)) / scale
    norms = _norm_buffers(model)
    row["norm_diff"] = max((float((norms[k] - v).abs().max()) for k, v in plain_norms.items()), default=0.0)
    model.zero_grad(set_to_none=True)
    step()
    model.zero_grad(set_to_none=True)  # gradients are allocated inside the measured step
    if edge:
        from benchmarks.edge import edge_peak_bytes

        return {"edge_peak_bytes": edge_peak_bytes(step)}
    row["peak_bytes"] = peak_bytes(step, device)

    def plain_step() -> None:
        torch.manual_seed(1)
        step_loss(model(x)).backward()

    # Plain and method steps alternate in this process, so the ratio compares steps taken
    # under the same conditions (machine load drifts between processes).
    times: dict[Callable[[], None], list[float]] = {plain_step: [], step: []}
    for fn in (plain_step, step):
        model.zero_grad(set_to_none=True)
        fn()
    for _ in range(repeats):
        for fn, spent in times.items():
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            spent.append(time.perf_counter() - t0)
    row["step_seconds"] = statistics.median(times[step])
    row["plain_step_seconds"] = statistics.median(times[plain_step])
    if method == PREDICTIONS_AT and cap_bytes is None:
        row["predictions"] = predictions(run.graph, device, BUDGETS)
    if device.type == "cpu":
        from benchmarks.edge import edge_check

        plan_made = (run.plan, run.graph) if method.startswith("remat:") else None
        worker = [sys.executable, __file__, "--worker", "--edge", "--model", model_name, "--device", "cpu",
                  "--batch", str(batch), "--size", str(size), "--repeats", "1"]
        row.update(edge_check(worker, method, plans_file, plan_made, graph_path))
    return row


def graph_path(plans_file: Path) -> Path:
    """The profiled graph beside a plans file (``<model>.jsonl`` -> ``<model>.graph.json``)."""
    return plans_file.with_suffix(".graph.json")


def plan_all(model_name: str, device_name: str, batch: int, size: int,
             requests: list[list[Any]], plans_file: Path) -> dict[str, Any]:
    """One profile of the model, and on it a plan for each ``[key, solver, budget]`` request
    (budget: ``"75%"`` of the profiled plain peak, or bytes), chosen as ``remat()`` chooses
    (``Planner._plan_locally``: the budget in bytes, ``solve`` with the device's solver
    options). Writes the graph and each distinct plan (one per line) beside ``plans_file``,
    so ``lightning-remat simulate`` can score them again; returns per key the plan's line,
    or why there is none, and every solver's prediction on the graph (the solver table)."""
    import torch

    from lightning_remat import RematInfeasibleError
    from lightning_remat.planner import PlanSettings
    from lightning_remat.solvers import solve
    from lightning_remat.solvers.policy import check_solver_for_device, solver_options

    device = torch.device(device_name)
    kind = "cuda" if device.type == "cuda" else "cpu"
    model, x, _ = build(model_name, kind, batch, size)
    model, x = model.to(device).train(), x.to(device)
    start = time.perf_counter()
    graph = _plain_graph(model, x)
    _calibrate(model, x, graph, device)
    profile_seconds = time.perf_counter() - start
    step = graph.meta.step_seconds or sum(n.t_fwd + n.t_bwd for n in graph.nodes)
    lines: dict[str, int] = {}
    cells: dict[str, dict[str, Any]] = {}
    for key, solver, budget in requests:
        try:
            check_solver_for_device(solver, device)
        except ValueError:
            cells[key] = {"skipped": NO_OFFLOAD}
            continue
        budget_bytes = PlanSettings(budget, solver).budget_bytes(graph, device)
        start = time.perf_counter()
        try:
            plan = solve(graph, budget_bytes, solver, **solver_options(solver, device))
        except RematInfeasibleError as exc:
            cells[key] = {"skipped": "infeasible", "budget_bytes": budget_bytes,
                          "min_budget_bytes": exc.min_budget_bytes}
            continue
        except Exception as exc:  # noqa: BLE001 - one solver's failure is its cell's, not the run's
            cells[key] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}", "budget_bytes": budget_bytes}
            continue
        line = lines.setdefault(json.dumps(plan.to_dict()["stages"]), len(lines))
        cells[key] = {"plan_line": line, "solver": plan.solver, "recomputed": plan.count("recompute"),
                      "offloaded": plan.count("offload"), "budget_bytes": budget_bytes,
                      "predicted_peak_bytes": plan.predicted_peak_bytes,
                      "predicted_extra_seconds": plan.predicted_extra_seconds,
                      "profiled_step_seconds": step, "solver_seconds": time.perf_counter() - start,
                      "_plan": plan.to_json()}
    # One line per distinct set of stages (a plan chosen at several budgets is measured once).
    texts: dict[int, str] = {}
    for cell in cells.values():
        if "plan_line" in cell:
            texts.setdefault(cell["plan_line"], cell.pop("_plan"))
    plans_file.parent.mkdir(parents=True, exist_ok=True)
    graph.save(graph_path(plans_file))
    plans_file.write_text("".join(texts[i] + "\n" for i in range(len(texts))))
    return {"vertices": len(graph), "graph_hash": graph.graph_hash(), "profile_seconds": profile_seconds,
            "plain_predicted_bytes": _plain_peak(graph), "profiled_step_seconds": step,
            "plans_file": plans_file.relative_to(ROOT).as_posix() if plans_file.is_relative_to(ROOT)
            else str(plans_file), "cells": cells,
            "predictions": predictions(graph, device, BUDGETS)}


def _plain_peak(graph) -> int:
    from lightning_remat.solvers.policy import plain_peak_bytes

    return plain_peak_bytes(graph)


def _plain_graph(model, x):
    """The model's profiled graph (the plain plan's, so nothing is solved)."""
    import lightning_remat

    return lightning_remat.remat(model, x, memory_budget=None, solver="plain", loss_fn=step_loss).graph


def _calibrate(model, x, graph, device) -> None:
    """The executor's own time measured on the model's step, as ``remat()`` measures it
    before it chooses a plan (docs/design.md section 4.7)."""
    import functools

    import torch

    from lightning_remat import apply_plan
    from lightning_remat.graph.effects import preserved_state
    from lightning_remat.graph.trace import trace_module
    from lightning_remat.runtime.overhead import CALIBRATION_STEPS, calibrate_on_model
    from lightning_remat.runtime.stepcheck import timed_rotation

    def step(module) -> Callable[[], None]:
        def run() -> None:
            torch.manual_seed(1)
            step_loss(module(x)).backward()
            model.zero_grad(set_to_none=True)
        return run

    timer = functools.partial(timed_rotation, step(model), device=device, steps=CALIBRATION_STEPS)
    with preserved_state(model, [device]):
        traced = trace_module(model, x)
        calibrate_on_model(graph, timer, lambda plan: step(
            apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=graph)))


def predictions(graph, device, budgets: list[str]) -> dict[str, Any]:
    """Each solver's predicted peak and extra time, and its runtime, on a profiled graph at
    each budget (a fraction of the plain plan's predicted peak)."""
    from lightning_remat.budget import Budget
    from lightning_remat.runtime.offload import measure_bandwidth
    from lightning_remat.solvers import fits, get_solver, min_budget
    from lightning_remat.solvers.policy import plain_peak_bytes, solver_options

    if graph.meta.bandwidth_bytes_per_s is None:
        graph.meta.bandwidth_bytes_per_s = measure_bandwidth(device)
    plain = plain_peak_bytes(graph)  # what a fractional budget is a fraction of
    step = graph.meta.step_seconds or sum(n.t_fwd + n.t_bwd for n in graph.nodes)
    cells = []
    for solver in PREDICTED_SOLVERS:
        options = solver_options(solver, device)
        for budget in budgets:
            budget_bytes = Budget(budget).resolve(plain)
            start = time.perf_counter()
            plan = get_solver(solver)(graph, budget_bytes, **options)
            seconds = time.perf_counter() - start
            cell = {"solver": solver, "budget": budget, "solver_seconds": seconds,
                    "fits": fits(plan, budget_bytes)}
            if cell["fits"]:
                cell.update(predicted_peak_bytes=plan.predicted_peak_bytes,
                            predicted_extra_seconds=plan.predicted_extra_seconds, chosen=plan.solver)
            else:
                try:
                    cell["min_budget_bytes"] = min_budget(graph, solver, **options)
                except Exception as exc:  # noqa: BLE001 - reported in the table
                    cell["error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
            cells.append(cell)
    return {"plain_predicted_bytes": plain, "profiled_step_seconds": step, "vertices": len(graph),
            "cells": cells}


# ---- the largest batch -----------------------------------------------------------------------
def largest_batch(fits_at: Callable[[int], bool], base: int, start: int | None = None) -> tuple[int | None, list[int]]:
    """The largest batch on the grid ``base x BATCH_GRID`` for which ``fits_at`` holds,
    assuming it holds up to some batch and not beyond (memory grows with the batch).
    Starts at ``start`` (a guess; default ``base``) and walks up or down the grid, so a good
    guess costs two probes. Returns (batch or None if even the smallest fails, probes made)."""
    grid = sorted({max(1, round(base * f)) for f in BATCH_GRID})
    i = grid.index(min(grid, key=lambda b: abs(b - (start or base))))
    probed: list[int] = []
    results: dict[int, bool] = {}

    def ok(j: int) -> bool:
        if grid[j] not in results:
            probed.append(grid[j])
            results[grid[j]] = fits_at(grid[j])
        return results[grid[j]]

    if ok(i):
        while i + 1 < len(grid) and ok(i + 1):
            i += 1
        return grid[i], probed
    while i > 0:
        i -= 1
        if ok(i):
            return grid[i], probed
    return None, probed


# ---- orchestration ---------------------------------------------------------------------------
def spawn(args: argparse.Namespace, model: str, method: str, batch: int, size: int,
          cap_bytes: int | None = None, plans_file: Path | None = None,
          requests: list[list[Any]] | None = None) -> dict[str, Any]:
    """``measure`` in a fresh process (``plan_all`` when ``requests`` are given)."""
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--method", method,
           "--device", args.device, "--batch", str(batch), "--size", str(size),
           "--repeats", str(args.repeats)]
    if cap_bytes is not None:
        cmd += ["--cap", str(cap_bytes)]
    if plans_file is not None:
        cmd += ["--plans-file", str(plans_file)]
    if requests is not None:
        cmd += ["--requests", json.dumps(requests)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]}


# What the benchmarks write themselves does not make the tree dirty.
OUTPUTS = ("benchmarks/results", "benchmarks/plots", "benchmarks/RESULTS.md")


def git_commit(allow_dirty: bool, root: Path = ROOT) -> str:
    """The commit measured; refuses (SystemExit) a tree with uncommitted changes to tracked
    files (the benchmarks' own outputs aside) unless told."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=root, check=True,
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                *(f":!{path}" for path in OUTPUTS)], cwd=root,
                               check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        if not allow_dirty:
            raise SystemExit("run.py: not a git checkout, so no commit can be recorded; "
                             "pass --allow-dirty to measure anyway (rows then name 'unknown')") from None
        return "unknown"
    if dirty and not allow_dirty:
        raise SystemExit("run.py: the tree has uncommitted changes, so the recorded commit would "
                         "not be what was measured; commit them, or pass --allow-dirty (rows then "
                         f"name {commit}+dirty):\n{dirty}")
    return commit + ("+dirty" if dirty else "")


def environment(device: str) -> dict[str, Any]:
    import torch

    if device.startswith("cuda"):
        machine = torch.cuda.get_device_name(0)
    else:
        machine = f"{platform.machine()} CPU, {os.cpu_count()} cores"
    return {"device": device, "machine": machine, "torch": torch.__version__,
            "python": platform.python_version(), "date": datetime.date.today().isoformat()}


def methods_for(model: str, args: argparse.Namespace, has_sequential: bool) -> list[tuple[str, str]]:
    """(part, method) pairs to measure for ``model``."""
    chosen = selection(args)
    out: list[tuple[str, str]] = [("peers", "plain")]
    if has_sequential:
        out += [("peers", f"checkpoint_sequential:{s}") for s in chosen["segments"]]
    if not args.no_compile:
        out += [("peers", f"compile:{b}") for b in chosen["compile"]]
    for solver in OUR_SOLVERS:
        for budget in chosen["solver_budgets"].get(solver, []):
            out.append(("ours", f"remat:{solver}:{budget}"))
    return out


def selection(args: argparse.Namespace) -> dict[str, Any]:
    """What ``--quick`` or ``--set`` selects: models, fractional budgets per solver, which
    models get the largest-batch search and which solvers the equal-memory comparison."""
    if args.quick:
        return {**QUICK, "equal_memory_models": QUICK["models"]}
    full = {"models": MODELS, "segments": SEGMENTS, "compile": COMPILE_BUDGETS,
            "solver_budgets": dict.fromkeys(OUR_SOLVERS, BUDGETS), "largest_batch": MODELS,
            "equal_memory_solvers": EQUAL_MEMORY_SOLVERS,
            "equal_memory_models": EQUAL_MEMORY_SET["models"], "sizes": {}}
    if args.set == "equal-memory":
        full.update(EQUAL_MEMORY_SET)
    return full


def run_model(args: argparse.Namespace, model: str, meta: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    chosen = selection(args)
    batch, size = chosen["sizes"].get(model) if kind == "cpu" and model in chosen["sizes"] else SIZES[kind][model]
    batch = args.batch or batch
    out_path = RESULTS / args.tag / f"{model}.json"
    # Parts of one model measured in separate invocations (benchmarks/gpu/plans.py) land in one file.
    whole = args.part in ("all", "table")
    record = json.loads(out_path.read_text()) if out_path.exists() and not whole else {}
    record.update(model=model, batch=batch, size=size, **meta)
    rows = record.setdefault("rows", {})
    has_sequential = model.startswith(("resnet", "vgg", "densenet")) or model == "gpt"
    parts = {"all": {"peers", "ours", "batch"}, "table": {"peers", "ours"}}.get(args.part, {args.part})

    def save() -> None:  # after every figure, so a step cut off by a time limit keeps its rows
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(record, indent=1) + "\n")

    for part, method in methods_for(model, args, has_sequential):
        if part == "ours":
            continue  # planned on one profile below
        if part in parts or (method == "plain" and "plain" not in rows):
            t0 = time.perf_counter()
            rows[method] = spawn(args, model, method, batch, size)
            save()
            log(f"  {model:<12} {method:<30} {_brief(rows[method])} ({time.perf_counter() - t0:.0f} s)")
    if "ours" in parts:
        requests = [[method, *method.split(":")[1:]] for part, method in
                    methods_for(model, args, has_sequential) if part == "ours"]
        if model in chosen["equal_memory_models"]:
            for peer, row in rows.items():
                if peer != "plain" and "peak_bytes" in row:
                    requests += [[f"{peer}|{solver}", solver, int(row["peak_bytes"])]
                                 for solver in chosen["equal_memory_solvers"]]
        measure_ours(args, model, batch, size, record, requests, save, log)
    if "batch" in parts and model in chosen["largest_batch"]:
        record["largest_batch"] = search_batches(args, model, batch, size, rows, has_sequential, log)
    save()
    return record


MEASURED = ("peak_bytes", "edge_peak_bytes", "edge_error", "step_seconds", "plain_step_seconds",
            "grad_rel_diff", "norm_diff", "error")
"""What a measurement gives (the rest of a plan's row comes from its planning)."""


def measure_ours(args: argparse.Namespace, model: str, batch: int, size: int, record: dict[str, Any],
                 requests: list[list[Any]], save: Callable[[], None], log: Callable[[str], None]) -> None:
    """Our rows: one profile of the model, every requested plan made on it (``plan_all``),
    each distinct plan measured once in a fresh process. A request keyed ``remat:SOLVER:B``
    is a row of the measured table; one keyed ``PEER|SOLVER`` (the budget: that peer's
    measured peak) a cell of ``record["equal_memory"][PEER][SOLVER]``."""
    t0 = time.perf_counter()
    plans_file = RESULTS / args.tag / "plans" / f"{model}.jsonl"
    profile = spawn(args, model, "plan-all", batch, size, plans_file=plans_file, requests=requests)
    cells = profile.pop("cells", None)
    record["profile"] = profile
    log(f"  {model:<12} {'profile and plans':<30} {len(cells or {})} requests, "
        f"{len(set(c.get('plan_line') for c in (cells or {}).values()) - {None})} distinct plans "
        f"({time.perf_counter() - t0:.0f} s)")
    equal = record.setdefault("equal_memory", {})
    measured: dict[int, tuple[str, dict[str, Any]]] = {}
    for key, _, _ in requests:
        t0 = time.perf_counter()
        cell = dict((cells or {}).get(key) or {"error": profile.get("error", "not planned")})
        if "plan_line" in cell:
            line = cell["plan_line"]
            if line in measured:
                first, row = measured[line]
                cell.update({k: row[k] for k in MEASURED if k in row}, same_plan_as=first)
            else:
                row = spawn(args, model, f"plan:{line}", batch, size, plans_file=plans_file)
                measured[line] = (key, row)
                cell.update(row)
        if "|" in key:
            peer, solver = key.split("|")
            equal.setdefault(peer, {})[solver] = cell
        else:
            record["rows"][key] = cell
        save()
        log(f"  {model:<12} {key:<30} {_brief(cell)} ({time.perf_counter() - t0:.0f} s)")


def search_batches(args: argparse.Namespace, model: str, batch: int, size: int, rows: dict[str, Any],
                   has_sequential: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """Each method's largest batch within the plain step's measured peak (the cap)."""
    plain = rows.get("plain", {})
    if "peak_bytes" not in plain:
        return {"error": "no plain peak to cap at"}
    cap = int(plain["peak_bytes"])
    candidates = ["plain", "compile:0.5", "remat:auto:cap"]
    if has_sequential:
        seg = [m for m in rows if m.startswith("checkpoint_sequential:") and "peak_bytes" in rows[m]]
        if seg:
            candidates.insert(1, min(seg, key=lambda m: rows[m]["peak_bytes"]))
    if args.no_compile:
        candidates.remove("compile:0.5")
    out: dict[str, Any] = {"cap_bytes": cap}
    for method in candidates:
        measured = rows.get(method, {})
        if method == "remat:auto:cap":
            feasible = [r for m, r in rows.items() if m.startswith("remat:") and "peak_bytes" in r]
            least = min((r["peak_bytes"] for r in feasible), default=cap)
            guess = batch * cap / max(least, 1)
        else:
            guess = batch * cap / measured["peak_bytes"] if "peak_bytes" in measured else batch
        probes: dict[int, dict[str, Any]] = {}

        def fits_at(b: int, method: str = method, probes: dict = probes) -> bool:
            if b == batch and method == "plain":
                probes[b] = plain  # the cap itself
            else:
                spec = "remat:auto:cap" if method == "remat:auto:cap" else method
                probes[b] = spawn(args, model, spec, b, size, cap_bytes=cap if spec.startswith("remat") else None)
            return "peak_bytes" in probes[b] and probes[b]["peak_bytes"] <= cap * SIZE_TOLERANCE

        best, probed = largest_batch(fits_at, batch, start=round(guess))
        out[method] = {"batch": best, "probes": {str(b): probes[b].get("peak_bytes", probes[b]) for b in probed}}
        if method.startswith("remat"):  # their predictions, for the prediction table
            out[method]["rows"] = {str(b): probes[b] for b in probed}
        if best is not None:
            out[method]["step_seconds"] = probes[best].get("step_seconds")
        log(f"  {model:<12} largest batch {method:<24} {best} (probed {probed})")
    return out


def _brief(row: dict[str, Any]) -> str:
    if "peak_bytes" in row:
        same = f" (the plan of {row['same_plan_as']})" if "same_plan_as" in row else ""
        return f"peak {row['peak_bytes'] / 2**20:.1f} MiB, {row['step_seconds']:.2f} s{same}"
    if "cells" in row:
        return f"{len(row['cells'])} predictions"
    return str(row)[:90]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the CPU subset (< 20 minutes on 2 cores)")
    p.add_argument("--set", default="all", choices=["all", "equal-memory"],
                   help="all: every model and method; equal-memory: the models of the equal-memory "
                   "comparison (ResNet-50, DenseNet-121, U-Net, GPT), every peer and every solver at "
                   "each peer's peak, our budgets for auto, no largest-batch search (the CPU set that "
                   "fits in under an hour on 2 cores)")
    p.add_argument("--models", help=f"comma-separated, of {','.join(MODELS)} (default: all, or the quick set)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--part", default="all", choices=["all", "table", "peers", "ours", "batch"],
                   help="measure one part of each model (results merge into its file); table: "
                   "peers and ours, no largest-batch search (a fresh file, as all)")
    p.add_argument("--tag", help="results folder under benchmarks/results/run (default: DEVICE[-quick])")
    p.add_argument("--batch", type=int, help="override the base batch size")
    p.add_argument("--repeats", type=int, help="timed steps per method, and as many plain ones "
                   "(default 5; 3 with --quick and --set equal-memory)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--allow-dirty", action="store_true", help="measure a tree with uncommitted changes")
    p.add_argument("--no-render", action="store_true", help="do not rewrite RESULTS.md and the plots")
    p.add_argument("--timeout", type=int, default=900, help="seconds per measurement")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--edge", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cap", type=int, help=argparse.SUPPRESS)
    p.add_argument("--plans-file", help=argparse.SUPPRESS)
    p.add_argument("--requests", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        if args.method == "plan-all":
            out = plan_all(args.model, args.device, args.batch, args.size, json.loads(args.requests),
                           Path(args.plans_file))
        else:
            out = measure(args.model, args.method, args.device, args.batch, args.size,
                          args.repeats, args.cap, args.plans_file, args.edge)
        print(json.dumps(out))
        return 0

    if args.repeats is None:
        args.repeats = selection(args).get("repeats", 5)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    if args.quick and args.set != "all":
        p.error("--quick and --set choose different sets; give one")
    models = args.models.split(",") if args.models else selection(args)["models"]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {MODELS}")
    if any(m in VISION_MODELS for m in models):
        try:
            import torchvision  # noqa: F401
        except ImportError:
            p.error("the torchvision models need torchvision: pip install -e .[vision] "
                    f"(or --models {','.join(m for m in models if m not in VISION_MODELS) or 'gpt'})")
    commit = git_commit(args.allow_dirty)
    args.tag = args.tag or kind + ("-quick" if args.quick else "")
    if args.part in ("all", "table") and (RESULTS / args.tag).is_dir() and not args.models:
        for old in (RESULTS / args.tag).glob("*.json"):  # a whole rerun replaces the tag
            old.unlink()
    meta = {"commit": commit, **environment(args.device), "quick": args.quick, "set": args.set}

    def log(line: str) -> None:
        print(line, flush=True)

    started = time.perf_counter()
    log(f"# run.py {args.tag}: {meta['machine']}, torch {meta['torch']}, {meta['date']}, commit {commit}")
    for model in models:
        run_model(args, model, meta, log)
    log(f"# {time.perf_counter() - started:.0f} s in all")
    if not args.no_render:
        from benchmarks import render

        render.main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
