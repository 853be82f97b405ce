"""Against the checkpointing users already have: timm's ``set_grad_checkpointing(True)`` and
Hugging Face's ``gradient_checkpointing_enable()``, and ``remat`` with the budget set to the
peer's measured peak, in the same harness and the same run.

Models: the zoo's timm ViT, Swin and EfficientNet (tests/test_zoo_vision.py, random init)
and a GPT-2 (4 layers, ``n_embd`` 256, 256 tokens, batch 2). Harness as in
``benchmarks/run.py``: every figure from a fresh process; the peak is one step's peak above
what was live before it (``lightning_remat.measure.peak.peak_bytes``, gradients freed before the
step so allocating them is part of it); the time is the median of ``--repeats`` steps after
a warm-up, alternating with plain steps in the same process (*time/plain* is the ratio of
the medians). Our smallest feasible budget is ``min_budget(graph, "auto")`` on the graph
``remat`` profiled.

    python benchmarks/peers_checkpointing.py            # every model; prints the table
    python benchmarks/peers_checkpointing.py --models vit gpt2

Results go to ``benchmarks/results/peers/<tag>.json``; ``benchmarks/render.py`` puts their
table in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "peers"
MiB = 2**20
MODELS = ("vit", "swin", "efficientnet", "gpt2")
PEER = {"vit": "timm set_grad_checkpointing", "swin": "timm set_grad_checkpointing",
        "efficientnet": "timm set_grad_checkpointing", "gpt2": "HF gradient_checkpointing_enable"}


def capture_of(notes: list[str]) -> str:
    """How the planner captured the forward, from its plan's note ("capture: torch.fx, 71
    vertices": ``torch.fx``, ``torch.export (non-strict)``, or the submodule fallback)."""
    for note in notes:
        found = re.match(r"capture: (.+?), \d+ vertices", note)
        if found:
            return found.group(1)
    return "unknown"


def build(name: str) -> tuple[Any, Any]:
    """(model, input), seeded, in training mode."""
    import torch

    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=256, vocab_size=2000,
                            use_cache=False)
        model, x = GPT2LMHeadModel(config), torch.randint(0, 2000, (2, 256))
    else:
        sys.path.insert(0, str(ROOT))
        from tests.test_zoo_vision import ZOO

        model, x = ZOO[name]()
    return model.train(), x


def step_loss(out: Any) -> Any:
    """The sum of the logits (a Hugging Face output's ``logits``, a tensor's own)."""
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
    return logits.float().sum()


def measure(name: str, method: str, budget: int | None, repeats: int) -> dict[str, Any]:
    """``method``: ``peer`` (the plain step's peak is measured here too) or ``remat`` at
    ``budget`` bytes."""
    import torch

    import lightning_remat
    from lightning_remat.measure.peak import peak_bytes
    from lightning_remat.solvers import min_budget

    model, x = build(name)
    row: dict[str, Any] = {}
    run = model
    if method == "peer":
        import copy

        def plain_only() -> None:
            torch.manual_seed(1)
            step_loss(model(x)).backward()

        plain_only()
        model.zero_grad(set_to_none=True)
        row["plain_peak_bytes"] = peak_bytes(plain_only)
        run = copy.deepcopy(model)  # the switch is on the model: plain steps need one without
        if name == "gpt2":
            run.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            run.set_grad_checkpointing(True)
    else:
        start = time.perf_counter()
        try:
            run = lightning_remat.remat(model, x, memory_budget=budget, loss_fn=step_loss)
            graph = run.graph
        except lightning_remat.RematInfeasibleError as refused:
            return {"infeasible": True, "min_budget_bytes": refused.min_budget_bytes,
                    "planning_seconds": time.perf_counter() - start}
        row.update(planning_seconds=time.perf_counter() - start, vertices=len(graph),
                   capture=capture_of(run.plan.notes),
                   min_budget_bytes=min_budget(graph, "auto"), budget_bytes=run.budget_bytes,
                   recomputed=run.plan.count("recompute"))

    def step() -> None:
        torch.manual_seed(1)
        step_loss(run(x)).backward()

    def plain_step() -> None:
        torch.manual_seed(1)
        step_loss(model(x)).backward()

    step()
    for p in list(run.parameters()) + list(model.parameters()):
        p.grad = None
    row["peak_bytes"] = peak_bytes(step)
    times: dict[Any, list[float]] = {plain_step: [], step: []}
    for _ in range(repeats):
        for fn, spent in times.items():
            for p in list(run.parameters()) + list(model.parameters()):
                p.grad = None
            t0 = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - t0)
    row["step_seconds"] = statistics.median(times[step])
    row["plain_step_seconds"] = statistics.median(times[plain_step])
    return row


