"""Both Lightning packages, any import order (fresh interpreters), and the strategy planning
what a LightningModule's training_step runs."""

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_remat  # noqa: F401
from lightning_remat.lightning.strategy import RematStrategy

_ROOT = Path(__file__).resolve().parents[1]

# Trains a tiny model two steps with `Trainer(strategy=...)` of the package given, the
# Trainer's default logger on, and plain from the same seed; prints one JSON line.
_FIT = textwrap.dedent('''
    import importlib, json, sys, tempfile, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    def fit(package, strategy, root):
        package.seed_everything(0)

        class Net(package.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = nn.Sequential(*[m for _ in range(24) for m in (nn.Linear(32, 32), nn.Tanh())])
            def forward(self, x):
                return self.net(x)
            def training_step(self, batch, batch_idx):
                return nn.functional.mse_loss(self(batch[0]), batch[1])
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        g = torch.Generator().manual_seed(0)
        data = DataLoader(TensorDataset(torch.randn(512, 32, generator=g), torch.randn(512, 32, generator=g)),
                          batch_size=256)
        model = Net()
        trainer = package.Trainer(strategy=strategy, accelerator="cpu", max_steps=2, default_root_dir=root,
                                  enable_progress_bar=False, enable_model_summary=False,
                                  enable_checkpointing=False)
        trainer.fit(model, data)
        return model, trainer

    def check(package, strategy):
        with tempfile.TemporaryDirectory() as root:
            plain, _ = fit(package, "auto", root + "/plain")
            model, trainer = fit(package, strategy, root + "/remat")
        planner = trainer.strategy.planner
        strategies = importlib.import_module(package.Trainer.__module__.split(".trainer")[0] + ".strategies")
        print(json.dumps({
            "package": package.__name__,
            "strategy": type(trainer.strategy).__module__ + "." + type(trainer.strategy).__name__,
            "is_package_strategy": isinstance(trainer.strategy, strategies.Strategy),
            "timeline_loggers": [type(cb).__module__ for cb in trainer.callbacks
                                 if type(cb).__name__ == "MemoryTimelineLogger"
                                 and isinstance(cb, package.Callback)],
            "planned": sorted(trainer.strategy.planners),
            "plans": len(planner.planned),
            "recomputed": sum(e.plan.count("recompute") for e in planner.planned.values()),
            "registered": sorted(n for n in strategies.StrategyRegistry if n.startswith("remat")),
            "max_param_diff": max((a - b).abs().max().item()
                                  for a, b in zip(plain.parameters(), model.parameters())),
        }), flush=True)
''')

_ORDERS = {
    "lightning first": "import lightning as L\nimport lightning_remat\ncheck(L, 'remat')",
    "lightning_remat first": "import lightning_remat\nimport lightning as L\ncheck(L, 'remat')",
    "a lightning.pytorch class first": (
        "from lightning_remat.unified import RematStrategy\nimport lightning as L\n"
        "check(L, RematStrategy(memory_budget='50%'))"),
    "pytorch_lightning first, then both packages": (
        "import pytorch_lightning as pl\nimport lightning_remat\nimport lightning as L\n"
        "from lightning_remat.unified import RematStrategy\n"
        "check(L, RematStrategy(memory_budget='50%'))\ncheck(pl, 'remat')"),
}

_OURS = {"lightning": "lightning_remat.unified", "pytorch_lightning": "lightning_remat.lightning"}


