import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

import lightning_remat  # noqa: F401  (registers the strategy)
from lightning_remat.lightning.strategy import RematStrategy, forward_routed
from lightning_remat.measure.peak import peak_bytes
from tests.lit_models import ConvNet, loaders, trainer_kwargs

SIZE = 16
"""The ConvNet's images: 16 pixels keep its activations several times its parameters (the
50% budget recomputes) at a quarter of the convolutions' work at 32."""


def _fit(tmp_path, strategy, seed=0, **extra):
    pl.seed_everything(seed)
    model = ConvNet()
    train, val = loaders(size=SIZE)
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(tmp_path, **extra))
    trainer.fit(model, train, val)
    return model, trainer


def test_registered_by_name(tmp_path):
    trainer = pl.Trainer(strategy="remat", **trainer_kwargs(tmp_path))
    assert isinstance(trainer.strategy, RematStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")


_ROOT = Path(__file__).resolve().parents[1]

_IMPORT_ORDERS = {
    "remat then lightning": "import lightning_remat\nimport pytorch_lightning as pl\n"
                            "trainer = pl.Trainer(strategy='remat', accelerator='cpu', logger=False)\n"
                            "print(type(trainer.strategy).__name__)",
    "lightning then remat": "import pytorch_lightning as pl\nimport lightning_remat\n"
                            "trainer = pl.Trainer(strategy='remat', accelerator='cpu', logger=False)\n"
                            "print(type(trainer.strategy).__name__)",
    "one name alone": "from lightning_remat import RematStrategy\nprint(RematStrategy.__name__)",
    "both, then a name": "import lightning_remat, pytorch_lightning\n"
                         "print(lightning_remat.RematFSDPStrategy.__name__)",
}


@pytest.mark.slow
@pytest.mark.parametrize("order", sorted(_IMPORT_ORDERS))
def test_every_import_order_registers_the_strategies_in_a_fresh_interpreter(order):
    # After the script, every name must be in Lightning's registry, whichever package came first.
    code = _IMPORT_ORDERS[order] + (
        "\nfrom pytorch_lightning.strategies import StrategyRegistry\n"
        "print(sorted(n for n in StrategyRegistry if n.startswith('remat')))")
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd="/tmp", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[-1] == "['remat', 'remat_ddp', 'remat_fsdp']"
    assert lines[-2].startswith("Remat"), lines


def test_forward_routed_nests_and_leaves_the_module_as_it_was():
    net = torch.nn.Linear(3, 2)
    x = torch.ones(1, 3)
    with forward_routed(net, lambda inp: inp * 2):
        assert inspect.signature(net.forward) == inspect.signature(torch.nn.Linear(3, 2).forward)
        with forward_routed(net, lambda inp: inp * 3):
            assert torch.equal(net(x), x * 3)
        assert torch.equal(net(x), x * 2)  # the outer route is back
    assert "forward" not in net.__dict__ and net(x).shape == (1, 2)
    own = net.forward  # an instance-level forward the caller set is put back
    net.forward = own
    with forward_routed(net, lambda inp: inp), pytest.raises(ZeroDivisionError):
        raise ZeroDivisionError
    assert net.__dict__["forward"] is own


def test_fit_leaves_the_lightning_module_as_it_was(tmp_path):
    model, trainer = _fit(tmp_path, RematStrategy(memory_budget="50%", cache_dir=tmp_path / "c"), max_epochs=1)
    assert trainer.strategy.planner.planned  # its calls went to the planner
    assert "forward" not in model.__dict__


def test_remat_training_ends_with_the_same_weights_and_a_lower_peak(tmp_path):
    plain, _ = _fit(tmp_path / "plain", "auto")
    strategy = RematStrategy(memory_budget="50%", cache_dir=tmp_path / "cache")
    remat, trainer = _fit(tmp_path / "remat", strategy)
    for (name, a), (_, b) in zip(plain.state_dict().items(), remat.state_dict().items()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6, rtol=0), name
    (entry,) = strategy.planner.planned.values()
    assert entry.plan.count("recompute") > 0
    # Measured: one step of the planned module against the plain module, same batch.
    x = next(iter(loaders(size=SIZE)[0]))[0]
    plain_peak = peak_bytes(lambda: plain(x).sum().backward())
    remat_peak = peak_bytes(lambda: entry.module(x).sum().backward())
    assert remat_peak < plain_peak


def test_second_run_hits_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    _fit(tmp_path / "a", RematStrategy(memory_budget="50%", cache_dir=cache), max_epochs=1)

    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled although the plan was cached")

    monkeypatch.setattr("lightning_remat.graph.profile.profile_module", no_profiling)
    strategy = RematStrategy(memory_budget="50%", cache_dir=cache)
    _fit(tmp_path / "b", strategy, max_epochs=1)
    (entry,) = strategy.planner.planned.values()
    assert entry.from_cache


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(memory_budget="lots"), "accepted"),
        (dict(solver="fastest"), "choose one of"),
        (dict(profile_steps=0), "profile_steps"),
        (dict(target=3), "submodule name"),
    ],
)
def test_bad_arguments_say_what_is_wrong(kwargs, words):
    with pytest.raises(ValueError, match=words):
        RematStrategy(**kwargs)


