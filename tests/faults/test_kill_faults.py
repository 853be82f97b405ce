"""A process killed while profiling or while saving a checkpoint loses nothing: the plan
cache still opens without a warning and keeps its plans, the last whole checkpoint resumes
with its plan, and training equals plain training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from lightning_remat.cache import PlanCache
from lightning_remat.planner import Planner, PlanSettings

ROOT = Path(__file__).resolve().parents[2]

MODEL = """
import torch
from torch import nn


def model():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())], nn.Linear(64, 1))

def batch(n):
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
"""


def _run_until(script: str, marker: Path, cwd: Path) -> None:
    """Run ``script`` in a fresh interpreter and SIGKILL it once ``marker`` exists."""
    child = subprocess.Popen([sys.executable, "-c", script], cwd=cwd,
                             env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{cwd}"})
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert child.poll() is None, "the child ended before it reached the point of the kill"
            assert time.monotonic() < deadline, "the child never reached the point of the kill"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(30)


@pytest.mark.slow
def test_a_kill_while_profiling_keeps_the_cache_and_a_rerun_trains_like_plain(tmp_path):
    (tmp_path / "kill_models.py").write_text(MODEL)
    cache_path, marker = tmp_path / "plans.sqlite", tmp_path / "profiling"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        import lightning_remat.planner as planner_module
        from lightning_remat.cache import PlanCache
        from lightning_remat.planner import Planner, PlanSettings
        from kill_models import batch, model

        planner = Planner(model(), PlanSettings("80%", "auto", profile_repeats=1),
                          cache=PlanCache({str(cache_path)!r}))
        planner.remat_module(batch(2048)).sum().backward()  # planned and cached
        real = planner_module.profile_module

        def profile_then_hang(*args, **kwargs):
            graph = real(*args, **kwargs)
            Path({str(marker)!r}).write_text("profiled")
            time.sleep(600)

        planner_module.profile_module = profile_then_hang
        planner.remat_module(batch(1024)).sum().backward()
    """)
    _run_until(script, marker, tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        from kill_models import batch, model
    finally:
        sys.path.remove(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the cache opens cleanly and keeps the first plan
        cache = PlanCache(cache_path)
        assert len(cache) == 1
    remat_model, plain = model(), model()
    planner = Planner(remat_model, PlanSettings("80%", "auto", profile_repeats=1), cache=cache)
    for n in (2048, 1024):
        for module in (planner.remat_module, plain):
            module.zero_grad()
            module(batch(n)).sum().backward()
        for a, b in zip(remat_model.parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad)
    first, second = planner.planned.values()
    assert first.from_cache and not second.from_cache
    assert len(PlanCache(cache_path)) == 2


@pytest.mark.slow
def test_a_kill_while_saving_a_checkpoint_keeps_the_last_one_which_resumes_like_plain(tmp_path):
    import pytorch_lightning as pl

    from lightning_remat.lightning.strategy import RematStrategy
    from tests.lit_models import ConvNet, loaders, trainer_kwargs

    good, bad, marker = tmp_path / "good.ckpt", tmp_path / "bad.ckpt", tmp_path / "saving"
    script = textwrap.dedent(f"""
        import io, os, signal
        from pathlib import Path
        import pytorch_lightning as pl, torch
        from lightning_remat.lightning.strategy import RematStrategy
        from tests.lit_models import ConvNet, loaders, trainer_kwargs

        pl.seed_everything(0)
        trainer = pl.Trainer(strategy=RematStrategy(memory_budget="60%"),
                             **trainer_kwargs({str(tmp_path)!r}, max_epochs=1, limit_train_batches=2))
        trainer.fit(ConvNet(), loaders()[0])
        trainer.save_checkpoint({str(good)!r})

        def save_half_then_die(checkpoint, path, storage_options=None):
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            with open(path, "wb") as out:
                out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            Path({str(marker)!r}).write_text("half written")
            os.kill(os.getpid(), signal.SIGKILL)

        trainer.strategy.checkpoint_io.save_checkpoint = save_half_then_die
        trainer.save_checkpoint({str(bad)!r})
    """)
    _run_until(script, marker, ROOT)
    assert good.exists() and bad.exists()

    def fit(strategy, root, ckpt_path=None):
        pl.seed_everything(0)
        model = ConvNet()
        trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(root, max_epochs=2, limit_train_batches=2))
        trainer.fit(model, loaders()[0], ckpt_path=ckpt_path)
        return model

    with pytest.raises(RuntimeError, match="zip archive"):  # refused, not half loaded
        fit(RematStrategy(memory_budget="60%"), tmp_path / "bad_resume", ckpt_path=bad)
    strategy = RematStrategy(memory_budget="60%")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        resumed = fit(strategy, tmp_path, ckpt_path=good)
    assert not [w for w in record if "lightning-remat" in str(w.message)]  # the plan still fits
    (entry,) = strategy.planner.planned.values()
    assert entry.from_cache
    plain = fit("auto", tmp_path / "plain")
    for (name, a), b in zip(plain.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6, rtol=0), name

