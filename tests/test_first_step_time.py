"""The first planned step's time against the plan's prediction: the correction of the
graph's times from a measurement, and the planner choosing the plan again with them. The
measured times are injected (no timed assertion: a test's own timings would be noise)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_remat.graph.ir import Graph
from lightning_remat.planner import Planner, PlanSettings
from lightning_remat.runtime.stepcheck import (
    TIME_POINTS,
    StepTimes,
    correct_times,
    predicted_extra_seconds,
    time_error,
)
from lightning_remat.solvers import min_budget, plain_plan, solve


def _graph() -> Graph:
    graph = Graph.chain([100] * 12, t_fwd=[1e-3] * 12)
    graph.meta.recompute_stage_seconds, graph.meta.recompute_vertex_seconds = 2e-4, 1e-5
    return graph


def _plan(graph: Graph):
    low, high = min_budget(graph, "kusumoto-tc"), plain_plan(graph).guaranteed_peak_bytes
    plan = solve(graph, (low + high) // 2, "kusumoto-tc")
    assert plan.count("recompute") > 0
    return plan


@pytest.mark.parametrize("factor", [3.0, 1.2, 0.5, 0.05])
def test_corrected_times_reproduce_the_measured_extra_time(factor: float) -> None:
    """Slower than predicted (the stage's time raised) or faster (the stage's, the
    vertex's and then the ops' times lowered): scored again with the corrected times, the
    plan's stages predict what was measured."""
    graph = _graph()
    plan = _plan(graph)
    predicted = predicted_extra_seconds(graph, plan)
    measured = factor * predicted
    said = correct_times(graph, plan, measured)
    assert said
    assert predicted_extra_seconds(graph, plan) == pytest.approx(measured, rel=1e-6)
    if factor > 1:
        assert graph.meta.recompute_stage_seconds > 2e-4 and graph.meta.recompute_vertex_seconds == 1e-5
    if factor == 0.05:
        assert graph.meta.recompute_stage_seconds == graph.meta.recompute_vertex_seconds == 0.0
        assert all(node.t_fwd < 1e-3 for node in graph.nodes)


def test_a_plan_that_recomputes_nothing_is_not_corrected() -> None:
    graph = _graph()
    plan = solve(graph, None, "plain")
    assert correct_times(graph, plan, 1.0) == ""
    assert graph.meta.recompute_stage_seconds == 2e-4


def test_a_difference_within_five_points_or_within_noise_is_no_error() -> None:
    plain = 1.0
    assert time_error(0.10, StepTimes(plain, plain + 0.10 + 0.9 * TIME_POINTS)) is None
    assert time_error(0.10, StepTimes(plain, plain + 0.30, noise_seconds=0.15)) is None
    assert time_error(0.10, StepTimes(plain, plain + 0.30, noise_seconds=0.01)) == pytest.approx(0.20)
    assert time_error(0.30, StepTimes(plain, plain + 0.10)) == pytest.approx(-0.20)


def _chain_planner(step_times, budget: str = "75%") -> tuple[Planner, torch.Tensor]:
    """A chain of 16 Linear and Tanh layers and its planner, its op times set (one op in
    eight costly, which free stages split around to keep it) and the executor's own time
    profiled as none, so that a measured time per stage changes the DP's choice."""
    from lightning_remat.graph.profile import profile_module

    def profiled(module, args, kwargs, traced) -> Graph:
        graph = profile_module(module, args, example_kwargs=kwargs or None, traced=traced, repeats=1)
        graph.meta.recompute_stage_seconds = graph.meta.recompute_vertex_seconds = 0.0
        for i, node in enumerate(graph.nodes):  # the DP's choice not left to this machine's timings
            node.t_fwd = 0.1 if i % 8 == 4 else 1e-3  # a costly op a stage boundary can keep
            node.t_bwd = 2 * node.t_fwd
        return graph

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(64, 64), nn.Tanh())])
    return (Planner(model, PlanSettings(budget), step_times=step_times, profiler=profiled),
            torch.randn(512, 64))


@pytest.fixture
def first_plans(monkeypatch) -> list:
    """The plan each time check starts from, in order."""
    plans: list = []
    original = Planner._check_time

    def recorded(self, planned, *args):
        plans.append(planned.plan)
        return original(self, planned, *args)

    monkeypatch.setattr(Planner, "_check_time", recorded)
    return plans


def test_a_step_off_its_predicted_time_is_planned_again_with_corrected_times_once_per_input(first_plans) -> None:
    """Measured (injected) at half a second per recomputed stage more than predicted: the
    graph's stage time is corrected so that the first plan's stages predict the
    measurement, the plan is the solver's on the corrected graph (fewer recomputed stages,
    no slower by the corrected model), one warning says so, the budget still holds, the
    step is timed once per input key, and the model trains as the plain model does."""
    calls: list[int] = []

    def slow(plain, planned, device) -> StepTimes:
        calls.append(1)
        plain()
        planned()  # each step runs, leaving the module as it was
        first = first_plans[-1]
        return StepTimes(1.0, 1.0 + first.predicted_extra_seconds + 0.5 * first.count("recompute"), 0.0)

    planner, x = _chain_planner(slow)
    reference = copy.deepcopy(planner.module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planner.last = planner.planned_for((x,), {})
    said = [str(w.message) for w in caught if "planned step took" in str(w.message)]
    assert len(said) == 1 and "chosen again" in said[0], said
    assert calls == [1]
    graph, plan = planner.last.graph, planner.last.plan
    first = first_plans[0]
    measured = first.predicted_extra_seconds + 0.5 * first.count("recompute")
    assert predicted_extra_seconds(graph, first) == pytest.approx(measured, rel=1e-3)
    assert plan.count("recompute") < first.count("recompute")
    assert predicted_extra_seconds(graph, plan) <= predicted_extra_seconds(graph, first) * (1 + 1e-9)
    assert plan.stages == solve(graph, planner.last.budget_bytes, "auto", allow_offload=False).stages
    assert plan.guaranteed_peak_bytes <= planner.last.budget_bytes
    assert planner.last.measured_peak_bytes <= planner.last.budget_bytes
    module = planner.remat_module
    module.set_current(planner.last.variant)
    for _ in range(2):
        module(x).sum().backward()
        reference(x).sum().backward()
        for mine, theirs in zip(planner.module.parameters(), reference.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad)
    assert calls == [1]  # the same input is not timed again
    planner.planned_for((x[:256],), {})
    assert calls == [1, 1]  # a new input is


def test_a_step_within_its_predicted_time_keeps_the_plan(first_plans) -> None:
    """Measured 1 point over the prediction: the graph's times and the plan stay, no
    warning."""
    def on_time(plain, planned, device) -> StepTimes:
        return StepTimes(1.0, 1.0 + first_plans[-1].predicted_extra_seconds + 0.01, 0.0)

    planner, x = _chain_planner(on_time)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planner.last = planner.planned_for((x,), {})
    assert not [w for w in caught if "planned step took" in str(w.message)]
    assert planner.last.plan is first_plans[0]
    assert planner.last.graph.meta.recompute_stage_seconds == 0.0