@pytest.mark.slow
@pytest.mark.parametrize("order", list(_ORDERS))
def test_both_packages_train_with_the_strategy_whichever_is_imported_first(order):
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    run = subprocess.run([sys.executable, "-c", _FIT + _ORDERS[order]], capture_output=True, text=True,
                         env=env, cwd="/tmp", timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == _ORDERS[order].count("check(")
    for result in results:
        ours = _OURS[result["package"]]
        assert result["strategy"] == f"{ours}.strategy.RematStrategy" and result["is_package_strategy"]
        assert result["registered"] == ["remat", "remat_ddp", "remat_fsdp"]
        # The default logger is TensorBoard's: the strategy adds the dashboards of its package.
        assert result["timeline_loggers"] == [f"{ours}.memory_timeline"]
        assert result["planned"] == [""] and result["plans"] == 1
        assert result["max_param_diff"] <= 1e-6, result
    if "50%" in _ORDERS[order]:
        assert results[0]["recomputed"] > 0


def test_the_lightning_pytorch_classes_are_that_packages_own_and_pickle():
    import pickle

    import lightning as L

    from lightning_remat.unified import MemoryTimelineLogger, RematDDPStrategy, RematStrategy

    assert issubclass(RematStrategy, L.pytorch.strategies.SingleDeviceStrategy)
    assert issubclass(RematDDPStrategy, L.pytorch.strategies.DDPStrategy)
    assert issubclass(MemoryTimelineLogger, L.Callback) and not issubclass(MemoryTimelineLogger, pl.Callback)
    assert not issubclass(RematStrategy, pl.strategies.Strategy)
    copy = pickle.loads(pickle.dumps(RematStrategy(memory_budget="40%")))  # spawned ranks unpickle it
    assert type(copy) is RematStrategy and copy.memory_budget == "40%"
    assert isinstance(L.Trainer(strategy="remat", accelerator="cpu", logger=False).strategy, RematStrategy)


@pytest.mark.parametrize("given", ["pytorch_lightning", "lightning"])
def test_a_strategy_given_to_the_other_packages_trainer_says_which_class_it_takes(given):
    """Lightning refuses the other package's strategy naming it by its repr: ours says
    which Trainer takes which class."""
    import lightning as L

    from lightning_remat.unified import RematStrategy as UnifiedStrategy

    strategy, trainer, takes = ((RematStrategy, L.Trainer, r"lightning\.Trainer takes lightning_remat\.unified\.RematStrategy")
                                if given == "pytorch_lightning" else
                                (UnifiedStrategy, pl.Trainer,
                                 r"pytorch_lightning\.Trainer takes lightning_remat\.lightning\.RematStrategy"))
    with pytest.raises(ValueError, match=takes):
        trainer(strategy=strategy(memory_budget="50%"), accelerator="cpu", logger=False)


# ---- planning what training_step runs ----------------------------------------------------------
def _mlp(width: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


class _Recorded(pl.LightningModule):
    """Records every parameter's gradient after each backward, and which modules' calls the
    strategy routes at the start of each step."""

    def __init__(self) -> None:
        super().__init__()
        self.grads: list[dict[str, torch.Tensor]] = []
        self.routed: list[set[str]] = []

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.routed.append({name for name, m in self.named_modules() if "forward" in m.__dict__})

    def on_after_backward(self) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CallsSelf(_Recorded):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp(64, 24)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self(batch[0]), batch[1])


class CallsModel(_Recorded):
    def __init__(self) -> None:
        super().__init__()
        self.model = _mlp(64, 24)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.model(batch[0]), batch[1])


class CallsEncoderThenHead(_Recorded):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = _mlp(64, 24)
        self.head = _mlp(64, 20)
        self.teacher = nn.Linear(64, 64)  # runs without grad: never planned

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            target = self.teacher(batch[1])
        return nn.functional.mse_loss(self.head(self.encoder(batch[0])), target)


class CallsNoModule(_Recorded):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64) / 8)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(torch.tanh(batch[0] @ self.weight), batch[1])


def _fit_steps(tmp_path, model_class, strategy):
    pl.seed_everything(0)
    model = model_class()
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(1536, 64, generator=g), torch.randn(1536, 64, generator=g)),
                      batch_size=512)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=3, default_root_dir=str(tmp_path),
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False)
    trainer.fit(model, data)
    return model


@pytest.mark.parametrize("model_class, planned", [
    (CallsSelf, [""]), (CallsModel, ["model"]), (CallsEncoderThenHead, ["encoder", "head"]),
])
def test_the_modules_the_training_step_runs_are_planned_and_train_as_plain(tmp_path, model_class, planned):
    plain = _fit_steps(tmp_path / "plain", model_class, "auto")
    strategy = RematStrategy(memory_budget="50%", cache_dir=tmp_path / "cache")
    remat = _fit_steps(tmp_path / "remat", model_class, strategy)
    assert list(strategy.planners) == planned
    for name in planned:
        assert strategy.planners[name].module is (remat.get_submodule(name) if name else remat)
        (entry,) = strategy.planners[name].planned.values()
        assert entry.plan.count("recompute") > 0, name
    assert len(strategy.plans) == len(planned)
    assert len(remat.grads) == len(plain.grads) == 3
    for step, (a, b) in enumerate(zip(plain.grads, remat.grads)):
        for name in a:
            assert torch.allclose(a[name], b[name], atol=1e-6, rtol=0), (step, name)
    # Only the planned modules keep a route once the first step has shown what runs; none
    # is left after fit.
    assert remat.routed[1:] == [set(planned)] * 2
    assert not any("forward" in m.__dict__ for m in remat.modules())


