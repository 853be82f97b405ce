"""The first planned step's time against the plan's prediction: the correction of the
graph's times from a measurement, and the planner choosing the plan again with them. The
measured times are injected (no timed assertion: a test's own timings would be noise)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lightning_remat.planner as planner_module
from lightning_remat.graph.ir import Graph
from lightning_remat.planner import Planner, PlanSettings
from lightning_remat.runtime.stepcheck import (
    TIME_POINTS,
    StepTimes,
    correct_times,
    pooled,
    predicted_extra_seconds,
    time_error,
    undecided,
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


@pytest.mark.parametrize("factor", [3.0, 0.5, 0.05])
def test_with_the_stage_time_measured_on_the_model_the_vertices_of_keeping_stages_take_the_difference(
        factor: float) -> None:
    """Where the stage's time was measured on the model (plain-checkpoint stages), what a
    plan that keeps values measured off its prediction is the policy's, per vertex: that
    time changes first (the stage's stays while the vertex's can take all of it), and the
    schedule the step ran predicts what was measured. Scored again, the plan's stages are
    predicted no slower: where the policy now costs more than running a stage's kept
    values again, the schedule runs that stage under plain checkpoint instead."""
    from lightning_remat.solvers.schedule import make_schedule
    from lightning_remat.solvers.scoring import executor_seconds, recomputed_seconds

    graph = _graph()
    graph.meta.recompute_stage_measured = True
    plan = _plan(graph)
    ran = make_schedule(graph, plan)
    assert any(s.kept for s in ran.stages if s.action == "recompute")
    predicted = predicted_extra_seconds(graph, plan)
    measured = factor * predicted
    said = correct_times(graph, plan, measured)
    assert recomputed_seconds(graph, ran) + executor_seconds(graph, ran) == pytest.approx(measured, rel=1e-6)
    assert predicted_extra_seconds(graph, plan) <= measured * (1 + 1e-9)
    if factor == 3.0:
        assert "per vertex" in said
        assert graph.meta.recompute_stage_seconds == 2e-4 and graph.meta.recompute_vertex_seconds > 1e-5
    else:  # more than the vertices' time to take off: theirs first, then the stage's
        assert graph.meta.recompute_vertex_seconds == 0.0 and graph.meta.recompute_stage_seconds < 2e-4


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


def test_an_error_hidden_only_by_the_noise_is_timed_again_and_read_with_the_first_timing() -> None:
    plain = 1.0
    hidden = StepTimes(plain, plain + 0.30, noise_seconds=0.15)  # 20 points off 0.10, within 2 x noise
    assert undecided(0.10, hidden) and time_error(0.10, hidden) is None
    assert not undecided(0.10, StepTimes(plain, plain + 0.30, noise_seconds=0.01))  # shown: acted on
    assert not undecided(0.10, StepTimes(plain, plain + 0.12, noise_seconds=0.15))  # within 5 points
    first = StepTimes(1.0, 1.3, 0.15, (1.0, 1.15), (1.3, 1.45))
    more = StepTimes(1.01, 1.31, 0.02, (1.01, 1.03), (1.31, 1.32))
    both = pooled(first, more)
    assert (both.plain_seconds, both.planned_seconds) == (1.0, 1.3)
    assert both.noise_seconds == pytest.approx(0.01)  # the second-least of all four steps of a kind
    assert time_error(0.10, both) == pytest.approx(0.20)
    assert pooled(StepTimes(1.0, 1.3, 0.15), more) is more  # no steps kept: the later timing


def test_a_step_off_its_prediction_within_the_noise_is_timed_again_then_corrected(first_plans) -> None:
    """Measured (injected) half a second per recomputed stage over the prediction, with a
    noise as large: the steps are timed again, and that timing, quiet, shows the error; the
    times are corrected and the plan chosen again, as where the first timing showed it."""
    calls: list[int] = []

    def noisy_then_quiet(call: int, first) -> StepTimes:
        off = 0.5 * first.count("recompute")
        if call == 3:  # the plan chosen again: as its first plan was predicted
            return StepTimes(1.0, 1.0 + first.predicted_extra_seconds, 0.0)
        return StepTimes(1.0, 1.0 + first.predicted_extra_seconds + off, off if call == 1 else 0.0)

    planner, x = _chain_planner(_injected(noisy_then_quiet, first_plans, calls))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planner.last = planner.planned_for((x,), {})
    said = [str(w.message) for w in caught if "planned step took" in str(w.message)]
    assert len(said) == 1 and "chosen again" in said[0], said
    assert calls == [1, 1, 1]
    assert planner.last.plan.count("recompute") < first_plans[0].count("recompute")


def _chain_planner(step_times, budget: str = "75%", stage_seconds: float = 0.0) -> tuple[Planner, torch.Tensor]:
    """A chain of 16 Linear and Tanh layers and its planner, its op times set (one op in
    eight costly, which free stages split around to keep it) and the executor's own time
    profiled as ``stage_seconds`` per stage (none per vertex), so that a measured time per
    stage changes the DP's choice."""
    from lightning_remat.graph.profile import profile_module

    def profiled(module, args, kwargs, traced) -> Graph:
        graph = profile_module(module, args, example_kwargs=kwargs or None, traced=traced, repeats=1)
        graph.meta.recompute_stage_seconds, graph.meta.recompute_vertex_seconds = stage_seconds, 0.0
        for i, node in enumerate(graph.nodes):  # the DP's choice not left to this machine's timings
            node.t_fwd = 0.1 if i % 8 == 4 else 1e-3  # a costly op a stage boundary can keep
            node.t_bwd = 2 * node.t_fwd
        return graph

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(64, 64), nn.Tanh())])
    return (Planner(model, PlanSettings(budget), step_times=step_times, profiler=profiled),
            torch.randn(512, 64))


