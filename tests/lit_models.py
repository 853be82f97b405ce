"""Small LightningModules on synthetic data for the strategy tests."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ConvNet(pl.LightningModule):
    """A CNN with BatchNorm and a residual add: activations of several MiB at batch 16."""

    def __init__(self, channels: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        c = channels
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                                   nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c))
        self.act = nn.ReLU()
        self.tail = nn.Sequential(*[m for _ in range(16) for m in (nn.Conv2d(c, c, 3, padding=1), nn.ReLU())])
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = self.act(h + self.block(h))
        h = self.tail(h)
        return self.head(h.mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def teardown(self, stage):
        # Spawned DDP ranks leave the process group together: a gloo rank that exits while the
        # other still holds the connection can abort it (SIGABRT after "Trainer.fit stopped").
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def loaders(n: int = 64, batch_size: int = 16, size: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    ds = TensorDataset(x, y)
    return DataLoader(ds, batch_size=batch_size), DataLoader(ds, batch_size=batch_size)


def trainer_kwargs(tmp_path, **extra):
    kwargs = dict(
        default_root_dir=str(tmp_path), accelerator="cpu", devices=1, max_epochs=2,
        enable_progress_bar=False, enable_model_summary=False, logger=False,
        enable_checkpointing=False, deterministic=True,
    )
    kwargs.update(extra)
    return kwargs


class FlaggedConvNet(ConvNet):
    """A forward with a Python flag that training_step alternates (a non-tensor argument)."""

    def forward(self, x: torch.Tensor, residual: bool = True) -> torch.Tensor:
        h = self.stem(x)
        h = self.act(h + self.block(h)) if residual else self.act(self.block(h))
        h = self.tail(h)
        return self.head(h.mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x, residual=batch_idx % 2 == 0), y)
        self.log("train_loss", loss)
        return loss
