"""What the four GPU commands share: a PASS/FAIL line per check, a time limit per part, and
one JSON file of results per command (with the device and the date), under
``benchmarks/results/gpu/``.

Each command is ``python benchmarks/gpu/<name>.py`` on a machine with one CUDA device; each
runs in under 9 minutes on one H100 (its parts have time limits that add up to less).
``--dry-run`` lists the parts and checks the arguments without a GPU (the test suite runs it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parents[1] / "results" / "gpu"
LIMIT_SECONDS = 9 * 60
"""The most one command may take on one H100."""


@dataclass
class Report:
    """The checks of one command, printed as they end and written as JSON at the end."""

    command: str
    checks: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def check(self, name: str, passed: bool, detail: str = "", **figures: Any) -> bool:
        """Record and print one ``PASS name: detail`` or ``FAIL name: detail`` line."""
        self.checks.append({"name": name, "passed": bool(passed), "detail": detail, **figures})
        print(f"{'PASS' if passed else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
        return bool(passed)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c["passed"] for c in self.checks)

    def write(self, out: Path | None = None) -> Path:
        """Write the JSON (device, date, seconds, checks) and print where it went."""
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        now = datetime.datetime.now(datetime.timezone.utc)
        path = out or RESULTS / f"{self.command}-{now:%Y%m%d-%H%M%S}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"command": self.command, "device": device, "date": now.isoformat(timespec="seconds"),
                  "torch": torch.__version__, "seconds": round(time.monotonic() - self.started, 1),
                  "passed": self.passed, "checks": self.checks}
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{'PASS' if self.passed else 'FAIL'} {self.command}: {len(self.checks)} checks, "
              f"results in {path}", flush=True)
        return path


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dry-run", action="store_true", help="list the parts and exit (no GPU needed)")
    p.add_argument("--out", type=Path, help="the JSON file (default: benchmarks/results/gpu/<command>-<date>.json)")
    return p


def refuse_without_cuda(report: Report) -> bool:
    """False (after a FAIL line) when there is no CUDA device to run on."""
    import torch

    return torch.cuda.is_available() or report.check("cuda device", False, "no CUDA device: run this on a GPU")


def run_part(report: Report, name: str, argv: list[str], seconds: float, env: dict[str, str] | None = None,
             cwd: Path = ROOT) -> subprocess.CompletedProcess | None:
    """Run ``argv`` (a Python command: the interpreter is prepended) within ``seconds``; a
    non-zero status or the time limit is a FAIL line. Its output is echoed."""
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=seconds,
                              env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        print(out[-4000:])
        report.check(name, False, f"over its limit of {seconds:.0f} s")
        return None
    print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n")
    report.check(name, proc.returncode == 0, f"status {proc.returncode} in {time.monotonic() - started:.0f} s")
    return proc


def dry_run(report: Report, parts: list[str]) -> int:
    for part in parts:
        print(f"would run: {part}")
    print(f"{report.command}: {len(parts)} parts; dry run, nothing measured")
    return 0


def lightning_model(width: int = 1024, depth: int = 12, batch_size: int = 8192, shard: bool = False) -> Any:
    """A residual MLP LightningModule (LayerNorm, Linear, GELU, Linear per block) whose
    activations dominate its memory (the defaults: a batch of 8192 rows through 1024-wide
    layers; a wide model at a small batch is bound by its gradients, which no plan frees); ``shard``: each block and the root ``fully_shard``-ed in
    ``configure_model``. Seeded: two instances are equal."""
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.fc1, self.act, self.fc2 = (nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(),
                                                       nn.Linear(width, width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(self.act(self.fc1(self.norm(x))))

    class ResidualMLP(pl.LightningModule):
        def __init__(self, batch_size: int = batch_size) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.batch_size = batch_size
            self.blocks = nn.Sequential(*[Block() for _ in range(depth)])
            self.head = nn.Linear(width, 16)

        def configure_model(self) -> None:
            if shard:
                from torch.distributed.fsdp import fully_shard

                for block in self.blocks:
                    fully_shard(block, mesh=self.device_mesh["data_parallel"])
                fully_shard(self, mesh=self.device_mesh["data_parallel"])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            n = 8 * self.batch_size
            data = TensorDataset(torch.randn(n, width, generator=g), torch.randint(0, 16, (n,), generator=g))
            return DataLoader(data, batch_size=self.batch_size)

    return ResidualMLP()


def step_peak() -> Any:
    """A callback whose ``peak`` is the largest CUDA peak of a training step after the first
    (the first plans), in bytes, above what was allocated when the step began (parameters,
    optimizer state, the batch), up to the optimizer's update: what a budget bounds."""
    import pytorch_lightning as pl
    import torch

    class StepPeak(pl.Callback):
        def __init__(self) -> None:
            self.peak = 0
            self.base = 0

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()

        def on_before_optimizer_step(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step >= 1:
                self.peak = max(self.peak, torch.cuda.max_memory_allocated() - self.base)

    return StepPeak()
