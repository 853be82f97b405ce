"""The timeline recorder: one point per op of a real step, forward and backward, and a
maximum that agrees with the peak meter."""

from __future__ import annotations

import torch
from test_simulate import run_isolated
from torch import nn

from lightning_remat.measure.timeline import TimelinePoint, aligned, record_timeline
from lightning_remat.planner import Planner, PlanSettings

_RECORD = r"""
import json
from lightning_remat.measure.peak import peak_bytes
from lightning_remat.measure.timeline import record_timeline
import torch
import torch.fx
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                      nn.Linear(2048, 256))
x = torch.randn(1024, 512)
loss_fn = lambda out: (out ** 2).mean()
step = lambda: loss_fn(model(x)).backward()
step()
kept = model[0].weight.grad
for p in model.parameters():
    p.grad = None
model[0].weight.grad = kept
points = record_timeline(model, (x,), loss_fn)
grad_restored = model[0].weight.grad is kept and model[2].weight.grad is None
for p in model.parameters():
    p.grad = None
measured = peak_bytes(step)
ops = [n.name for n in torch.fx.symbolic_trace(model).graph.nodes if n.op == "call_module"]
print(json.dumps({"points": [[p.phase, p.op, p.live_bytes, p.peak_bytes] for p in points],
                  "ops": ops, "measured": measured, "grad_restored": grad_restored}))
"""


def test_one_point_per_op_and_the_peak_agrees_with_the_meter():
    got = run_isolated(_RECORD)
    points, ops = got["points"], got["ops"]
    forward = [p[1] for p in points if p[0] == "forward"]
    backward = [p[1] for p in points if p[0] == "backward"]
    assert forward == ops + ["loss"]
    # The backward visits every op once, in reverse (the loss first).
    assert backward == ["loss"] + ops[::-1]
    measured = got["measured"]
    highest = max(p[3] for p in points)
    assert abs(highest - measured) <= 0.10 * measured, (highest, measured)
    # Live bytes after each forward op grow by the activations the step keeps: the
    # two ReLU outputs (8 MiB each) are held for the backward, so after the last op more
    # than 16 MiB is live; at the end only the parameter gradients (about 22 MiB) remain.
    live_after = {p[1]: p[2] for p in points if p[0] == "forward"}
    assert live_after[ops[-1]] > 16 * 2**20
    param_bytes = 4 * (512 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 256 + 256)
    assert abs(points[-1][2] - param_bytes) <= 0.1 * param_bytes
    assert got["grad_restored"]


class Branchy(nn.Module):
    """A forward fx cannot trace (control flow on a tensor's value)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.last = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.first(x))
        if h.sum() > -1:  # data-dependent: fx gives up
            h = h * 2
        return self.last(h)


def test_untraceable_module_falls_back_to_leaf_module_points():
    points = record_timeline(Branchy(), torch.randn(4, 8))
    assert [p.op for p in points if p.phase == "forward"] == ["first", "act", "last", "loss"]
    backward = [p.op for p in points if p.phase == "backward"]
    # Each leaf module's backward is read once, the last layer's before the first's.
    assert sorted(backward) == sorted(["loss", "last", "act", "first"])
    assert backward.index("last") < backward.index("act") < backward.index("first")


def test_aligned_puts_a_steps_points_on_the_ops_of_another_timeline():
    points = [TimelinePoint("forward", "a", 10, 12), TimelinePoint("forward", "glue", 11, 30),
              TimelinePoint("forward", "b", 20, 21), TimelinePoint("backward", "b", 15, 25),
              TimelinePoint("recompute", "a", 18, 18), TimelinePoint("backward", "a", 5, 19)]
    ops = [("forward", "a"), ("forward", "b"), ("forward", "c"), ("backward", "c"),
           ("backward", "b"), ("recompute", "a"), ("backward", "a")]
    got = aligned(points, ops)
    assert [(p.phase, p.op) for p in got] == ops
    # b takes the peak of the op before it the other timeline lacks (glue); c, with no
    # point of its own, reads as the op before it, its live bytes throughout.
    assert [(p.live_bytes, p.peak_bytes) for p in got] == [
        (10, 12), (20, 30), (20, 20), (20, 20), (15, 25), (18, 18), (5, 19)]


def test_a_planned_step_is_measured_op_for_op_on_the_predicted_timeline():
    """Planned.measure_timeline: one point per event of the predicted timeline, in its
    order, forward, recomputation and backward, each the same op's reading; the
    gradients and the module's state as before."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(128, 128), nn.Tanh())])
    x = torch.randn(2048, 128)
    planner = Planner(model, PlanSettings("75%", profile_repeats=1), keep_example=True)
    entry = planner.planned_for((x,), {})
    assert entry.plan.count("recompute") > 0
    grads = [p.grad for p in model.parameters()]
    statistics = [b.clone() for b in model.buffers()]
    points = entry.measure_timeline()
    events = entry.predicted_timeline().events
    assert [(p.phase, p.op) for p in points] == [(e.phase, e.node) for e in events]
    assert {"forward", "recompute", "backward"} == {p.phase for p in points}
    peak = max(e.peak_bytes for e in events)
    beside = [abs(p.peak_bytes - e.peak_bytes) <= 0.1 * peak for p, e in zip(points, events)]
    assert sum(beside) >= 0.9 * len(events), [(e.phase, e.node, p.peak_bytes, e.peak_bytes)
                                              for p, e in zip(points, events)]
    assert abs(max(p.peak_bytes for p in points) - peak) <= 0.1 * peak
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(b, s) for b, s in zip(model.buffers(), statistics))


def test_the_predicted_timeline_follows_the_schedule_the_stages_run_after_the_times_change():
    """Which recomputed stages keep their boundary values reads the graph's times (the
    selective policy's cost per vertex), which the planner corrects after the stages are
    built (the first step's time check). The predicted timeline follows the schedule the
    stages were compiled to: with the times changed so that a schedule made now would
    differ, it is the timeline predicted before, and it still matches the measured step
    op for op."""
    from lightning_remat.solvers.schedule import make_schedule

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(128, 128), nn.Tanh())])
    x = torch.randn(2048, 128)
    planner = Planner(model, PlanSettings("75%", profile_repeats=1), keep_example=True)
    entry = planner.planned_for((x,), {})
    graph, plan = entry.graph, entry.plan
    running = make_schedule(graph, plan)
    assert any(s.action == "recompute" for s in running.stages)
    before = entry.predicted_timeline().events
    keeps = any(s.kept for s in running.stages)
    # The policy's cost per vertex made large (a stage then runs under plain checkpoint) or
    # nothing (a stage then keeps its boundary), whichever changes the schedule.
    graph.meta.recompute_vertex_seconds = 1.0 if keeps else 0.0
    assert make_schedule(graph, plan) != running
    assert entry.predicted_timeline().events == before
    points = entry.measure_timeline()
    peak = max(e.peak_bytes for e in before)
    beside = [abs(p.peak_bytes - e.peak_bytes) <= 0.1 * peak for p, e in zip(points, before)]
    assert len(points) == len(before) and sum(beside) >= 0.9 * len(before)
