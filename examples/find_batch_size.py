"""Find the largest batch that trains within a memory budget, plain and with rematerialization.

Runs on CPU in about a minute: a small residual CNN on 32 px random images, a 24 MiB budget
for one training step's activations. The search is an Optuna study stored in SQLite under
``--root-dir`` (a fresh temporary folder by default); run it again with the same folder and
it resumes instead of starting over.

    python examples/find_batch_size.py [--budget 24MiB] [--root-dir DIR] [--solver auto]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_remat
from lightning_remat import RematStrategy


class ResidualCNN(pl.LightningModule):
    """Six residual blocks at full resolution: activations grow with the batch, the
    parameters do not, which is the case rematerialization helps with."""

    def __init__(self, batch_size: int = 4, channels: int = 16, blocks: int = 6) -> None:
        super().__init__()
        self.batch_size = batch_size
        c = channels
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                          nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c))
            for _ in range(blocks)
        )
        self.act = nn.ReLU()
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = self.act(h + block(h))
        return self.head(h.mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (256,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="24MiB")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--root-dir", default=None)
    parser.add_argument("--max-val", type=int, default=1024)
    args = parser.parse_args()
    torch.manual_seed(0)
    root = args.root_dir or tempfile.mkdtemp(prefix="find_batch_size_")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, default_root_dir=root, logger=False,
        enable_checkpointing=False, enable_model_summary=False,
        # offload=False: on a CPU there is no device memory to offload from.
        strategy=RematStrategy(memory_budget=args.budget, solver=args.solver, profile_steps=1, offload=False),
    )
    model = ResidualCNN()
    started = time.perf_counter()
    report = lightning_remat.find_max_batch_size(
        trainer, model, init_val=4, max_val=args.max_val, steps_per_trial=2,
    )
    print()
    print(report.table())
    print(f"\nsearch took {time.perf_counter() - started:.1f} s; study in {root}/lightning_remat_cache/batch_size.db;"
          f" model.batch_size is now {model.batch_size}")


if __name__ == "__main__":
    main()
