"""One budget, the same bytes everywhere: every accepted form of ``memory_budget`` given to
``remat()``, to the strategy, to the batch-size search and to the command line means the
same bytes (a fraction: of the plain peak the graph's profile measured), and the forms a
consumer cannot take are refused there with the same message."""

from __future__ import annotations

import re

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_remat import RematBatchSizeFinder, RematStrategy, find_max_batch_size, remat
from lightning_remat.budget import Budget
from lightning_remat.cli import main
from lightning_remat.solvers.policy import plain_peak_bytes
from tests.lit_models import trainer_kwargs


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(128, 128), nn.Tanh())], nn.Linear(128, 4))


class Regression(pl.LightningModule):
    def __init__(self, batch_size: int = 512) -> None:
        super().__init__()
        self.net, self.batch_size = mlp(), batch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(torch.randn(1024, 128), torch.randn(1024, 4))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


def _cli_bytes(graph_path: str, budget: str, capsys: pytest.CaptureFixture) -> int:
    """The bytes ``lightning-remat solve`` plans for (its table says them)."""
    assert main(["solve", "--graph", graph_path, "--budget", budget, "--solver", "auto"]) == 0, capsys.readouterr()
    match = re.search(r"budget\s*:?\s*[\d.]+ \w+ \((\d+) bytes\)", capsys.readouterr().out)
    assert match is not None
    return int(match.group(1))


def _strategy_bytes(tmp_path, budget: object) -> tuple[int | None, int]:
    """The budget the strategy planned its module at, and the plain peak of its graph."""
    trainer = pl.Trainer(strategy=RematStrategy(memory_budget=budget),
                         **trainer_kwargs(tmp_path, max_steps=1))
    trainer.fit(Regression())
    entry = trainer.strategy.planner.last
    return entry.budget_bytes, plain_peak_bytes(entry.graph)


def test_every_form_is_the_same_bytes_for_remat_the_strategy_the_search_and_the_cli(tmp_path, capsys) -> None:
    x = torch.randn(512, 128)
    planned = remat(mlp(), x, "90%")
    graph_path = str(tmp_path / "graph.json")
    planned.graph.save(graph_path)
    plain = plain_peak_bytes(planned.graph)

    # Fractions, written three ways: of the measured plain peak, for remat() and the CLI alike.
    for form in ("90%", 0.9, "0.9"):
        expected = int(0.9 * plain)
        assert Budget(form).resolve(plain) == expected
        again = remat(mlp(), x, form)
        assert again.budget_bytes == int(0.9 * plain_peak_bytes(again.graph))
        assert _cli_bytes(graph_path, str(form), capsys) == expected
        # The search refuses every spelling of a fraction, before it runs, saying why.
        with pytest.raises(ValueError, match="fraction of the plain step's peak.*batch size"):
            RematBatchSizeFinder(memory_budget=form)
    # The strategy's fraction is of its own graph's plain peak.
    budget_bytes, strategy_plain = _strategy_bytes(tmp_path / "fraction", "90%")
    assert budget_bytes == int(0.9 * strategy_plain)

    # Bytes, written as an int, a string of digits and a size string: the same bytes everywhere.
    kib = int(0.9 * plain) // 1024
    for form in (kib * 1024, str(kib * 1024), f"{kib}KiB"):
        assert remat(mlp(), x, form).budget_bytes == kib * 1024
        assert _cli_bytes(graph_path, str(form), capsys) == kib * 1024
    assert _strategy_bytes(tmp_path / "bytes", f"{kib}KiB")[0] == kib * 1024
    trainer = pl.Trainer(**trainer_kwargs(tmp_path / "search", max_steps=1))
    report = find_max_batch_size(trainer, Regression(), memory_budget=f"{kib}KiB", init_val=512, max_val=512,
                                 compare_plain=False, steps_per_trial=1, progress_bar=False)
    assert report.budget_bytes == kib * 1024

    # None: no limit off CUDA, for each of them.
    assert remat(mlp(), x, None).budget_bytes is None
    assert _strategy_bytes(tmp_path / "none", None)[0] is None
