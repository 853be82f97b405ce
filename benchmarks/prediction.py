"""Predicted against measured peak and extra time of every plan ``benchmarks/run.py`` measured,
and of a plain and a sqrt(n) recompute plan on three small models.

By default it reads ``benchmarks/results/run/<tag>/*.json`` (every tag, or ``--tag``) and prints,
for every plan of ours run.py measured (its budgets, the equal-memory cells, the largest-batch
probes), the measured and predicted peak with the error in %, the measured extra time
(time/plain - 1) and the predicted one (the plan's extra seconds over the profiled step)
with the error in percentage points; then the worst errors and how many plans meet the
targets (3%, 5 points). Nothing is measured again; the exit code is 1 when a target is
missed, so scripts can check it. Where run.py kept the profiled graph and the plans
(``results/<tag>/plans/``), each plan's predicted peak is scored again by the simulator
(``lightning-remat simulate`` gives the same) and a plan whose recorded prediction differs
is named.

    python benchmarks/prediction.py                       # every results folder
    python benchmarks/prediction.py --tag cpu             # one
    python benchmarks/prediction.py --measure             # the small models below, CPU
    python benchmarks/prediction.py --measure --device cuda

``--measure``: for each model: one plain step's peak is measured with ``peak_bytes`` (after a warm-up
step, parameter gradients set to None so the step allocates them as a first step does), the
model is profiled with ``profile_module`` and the simulator predicts the same step's peak.
Each model runs in its own fresh subprocess so earlier models leave nothing behind
(allocator caches, glibc heaps). The step is ``model(x, targets).backward()`` where the
model ends with its cross-entropy loss (``benchmarks.models.WithLoss``). torchvision models
need torchvision (``make``'s venv has it): the workers run under ``--python`` (default: this
interpreter).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "run"

# name -> (batch, description); small sizes so the CPU run takes a few minutes.
MODELS = {
    "resnet18": (16, "torchvision resnet18, 3x128x128 images, 1000 classes"),
    "vgg11": (8, "torchvision vgg11, 3x128x128 images, 1000 classes"),
    "gpt": (8, "GPT (benchmarks.models): vocab 8192, width 256, 4 blocks, 4 heads, 256 tokens"),
}


def build(name: str, batch: int, device: str):
    import torch

    from benchmarks.models import GPT, WithLoss

    torch.manual_seed(0)
    if name == "gpt":
        model = GPT()
        x = torch.randint(0, 8192, (batch, 256))
        y = torch.randint(0, 8192, (batch, 256))
    else:
        import torchvision

        model = getattr(torchvision.models, name)(num_classes=1000)
        x = torch.randn(batch, 3, 128, 128)
        y = torch.randint(0, 1000, (batch,))
    return WithLoss(model, sequence=name == "gpt").to(device).train(), (x.to(device), y.to(device))


def worker(name: str, device: str) -> dict:
    import torch

    from lightning_remat.graph.profile import profile_module
    from lightning_remat.graph.trace import trace_module
    from lightning_remat.measure.peak import peak_bytes
    from lightning_remat.solvers.scoring import make_plan
    from lightning_remat.solvers.simulate import simulate

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    batch, _ = MODELS[name]
    model, inputs = build(name, batch, device)

    def step() -> None:
        model(*inputs).backward()

    def clear() -> None:
        for p in model.parameters():
            p.grad = None

    step()
    clear()  # warm-up (lazy initialisation), then measure from a state without gradients
    measured = peak_bytes(step, device)
    clear()
    traced = trace_module(model, inputs)
    graph = profile_module(model, inputs, loss_fn=lambda out: out, warmup=1, repeats=1,
                           traced=traced)
    result = {"model": name, "batch": batch, "vertices": len(graph),
              "measured": measured, "predicted": simulate(graph).peak_bytes}
    # One recompute plan: about sqrt(n) stages of equal size, all but the last recomputed.
    ids = graph.ids
    size = max(1, round(math.sqrt(len(ids))))
    chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
    plan = make_plan(graph, [(c, "recompute") for c in chunks[:-1]] + [(chunks[-1], "keep")],
                     "sqrt-n")
    result["recompute_stages"] = len(chunks) - 1
    result["recompute_predicted"] = plan.predicted_peak_bytes
    result["recompute_measured"] = None
    from lightning_remat.runtime.module import apply_plan

    remat = apply_plan(traced.gm, plan, root=model, charge=traced.charge, graph=graph)
    step_remat = lambda: remat(*inputs).backward()  # noqa: E731
    step_remat()
    clear()
    result["recompute_measured"] = peak_bytes(step_remat, device)
    return result


def resimulated(tag_dir: Path, record: dict) -> dict[str, int]:
    """Each plan line's peak scored again by the simulator on the graph run.py profiled (empty
    when run.py kept no plans for this model)."""
    plans_file = (ROOT / record["profile"]["plans_file"]) if record.get("profile", {}).get("plans_file") else None
    if plans_file is None or not plans_file.exists() or not plans_file.with_suffix(".graph.json").exists():
        return {}
    from lightning_remat.graph.ir import Graph
    from lightning_remat.solvers.plan import Plan
    from lightning_remat.solvers.simulate import simulate

    graph = Graph.load(plans_file.with_suffix(".graph.json"))
    return {str(i): simulate(graph, Plan.from_json(line)).peak_bytes
            for i, line in enumerate(plans_file.read_text().splitlines())}


def report(results: Path, tags: list[str] | None = None) -> int:
    """Print every measured plan's predicted against measured peak and extra time, per tag,
    and the worst errors; 1 when a target is missed or nothing was found, else 0."""
    from benchmarks.render import (
        EXTRA_TARGET_POINTS,
        PEAK_TARGET_PCT,
        edge_against_budgets,
        edge_sentence,
        load,
        measured_plans,
        prediction_errors,
        worst_predictions,
    )

    mib = 2**20
    status, found = 0, False
    dirs = [results / t for t in tags] if tags else sorted(d for d in results.iterdir() if d.is_dir())
    for tag_dir in dirs:
        records = load(tag_dir) if tag_dir.is_dir() else []
        if not records:
            print(f"{tag_dir.name}: no results (run benchmarks/run.py)")
            continue
        first = records[0]
        print(f"== {tag_dir.name}: {first['machine']}, torch {first['torch']}, {first['date']}, "
              f"commit {first['commit']}")
        header = (f"{'model':<12} {'plan':<58} {'peak MiB':>9} {'edge':>8} {'pred.':>8} {'error':>7} "
                  f"{'extra':>6} {'pred.':>6} {'error':>8}")
        print(header)
        print("-" * len(header))
        for record in records:
            again = resimulated(tag_dir, record)
            for label, row in measured_plans(record):
                err = prediction_errors(row)
                if err is None:
                    continue
                found = True
                edge = f"{row['edge_peak_bytes'] / mib:.1f}" if row.get("edge_peak_bytes") else "-"
                line = (f"{record['model']:<12} {label[:58]:<58} {row['peak_bytes'] / mib:>9.1f} {edge:>8} "
                        f"{row['predicted_peak_bytes'] / mib:>8.1f} {err['peak_error_pct']:>+6.1f}% "
                        f"{err['measured_extra_pct']:>+5.0f}% {err['predicted_extra_pct']:>+5.0f}% "
                        f"{err['extra_error_points']:>+5.0f} pts")
                simulated = again.get(str(row.get("plan_line")))
                if simulated is not None and simulated != row["predicted_peak_bytes"]:
                    line += f"  (the simulator now says {simulated / mib:.1f} MiB)"
                print(line)
        worst = worst_predictions(records)
        if worst:
            m, label, _, e = worst["worst_peak"]
            m2, label2, _, e2 = worst["worst_extra"]
            print(f"{worst['plans']} plans: peak within {PEAK_TARGET_PCT:.0f}% for {worst['peak_within']}, "
                  f"extra time within {EXTRA_TARGET_POINTS:.0f} points for {worst['extra_within']}")
            print(f"worst peak error: {e['peak_error_pct']:+.1f}% ({m}, {label})")
            print(f"worst extra-time error: {e2['extra_error_points']:+.0f} points ({m2}, {label2}: "
                  f"predicted {e2['predicted_extra_pct']:+.0f}%, measured {e2['measured_extra_pct']:+.0f}%)")
            print(edge_sentence(records))
            if worst["peak_within"] < worst["plans"] or worst["extra_within"] < worst["plans"]:
                status = 1
            if edge_against_budgets(records)["over"]:
                status = 1
    if not found:
        print("no measured plans with predictions found")
        return 1
    return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", action="append", help="a results folder under benchmarks/results/run "
                        "(repeatable; default: every one)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    parser.add_argument("--measure", action="store_true",
                        help="measure a plain and a sqrt(n) plan on the small models instead")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--python", default=sys.executable, help="interpreter for the workers (needs torchvision)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.device)))
        return
    if not args.measure:
        sys.exit(report(args.results, args.tag))

    # This checkout is importable in the workers (after any PYTHONPATH the caller set).
    path = [p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    env.setdefault("OMP_NUM_THREADS", "2")
    info = subprocess.run([args.python, "-c", "import torch; print(torch.__version__); "
                           "print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')"],
                          capture_output=True, text=True, env=env).stdout.split("\n")
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs"
          + (f", {info[1]}" if args.device == "cuda" and len(info) > 1 else ""))
    print(f"torch: {info[0]}   device: {args.device}")
    for name in args.models:
        print(f"  {name}: batch {MODELS[name][0]}, {MODELS[name][1]}")
    mib = 2**20
    print("plain: keep everything; recompute N: the vertices cut into N + 1 runs of about "
          "sqrt(n), the first N under non-reentrant checkpoint)")
    header = f"{'model':10} {'batch':>5} {'plan':>12} {'predicted':>12} {'measured':>12} {'error':>8}"
    print(header)
    print("-" * len(header))
    for name in args.models:
        run = subprocess.run([args.python, __file__, "--worker", name, "--device", args.device],
                             capture_output=True, text=True, env=env, cwd=ROOT)
        if run.returncode != 0:
            print(f"{name:10} failed:\n{run.stderr[-2000:]}")
            continue
        r = json.loads(run.stdout.strip().splitlines()[-1])
        err = 100.0 * (r["predicted"] - r["measured"]) / r["measured"]
        print(f"{name:10} {r['batch']:>5} {'plain':>12} {r['predicted'] / mib:>9.1f} MiB"
              f" {r['measured'] / mib:>8.1f} MiB {err:>+7.1f}%")
        plan = f"recompute {r['recompute_stages']:<2}"
        if r["recompute_measured"]:
            err = 100.0 * (r["recompute_predicted"] - r["recompute_measured"]) / r["recompute_measured"]
            print(f"{'':10} {'':>5} {plan:>12} {r['recompute_predicted'] / mib:>9.1f} MiB"
                  f" {r['recompute_measured'] / mib:>8.1f} MiB {err:>+7.1f}%")
        else:
            print(f"{'':10} {'':>5} {plan:>12} {r['recompute_predicted'] / mib:>9.1f} MiB"
                  f" {'(no runtime)':>12}")


if __name__ == "__main__":
    main()
