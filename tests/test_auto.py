"""solver="auto": TC, then MC, then DynProg offloading, then the best infeasible plan."""

from __future__ import annotations

import pytest

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers import auto, min_budget, solve
from lightning_remat.solvers.auto import min_budget_solve_auto, solve_auto
from lightning_remat.solvers.kusumoto import (
    min_budget_solve_approx_tc,
    solve_approx_mc,
    solve_approx_tc,
)

GRAPH = Graph.chain([4, 3, 5, 2, 6, 1, 7], t_fwd=[1, 2, 1, 3, 1, 2, 2])


@pytest.fixture
def no_offload(monkeypatch):
    def unavailable(*args, **kwargs):
        raise ValueError("offloading is not planned in this test")

    monkeypatch.setattr(auto, "solve_dynprog", unavailable)
    monkeypatch.setattr(auto, "min_budget_solve_dynprog", unavailable)


def test_tc_first_when_it_fits(no_offload):
    budget = min_budget_solve_approx_tc(GRAPH) + 5
    plan = solve_auto(GRAPH, budget)
    assert plan.solver == "auto:kusumoto-tc" and plan.feasible
    assert plan.predicted_extra_seconds <= solve_approx_tc(GRAPH, budget).predicted_extra_seconds
    assert plan.guaranteed_peak_bytes <= budget


def test_the_time_centric_dp_runs_above_the_budget_only_once_it_fits(no_offload, monkeypatch):
    """auto runs the time-centric DP at the budget, then, where it has a plan, at a few
    budgets above it (a bounded scan); where it has none, the memory-centric DP once."""
    calls: list[tuple[str, int | None]] = []
    real_tc, real_mc = auto.solve_approx_tc, auto.solve_approx_mc

    def tc(graph, budget_bytes, **options):
        calls.append(("tc", budget_bytes))
        return real_tc(graph, budget_bytes, **options)

    def mc(graph, budget_bytes, **options):
        calls.append(("mc", budget_bytes))
        return real_mc(graph, budget_bytes, **options)

    monkeypatch.setattr(auto, "solve_approx_tc", tc)
    monkeypatch.setattr(auto, "solve_approx_mc", mc)
    least = min_budget_solve_approx_tc(GRAPH)
    solve_auto(GRAPH, least)
    assert calls[0] == ("tc", least)
    assert all(kind == "tc" and budget > least for kind, budget in calls[1:])
    assert len(calls) <= 1 + len(auto.SCAN_SCALES) + auto.SCAN_BISECTIONS
    calls.clear()
    solve_auto(GRAPH, least - 1)
    assert calls == [("tc", least - 1), ("mc", least - 1)]


def test_falls_back_to_mc_by_control_flow(no_offload, monkeypatch):
    budget = 2 * int(GRAPH.total("mem"))
    real_tc = auto.solve_approx_tc

    def tc_that_misses(graph, budget_bytes, **options):
        plan = real_tc(graph, budget_bytes, **options)
        plan.feasible = False
        return plan

    monkeypatch.setattr(auto, "solve_approx_tc", tc_that_misses)
    plan = solve_auto(GRAPH, budget)
    assert plan.solver == "auto:kusumoto-mc" and plan.feasible
    assert plan.notes[0].startswith("kusumoto-tc found no strategy")


def test_nothing_fits_returns_least_peak_plan_and_notes_the_missing_offloader(no_offload):
    plan = solve_auto(GRAPH, 1)
    assert not plan.feasible
    assert plan.solver.startswith("auto:kusumoto-")
    assert any("dynprog skipped" in note for note in plan.notes)
    assert any("nothing fits" in note for note in plan.notes)
    with pytest.raises(Exception, match="smallest feasible budget"):
        solve(GRAPH, 1, "auto")


def test_offloading_is_tried_last(monkeypatch):
    calls = []

    def fake_dynprog(graph, budget_bytes, **options):
        calls.append(budget_bytes)
        plan = solve_approx_mc(graph, None)
        plan.feasible = True
        plan.predicted_peak_bytes = 0  # a schedule that fits: auto also checks the simulator's peak
        plan.solver = "dynprog"
        return plan

    monkeypatch.setattr(auto, "solve_dynprog", fake_dynprog)
    plan = solve_auto(GRAPH, 1)
    assert calls == [1] and plan.solver == "auto:dynprog" and plan.feasible


