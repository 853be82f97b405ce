"""The distributed row: the GPT of ``benchmarks/models.py`` on 2 ranks under torch FSDP2.

Two processes (gloo on the CPU, NCCL on CUDA) train the GPT with every ``Block`` and the
model each a ``fully_shard`` unit, as ``RematFSDPStrategy`` expects it, in four ways:

- ``plain FSDP``;
- ``remat_fsdp`` at 50% and 75% of plain FSDP's per-rank peak: the planner inside the
  sharded model exactly as ``RematFSDPStrategy`` runs it (a new input planned in a forward
  pre-hook ahead of FSDP's, every rank profiling together, rank zero solving, every rank
  running rank zero's plan);
- ``activation_checkpointing_policy={Block}``: what Lightning's policy does, torch's
  ``apply_activation_checkpointing`` with ``checkpoint_wrapper`` on every ``Block``, then
  ``fully_shard``.

For each: the per-rank peak of one step (:func:`lightning_remat.measure.peak.peak_bytes` on each rank,
the larger of the two), the median step time as a ratio to plain FSDP's (measured in the same
processes), and the largest batch per rank whose measured peak stays within plain FSDP's
per-rank peak at the base batch (doubling, then bisecting to ``--granularity``; for
``remat_fsdp`` every size is planned for that peak as an absolute budget). Results go to
``benchmarks/results/distributed/<tag>.json``; :func:`render_section` turns them into the
"Distributed" section of ``benchmarks/RESULTS.md`` (``benchmarks/render.py`` calls it).

    python benchmarks/distributed.py            # about 5 minutes on a 2-core CPU
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "distributed"
MiB = 2**20
METHODS = ["plain", "remat:50%", "remat:75%", "policy:Block"]
LABELS = {"plain": "plain FSDP", "remat:50%": "remat_fsdp 50%", "remat:75%": "remat_fsdp 75%",
          "policy:Block": "activation_checkpointing_policy={Block}"}


def _build(method: str, batch: int, args: argparse.Namespace, budget: Any) -> tuple[Any, Any, Any]:
    """(model, optimizer, planner or None): a fresh sharded GPT for ``method``."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from benchmarks.models import GPT, Block

    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, width=args.width, depth=args.depth, heads=args.heads, context=args.context)
    if method.startswith("policy:"):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: isinstance(m, Block))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    planner = None
    if method.startswith("remat:"):
        from lightning_remat.messages import DistributedRanks
        from lightning_remat.planner import Planner, PlanSettings

        planner = Planner(model, PlanSettings(budget, profile_repeats=1), ranks=DistributedRanks())
        original = model.forward

        @functools.wraps(type(model).forward)
        def forward(self: Any, *a: Any, **k: Any) -> Any:
            return original(*a, **k) if planner.busy else planner(*a, **k)

        def plan_first(unit: Any, a: tuple, k: dict) -> None:  # as RematFSDPStrategy does
            if not planner.busy and torch.is_grad_enabled():
                planner.planned_for(a, k)

        model.forward = types.MethodType(forward, model)
        model.register_forward_pre_hook(plan_first, prepend=True, with_kwargs=True)
    return model, optimizer, planner


