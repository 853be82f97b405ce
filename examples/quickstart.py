"""Quickstart: train a small CNN on synthetic images with Trainer(strategy="remat").

Runs on CPU in well under a minute. It trains the same model twice from the same seed,
plainly and within half of the plain step's peak memory, then shows the plan, the measured
peak of one step of each, and that the weights agree.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_remat
from lightning_remat.budget import format_bytes
from lightning_remat.measure.peak import peak_bytes


class SmallCNN(pl.LightningModule):
    """Twelve conv blocks with BatchNorm, in-place ReLU and dropout: the traps of recomputation."""

    def __init__(self, channels: int = 16, depth: int = 12) -> None:
        super().__init__()
        c = channels
        layers: list[nn.Module] = [nn.Conv2d(3, c, 3, padding=1)]
        for _ in range(depth):
            layers += [nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers, nn.Dropout(0.1))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 48, 48, generator=g), torch.randint(0, 10, (64,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def train(strategy, root: Path, logger=False) -> SmallCNN:
    pl.seed_everything(0, workers=True)
    model = SmallCNN()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2,
                         default_root_dir=str(root), logger=logger, enable_checkpointing=False,
                         enable_model_summary=False, deterministic=True, log_every_n_steps=1)
    trainer.fit(model, data())
    return model


def main() -> int:
    logging.getLogger("lightning_remat").setLevel(logging.INFO)
    root = Path("lightning_logs") / "quickstart"
    print(f"lightning-remat {lightning_remat.__version__}, torch {torch.__version__}, CPU")
    plain = train("auto", root / "plain")
    strategy = lightning_remat.RematStrategy(memory_budget="50%", cache_dir=root / "cache")
    # With a TensorBoard logger the strategy adds the memory dashboards by itself.
    tensorboard = TensorBoardLogger(str(root), name="tensorboard")
    remat = train(strategy, root / "remat", logger=tensorboard)

    (entry,) = strategy.planner.planned.values()
    x = next(iter(data()))[0]
    plain.train(), remat.train()
    plain_peak = peak_bytes(lambda: plain(x).sum().backward())
    remat_peak = peak_bytes(lambda: entry.module(x).sum().backward())
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain.state_dict().values(),
                                                               remat.state_dict().values()))
    print()
    print(f"measured peak of one step, plain : {format_bytes(plain_peak)}")
    print(f"measured peak of one step, remat : {format_bytes(remat_peak)} "
          f"(budget {format_bytes(entry.budget_bytes)}, predicted {format_bytes(entry.plan.predicted_peak_bytes)})")
    print(f"memory saved                     : {100 * (1 - remat_peak / plain_peak):.0f}%")
    print(f"weights equal to plain training  : {same}")
    print(f"TensorBoard logs                 : {tensorboard.log_dir}  "
          f"(tensorboard --logdir {tensorboard.log_dir}, or lightning-remat report {tensorboard.log_dir})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
