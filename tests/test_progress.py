"""Planning shows its phases while it runs, and a summary in seconds and plain steps."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

import lightning_remat
import lightning_remat.lightning.strategy as strategy_mod
from lightning_remat.lightning.strategy import RematStrategy
from tests import models
from tests.lit_models import ConvNet, loaders, trainer_kwargs


def test_remat_reports_each_phase_on_request_only(capsys):
    x = torch.randn(64, 256)
    lightning_remat.remat(models.mlp(width=256), x, memory_budget=None, progress=True)
    lines = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("lightning-remat: ") for line in lines), lines
    phases = [line.split(": ")[1] for line in lines]
    assert phases[0] == "trace" and "profile" in phases and "solve" in phases
    summary = lines[-1]
    assert "planning took" in summary and "plain steps" in summary and "profile" in summary
    lightning_remat.remat(models.mlp(width=256), x, memory_budget=None)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("bar", [True, False])
def test_strategy_reports_on_rank_zero_only_with_a_progress_bar(tmp_path, monkeypatch, bar):
    lines: list[str] = []
    monkeypatch.setattr(strategy_mod, "rank_zero_info", lambda line: lines.append(str(line)))
    pl.seed_everything(0)
    train, val = loaders()
    trainer = pl.Trainer(strategy=RematStrategy(memory_budget="80%"),
                         **trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=2,
                                          limit_val_batches=0, enable_progress_bar=bar))
    trainer.fit(ConvNet(), train, val)
    phases = [line for line in lines if line.startswith("lightning-remat: ")]
    if bar:
        assert phases[0] == "lightning-remat: trace: the forward's graph"
        assert any(line.startswith("lightning-remat: profile") for line in phases)
        assert "plain steps" in phases[-1]
    else:
        assert phases == []