def _measure(method: str, batch: int, args: argparse.Namespace, budget: Any, steps: int) -> dict[str, Any]:
    """Per-rank peak (max over ranks) and median step time of ``steps`` timed steps."""
    import torch
    import torch.distributed as dist

    from benchmarks.models import lm_loss
    from lightning_remat.errors import RematInfeasibleError
    from lightning_remat.measure.peak import peak_bytes

    model, optimizer, planner = _build(method, batch, args, budget)
    g = torch.Generator().manual_seed(dist.get_rank())
    idx = torch.randint(0, args.vocab, (batch, args.context), generator=g)
    targets = torch.randint(0, args.vocab, (batch, args.context), generator=g)

    def step() -> None:
        lm_loss(model(idx), targets).backward()

    try:
        step()  # the first step plans (remat) and warms up
    except RematInfeasibleError as exc:
        return {"feasible": False, "reason": str(exc)}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step()
    optimizer.step()  # optimizer state exists: resident before the measured step
    optimizer.zero_grad(set_to_none=True)
    peak = peak_bytes(step, torch.device("cpu"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    worst = torch.tensor([peak], dtype=torch.int64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    out = {"feasible": True, "peak_bytes": int(worst.item()), "seconds": statistics.median(seconds) if seconds else None}
    if planner is not None and planner.last is not None:
        plan = planner.last.plan
        out["plan"] = [[s.action, len(s.nodes)] for s in plan.stages]
        out["predicted_peak_bytes"] = plan.predicted_peak_bytes
    return out


def _largest_batch(method: str, args: argparse.Namespace, cap: int) -> int | None:
    """The largest batch per rank whose measured per-rank peak is within ``cap``."""
    def fits(b: int) -> bool:
        budget = cap if method.startswith("remat:") else None
        result = _measure(method, b, args, budget, steps=0)
        return result["feasible"] and result["peak_bytes"] <= cap

    low, high = 0, None
    b = args.batch
    while high is None and b <= args.max_batch:
        if fits(b):
            low, b = b, b * 2
        else:
            high = b
    if high is None:
        return low or None
    while high - low > args.granularity:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low or None


def _rank_main(rank: int, args: argparse.Namespace, out_path: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        rows: dict[str, dict[str, Any]] = {}
        if args.resume and Path(out_path).exists():  # the figures a run cut short kept
            rows = json.loads(Path(out_path).read_text())

        def keep() -> None:  # after every figure, so a run cut short keeps what it measured
            if rank == 0:
                Path(out_path).write_text(json.dumps(rows))

        if "plain" not in rows:
            rows["plain"] = _measure("plain", args.batch, args, None, args.steps)
        plain = rows["plain"]
        for method in METHODS[1:]:
            if method not in rows:
                budget = method.partition(":")[2] if method.startswith("remat:") else None
                rows[method] = _measure(method, args.batch, args, budget, args.steps)
                keep()
        if not args.no_largest:
            for method in METHODS:
                if rows[method].get("largest_batch") is None:
                    rows[method]["largest_batch"] = _largest_batch(method, args, plain["peak_bytes"])
                    keep()
    finally:
        dist.barrier()
        dist.destroy_process_group()


def render_section(results: Path = RESULTS) -> list[str]:
    """The "Distributed" section of RESULTS.md (empty without results)."""
    files = sorted(results.glob("*.json")) if results.is_dir() else []
    out: list[str] = []
    for path in files:
        record = json.loads(path.read_text())
        rows = record["rows"]
        plain = rows["plain"]
        out += [f"## distributed: {record['model']} on {record['world_size']} ranks ({path.stem})", "",
                f"{record['machine']}, {record['backend']}, torch {record['torch']}, measured {record['date']} "
                f"at commit {record['commit']}. Batch {record['batch']} per rank, {record['context']} tokens; "
                "torch FSDP2 (`fully_shard` on every Block and on the model). Peak: the larger of the two "
                "ranks' step peaks; largest batch: per rank, within plain FSDP's per-rank peak "
                f"({plain['peak_bytes'] / MiB:.1f} MiB), to {record['granularity']} samples.", "",
                "| method | per-rank peak MiB | peak/plain | time/plain | largest batch per rank |",
                "|---|---|---|---|---|"]
        for method in METHODS:
            row = rows.get(method)
            if row is None:
                continue
            if not row.get("feasible"):
                out.append(f"| {LABELS[method]} | infeasible: {row.get('reason', '')[:80]} | | | |")
                continue
            largest = row.get("largest_batch", "-")
            if largest == record.get("max_batch"):
                largest = f">= {largest} (the largest tried)"
            out.append(f"| {LABELS[method]} | {row['peak_bytes'] / MiB:.1f} | "
                       f"{row['peak_bytes'] / plain['peak_bytes']:.2f} | {row['seconds'] / plain['seconds']:.2f} | "
                       f"{largest} |")
        out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    import subprocess

    import torch
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tag", default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--granularity", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=128)
    p.add_argument("--no-largest", action="store_true")
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--resume", action="store_true", help="keep the figures a run cut short measured")
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS / f".{args.tag}.rows.json"
    started = time.time()
    if not args.resume:
        tmp.unlink(missing_ok=True)
    mp.spawn(_rank_main, args=(args, str(tmp)), nprocs=2)
    rows = json.loads(tmp.read_text())
    tmp.unlink()
    print(f"measured in {time.time() - started:.0f} s")
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    record = {
        "model": "gpt", "world_size": 2, "backend": "gloo", "batch": args.batch, "context": args.context,
        "shape": {"vocab": args.vocab, "width": args.width, "depth": args.depth, "heads": args.heads},
        "granularity": args.granularity, "max_batch": args.max_batch, "commit": commit + ("+dirty" if dirty else ""),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores", "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_seconds": round(time.time() - started), "rows": rows,
    }
    (RESULTS / f"{args.tag}.json").write_text(json.dumps(record, indent=1) + "\n")
    print("\n".join(render_section()))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
