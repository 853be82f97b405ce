"""A plan from a checkpoint or the plan cache is used only when everything that decided it is
unchanged (budget, solver, precision, inputs, device, torch version, graph); otherwise the
step is planned again and one line says why."""

from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

import lightning_remat  # noqa: F401  (registers the strategies)
from lightning_remat.lightning.strategy import RematStrategy
from lightning_remat.planner import Planner, PlanSettings
from tests.lit_models import ConvNet, loaders, trainer_kwargs


def _fit(root, strategy, ckpt_path=None, **extra):
    pl.seed_everything(0)
    model = ConvNet()
    # 16-pixel images: the plans and the messages are what is checked, and a bf16 convolution
    # on the CPU is slow.
    train, _ = loaders(size=16)
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(root, **{"max_epochs": 1, "limit_train_batches": 2, **extra}))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model, train, ckpt_path=ckpt_path)
    ours = [str(w.message) for w in record if "lightning-remat" in str(w.message)]
    return model, trainer, ours


@pytest.mark.slow
def test_a_resume_with_a_new_budget_plans_again_and_says_why(tmp_path):
    _, trainer, _ = _fit(tmp_path, RematStrategy(memory_budget=None))
    path = tmp_path / "first.ckpt"
    trainer.save_checkpoint(path)
    strategy = RematStrategy(memory_budget="66%")
    _, trainer, messages = _fit(tmp_path, strategy, ckpt_path=path, max_epochs=2)
    assert messages == ["lightning-remat: the checkpoint's plan was made for budget None, this run "
                        "asks for budget '66%': planning again"], messages
    (entry,) = strategy.planner.planned.values()
    assert not entry.from_cache and entry.plan.solver != "plain" and entry.plan.count("recompute") > 0
    # The new plan is what the next checkpoint stores: resuming from it at 66% reuses it.
    trainer.save_checkpoint(tmp_path / "second.ckpt")
    again = RematStrategy(memory_budget="66%", cache_dir=tmp_path / "empty")
    _, _, messages = _fit(tmp_path, again, ckpt_path=tmp_path / "second.ckpt", max_epochs=3)
    assert messages == [] and next(iter(again.planner.planned.values())).from_cache


@pytest.mark.slow
def test_the_plan_cache_keeps_plans_apart_by_precision(tmp_path):
    first = RematStrategy(memory_budget="60%")
    _fit(tmp_path, first, precision="bf16-mixed")
    (bf16,) = first.planner.planned.values()
    assert bf16.basis.autocast == "torch.bfloat16"
    second = RematStrategy(memory_budget="60%")
    _, _, messages = _fit(tmp_path, second, precision="32-true")
    (fp32,) = second.planner.planned.values()
    assert not fp32.from_cache and fp32.basis.autocast == "off"
    assert messages == ["lightning-remat: the plan cache's plan was made for autocast torch.bfloat16, "
                        "this run asks for autocast off: planning again"], messages
    third = RematStrategy(memory_budget="60%")  # both plans are cached now, each for its precision
    _, _, messages = _fit(tmp_path, third, precision="bf16-mixed")
    assert messages == [] and next(iter(third.planner.planned.values())).from_cache


class _CastingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())],
                                    nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.float())


def _step(module: nn.Module, x: torch.Tensor, bf16: bool) -> list[torch.Tensor]:
    module.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = module(x)
    out.float().sum().backward()
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("change, x, bf16, words", [
    ("shape", torch.randn(1024, 64), False, "shapes [[2048, 64]] -> [[1024, 64]]"),
    ("dtype", torch.randn(2048, 64).double(), False, "dtypes ['torch.float32'] -> ['torch.float64']"),
    ("precision", torch.randn(2048, 64), True, "precision (autocast on cpu/cuda, parameters) "
     "off/off/torch.float32 -> torch.bfloat16/off/torch.float32"),
])
def test_a_change_in_mid_run_is_planned_again_with_one_line_and_trains_like_plain(change, x, bf16, words):
    plain, model = _CastingNet(), _CastingNet()
    planner = Planner(model, PlanSettings("80%", "auto", profile_repeats=1))
    first = torch.randn(2048, 64)
    assert all(torch.equal(a, b) for a, b in zip(_step(planner.remat_module, first, False),
                                                  _step(plain, first, False)))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        grads = _step(planner.remat_module, x, bf16)
    messages = [str(w.message) for w in record if "re-planning" in str(w.message)]
    assert len(messages) == 1 and words in messages[0], messages
    assert len(planner.planned) == 2
    for a, b in zip(grads, _step(plain, x, bf16)):
        assert torch.equal(a, b), change
