"""DDP on two CPU processes (gloo): both ranks use rank zero's plan and the weights equal
plain DDP's."""

import json

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

from lightning_remat.lightning.strategy import RematDDPStrategy
from tests.lit_models import ConvNet, loaders, trainer_kwargs


class RecordingConvNet(ConvNet):
    """Writes the plans its rank used, so the test can compare ranks after the spawn."""

    def __init__(self, plan_dir=None):
        super().__init__()
        self.plan_dir = plan_dir

    def on_train_end(self):
        planner = getattr(self.trainer.strategy, "planner", None)
        if self.plan_dir is not None and planner is not None:
            plans = [e.plan.to_json() for e in planner.planned.values()]
            (self.plan_dir / f"rank{self.global_rank}.json").write_text(json.dumps(plans))


def _fit(tmp_path, strategy, plan_dir=None):
    pl.seed_everything(0)
    model = RecordingConvNet(plan_dir)
    kwargs = trainer_kwargs(tmp_path, devices=2, max_epochs=1)
    trainer = pl.Trainer(strategy=strategy, **kwargs)
    trainer.fit(model, loaders(n=64, batch_size=8)[0])
    return model, trainer


@pytest.mark.slow
def test_remat_ddp_matches_plain_ddp_and_ranks_share_the_plan(tmp_path):
    plain, _ = _fit(tmp_path / "plain", DDPStrategy(start_method="spawn", process_group_backend="gloo"))
    strategy = RematDDPStrategy(memory_budget="50%", cache_dir=tmp_path / "cache", start_method="spawn",
                                process_group_backend="gloo")
    remat, trainer = _fit(tmp_path / "remat", strategy, plan_dir=tmp_path)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 and rank0 == rank1
    assert any('"recompute"' in p for p in rank0)
    for (name, a), (_, b) in zip(plain.state_dict().items(), remat.state_dict().items()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6, rtol=0), name


def test_registered_as_remat_ddp(tmp_path):
    trainer = pl.Trainer(strategy="remat_ddp", **trainer_kwargs(tmp_path, devices=2))
    assert isinstance(trainer.strategy, RematDDPStrategy)
    assert trainer.strategy.world_size == 2
