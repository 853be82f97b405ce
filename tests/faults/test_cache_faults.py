"""A plan cache or a batch-size study that cannot be read never stops training: the file is
moved aside with one warning, the plans that can still be read are kept, and the run goes on
(docs/design.md section 5)."""

from __future__ import annotations

import random
import sqlite3
import warnings

import pytest
import torch
from torch import nn

from lightning_remat.cache import PlanBasis, PlanCache
from lightning_remat.graph.ir import Graph
from lightning_remat.planner import Planner, PlanSettings
from lightning_remat.solvers.scoring import make_plan
from lightning_remat.tuning.search import TrialResult, run_search

PAGE = 4096


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())], nn.Linear(64, 1))


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad()
    module(x).sum().backward()
    return [p.grad.clone() for p in module.parameters()]


def _plan_and_train(cache_path) -> tuple[Planner, list[torch.Tensor]]:
    model = _model()
    planner = Planner(model, PlanSettings("80%", "auto", profile_repeats=1), cache=PlanCache(cache_path))
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(1))
    grads = _grads(planner.remat_module, x)
    return planner, grads


def _plain_grads() -> list[torch.Tensor]:
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(1))
    return _grads(_model(), x)


def _entries(n: int) -> list[tuple[PlanBasis, Graph, object]]:
    out = []
    for i in range(n):
        graph = Graph.chain([1000 + i] * 40)
        plan = make_plan(graph, [(graph.ids[:20], "recompute"), (graph.ids[20:], "keep")], "test")
        basis = PlanBasis(graph.graph_hash(), f"input {i}", "cpu", "'60%'", "chen[]", "off",
                          "torch.float32", "2.13.0")
        out.append((basis, graph, plan))
    return out


def _our_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "lightning-remat" in str(w.message)]


def test_a_cache_with_random_bytes_after_its_first_page_is_moved_aside_and_training_goes_on(tmp_path):
    path = tmp_path / "plans.sqlite"
    cache = PlanCache(path)
    for basis, graph, plan in _entries(3):
        cache.put(basis, graph, plan)
    data = path.read_bytes()
    assert len(data) > PAGE
    path.write_bytes(data[:PAGE] + random.Random(0).randbytes(len(data) - PAGE))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, grads = _plan_and_train(path)
    messages = _our_warnings(record)
    assert len(messages) == 1 and "moved it to" in messages[0], messages
    assert (tmp_path / "plans.sqlite.corrupt").exists()
    for a, b in zip(grads, _plain_grads()):
        assert torch.equal(a, b)
    assert len(PlanCache(path)) == 1  # the new file holds the plan just made


def test_a_plans_table_of_another_schema_is_moved_aside(tmp_path):
    path = tmp_path / "plans.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE plans (key TEXT PRIMARY KEY, value TEXT)")
        db.execute("INSERT INTO plans VALUES ('a', 'b')")
    with pytest.warns(UserWarning, match="columns") as record:
        _, grads = _plan_and_train(path)
    assert len(_our_warnings(record)) == 1
    assert (tmp_path / "plans.sqlite.corrupt").exists()
    with sqlite3.connect(tmp_path / "plans.sqlite.corrupt") as db:  # kept as it was
        assert db.execute("SELECT value FROM plans").fetchall() == [("b",)]
    for a, b in zip(grads, _plain_grads()):
        assert torch.equal(a, b)


def test_a_cache_corrupted_at_any_page_warns_once_moves_aside_and_keeps_working(tmp_path):
    source = tmp_path / "clean.sqlite"
    cache = PlanCache(source)
    entries = _entries(3)
    for basis, graph, plan in entries:
        cache.put(basis, graph, plan)
    data = source.read_bytes()
    pages = len(data) // PAGE
    assert pages >= 4
    garbage = random.Random(1).randbytes(PAGE)
    for k in range(pages):
        folder = tmp_path / f"page{k}"
        folder.mkdir()
        path = folder / "plans.sqlite"
        path.write_bytes(data[:k * PAGE] + garbage + data[(k + 1) * PAGE:])
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            cache = PlanCache(path)
            found = [cache.get(basis) for basis, _, _ in entries]
        messages = _our_warnings(record)
        assert len(messages) == 1 and "moved it to" in messages[0], (k, messages)
        assert (folder / "plans.sqlite.corrupt").exists(), k
        for (_, graph, plan), hit in zip(entries, found):
            assert hit is None or (hit.plan == plan and hit.graph.to_dict() == graph.to_dict()), k
        basis, graph, plan = entries[0]
        cache.put(basis, graph, plan)  # the new file works
        assert PlanCache(path).get(basis).plan == plan


def test_rows_still_readable_are_kept_when_the_file_is_moved_aside(tmp_path):
    path = tmp_path / "plans.sqlite"
    cache = PlanCache(path)
    entries = _entries(2)
    for basis, graph, plan in entries:
        cache.put(basis, graph, plan)
    with sqlite3.connect(path) as db:  # one row's text damaged, the file itself sound
        db.execute("UPDATE plans SET plan = '{\"stages\": [' WHERE key = ?", (entries[0][0].digest(),))
    with pytest.warns(UserWarning, match="moved it to"):
        assert cache.get(entries[0][0]) is None
    assert cache.get(entries[1][0]).plan == entries[1][2]  # the other key's plan survived


