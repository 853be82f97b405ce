"""remat_fsdp on two CPU processes (gloo, torch FSDP2 ``fully_shard``): the same training as
plain FSDP (parameters, optimizer state, BatchNorm statistics, rank by rank), every rank runs
rank zero's plan, and the checkpoints of the two load into each other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_remat.lightning.fsdp import RematFSDPStrategy
from tests.distributed import run_ranks
from tests.lit_models import trainer_kwargs

STEPS = 3


class Block(nn.Module):
    """Linear, BatchNorm, Tanh, with a residual add: one fully_shard unit."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.norm(self.fc(x)))


class Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 8) -> None:
        super().__init__()
        self.stem = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


class ShardedNet(pl.LightningModule):
    """Each Block a fully_shard unit, the Net the root unit (Lightning's configure_model)."""

    def __init__(self, batch_size: int = 64, out_dir=None, save=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()
        self.batch_size = batch_size
        self.out_dir = out_dir
        self.save = save

    def configure_model(self) -> None:
        for block in self.net.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(1024, 16, generator=g), torch.randint(0, 4, (1024,), generator=g))
        return DataLoader(data, batch_size=self.batch_size)

    def on_fit_end(self):
        if self.save is not None:
            self.trainer.save_checkpoint(self.save)  # on every rank: each writes its shards
        if self.out_dir is None:
            return
        # Rank by rank: the local shards, the BatchNorm statistics, the optimizer state.
        local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in self.state_dict().items()}
        optim = self.trainer.optimizers[0].state_dict()["state"]
        optim = {i: {k: v.to_local() if hasattr(v, "to_local") else v for k, v in s.items()}
                 for i, s in optim.items()}
        torch.save({"state": local, "optim": optim}, self.out_dir / f"rank{self.global_rank}.pt")
        planner = getattr(self.trainer.strategy, "planner", None)
        if planner is not None:
            plans = [e.plan.to_json() for e in planner.planned.values()]
            (self.out_dir / f"plans{self.global_rank}.json").write_text(json.dumps(plans))


def saved(path, rank):
    return torch.load(path / f"rank{rank}.pt", weights_only=False)


def assert_same_training(a, b, buffers=True):
    for rank in (0, 1):
        ra, rb = saved(a, rank), saved(b, rank)
        assert ra["state"].keys() == rb["state"].keys()
        for name in ra["state"]:
            if not buffers and ("running_" in name or "num_batches" in name):
                continue
            assert torch.equal(ra["state"][name], rb["state"][name]), (rank, name)
        for i in ra["optim"]:
            for k in ra["optim"][i]:
                assert torch.equal(torch.as_tensor(ra["optim"][i][k]), torch.as_tensor(rb["optim"][i][k])), (rank, i, k)


# ---- four fits in one spawn of two ranks (tests/distributed.py), run in this order -------------
# The spawned launcher of remat_fsdp (start_method="spawn") is what
# tests/test_batch_size_ranks.py's search under remat_fsdp runs.


def _plain_strategy() -> ModelParallelStrategy:
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


def _remat_strategy(out: Path) -> RematFSDPStrategy:
    return RematFSDPStrategy(memory_budget="75%", cache_dir=out.parent / "cache", profile_steps=1,
                             data_parallel_size=2, tensor_parallel_size=1)


def _ranked_fit(out: Path, strategy, ckpt_path=None, save=None) -> None:
    model = ShardedNet(out_dir=out, save=save)
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(out, devices=2, max_steps=STEPS,
                                                             deterministic=False))
    trainer.fit(model, ckpt_path=ckpt_path)


def plain(rank: int, out: Path) -> None:
    _ranked_fit(out, _plain_strategy(), save=out.parent / "plain.ckpt")


def remat(rank: int, out: Path) -> None:
    _ranked_fit(out, _remat_strategy(out), save=out.parent / "remat.ckpt")


def plain_from_remat(rank: int, out: Path) -> None:
    _ranked_fit(out, _plain_strategy(), ckpt_path=out.parent / "remat.ckpt")


def remat_from_plain(rank: int, out: Path) -> None:
    _ranked_fit(out, _remat_strategy(out), ckpt_path=out.parent / "plain.ckpt")


@pytest.mark.slow
def test_remat_fsdp_trains_as_plain_fsdp_and_checkpoints_load_into_each_other(tmp_path):
    run_ranks(tmp_path, [plain, remat, plain_from_remat, remat_from_plain])
    plans = [json.loads((tmp_path / "remat" / f"plans{r}.json").read_text()) for r in (0, 1)]
    assert plans[0] and plans[0] == plans[1]  # every rank ran rank zero's plan
    assert any('"recompute"' in p for p in plans[0])
    assert_same_training(tmp_path / "plain", tmp_path / "remat")
    # Each run resumed from the other's checkpoint (max_steps already reached: it only loads).
    # A distributed checkpoint keeps one copy of a replicated buffer, so the per-rank
    # BatchNorm statistics are not compared after loading (plain FSDP's own resume is alike).
    assert_same_training(tmp_path / "plain", tmp_path / "plain_from_remat", buffers=False)
    assert_same_training(tmp_path / "plain", tmp_path / "remat_from_plain", buffers=False)


def test_registered_as_remat_fsdp(tmp_path):
    trainer = pl.Trainer(strategy="remat_fsdp", **trainer_kwargs(tmp_path, devices=2))
    assert isinstance(trainer.strategy, RematFSDPStrategy)
    assert trainer.strategy.world_size == 2


class OneDeviceFSDP(ModelParallelStrategy):
    """Plain FSDP on one process, in this one."""


def _fit_one_device(tmp_path, strategy):
    tmp_path.mkdir(parents=True, exist_ok=True)
    model = ShardedNet(out_dir=tmp_path)
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(tmp_path, devices=1, max_steps=STEPS,
                                                             deterministic=False))
    try:
        trainer.fit(model)
    finally:
        if torch.distributed.is_initialized():  # one rank, in this process: leave no group behind
            torch.distributed.destroy_process_group()
    return trainer


@pytest.mark.slow
def test_remat_fsdp_on_one_device_plans_and_trains_as_plain(tmp_path):
    _fit_one_device(tmp_path / "plain", OneDeviceFSDP(data_parallel_size=1, tensor_parallel_size=1))
    strategy = RematFSDPStrategy(memory_budget="75%", cache_dir=tmp_path / "cache", profile_steps=1)
    trainer = _fit_one_device(tmp_path / "remat", strategy)
    assert trainer.strategy.world_size == 1 and trainer.strategy.planner.ranks is None
    plans = json.loads((tmp_path / "remat" / "plans0.json").read_text())
    assert any('"recompute"' in p for p in plans)
    for name, value in saved(tmp_path / "plain", 0)["state"].items():
        assert torch.equal(value, saved(tmp_path / "remat", 0)["state"][name]), name