def test_a_training_step_that_runs_no_module_warns_once_and_trains(tmp_path):
    strategy = RematStrategy(memory_budget="50%", cache_dir=tmp_path / "cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _fit_steps(tmp_path, CallsNoModule, strategy)
    said = [str(w.message) for w in caught if "lightning-remat" in str(w.message)]
    assert len(said) == 1 and "ran nothing the strategy can plan" in said[0] and "target=" in said[0]
    assert strategy.planners == {} and len(model.grads) == 3
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_target_still_names_the_module_planned(tmp_path):
    strategy = RematStrategy(memory_budget="50%", target="head", cache_dir=tmp_path / "cache")
    _fit_steps(tmp_path, CallsEncoderThenHead, strategy)
    assert list(strategy.planners) == ["head"]


class CallsEncoderThenSmallHead(_Recorded):
    """An encoder and a head of one Linear layer, which alone cannot reach 45% of its own
    plain peak (it has nothing to recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _mlp(64, 40)
        self.head = nn.Linear(64, 64)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.head(self.encoder(batch[0])), batch[1])


def _shared(strategy) -> tuple[int, int]:
    """The step's budget the planned modules share, and what their plans take together."""
    shared = strategy._step_budget
    return shared.total(), sum(shared.used(name) for name in shared.members)


def test_modules_called_in_turn_share_one_budget_for_the_step(tmp_path):
    """At 45% the head alone cannot be planned within 45% of its own peak: it takes the
    least it needs and the encoder is planned again lower, so the two plans together stay
    within 45% of the two plain peaks together, and training is plain training's."""
    from lightning_remat.solvers.policy import plain_peak_bytes

    plain = _fit_steps(tmp_path / "plain", CallsEncoderThenSmallHead, "auto")
    strategy = RematStrategy(memory_budget="45%", cache_dir=tmp_path / "cache")
    remat = _fit_steps(tmp_path / "remat", CallsEncoderThenSmallHead, strategy)
    assert list(strategy.planners) == ["encoder", "head"]
    head = strategy.planners["head"].last
    assert head.plan.guaranteed_peak_bytes > 0.45 * plain_peak_bytes(head.graph)
    total, used = _shared(strategy)
    peaks = sum(plain_peak_bytes(p.last.graph) for p in strategy.planners.values())
    assert total == sum(int(0.45 * plain_peak_bytes(p.last.graph)) for p in strategy.planners.values())
    assert used <= total < peaks
    for step, (a, b) in enumerate(zip(plain.grads, remat.grads)):
        for name in a:
            assert torch.allclose(a[name], b[name], atol=1e-6, rtol=0), (step, name)


def test_a_step_budget_no_modules_fit_together_names_them_and_advises_a_budget_that_is_accepted(tmp_path):
    from lightning_remat.errors import RematInfeasibleError

    strategy = RematStrategy(memory_budget="30%", cache_dir=tmp_path / "cache")
    with pytest.raises(RematInfeasibleError) as refused:
        _fit_steps(tmp_path / "low", CallsEncoderThenSmallHead, strategy)
    message = str(refused.value)
    assert "'encoder'" in message or "encoder at least" in message
    assert "head" in message
    advised = re.search(r"memory_budget='([0-9.]+%)'", message)
    assert advised, message
    strategy = RematStrategy(memory_budget=advised.group(1), cache_dir=tmp_path / "cache2")
    _fit_steps(tmp_path / "advised", CallsEncoderThenSmallHead, strategy)
    total, used = _shared(strategy)
    assert used <= total


def test_the_registration_table_names_each_class_by_its_own_strategy_name() -> None:
    """``import lightning_remat`` registers the strategies from a table, without importing
    them (no import order may meet a partly imported module): each row names the class, in
    each Lightning package's twin, whose ``strategy_name`` it registers."""
    import importlib

    from lightning_remat import registration

    for ours in registration.PACKAGES.values():
        for name, (module, class_name, _) in registration.STRATEGIES.items():
            strategy = getattr(importlib.import_module(f"{ours}.{module}"), class_name)
            assert strategy.strategy_name == name, (ours, class_name)
