"""The batch-size finder never takes a failed measurement for a fit."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from lightning_remat.lightning import trial as trial_module
from lightning_remat.lightning.batch_size import find_max_batch_size
from lightning_remat.lightning.trial import LightningTrial, MeasurementError, SearchSettings
from lightning_remat.planner import PlanSettings
from tests.lit_models import ConvNet, loaders


class SizedConvNet(ConvNet):
    def __init__(self, batch_size: int = 2) -> None:
        super().__init__(channels=4)
        self.batch_size = batch_size

    def train_dataloader(self):
        return loaders(n=16, batch_size=self.batch_size, size=8)[0]


def small_trainer(tmp_path, **kwargs):
    return pl.Trainer(default_root_dir=str(tmp_path), accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_model_summary=False,
                      enable_progress_bar=False, **kwargs)


def grad_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def zero_meter(fn, device="cpu") -> int:
    """A meter that fails: runs the step and reads nothing."""
    fn()
    return 0


def run_trial(tmp_path, budget_bytes: int, batch_size: int = 4):
    """One plain trial inside a fitting Trainer; returns its result or the exception."""
    model = SizedConvNet()
    outcome = {}

    class Probe(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            settings = SearchSettings(plan=PlanSettings(budget_bytes), budget_bytes=budget_bytes,
                                      device=trainer.strategy.root_device, target=None,
                                      cache_dir=tmp_path / "lightning_remat")
            trial = LightningTrial(trainer, pl_module, batch_arg_name="batch_size",
                                   steps_per_trial=1, solver="plain", settings=settings)
            try:
                outcome["result"] = trial(batch_size)
            except MeasurementError as exc:
                outcome["error"] = exc
            raise pl.utilities.exceptions._TunerExitException()

    small_trainer(tmp_path, max_steps=1, callbacks=[Probe()]).fit(model)
    return model, outcome


def test_a_zero_reading_under_a_budget_below_the_gradients_is_infeasible(tmp_path, monkeypatch):
    monkeypatch.setattr(trial_module, "peak_bytes", zero_meter)
    model, outcome = run_trial(tmp_path, budget_bytes=1000)
    result = outcome["result"]
    assert not result.feasible
    assert f"parameter gradients alone take {grad_bytes(model)} B" in result.reason
    assert "over the budget 1000 B" in result.reason


def test_a_zero_reading_is_a_failed_measurement_not_a_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(trial_module, "peak_bytes", zero_meter)
    _, outcome = run_trial(tmp_path, budget_bytes=2**30)
    assert "result" not in outcome, outcome
    assert "a failed measurement, not a fit" in str(outcome["error"])


def test_a_reading_below_the_gradients_is_a_failed_measurement(tmp_path, monkeypatch):
    def short_meter(fn, device="cpu") -> int:
        fn()
        return 16  # some bytes, fewer than any gradient of the model

    monkeypatch.setattr(trial_module, "peak_bytes", short_meter)
    _, outcome = run_trial(tmp_path, budget_bytes=2**30)
    assert "result" not in outcome, outcome
    assert "a peak of 16 B" in str(outcome["error"])


@pytest.mark.slow
def test_plain_search_under_a_budget_below_the_gradients_fits_nothing(tmp_path):
    model = SizedConvNet()
    report = find_max_batch_size(small_trainer(tmp_path, max_epochs=1), model, memory_budget=1000,
                                 solver="plain", init_val=2, max_val=32, steps_per_trial=1,
                                 progress_bar=False)
    assert report.remat.largest_feasible is None
    assert report.remat.trials and all(
        not r.feasible and "parameter gradients alone" in r.reason for r in report.remat.trials)
    assert model.batch_size == 2  # left as it was
