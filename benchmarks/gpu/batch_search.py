"""GPU command 4: the batch-size search on CUDA, with a byte budget and with none (the free
memory: trials past the device's capacity run out of memory for real). Each search's size
then trains a few steps: within the byte budget, and without running out of memory.

    python benchmarks/gpu/batch_search.py            # under 9 minutes on one H100
    python benchmarks/gpu/batch_search.py --dry-run  # the searches, without a GPU
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu import common  # noqa: E402
from benchmarks.gpu.common import Report, dry_run, lightning_model, parser  # noqa: E402

SEARCHES = {"byte budget 4GiB": "4GiB", "no budget (free memory, real OOMs)": None}


def search(report: Report, name: str, budget: str | None, max_val: int) -> None:
    import pytorch_lightning as pl
    import torch

    from lightning_remat import RematStrategy, find_max_batch_size
    from lightning_remat.budget import Budget

    with tempfile.TemporaryDirectory() as tmp:
        try:
            model = lightning_model(width=4096, depth=8, batch_size=256)
            trainer = pl.Trainer(strategy=RematStrategy(memory_budget=budget), accelerator="cuda", devices=1,
                                 max_steps=3, default_root_dir=tmp, enable_checkpointing=False,
                                 enable_progress_bar=False)
            found = find_max_batch_size(trainer, model, init_val=256, max_val=max_val, steps_per_trial=2)
            print(found.table())
        except Exception as exc:
            report.check(name, False, f"{type(exc).__name__}: {str(exc)[:300]}")
            return
        report.check(f"{name}: a size found", found.batch_size > 0, f"batch size {found.batch_size}",
                     batch_size=found.batch_size)
        peak_of = common.step_peak()
        try:
            trainer = pl.Trainer(strategy=RematStrategy(memory_budget=budget), accelerator="cuda", devices=1,
                                 max_steps=3, default_root_dir=tmp, enable_checkpointing=False,
                                 enable_progress_bar=False, callbacks=[peak_of])
            trainer.fit(model)
        except Exception as exc:
            report.check(f"{name}: trains at the size found", False, f"{type(exc).__name__}: {str(exc)[:300]}")
            return
        # What a budget bounds: a step's peak above what is resident when it begins.
        peak = peak_of.peak
        limit = Budget(budget).resolve(free_memory=lambda: torch.cuda.mem_get_info()[1])
        report.check(f"{name}: trains at the size found within the budget", peak <= limit,
                     f"peak {peak / 2**30:.2f} GiB, budget {limit / 2**30:.2f} GiB", peak_bytes=peak)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--max-val", type=int, default=1 << 17, help="the largest batch size tried")
    p.add_argument("--searches", nargs="*", choices=list(SEARCHES), default=list(SEARCHES))
    args = p.parse_args(argv)
    report = Report("batch_search")
    if args.dry_run:
        return dry_run(report, [f"{name}: find_max_batch_size up to {args.max_val}, then 3 steps"
                                for name in args.searches])
    if common.refuse_without_cuda(report):
        for name in args.searches:
            search(report, name, SEARCHES[name], args.max_val)
    report.write(args.out)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
