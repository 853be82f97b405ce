"""Predicted against measured peak on every transformers architecture of
``tests/hf_architectures.py`` with its config's defaults (the cache, the attention
implementation and dropout as shipped; random init, small sizes, a padded batch with an
attention mask and labels -100 on the padding), captured by ``torch.export`` op by op.

For each model, in a fresh subprocess: one plain step of the model itself is measured with
``peak_bytes`` (gradients set to None, so the step allocates them as a first step does);
the model is captured and profiled as the planner does (its cache off in the calls); then
the captured graph runs plans of 1 (plain), 2, 4 and 8 equal segments, all but the last
recomputed, each measured the same way and predicted by the simulator
(``Plan.predicted_peak_bytes``, without the plan's margin).

    python benchmarks/prediction_transformers.py                 # every architecture
    python benchmarks/prediction_transformers.py --models gpt2 llama t5

Results go to ``benchmarks/results/prediction/transformers-<tag>.json``.
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

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "prediction"
SEGMENTS = (1, 2, 4, 8)
BATCH, LENGTH = 8, 128
MiB = 2**20


def worker(model_type: str) -> dict:
    import warnings

    import torch

    sys.path.insert(0, str(ROOT))
    from lightning_remat.graph.calls import cache_configs, caches_off
    from lightning_remat.graph.profile import profile_module
    from lightning_remat.graph.trace import trace_module
    from lightning_remat.measure.peak import peak_bytes
    from lightning_remat.runtime.module import apply_plan
    from lightning_remat.solvers.scoring import make_plan
    from tests.hf_architectures import build

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, call = build(model_type, batch=BATCH, length=LENGTH)

    class Loss(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs).loss

    wrapped = Loss(model).train()

    def clear() -> None:
        for p in wrapped.parameters():
            p.grad = None

    result: dict = {"model": model_type, "batch": BATCH, "length": LENGTH, "plans": []}
    with caches_off(cache_configs(wrapped)):
        def step() -> None:
            wrapped(**call).backward()

        step()
        clear()
        result["plain_measured"] = peak_bytes(step)
        clear()
        traced = trace_module(wrapped, (), call)
        graph = profile_module(wrapped, (), loss_fn=lambda out: out, warmup=1, repeats=1, traced=traced,
                               example_kwargs=call)
        result["vertices"] = len(graph)
        ids = graph.ids
        for segments in SEGMENTS:
            size = max(1, math.ceil(len(ids) / segments))
            chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
            plan = make_plan(graph, [(c, "recompute") for c in chunks[:-1]] + [(chunks[-1], "keep")],
                             f"{segments} segments")
            planned = apply_plan(traced.gm, plan, root=wrapped, charge=traced.charge, graph=graph)

            def planned_step(planned=planned) -> None:
                out = planned(**call)
                (out[0] if isinstance(out, tuple) else out).backward()

            planned_step()
            clear()
            measured = peak_bytes(planned_step)
            clear()
            result["plans"].append({"segments": segments, "recomputed": len(chunks) - 1,
                                    "predicted": plan.predicted_peak_bytes, "measured": measured})
    return result


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from tests.hf_architectures import ARCHITECTURES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=list(ARCHITECTURES))
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    import torch
    import transformers

    rows, errors = [], []
    print(f"{'model':<13}{'vertices':>9}{'eager MiB':>11}  " + "  ".join(f"{s} seg: pred/meas MiB (err)" for s in SEGMENTS))
    for name in args.models:
        run = subprocess.run([sys.executable, __file__, "--worker", name], capture_output=True, text=True,
                             cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=900)
        if run.returncode != 0:
            print(f"{name:<13} failed: {run.stderr.strip().splitlines()[-1][:160] if run.stderr.strip() else run.returncode}")
            rows.append({"model": name, "error": run.stderr[-2000:]})
            continue
        row = json.loads(run.stdout.strip().splitlines()[-1])
        rows.append(row)
        cells = []
        for plan in row["plans"]:
            err = 100 * (plan["predicted"] - plan["measured"]) / plan["measured"]
            errors.append(err)
            cells.append(f"{plan['predicted'] / MiB:7.2f}/{plan['measured'] / MiB:7.2f} ({err:+5.1f}%)")
        print(f"{name:<13}{row['vertices']:>9}{row['plain_measured'] / MiB:>11.2f}  " + "  ".join(cells), flush=True)
    if errors:
        under = sum(e < -1 for e in errors)
        within = sum(abs(e) <= 3 for e in errors)
        print(f"{len(errors)} plans: {within} within 3%, {under} predicted more than 1% under the measured "
              f"peak; worst under {min(errors):+.1f}%, worst over {max(errors):+.1f}%")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"transformers-{args.tag}.json"
    out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__,
        "transformers": transformers.__version__, "rows": rows}, indent=1))
    print(f"written {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
