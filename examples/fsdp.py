"""Sharded training within a memory budget: strategy="remat_fsdp" on two CPU processes.

The LightningModule shards itself in ``configure_model`` with torch's ``fully_shard``, as for
Lightning's ``ModelParallelStrategy``: every transformer Block is a unit, then the model. The
planner runs inside the sharded model: every rank profiles the FSDP step together, rank zero
plans (the summary is logged once), and every rank runs the same plan, recomputing whole
Blocks (each re-gathering its parameters, a cost the plan counts).

    python examples/fsdp.py
    python examples/fsdp.py --accelerator gpu --devices 4 --budget 60%
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.models

from benchmarks.models import GPT, Block, lm_loss  # noqa: E402
from lightning_remat import RematFSDPStrategy  # noqa: E402  (registers "remat_fsdp")


class ShardedGPT(pl.LightningModule):
    def __init__(self, context: int = 128) -> None:
        super().__init__()
        self.model = GPT(vocab=2000, width=128, depth=4, heads=4, context=context)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            if isinstance(block, Block):
                fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        loss = lm_loss(self(idx), targets)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="50%")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    args = p.parse_args()
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2000, (64, 129), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    # "spawn": ranks started from this process (the default "popen" runs the script again per rank).
    # Every process shards (ModelParallelStrategy's own default is one data-parallel rank per node).
    strategy = RematFSDPStrategy(memory_budget=args.budget, start_method="spawn",
                                 data_parallel_size=args.devices, tensor_parallel_size=1)
    trainer = pl.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices,
                         max_steps=4, logger=False, enable_checkpointing=False)
    trainer.fit(ShardedGPT(), DataLoader(data, batch_size=8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
