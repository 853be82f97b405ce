"""A recomputed stage whose kept values would not run again anyway (its last saving op, a
Linear, packs only its input; a residual add after it saves nothing) runs under plain
checkpoint, without the selective-checkpoint policy's Python dispatch on every op: its kept
ops still do not run again, and its gradients equal plain training's (docs/design.md
section 5)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_remat.graph.profile import profile_module
from lightning_remat.graph.trace import trace_module
from lightning_remat.runtime.module import apply_plan
from lightning_remat.runtime.stages import saving_ops
from lightning_remat.solvers.plan import Stage
from lightning_remat.solvers.scoring import make_plan
from tests.test_double_backward import penalty_step, retained_step


class Block(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(self.act(self.fc1(x)))))


class CountMatmuls(TorchDispatchMode):
    """Counts the forward matmuls (``addmm``) that run; a Linear's backward runs ``mm``."""

    def __init__(self) -> None:
        super().__init__()
        self.addmm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.addmm.default:
            self.addmm += 1
        return func(*args, **(kwargs or {}))


def test_a_stage_whose_kept_linear_stops_the_recomputation_runs_without_the_policy() -> None:
    torch.manual_seed(0)
    model = Block()
    plain = copy.deepcopy(model)
    x = torch.randn(16, 32)
    graph = profile_module(model, (x,), repeats=1)
    saving = saving_ops(graph)
    assert saving is not None and saving["fc2"] and not saving["tanh"], saving
    traced = trace_module(model, (x,), {})
    ids = graph.ids
    cut = ids.index("fc2") + 1
    plan = make_plan(graph, [Stage(ids[:cut], "recompute"), Stage(ids[cut:], "keep")], "test")
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=graph)
    program = remat_model.current.stages.programs[0]
    assert program.kept_boundary == ["fc2"] and not program.selective

    loss = remat_model(x).sum()
    counter = CountMatmuls()
    with counter:
        loss.backward()
    assert counter.addmm == 1, "the recomputation runs fc1 again, not the kept fc2"
    plain(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_kept_op_that_saves_its_own_output_keeps_the_policy() -> None:
    """tanh saves its output: kept at the end of a recomputed stage, plain checkpoint would
    run it again before its recomputation stops, so the stage keeps its policy."""
    torch.manual_seed(0)
    model = Block()
    plain = copy.deepcopy(model)
    x = torch.randn(16, 32)
    graph = profile_module(model, (x,), repeats=1)
    traced = trace_module(model, (x,), {})
    ids = graph.ids
    cut = ids.index("tanh") + 1
    plan = make_plan(graph, [Stage(ids[:cut], "recompute"), Stage(ids[cut:], "keep")], "test")
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=graph)
    program = remat_model.current.stages.programs[0]
    assert program.kept_boundary == ["tanh"] and program.selective
    remat_model(x).sum().backward()
    plain(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


class Residual(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc0 = nn.Linear(width, width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.fc0(x)
        h = a + self.fc1(a)  # read by fc2 in its stage and by the next stage
        return self.head(torch.tanh(self.fc2(h)) + h)


class CountOps(TorchDispatchMode):
    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is self.op
        return func(*args, **(kwargs or {}))


def test_a_kept_value_that_saves_nothing_is_handed_to_the_recomputation() -> None:
    """The residual add is kept in the middle of its stage, before fc2 which saves it: the
    stage's code hands the forward's value to the recomputation, which does not run the
    add again, with no policy; gradients equal plain's in two steps, and nothing is held
    after the backward."""
    torch.manual_seed(0)
    model = Residual()
    plain = copy.deepcopy(model)
    x = torch.randn(16, 32)
    graph = profile_module(model, (x,), repeats=1)
    traced = trace_module(model, (x,), {})
    ids = graph.ids
    cut = ids.index("fc2") + 1
    plan = make_plan(graph, [Stage(ids[:cut], "recompute"), Stage(ids[cut:], "keep")], "test")
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=graph)
    program = remat_model.current.stages.programs[0]
    assert program.handed_on == ["add"] and not program.selective, program.source
    for _ in range(2):
        counts = []
        for module in (plain, remat_model):
            loss = module(x).sum()
            counter = CountOps(torch.ops.aten.add.Tensor)
            with counter:
                loss.backward()
            counts.append(counter.count)
        assert counts[0] == counts[1], "the recomputation runs the kept add again"
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), name
            p.grad = q.grad = None
    with torch.no_grad():  # outside training the stage runs plainly
        assert torch.equal(remat_model(x), plain(x))


def test_handed_values_serve_a_second_backward() -> None:
    """A gradient penalty (``create_graph=True``) and a retained graph run the stage's
    recomputation twice: both read the values handed on, and the gradients equal plain's."""
    torch.manual_seed(0)
    model = Residual()
    plain = copy.deepcopy(model)
    x = torch.randn(16, 32)
    graph = profile_module(model, (x,), repeats=1)
    traced = trace_module(model, (x,), {})
    ids = graph.ids
    cut = ids.index("fc2") + 1
    plan = make_plan(graph, [Stage(ids[:cut], "recompute"), Stage(ids[cut:], "keep")], "test")
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=graph)
    assert remat_model.current.stages.programs[0].handed_on == ["add"]
    for step in (penalty_step, retained_step):
        want = step(plain, list(plain.parameters()), x, 0)
        got = step(remat_model, list(model.parameters()), x, 0)
        for k, (a, b) in enumerate(zip(got, want)):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), f"{step.__name__}, parameter {k}"
