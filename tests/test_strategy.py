import pytest
import pytorch_lightning as pl
import torch

import lightning_remat  # noqa: F401  (registers the strategy)
from lightning_remat.lightning.strategy import RematStrategy
from lightning_remat.meter import peak_bytes
from tests.lit_models import ConvNet, loaders, trainer_kwargs


def _fit(tmp_path, strategy, seed=0, **extra):
    pl.seed_everything(seed)
    model = ConvNet()
    train, val = loaders()
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(tmp_path, **extra))
    trainer.fit(model, train, val)
    return model, trainer


def test_registered_by_name(tmp_path):
    trainer = pl.Trainer(strategy="remat", **trainer_kwargs(tmp_path))
    assert isinstance(trainer.strategy, RematStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")


def test_remat_training_ends_with_the_same_weights_and_a_lower_peak(tmp_path):
    plain, _ = _fit(tmp_path / "plain", "auto")
    strategy = RematStrategy(memory_budget="50%", cache_dir=tmp_path / "cache")
    remat, trainer = _fit(tmp_path / "remat", strategy)
    for (name, a), (_, b) in zip(plain.state_dict().items(), remat.state_dict().items()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6, rtol=0), name
    (entry,) = strategy.planner.planned.values()
    assert entry.plan.count("recompute") > 0
    # Measured: one step of the planned module against the plain module, same batch.
    x = next(iter(loaders()[0]))[0]
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
    trainer.fit(ConvNet(), *loaders(), ckpt_path=path)
    (entry,) = resumed.planner.planned.values()
    assert entry.from_cache


def test_plain_checkpoint_loads_into_a_remat_run(tmp_path):
    model, trainer = _fit(tmp_path / "plain", "auto", max_epochs=1)
    path = tmp_path / "plain.ckpt"
    trainer.save_checkpoint(path)
    strategy = RematStrategy(memory_budget="50%", cache_dir=tmp_path / "cache")
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(tmp_path / "r"))
    trainer.fit(ConvNet(), *loaders(), ckpt_path=path)
    assert trainer.current_epoch == 2 and strategy.planner.planned
