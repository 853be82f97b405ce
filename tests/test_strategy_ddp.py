"""DDP on two CPU processes (gloo): both ranks use rank zero's plan and the weights equal
plain DDP's. Both fits run in one spawn of two ranks (tests/distributed.py); the spawned
launcher of remat_ddp (``start_method="spawn"``) is what tests/test_ddp_shapes.py runs."""

import json
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

from lightning_remat.lightning.strategy import RematDDPStrategy
from tests.distributed import run_ranks
from tests.lit_models import ConvNet, loaders, trainer_kwargs


class RecordingConvNet(ConvNet):
    """Writes its rank's weights and the plans its rank used, so the test compares ranks
    after the spawn."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__()
        self.out_dir = out_dir

    def on_train_end(self):
        torch.save(self.state_dict(), self.out_dir / f"state{self.global_rank}.pt")
        planner = getattr(self.trainer.strategy, "planner", None)
        if planner is not None:
            plans = [e.plan.to_json() for e in planner.planned.values()]
            (self.out_dir / f"rank{self.global_rank}.json").write_text(json.dumps(plans))

    def teardown(self, stage):
        pass  # the ranks leave the process group together after the last fit (run_ranks)


def _fit(out: Path, strategy) -> None:
    pl.seed_everything(0)
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(out, devices=2, max_epochs=1))
    trainer.fit(RecordingConvNet(out), loaders(n=64, batch_size=8)[0])


def plain(rank: int, out: Path) -> None:
    _fit(out, DDPStrategy(process_group_backend="gloo"))


def remat(rank: int, out: Path) -> None:
    _fit(out, RematDDPStrategy(memory_budget="50%", cache_dir=out / "cache", process_group_backend="gloo"))


@pytest.mark.slow
def test_remat_ddp_matches_plain_ddp_and_ranks_share_the_plan(tmp_path):
    run_ranks(tmp_path, [plain, remat])
    rank0, rank1 = (json.loads((tmp_path / "remat" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 and rank0 == rank1
    assert any('"recompute"' in p for p in rank0)
    for rank in (0, 1):
        a = torch.load(tmp_path / "plain" / f"state{rank}.pt")
        b = torch.load(tmp_path / "remat" / f"state{rank}.pt")
        assert a.keys() == b.keys()
        for name in a:
            assert torch.allclose(a[name].float(), b[name].float(), atol=1e-6, rtol=0), (rank, name)


def test_registered_as_remat_ddp(tmp_path):
    trainer = pl.Trainer(strategy="remat_ddp", **trainer_kwargs(tmp_path, devices=2))
    assert isinstance(trainer.strategy, RematDDPStrategy)
    assert trainer.strategy.world_size == 2
