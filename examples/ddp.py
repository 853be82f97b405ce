"""Data-parallel training within a memory budget: strategy="remat_ddp" on two CPU processes.

Rank zero profiles and plans; every rank applies the same plan (the summary is logged once).

    python examples/ddp.py
    python examples/ddp.py --accelerator gpu --devices 4 --budget 60%
"""

from __future__ import annotations

import argparse
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_remat import RematDDPStrategy


class DeepCNN(pl.LightningModule):
    def __init__(self, channels: int = 16, depth: int = 12) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1)]
        for _ in range(depth):
            layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, 10)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="50%")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    args = p.parse_args()
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    backend = "gloo" if args.accelerator == "cpu" else "nccl"
    strategy = RematDDPStrategy(memory_budget=args.budget, start_method="spawn", process_group_backend=backend)
    trainer = pl.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices,
                         max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(DeepCNN(), DataLoader(TensorDataset(x, y), batch_size=8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
