import sqlite3

import pytest

from lightning_remat.cache import PlanBasis, PlanCache
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.scoring import make_plan


def _setup(tmp_path):
    graph = Graph.chain([100] * 4)
    plan = make_plan(graph, [(graph.ids[:2], "recompute"), (graph.ids[2:], "keep")], "test")
    key = PlanBasis(graph.graph_hash(), repr(((8, 3, 32, 32), "torch.float32")), "cpu", "1000", "auto",
                    "off", "torch.float32", "2.13.0")
    return PlanCache(tmp_path / "plans.sqlite"), key, graph, plan


def test_hit_after_put_and_miss_on_any_other_key(tmp_path):
    cache, key, graph, plan = _setup(tmp_path)
    assert cache.get(key) is None
    cache.put(key, graph, plan)
    entry = PlanCache(tmp_path / "plans.sqlite").get(key)  # a new process would open anew
    assert entry is not None and entry.plan == plan and entry.graph.to_dict() == graph.to_dict()
    for changed in (dict(budget="999"), dict(input_key=repr(((4, 3, 32, 32), "torch.float32"))),
                    dict(solver="x"), dict(device_name="cuda"), dict(autocast="torch.bfloat16"),
                    dict(param_dtype="torch.float16"), dict(torch_version="2.14.0")):
        other = PlanBasis(**{**key.__dict__, **changed})
        assert cache.get(other) is None


def test_corrupted_entry_is_ignored_with_a_warning_and_dropped(tmp_path):
    cache, key, graph, plan = _setup(tmp_path)
    cache.put(key, graph, plan)
    with sqlite3.connect(cache.path) as db:
        db.execute("UPDATE plans SET plan = ?", ('{"stages": [{"nodes": ["nope"], "action": "keep"}]',))
    with pytest.warns(UserWarning, match="cannot be read"):
        assert cache.get(key) is None
    assert len(cache) == 0 and (tmp_path / "plans.sqlite.corrupt").exists()


def test_plan_that_does_not_cover_the_graph_is_stale(tmp_path):
    cache, key, graph, plan = _setup(tmp_path)
    bad = make_plan(graph, [(graph.ids, "keep")], "test")
    bad.stages[0].nodes = graph.ids[:3]
    cache.put(key, graph, bad)
    with pytest.warns(UserWarning, match="in no stage"):
        assert cache.get(key) is None


def test_unreadable_file_is_moved_aside(tmp_path):
    path = tmp_path / "plans.sqlite"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.warns(UserWarning, match="cannot be read"):
        cache = PlanCache(path)
    assert len(cache) == 0 and (tmp_path / "plans.sqlite.corrupt").exists()


def test_a_plan_made_for_another_world_size_or_sharding_is_made_again_with_one_line():
    import dataclasses
    import warnings

    import torch
    from torch import nn

    from lightning_remat.cache import StoredPlan
    from lightning_remat.planner import Planner, PlanSettings

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.Tanh())])
    x = torch.randn(2048, 16)  # activations well above the random-number stash of a recomputed stage
    first = Planner(model, PlanSettings("75%", profile_repeats=1))
    entry = first.planned_for((x,), {})
    assert (entry.basis.world_size, entry.basis.sharding) == ("1", "none")
    stored = StoredPlan(entry.graph.to_json(), entry.plan.to_json(),
                        dataclasses.replace(entry.basis, world_size="2", sharding="fully_shard: Linear x6"))
    again = Planner(model, PlanSettings("75%", profile_repeats=1), restored={repr(entry.key): stored})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.planned_for((x,), {})
    lines = [str(w.message) for w in caught if "planning again" in str(w.message)]
    assert lines == ["lightning-remat: the checkpoint's plan was made for world size 2, sharding "
                     "fully_shard: Linear x6, this run asks for world size 1, sharding none: planning again"]
    # A basis without every field does not read: its plan is never reused.
    partial = {k: v for k, v in stored.to_dict()["basis"].items() if k not in ("world_size", "sharding")}
    assert PlanBasis.from_dict(partial) is None
    assert PlanBasis.from_dict(stored.to_dict()["basis"]) == stored.basis


def _edit_cached_plan(path, edit) -> None:
    """Change the one plan stored in the SQLite file as a person with sqlite3 would."""
    import json

    with sqlite3.connect(path) as db:
        (text,) = db.execute("SELECT plan FROM plans").fetchone()
        plan = json.loads(text)
        edit(plan)
        db.execute("UPDATE plans SET plan = ?", (json.dumps(plan),))


def test_a_cached_plan_is_simulated_again_before_it_is_trusted(tmp_path):
    """A plan edited in the cache file (every stage set to keep, its stored prediction left
    as it was) is over its budget on its own graph: one warning, planned afresh, the fresh
    plan trains as plain PyTorch and replaces it in a file that still reads. A stored
    prediction is never taken as it is: the simulator's replaces it."""
    import copy
    import warnings

    import torch
    from torch import nn

    from lightning_remat.planner import Planner, PlanSettings

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.Tanh())])
    plain = copy.deepcopy(model)
    x = torch.randn(2048, 16)
    path, settings = tmp_path / "plans.sqlite", PlanSettings("75%", profile_repeats=1)
    made = Planner(model, settings, cache=PlanCache(path)).planned_for((x,), {})
    assert made.plan.count("recompute") > 0 and not made.from_cache

    _edit_cached_plan(path, lambda plan: plan.update(predicted_peak_bytes=1, margin_bytes=0))
    warm = Planner(model, settings, cache=PlanCache(path)).planned_for((x,), {})
    assert warm.from_cache and warm.plan == made.plan  # the simulator's prediction, not the file's
    assert warm.plan.guaranteed_peak_bytes == made.plan.guaranteed_peak_bytes

    _edit_cached_plan(path, lambda plan: [stage.update(action="keep") for stage in plan["stages"]])
    planner = Planner(model, settings, cache=PlanCache(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = planner.planned_for((x,), {})
    said = [str(w.message) for w in caught if "plan cache" in str(w.message)]
    assert len(said) == 1 and "over the budget" in said[0] and "planning again" in said[0], said
    assert not again.from_cache and again.plan.count("recompute") > 0
    assert again.plan.guaranteed_peak_bytes <= again.budget_bytes
    stored = PlanCache(path).get(again.basis)  # the file reads, and holds the fresh plan
    assert stored is not None and stored.plan == again.plan
    assert not list(tmp_path.glob("*.corrupt*"))
    planner(x).sum().backward()
    plain(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name
