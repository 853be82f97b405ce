"""Double backward through recomputed stages: a gradient penalty (``torch.autograd.grad``
with ``create_graph=True``, then ``.backward()`` of a loss that holds those gradients) and a
second backward over a retained graph give plain training's gradients, whether a stage keeps
values from the forward (selective checkpointing) or runs again whole (docs/design.md
section 5)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_remat import remat
from lightning_remat.graph.trace import trace_module
from lightning_remat.runtime.module import RematModule, apply_plan
from lightning_remat.solvers.schedule import make_schedule
from tests.test_apply import segments_plan


class PenaltyNet(nn.Module):
    """Smooth activations (their second derivatives are not zero), a norm layer with running
    statistics and dropout: what a gradient penalty's second backward runs through."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.fc2 = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)
        self.fc3 = nn.Linear(width, width)
        self.fc4 = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.fc1(x)))
        h = self.drop(F.gelu(self.fc2(h)))
        h = torch.sigmoid(self.fc3(h)) * h
        return self.fc4(h)


def penalty_step(module: nn.Module, params: list[nn.Parameter], x: torch.Tensor,
                 seed: int) -> list[torch.Tensor]:
    """A WGAN-GP style step: the loss plus the squared norm of its gradient with respect to
    the input and the parameters; the parameters' gradients afterwards."""
    torch.manual_seed(seed)  # the same dropout masks on both sides
    x = x.clone().requires_grad_(True)
    loss = module(x).pow(2).mean()
    grads = torch.autograd.grad(loss, [x, *params], create_graph=True)
    penalty = sum(g.pow(2).sum() for g in grads)
    (loss + penalty).backward()
    result = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return result


def retained_step(module: nn.Module, params: list[nn.Parameter], x: torch.Tensor,
                  seed: int) -> list[torch.Tensor]:
    """Two backward passes over one retained graph."""
    torch.manual_seed(seed)
    loss = module(x).pow(2).mean()
    loss.backward(retain_graph=True)
    loss.backward()
    result = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return result


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), f"parameter {k}: max diff {(a - b).abs().max()}"


def planned(model: nn.Module, x: torch.Tensor, n_segments: int) -> RematModule:
    traced = trace_module(model, (x,), {})
    plan = segments_plan(traced.graph, n_segments)
    schedule = make_schedule(traced.graph, plan)
    assert any(s.kept for s in schedule.stages), "the plan keeps values from the forward"
    assert any(s.runs_again for s in schedule.stages), "the plan recomputes"
    return apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=traced.graph)


@pytest.mark.parametrize("step", [penalty_step, retained_step])
@pytest.mark.parametrize("n_segments", [2, 4])
def test_second_backward_through_recomputed_stages_equals_plain(step, n_segments: int) -> None:
    torch.manual_seed(0)
    model = PenaltyNet()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 16)
    remat_model = planned(model, x, n_segments)
    for seed in range(2):  # the second step sees the running statistics the first left
        want = step(plain, list(plain.parameters()), x, seed)
        got = step(remat_model, list(model.parameters()), x, seed)
        assert_same(got, want)
        assert torch.allclose(model.norm.running_mean, plain.norm.running_mean, atol=1e-6)
        assert torch.allclose(model.norm.running_var, plain.norm.running_var, atol=1e-6)


@pytest.mark.slow
def test_gradient_penalty_through_remat_at_a_small_budget() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(32, 32), nn.Tanh())])
    plain = copy.deepcopy(model)
    x = torch.randn(512, 32)
    remat_model = remat(model, x, memory_budget="75%")
    assert any(s.action == "recompute" for s in remat_model.plan.stages)
    assert_same(penalty_step(remat_model, list(model.parameters()), x, 0),
                penalty_step(plain, list(plain.parameters()), x, 0))