def test_unknown_target_names_the_children(tmp_path):
    with pytest.raises(ValueError, match="children are"):
        _fit(tmp_path, RematStrategy(target="decoder", cache_dir=tmp_path / "c"), max_epochs=1)


def test_checkpoints_load_both_ways_and_resume_restores_the_plan(tmp_path, monkeypatch):
    strategy = RematStrategy(memory_budget="50%", cache_dir=tmp_path / "cache")
    model, trainer = _fit(tmp_path / "remat", strategy, max_epochs=1)
    path = tmp_path / "remat.ckpt"
    trainer.save_checkpoint(path)
    plain = ConvNet.load_from_checkpoint(path)
    assert plain.state_dict().keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, plain.state_dict()[k])
    # Resume with an empty cache: the plan comes from the checkpoint, no profiling.
    monkeypatch.setattr("lightning_remat.graph.profile.profile_module",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("profiled")))
    resumed = RematStrategy(memory_budget="50%", cache_dir=tmp_path / "empty")
    pl.seed_everything(0)
    trainer = pl.Trainer(strategy=resumed, **trainer_kwargs(tmp_path / "resume"))
    trainer.fit(ConvNet(), *loaders(size=SIZE), ckpt_path=path)
    (entry,) = resumed.planner.planned.values()
    assert entry.from_cache


def test_plain_checkpoint_loads_into_a_remat_run(tmp_path):
    model, trainer = _fit(tmp_path / "plain", "auto", max_epochs=1)
    path = tmp_path / "plain.ckpt"
    trainer.save_checkpoint(path)
    strategy = RematStrategy(memory_budget="50%", cache_dir=tmp_path / "cache")
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(tmp_path / "r"))
    trainer.fit(ConvNet(), *loaders(size=SIZE), ckpt_path=path)
    assert trainer.current_epoch == 2 and strategy.planner.planned


def test_a_new_non_tensor_argument_is_planned_again_and_trains_like_plain(tmp_path):
    # The strategy and remat() share one planner and one input key: a flag that changes
    # between steps is a new input, traced and planned for its value, not run through a
    # graph specialised for the other value.
    from tests.lit_models import FlaggedConvNet

    results = {}
    for name, strategy in (("plain", "auto"), ("remat", RematStrategy(memory_budget="60%", cache_dir=tmp_path / "c"))):
        pl.seed_everything(0)
        model = FlaggedConvNet()
        train, _ = loaders(size=SIZE)
        trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(tmp_path / name, max_epochs=1))
        trainer.fit(model, train)
        results[name] = (model, trainer)
    planner = results["remat"][1].strategy.planner
    flags = sorted(key[-1] for key in planner.planned)
    assert flags == ["False", "True"], list(planner.planned)
    assert all(entry.plan.count("recompute") >= 1 for entry in planner.planned.values())
    plain, remat_model = results["plain"][0], results["remat"][0]
    for (name, a), b in zip(plain.state_dict().items(), remat_model.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6, rtol=0), name
