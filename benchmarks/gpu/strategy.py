"""GPU command 3: the strategy end to end for a few steps with Lightning's TensorBoard
logger, each case against plain training from the same seed: fp32 at 50%, bf16-mixed at
50%, DynProg offloading at 60%, and ``remat_fsdp`` on one device. Each case checks that the
weights equal plain training's (to ``--atol``), that the logger wrote the plan's dashboards,
and that the planned step's CUDA peak is below the plain step's.

    python benchmarks/gpu/strategy.py            # under 9 minutes on one H100
    python benchmarks/gpu/strategy.py --dry-run  # the cases, without a GPU
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu import common  # noqa: E402
from benchmarks.gpu.common import Report, dry_run, lightning_model, parser  # noqa: E402

CASES = {
    "fp32 at 50%": {"budget": "50%", "precision": "32-true"},
    "bf16-mixed at 50%": {"budget": "50%", "precision": "bf16-mixed"},
    "dynprog offloading at 60%": {"budget": "60%", "precision": "32-true", "solver": "dynprog"},
    "remat_fsdp on one device at 50%": {"budget": "50%", "precision": "32-true", "fsdp": True},
}
STEPS = 4


def fit(root: Path, case: dict[str, Any], remat: bool) -> tuple[dict[str, Any], int]:
    """Train ``STEPS`` steps; the final weights (on the host) and the largest step peak
    after the first (``common.step_peak``)."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.strategies import ModelParallelStrategy

    from lightning_remat import RematStrategy
    from lightning_remat.lightning.fsdp import RematFSDPStrategy

    pl.seed_everything(0)
    fsdp = case.get("fsdp", False)
    model = lightning_model(shard=fsdp)
    if fsdp:
        strategy: Any = (RematFSDPStrategy(memory_budget=case["budget"], cache_dir=root / "cache") if remat
                         else ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    else:
        strategy = (RematStrategy(memory_budget=case["budget"], solver=case.get("solver", "auto"),
                                  cache_dir=root / "cache") if remat else "auto")
    peak = common.step_peak()
    trainer = pl.Trainer(strategy=strategy, accelerator="cuda", devices=1, max_steps=STEPS,
                         precision=case["precision"], default_root_dir=str(root), enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[peak])
    try:
        trainer.fit(model)
    finally:
        if fsdp and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu()
               for k, v in model.state_dict().items()}
    torch.cuda.empty_cache()
    return weights, peak.peak


def run_case(report: Report, name: str, case: dict[str, Any], atol: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            plain, plain_peak = fit(root / "plain", case, remat=False)
            remat, remat_peak = fit(root / "remat", case, remat=True)
        except Exception as exc:  # one case's failure is its FAIL line, the others still run
            report.check(name, False, f"{type(exc).__name__}: {str(exc)[:300]}")
            return
        diff = max(float((plain[k] - remat[k]).abs().max()) for k in plain)
        report.check(f"{name}: same weights as plain", diff <= atol, f"max abs difference {diff:.3g}",
                     max_abs_diff=diff)
        events = list((root / "remat").glob("lightning_logs/version_*/events.*"))
        report.check(f"{name}: TensorBoard dashboards written", bool(events), f"{len(events)} event files")
        report.check(f"{name}: peak below plain", remat_peak < plain_peak,
                     f"{remat_peak / 2**20:.0f} MiB vs plain {plain_peak / 2**20:.0f} MiB",
                     peak_bytes=remat_peak, plain_peak_bytes=plain_peak)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--atol", type=float, default=1e-5, help="largest weight difference from plain accepted")
    p.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES))
    args = p.parse_args(argv)
    report = Report("strategy")
    if args.dry_run:
        return dry_run(report, [f"{name}: {CASES[name]}, {STEPS} steps, against plain" for name in args.cases])
    if common.refuse_without_cuda(report):
        for name in args.cases:
            # bf16's rounding differs between a recomputed and a kept op only where
            # kernels differ; its weights are compared to bf16's own resolution.
            run_case(report, name, CASES[name], args.atol if "bf16" not in name else max(args.atol, 1e-2))
    report.write(args.out)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
