"""A torchvision ResNet trained with Trainer(strategy="remat") on synthetic images.

Needs the `vision` extra (pip install 'lightning-remat[vision]').

    python examples/resnet.py --arch resnet18 --budget 75%
    python examples/resnet.py --accelerator gpu --arch resnet50 --image-size 224 --batch 64 --budget 8GiB
"""

from __future__ import annotations

import argparse
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_remat import RematStrategy

try:
    import torchvision
except ImportError:
    sys.exit("examples/resnet.py needs torchvision: pip install 'lightning-remat[vision]'")


class LitResNet(pl.LightningModule):
    def __init__(self, arch: str, num_classes: int = 10) -> None:
        super().__init__()
        self.model = torchvision.models.get_model(arch, num_classes=num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--budget", default="75%")
    p.add_argument("--solver", default="auto")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    n = args.batch * args.steps
    x = torch.randn(n, 3, args.image_size, args.image_size, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    trainer = pl.Trainer(strategy=RematStrategy(memory_budget=args.budget, solver=args.solver),
                         accelerator=args.accelerator, devices=1, max_epochs=1, logger=False,
                         enable_checkpointing=False)
    trainer.fit(LitResNet(args.arch), DataLoader(TensorDataset(x, y), batch_size=args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