def spawn(name: str, method: str, budget: int | None, repeats: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", name, method, str(budget or 0), str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=900)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]}


def table(record: dict[str, Any]) -> list[str]:
    """The Markdown table of one run."""
    out = ["| model | peer | plain peak MiB | peer peak MiB (/plain) | our smallest budget MiB (/plain) "
           "| our peak at the peer's peak MiB (/plain) | peer time/plain | our time/plain "
           "| our capture, vertices |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, rows in record["rows"].items():
        peer, ours = rows.get("peer", {}), rows.get("remat", {})
        if "peak_bytes" not in peer:
            out.append(f"| {name} | {PEER[name]} | peer failed: {peer.get('error', '')} | | | | | | |")
            continue
        plain = peer["plain_peak_bytes"]

        def mib(b: float, plain: int = plain) -> str:
            return f"{b / MiB:.1f} ({b / plain:.2f})"

        least = mib(ours["min_budget_bytes"]) if "min_budget_bytes" in ours else "-"
        if "peak_bytes" in ours:
            our_peak = mib(ours["peak_bytes"])
            our_time = f"{ours['step_seconds'] / ours['plain_step_seconds']:.2f}"
            capture = f"{ours['capture']}, {ours['vertices']}"
        else:
            our_peak = "infeasible" if ours.get("infeasible") else f"error: {ours.get('error', '')}"
            our_time, capture = "-", "-"
        out.append(f"| {name} | {PEER[name]} | {plain / MiB:.1f} | {mib(peer['peak_bytes'])} | {least} | "
                   f"{our_peak} | {peer['step_seconds'] / peer['plain_step_seconds']:.2f} | {our_time} | "
                   f"{capture} |")
    return out


def render_section(results: Path = RESULTS) -> list[str]:
    """The section of RESULTS.md (empty without results)."""
    out: list[str] = []
    for path in sorted(results.glob("*.json")) if results.is_dir() else []:
        record = json.loads(path.read_text())
        out += [f"## Against timm and Hugging Face checkpointing ({path.stem})", "",
                f"{record['machine']}, torch {record['torch']}, measured {record['date']} at commit "
                f"{record['commit']} by `benchmarks/peers_checkpointing.py`"
                + (f" ({record['seconds']:.0f} s)" if "seconds" in record else "")
                + (f"; {record['note']}" if record.get("note") else "") + ". "
                "Each peer's measured peak is the budget of `remat` (solver `auto`), measured in the "
                "same run and harness; ratios in brackets are to the plain step's peak, times are "
                "to plain steps alternated in the same process.", "", *table(record), ""]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tag", default="cpu")
    args = p.parse_args(argv)
    import torch

    from benchmarks.run import git_commit

    started = time.time()
    record: dict[str, Any] = {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores", "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(allow_dirty=True), "rows": {}}
    for name in args.models:
        peer = spawn(name, "peer", None, args.repeats)
        rows = record["rows"][name] = {"peer": peer}
        if "peak_bytes" in peer:
            rows["remat"] = spawn(name, "remat", peer["peak_bytes"], args.repeats)
        print(name, json.dumps(rows), flush=True)
        # Written after each model: a run cut short keeps what it measured.
        record["seconds"] = time.time() - started
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.tag}.json").write_text(json.dumps(record, indent=1))
    print("\n".join(render_section()))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        name, method, budget, repeats = sys.argv[2:6]
        print(json.dumps(measure(name, method, int(budget) or None, int(repeats))))
        raise SystemExit(0)
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