def _trains_as(planner: Planner, reference: nn.Module, x: torch.Tensor) -> None:
    """Two steps of the planner's plan give the gradients two plain steps of ``reference``
    (a copy of the module before planning) give."""
    module = planner.remat_module
    module.set_current(planner.last.variant)
    for _ in range(2):
        module(x).sum().backward()
        reference(x).sum().backward()
        for mine, theirs in zip(planner.module.parameters(), reference.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad)


def _injected(times, first_plans: list, calls: list[int]):
    """A step timer for the planner that runs each step once (leaving the module as it
    was), counts its calls in ``calls`` and answers ``times(the call's number, the plan the
    time check started from)``."""
    def timer(plain, planned, device) -> StepTimes:
        calls.append(1)
        plain()
        planned()
        return times(len(calls), first_plans[-1])

    return timer


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
    no slower by the corrected model, and timed before it is taken: faster than the first),
    one warning says so, the budget still holds, the step is timed once per input key (and
    the plan chosen again once), and the model trains as the plain model does."""
    calls: list[int] = []

    def slow(call: int, first) -> StepTimes:
        if call % 2 == 0:  # the plan chosen again: as its first plan was predicted
            return StepTimes(1.0, 1.0 + first.predicted_extra_seconds, 0.0)
        return StepTimes(1.0, 1.0 + first.predicted_extra_seconds + 0.5 * first.count("recompute"), 0.0)

    planner, x = _chain_planner(_injected(slow, first_plans, calls))
    reference = copy.deepcopy(planner.module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planner.last = planner.planned_for((x,), {})
    said = [str(w.message) for w in caught if "planned step took" in str(w.message)]
    assert len(said) == 1 and "chosen again" in said[0], said
    assert calls == [1, 1]
    graph, plan = planner.last.graph, planner.last.plan
    first = first_plans[0]
    measured = first.predicted_extra_seconds + 0.5 * first.count("recompute")
    assert predicted_extra_seconds(graph, first) == pytest.approx(measured, rel=1e-3)
    assert plan.count("recompute") < first.count("recompute")
    assert predicted_extra_seconds(graph, plan) <= predicted_extra_seconds(graph, first) * (1 + 1e-9)
    assert plan.stages == solve(graph, planner.last.budget_bytes, "auto", allow_offload=False).stages
    assert plan.guaranteed_peak_bytes <= planner.last.budget_bytes
    assert planner.last.measured_peak_bytes <= planner.last.budget_bytes
    _trains_as(planner, reference, x)
    assert calls == [1, 1]  # the same input is not timed again
    planner.planned_for((x[:256],), {})
    assert calls == [1, 1, 1, 1]  # a new input is


def test_a_plan_chosen_again_that_measures_no_faster_is_not_taken(first_plans) -> None:
    """The first step measured (injected) no slower than plain, far under its prediction
    (a slow spell on the plain step): the times corrected to that make running ops again
    look free, and the plan chosen with them recomputes more stages. Timed before it is
    taken, that plan measures slower than the first: the first plan and the profiled times
    are kept, the plan's notes say so, no warning, and the model trains as the plain model
    does."""
    calls: list[int] = []

    def noisy(call: int, first) -> StepTimes:
        base = first.predicted_extra_seconds  # a plain step of that length: 5 points are less
        return StepTimes(base, base, 0.0) if call == 1 else StepTimes(base, 3 * base, 0.0)

    planner, x = _chain_planner(_injected(noisy, first_plans, calls), stage_seconds=0.1)
    reference = copy.deepcopy(planner.module)
    corrected: list[Graph] = []
    original = planner_module.first_step.correct_times

    def correcting(graph, plan, measured):
        said = original(graph, plan, measured)
        corrected.append(copy.deepcopy(graph))
        return said

    with warnings.catch_warnings(record=True) as caught, pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner_module.first_step, "correct_times", correcting)
        warnings.simplefilter("always")
        planner.last = planner.planned_for((x,), {})
    assert not [w for w in caught if "planned step took" in str(w.message)]
    assert calls == [1, 1]  # the first plan, then the plan chosen again
    assert len(corrected) == 1 and corrected[0].meta.recompute_stage_seconds == 0.0
    graph, plan = planner.last.graph, planner.last.plan
    assert plan is first_plans[0]
    assert graph.meta.recompute_stage_seconds == 0.1
    assert [n.t_fwd for n in graph.nodes] == [0.1 if i % 8 == 4 else 1e-3 for i in range(len(graph))]
    assert any(note.startswith("time check:") and "no faster" in note for note in plan.notes), plan.notes
    _trains_as(planner, reference, x)


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


# ---- the stage's time measured on the model -------------------------------------------------
def _profiled_chain() -> tuple[nn.Module, torch.Tensor, Graph]:
    from lightning_remat.graph.profile import profile_module

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(40) for m in (nn.Linear(32, 32), nn.Tanh())])
    x = torch.randn(64, 32)
    return model, x, profile_module(model, (x,), repeats=1)


def test_the_calibration_plan_recomputes_single_linear_layers_that_run_nothing_again() -> None:
    """At most ``CALIBRATION_STAGES`` recomputed stages in the graph's order, each a linear
    layer alone (which saves only its input), the rest kept, the last part too: the
    recomputation packs the layer's input and stops before it computes, so the step's time
    beyond plain is the stages' own cost, with no op run again whose profiled time would be
    taken off it. A graph with no such op gets stages cut at single-tensor boundaries,
    which do recompute their ops."""
    from lightning_remat.runtime.overhead import CALIBRATION_STAGES, calibration_plan
    from lightning_remat.solvers.schedule import make_schedule
    from lightning_remat.solvers.scoring import plain_plan, recomputed_seconds

    _, _, graph = _profiled_chain()
    plan = calibration_plan(graph)
    assert plan is not None
    assert [n for s in plan.stages for n in s.nodes] == graph.ids
    assert plan.count("recompute") == CALIBRATION_STAGES and plan.stages[-1].action == "keep"
    linear = set(graph.ids[0::2])
    assert all(len(s.nodes) == 1 and s.nodes[0] in linear for s in plan.stages if s.action == "recompute")
    schedule = make_schedule(graph, plan)
    assert all(not s.kept and not s.recomputed and s.packed_only and s.runs_again
               for s in schedule.stages if s.action == "recompute")
    assert recomputed_seconds(graph, schedule) == 0.0
    # It saves what the plain step saves: it fits where the profiled plain step did.
    assert plan.predicted_peak_bytes <= plain_plan(graph).predicted_peak_bytes
    assert calibration_plan(graph, stages=3).count("recompute") == 3
    assert calibration_plan(Graph.chain([100], t_fwd=[1e-3])) is None
    # With no op that saves only its inputs (no profile of what each op saves), the cuts.
    graph.meta.saved_refs = None
    cut = calibration_plan(graph)
    assert cut is not None and cut.count("recompute") == CALIBRATION_STAGES
    assert recomputed_seconds(graph, make_schedule(graph, cut)) > 0
    # At the tanh layers (which save their output) every stage keeps its boundary under the
    # selective policy: that plan measures the policy's time per vertex.
    _, _, graph = _profiled_chain()
    policy = calibration_plan(graph, policy=True)
    assert [n for s in policy.stages for n in s.nodes] == graph.ids
    assert all(s.nodes[-1] in graph.ids[1::2] for s in policy.stages[:-1])
    assert all(s.kept for s in make_schedule(graph, policy).stages if s.action == "recompute")


def test_the_stage_time_measured_on_the_model_is_the_extra_time_beyond_the_ops_run_again() -> None:
    """The measured extra time less the ops run again (their profiled forward time) and
    the policy's per-vertex time, per recomputed stage; None (the chain's figure stands)
    within twice the noise or 1% of the plain step; never below 0."""
    from lightning_remat.runtime.overhead import calibration_plan, measured_stage_seconds
    from lightning_remat.solvers.schedule import make_schedule
    from lightning_remat.solvers.scoring import recomputed_seconds

    _, _, graph = _profiled_chain()
    graph.meta.recompute_stage_seconds, graph.meta.recompute_vertex_seconds = 2e-4, 1e-5
    plan = calibration_plan(graph)
    schedule = make_schedule(graph, plan)
    again, k = recomputed_seconds(graph, schedule), plan.count("recompute")
    assert measured_stage_seconds(graph, plan, StepTimes(1.0, 1.0 + again + k * 3e-3, 1e-3)) \
        == pytest.approx(3e-3)
    assert measured_stage_seconds(graph, plan, StepTimes(1.0, 1.0 + again + k * 3e-3, 0.05)) is None
    assert measured_stage_seconds(graph, plan, StepTimes(1.0, 1.0 + again + k * 5e-4, 0.0)) is None  # < 1%
    assert measured_stage_seconds(graph, plan, StepTimes(1.0, 1.0, 0.0)) in (None, 0.0)
    assert measured_stage_seconds(graph, plan, StepTimes(1.0, 0.9, 0.0)) == 0.0


def test_the_policy_time_measured_on_the_model_is_the_extra_time_beyond_the_ops_and_stages() -> None:
    """The measured extra time less the ops run again and each stage's time, per vertex
    under the policy; None within the noise, and for a plan with no such vertex."""
    from lightning_remat.runtime.overhead import calibration_plan, measured_vertex_seconds
    from lightning_remat.solvers.schedule import make_schedule
    from lightning_remat.solvers.scoring import recomputed_seconds

    _, _, graph = _profiled_chain()
    # No policy time yet: with one, the schedule runs a stage whose kept values cost less
    # than the policy under plain checkpoint instead.
    graph.meta.recompute_stage_seconds, graph.meta.recompute_vertex_seconds = 2e-3, 0.0
    plan = calibration_plan(graph, policy=True)
    schedule = make_schedule(graph, plan)
    again, k = recomputed_seconds(graph, schedule), plan.count("recompute")
    n = sum(len(s.vertices) for s in schedule.stages if s.action == "recompute" and s.kept)
    assert n > 0
    assert measured_vertex_seconds(graph, plan, StepTimes(1.0, 1.0 + again + k * 2e-3 + n * 4e-4, 1e-3)) \
        == pytest.approx(4e-4)
    assert measured_vertex_seconds(graph, plan, StepTimes(1.0, 1.0 + again + k * 2e-3 + n * 4e-4, 0.1)) is None
    assert measured_vertex_seconds(graph, calibration_plan(graph), StepTimes(1.0, 2.0, 0.0)) is None


def test_op_times_over_the_plain_step_are_scaled_to_it_before_the_stage_time_is_measured() -> None:
    """A profile whose op times sum to twice the plain step they are part of (the profiler's
    own time inside each op's interval) is scaled to the step before the calibration plan's
    extra time is split (stages cut at single-tensor boundaries, which run their ops
    again), so the stages' own 3 ms each is measured, not hidden under the ops
    run again (0 without the scaling); op times within the step are left as they are."""
    from lightning_remat.runtime.overhead import calibrate_on_model, calibration_plan
    from lightning_remat.solvers.schedule import make_schedule
    from lightning_remat.solvers.scoring import recomputed_seconds

    _, _, graph = _profiled_chain()
    # No record of what each op saves: the calibration plan's stages run their ops again.
    graph.meta.saved_refs = None
    graph.meta.recompute_stage_seconds, graph.meta.recompute_vertex_seconds = 2e-4, 0.0
    ops = graph.total("t_fwd", graph.ids) + graph.total("t_bwd", graph.ids)
    plan = calibration_plan(graph)
    k = plan.count("recompute")
    true_again = recomputed_seconds(graph, make_schedule(graph, plan)) / 2  # the ops at half the profile's
    plain = ops / 2

    def timer(steps):
        return [StepTimes(plain, plain + true_again + k * 3e-3, 0.0) for _ in steps]

    said = calibrate_on_model(graph, timer, lambda plan: lambda: None)
    assert graph.total("t_fwd", graph.ids) + graph.total("t_bwd", graph.ids) == pytest.approx(plain)
    assert graph.meta.recompute_stage_measured and graph.meta.recompute_stage_seconds == pytest.approx(3e-3)
    assert any("scaled by 0.500" in line for line in said), said

    _, _, graph = _profiled_chain()
    times = [(n.t_fwd, n.t_bwd) for n in graph.nodes]
    ops = graph.total("t_fwd", graph.ids) + graph.total("t_bwd", graph.ids)
    said = calibrate_on_model(graph, lambda steps: [StepTimes(2 * ops, 2 * ops, 0.0) for _ in steps],
                              lambda plan: lambda: None)
    assert [(n.t_fwd, n.t_bwd) for n in graph.nodes] == times
    assert not any("scaled" in line for line in said), said


def test_the_planner_measures_the_executor_time_on_the_model_before_it_chooses(first_plans) -> None:
    """Planning a new input times the calibration plans' steps against the plain step
    before solving (injected: 5 ms per stage, then 1 ms per vertex under the policy,
    beyond the ops run again): the graph's times are those, marked measured, the progress
    says so, the plan is the solver's on those times, and the model trains as the plain
    model does."""
    from lightning_remat.runtime.overhead import calibration_plan
    from lightning_remat.solvers.schedule import make_schedule
    from lightning_remat.solvers.scoring import recomputed_seconds

    model, x, _ = _profiled_chain()
    reference = copy.deepcopy(model)
    calls: list[str] = []

    def timer(plain, planned, device) -> StepTimes:
        plain()
        planned()  # each step runs, leaving the module as it was
        if len(calls) < 2:
            graph = seen[0]
            policy = bool(calls)
            plan = calibration_plan(graph, policy=policy)
            schedule = make_schedule(graph, plan)
            again = recomputed_seconds(graph, schedule)
            n = sum(len(s.vertices) for s in schedule.stages if s.action == "recompute" and s.kept)
            calls.append("policy" if policy else "stages")
            return StepTimes(1.0, 1.0 + again + plan.count("recompute") * 5e-3 + policy * n * 1e-3, 0.0)
        calls.append("first step")
        return StepTimes(1.0, 1.0 + first_plans[-1].predicted_extra_seconds, 0.0)  # as predicted

    seen: list[Graph] = []
    original = Planner._calibrate_executor

    def recorded(self, graph, *args):
        seen.append(graph)
        return original(self, graph, *args)

    notes: list[str] = []
    planner = Planner(model, PlanSettings("75%"), step_times=timer, progress=notes.append)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Planner, "_calibrate_executor", recorded)
        # The chain's figures, as a machine could measure them: no policy time, so that
        # the tanh stages keep their boundaries under the policy until it is measured.
        patch.setattr(planner_module, "measure_recompute_overhead", lambda device: (2e-4, 0.0))
        planner.last = planner.planned_for((x,), {})
    graph, plan = planner.last.graph, planner.last.plan
    assert calls == ["stages", "policy", "first step"]
    assert graph.meta.recompute_stage_measured and graph.meta.recompute_stage_seconds == pytest.approx(5e-3)
    assert graph.meta.recompute_vertex_measured and graph.meta.recompute_vertex_seconds == pytest.approx(1e-3)
    assert any("measured on the model: 5.000 ms" in note for note in notes), notes
    assert any("selective policy: 1.000 ms" in note for note in notes), notes
    assert plan.stages == solve(graph, planner.last.budget_bytes, "auto", allow_offload=False).stages
    _trains_as(planner, reference, x)
