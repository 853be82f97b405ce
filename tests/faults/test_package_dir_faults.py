"""No run writes into the package directory, even from a checkout's root, where Lightning's
default root (the working directory) holds the package's own folder."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lightning_remat

PACKAGE = Path(lightning_remat.__file__).resolve().parent
ROOT = PACKAGE.parent


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
def test_fit_remat_and_the_cli_from_a_checkout_root_write_nothing_into_the_package(tmp_path):
    checkout = tmp_path / "checkout"  # the layout of a clone: the package folder under the root
    shutil.copytree(PACKAGE, checkout / "lightning_remat",
                    ignore=shutil.ignore_patterns("__pycache__", "*.sqlite", "*.db"))
    shutil.copytree(ROOT / "tests", checkout / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    before = _files(checkout / "lightning_remat")
    script = textwrap.dedent("""
        import pytorch_lightning as pl, torch
        import lightning_remat
        from lightning_remat.cli import main
        from tests.lit_models import ConvNet, loaders

        trainer = pl.Trainer(strategy=lightning_remat.RematStrategy(memory_budget="60%"),
                             accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=1,
                             logger=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(ConvNet(), loaders()[0])  # default_root_dir: the working directory
        lightning_remat.remat(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
                              torch.randn(4, 8), memory_budget=None)
        assert main(["tune", "tests.faults.test_package_dir_faults:tiny", "--input-shape", "8",
                     "--budget", "1MiB", "--solver", "plain", "--max-val", "8",
                     "--steps-per-trial", "1", "--no-plain", "--no-progress"]) == 0
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=checkout, capture_output=True,
                          text=True, env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _files(checkout / "lightning_remat") == before
    written = _files(checkout / "lightning_remat_cache")
    assert {"plans.sqlite", "batch_size.db"} <= written, written


def tiny():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_gitignore_covers_what_runs_write():
    ignored = (ROOT / ".gitignore").read_text().split()
    for pattern in ("*.sqlite", "*.db", "*.ckpt", "lightning_remat_cache/", "lightning_logs/"):
        assert pattern in ignored, pattern