def test_min_budget_is_a_budget_auto_meets(no_offload):
    least = min_budget_solve_auto(GRAPH)
    assert solve_auto(GRAPH, least).feasible
    assert not solve_auto(GRAPH, least - 1).feasible or least - 1 < 0
    assert min_budget(GRAPH, "auto") == least


def test_no_budget_is_plain_tc(no_offload):
    plan = solve_auto(GRAPH, None)
    assert plan.solver == "auto:kusumoto-tc" and len(plan.stages) == 1 and plan.feasible


def test_auto_spends_the_budget_the_time_centric_dp_leaves():
    """A ResNet-50 profiled on an H200 (benchmarks/results/run/cuda): the DP's summed cache
    counts values the simulator frees between stages, so its plan for a budget leaves part
    of it unspent. auto's plan fits the budget with less extra time than the DP's own."""
    from pathlib import Path

    from lightning_remat.solvers.policy import plain_peak_bytes

    graph = Graph.load(Path(__file__).parents[1] / "benchmarks/results/run/cuda/plans/resnet50.graph.json")
    for fraction in (0.5, 0.75):
        budget = int(plain_peak_bytes(graph) * fraction)
        dp = solve_approx_tc(graph, budget)
        plan = solve(graph, budget, "auto")
        assert plan.feasible and plan.guaranteed_peak_bytes <= budget
        assert plan.predicted_extra_seconds < dp.predicted_extra_seconds, fraction


def test_the_smallest_budget_depends_on_the_bytes_not_the_times():
    """Two profiles of one model measure the same bytes and times apart (tiny CPU ops vary
    by half and more). The smallest budget auto names is the same for both, and each
    profile's plan fits it: the budget an error named after one profile is accepted after
    the next."""
    import dataclasses
    import random

    import torch

    from lightning_remat import remat
    from tests.models import TinyLM

    torch.manual_seed(0)
    graph = remat(TinyLM(vocab=500, dim=32, heads=2, layers=3, max_len=64),
                  torch.randint(0, 500, (8, 64)), None).graph
    rng = random.Random(0)
    named = []
    for _ in range(6):
        nodes = [dataclasses.replace(n, t_fwd=n.t_fwd * rng.uniform(0.5, 2.0),
                                     t_bwd=n.t_bwd * rng.uniform(0.5, 2.0)) for n in graph.nodes]
        meta = graph.meta.copy()
        for name in ("recompute_stage_seconds", "recompute_vertex_seconds"):  # the executor's
            setattr(meta, name, getattr(meta, name) * rng.uniform(0.5, 2.0))
        profile = Graph(nodes, list(graph.edges), meta)
        least = min_budget(profile, "auto")
        plan = solve(profile, least, "auto")
        assert plan.feasible and plan.guaranteed_peak_bytes <= least
        named.append(least)
    assert len(set(named)) == 1, named


def test_a_llama_is_planned_within_the_peak_of_hugging_face_checkpointing():
    """examples/hf_finetune.py's Llama with its config's defaults, its own loss, profiled on a
    CPU (tests/data/llama_cpu_b8.json: 269 ATen vertices, too many pairs of lower sets to
    simulate every one): the smallest budget auto names is at most the predicted peak of
    Hugging Face's gradient checkpointing (every decoder layer recomputed, the rest kept;
    its measured peak on that CPU was within 1 KiB of it), and auto plans within that. The
    upper bound alone named a budget 18% above it; the time-centric plan on the sampled
    family's smallest budget was 10% over by the simulator where the memory-centric one fit."""
    from pathlib import Path

    from lightning_remat.solvers.plan import Stage
    from lightning_remat.solvers.scoring import make_plan

    graph = Graph.load(Path(__file__).parent / "data" / "llama_cpu_b8.json")
    ids = graph.ids
    # Each RMSNorm starts with its float cast feeding a pow: two per decoder layer, then the final one.
    norms = [k - 1 for k, node in enumerate(graph.nodes) if node.op == "pow"]
    assert len(norms) == 9
    starts = [0, *norms[0:8:2], norms[8], len(ids)]
    actions = ["keep", *["recompute"] * 4, "keep"]
    hf = make_plan(graph, [Stage(ids[a:b], act) for a, b, act in zip(starts, starts[1:], actions)], "hf")
    least = min_budget(graph, "auto")
    assert least <= hf.predicted_peak_bytes
    plan = solve(graph, hf.predicted_peak_bytes, "auto")
    assert plan.feasible and plan.guaranteed_peak_bytes <= hf.predicted_peak_bytes
