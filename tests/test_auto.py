"""solver="auto": TC, then MC, then DynProg offloading, then the best infeasible plan."""

from __future__ import annotations

import random

import pytest

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers import auto, min_budget, solve
from lightning_remat.solvers.auto import min_budget_solve_auto, solve_auto
from lightning_remat.solvers.kusumoto import solve_approx_mc, solve_approx_tc

GRAPH = Graph.chain([4, 3, 5, 2, 6, 1, 7], t_fwd=[1, 2, 1, 3, 1, 2, 2])


@pytest.fixture
def no_offload(monkeypatch):
    def unavailable(*args, **kwargs):
        raise ValueError("offloading is not planned in this test")

    monkeypatch.setattr(auto, "solve_dynprog", unavailable)
    monkeypatch.setattr(auto, "min_budget_solve_dynprog", unavailable)


def test_tc_first_when_it_fits(no_offload):
    budget = 2 * int(GRAPH.total("mem"))
    plan = solve_auto(GRAPH, budget)
    assert plan.solver == "auto:kusumoto-tc" and plan.feasible
    assert plan.predicted_extra_seconds == solve_approx_tc(GRAPH, budget).predicted_extra_seconds


def test_falls_back_to_mc_where_no_tc_plan_fits(no_offload):
    """Search seeded random chains for a budget where no budget handed to the TC DP gives a
    plan whose predicted peak fits, while the MC plan fits (the paper's reason for MC); auto
    must take MC and say why TC failed."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(4, 9)
        graph = Graph.chain([rng.randint(1, 9) for _ in range(n)],
                            t_fwd=[rng.randint(1, 5) for _ in range(n)])
        for budget in range(2 * int(graph.total("mem")), 0, -1):
            mc = solve_approx_mc(graph, budget)
            if mc.predicted_peak_bytes > budget or not mc.feasible:
                continue
            tc_fits = any(
                (tc := solve_approx_tc(graph, given)).feasible and tc.predicted_peak_bytes <= budget
                for given in range(1, 4 * int(graph.total("mem")))
            )
            if not tc_fits:
                plan = solve_auto(graph, budget)
                assert plan.solver == "auto:kusumoto-mc" and plan.feasible
                assert plan.predicted_peak_bytes <= budget
                assert any(note.startswith("kusumoto-tc failed") for note in plan.notes)
                return
    pytest.fail("no chain where MC fits and no TC plan does")


def test_tc_budget_is_calibrated_against_the_simulator(no_offload):
    """Where the TC plan at the budget itself does not fit but the DP given less room has one
    that does, auto takes that one (the DP's formula has no parameter gradients)."""
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(4, 9)
        graph = Graph.chain([rng.randint(1, 9) for _ in range(n)],
                            t_fwd=[rng.randint(1, 5) for _ in range(n)])
        for budget in range(2 * int(graph.total("mem")), 0, -1):
            at_budget = solve_approx_tc(graph, budget)
            if at_budget.predicted_peak_bytes <= budget:
                continue
            plan = solve_auto(graph, budget)
            if plan.solver == "auto:kusumoto-tc":
                assert plan.feasible and plan.predicted_peak_bytes <= budget
                return
    pytest.fail("no chain where calibration was needed")


def test_falls_back_to_mc_by_control_flow(no_offload, monkeypatch):
    budget = 2 * int(GRAPH.total("mem"))
    real_tc = auto.solve_approx_tc

    def tc_that_misses(graph, budget_bytes, **options):
        plan = real_tc(graph, budget_bytes, **options)
        plan.predicted_peak_bytes = budget + 1
        return plan

    monkeypatch.setattr(auto, "solve_approx_tc", tc_that_misses)
    plan = solve_auto(GRAPH, budget)
    assert plan.solver == "auto:kusumoto-mc"
    assert "exceeds the budget" in plan.notes[0]


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


def test_memory_centric_dp_at_a_looser_budget_is_used_when_its_real_peak_fits(no_offload, monkeypatch):
    """The MC DP's formula has no liveness: where it finds nothing at the budget but its plan
    for a looser budget has a simulated peak within it, auto takes that plan."""
    from lightning_remat.solvers.simulate import plain_plan

    plain = plain_plan(GRAPH).predicted_peak_bytes
    loose = solve_approx_mc(GRAPH, plain)  # the scan's 1.0
    budget = loose.predicted_peak_bytes
    assert budget < plain
    real_mc = auto.solve_approx_mc

    def mc_blind_below(graph, b, **kw):
        plan = real_mc(graph, b, **kw)
        if b is None or b < plain:
            plan.feasible = False  # "no strategy meets the budget under the DP's formula"
            plan.predicted_peak_bytes = plain
        return plan

    monkeypatch.setattr(auto, "solve_approx_mc", mc_blind_below)
    monkeypatch.setattr(auto, "_memory_optimal_plans", lambda graph, b: [])
    monkeypatch.setattr(auto, "_calibrated_tc", lambda graph, b, opts: solve_approx_tc(graph, 1))
    plan = solve_auto(GRAPH, budget)
    assert plan.feasible and plan.solver == "auto:kusumoto-mc"
    assert plan.predicted_peak_bytes <= budget
    assert any("given" in note for note in plan.notes)
