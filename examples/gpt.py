"""A GPT-style language model trained with Trainer(strategy="remat") on random tokens.

    python examples/gpt.py --budget 50% --depth 4
    python examples/gpt.py --accelerator gpu --budget 6GiB --depth 12 --width 768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import GPT, lm_loss  # noqa: E402
from lightning_remat import RematStrategy  # noqa: E402


class LitGPT(pl.LightningModule):
    def __init__(self, **gpt_kwargs) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(**gpt_kwargs)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        loss = lm_loss(self(idx), targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="50%")
    p.add_argument("--solver", default="auto")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch * args.steps, args.context + 1), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    model = LitGPT(vocab=args.vocab, width=args.width, depth=args.depth, context=args.context)
    trainer = pl.Trainer(strategy=RematStrategy(memory_budget=args.budget, solver=args.solver),
                         accelerator=args.accelerator, devices=1, max_epochs=1, logger=False,
                         enable_checkpointing=False)
    trainer.fit(model, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