def _trial(batch_size: int) -> TrialResult:
    return TrialResult(batch_size <= 12, peak_bytes=batch_size * 100, seconds=0.01)


def test_an_unreadable_study_file_is_moved_aside_and_the_search_runs(tmp_path):
    path = tmp_path / "batch_size.db"
    run_search(_trial, storage=f"sqlite:///{path}", study_name="s")
    data = path.read_bytes()
    path.write_bytes(data[:PAGE] + random.Random(2).randbytes(len(data) - PAGE))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = run_search(_trial, storage=f"sqlite:///{path}", study_name="s")
    messages = _our_warnings(record)
    assert len(messages) == 1 and "moved it to" in messages[0], messages
    assert result.largest_feasible == 12 and (tmp_path / "batch_size.db.corrupt").exists()


def _without_cache(messages: list[str]) -> bool:
    return len(messages) == 1 and "without" in messages[0]


def test_a_cache_folder_under_a_file_warns_once_and_plans_in_memory(tmp_path):
    # Root may write to any directory; a path under a file fails for everyone.
    (tmp_path / "blocker").write_text("not a folder")
    path = tmp_path / "blocker" / "cache" / "plans.sqlite"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        planner, grads = _plan_and_train(path)
        basis, graph, plan = _entries(1)[0]
        cache = planner.cache
        cache.put(basis, graph, plan)
        assert cache.get(basis) is None and len(cache) == 0 and cache.bases() == []
    messages = _our_warnings(record)
    assert _without_cache(messages) and str(path.parent) in messages[0], messages
    for a, b in zip(grads, _plain_grads()):
        assert torch.equal(a, b)


def test_a_read_only_cache_is_neither_moved_nor_stops_training(tmp_path, monkeypatch):
    path = tmp_path / "plans.sqlite"
    cache = PlanCache(path)
    for basis, graph, plan in _entries(2):
        cache.put(basis, graph, plan)
    before = path.read_bytes()

    def read_only(*args, **kwargs):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    # chmod does not stop root, so the read-only file is simulated at SQLite's door.
    monkeypatch.setattr("lightning_remat.cache.sqlite3.connect", read_only)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, grads = _plan_and_train(path)
    messages = _our_warnings(record)
    assert _without_cache(messages) and "readonly" in messages[0], messages
    monkeypatch.undo()
    assert path.read_bytes() == before and not (tmp_path / "plans.sqlite.corrupt").exists()
    for a, b in zip(grads, _plain_grads()):
        assert torch.equal(a, b)


def test_a_read_only_cache_directory_does_not_stop_a_fit_at_setup(tmp_path, monkeypatch):
    """Lightning's defaults over a root directory whose plan cache exists and cannot be
    written (a read-only mount): the fit runs to its end on plans made in memory, with one
    warning, and the cache is neither moved aside nor changed."""
    import pytorch_lightning as pl

    import lightning_remat  # noqa: F401  (registers the strategy)
    from tests.lit_models import ConvNet, loaders, trainer_kwargs

    folder = tmp_path / "lightning_remat_cache"
    folder.mkdir()
    cache = PlanCache(folder / "plans.sqlite")
    for basis, graph, plan in _entries(2):
        cache.put(basis, graph, plan)
    before = sorted((p.name, p.read_bytes()) for p in folder.iterdir())

    def read_only(*args, **kwargs):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    # chmod does not stop root, so the read-only mount is simulated at SQLite's door.
    monkeypatch.setattr("lightning_remat.cache.sqlite3.connect", read_only)
    pl.seed_everything(0)
    trainer = pl.Trainer(strategy="remat", **trainer_kwargs(tmp_path, max_epochs=1))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(ConvNet(), *loaders())
    monkeypatch.undo()
    messages = _our_warnings(record)
    assert _without_cache(messages) and "readonly" in messages[0], messages
    assert trainer.state.finished and trainer.global_step > 0
    assert trainer.strategy.planner.last is not None  # planned, in memory
    assert sorted((p.name, p.read_bytes()) for p in folder.iterdir()) == before


def test_a_root_dir_whose_cache_folder_is_a_file_still_fits(tmp_path):
    import pytorch_lightning as pl

    import lightning_remat  # noqa: F401  (registers the strategy)
    from tests.lit_models import ConvNet, loaders, trainer_kwargs

    (tmp_path / "lightning_remat_cache").write_text("not a folder")
    pl.seed_everything(0)
    model = ConvNet()
    trainer = pl.Trainer(strategy="remat", **trainer_kwargs(tmp_path, max_epochs=1))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model, *loaders())
    messages = _our_warnings(record)
    assert _without_cache(messages) and "lightning_remat_cache" in messages[0], messages
    assert trainer.state.finished and trainer.global_step > 0
    assert trainer.strategy.planner.last is not None  # planned, in memory


def test_a_study_file_that_cannot_be_created_warns_once_and_the_search_runs(tmp_path):
    from lightning_remat.tuning.study import default_storage

    (tmp_path / "lightning_remat_cache").write_text("not a folder")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = run_search(_trial, storage=default_storage(tmp_path), study_name="s")
    messages = _our_warnings(record)
    assert _without_cache(messages) and "lightning_remat_cache" in messages[0], messages
    assert result.largest_feasible == 12
