"""The smallest budget named is accepted when given: for generated models, traceable by
torch.fx or not (each submodule then checkpointed on its own), with a tensor, a list, a dict
or keyword inputs, ``remat`` refuses a budget that is too small with the smallest budget it
accepts, and accepts that budget."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_remat import remat
from lightning_remat.errors import RematInfeasibleError


class Generated(nn.Module):
    """``depth`` submodules in a chain (flat Linear/Tanh layers, or residual blocks with a
    wider hidden layer) and a side input; ``traceable=False`` adds data-dependent control
    flow, which fx cannot trace."""

    def __init__(self, form: str, traceable: bool, depth: int, width: int, blocks: bool) -> None:
        super().__init__()
        self.form, self.traceable, self.blocks = form, traceable, blocks
        if blocks:
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
                for _ in range(depth))
        else:
            self.layers = nn.ModuleList(m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh()))
        self.side = nn.Linear(width, width)

    def body(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            a = layer(a) + a if self.blocks else layer(a)
        if not self.traceable and a.sum() > 1e12:
            a = a * 0
        return a + self.side(b)

    def forward(self, first: Any, b: torch.Tensor | None = None) -> torch.Tensor:
        if self.form == "list":
            return self.body(first[0], first[1])
        if self.form == "dict":
            return self.body(first["a"], first["b"])
        return self.body(first, b)


def example_input(form: str, batch: int, width: int) -> object:
    a, b = torch.randn(batch, width), torch.randn(batch, width)
    return {"tensor": (a, b), "list": ([a, b],), "dict": ({"a": a, "b": b},),
            "kwargs": {"first": a, "b": b}}[form]


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(form=st.sampled_from(["tensor", "list", "dict", "kwargs"]), traceable=st.booleans(),
       depth=st.integers(2, 6), width=st.sampled_from([16, 32]), batch=st.sampled_from([64, 256]),
       blocks=st.booleans())
# Untraceable, flat: the solver's plan groups layers, which checkpointing each submodule on
# its own cannot, so the fallback needs more than the solver's smallest budget.
@example(form="tensor", traceable=False, depth=6, width=32, batch=256, blocks=False)
@example(form="list", traceable=True, depth=3, width=16, batch=64, blocks=False)
def test_the_smallest_budget_named_is_accepted(form: str, traceable: bool, depth: int, width: int,
                                               batch: int, blocks: bool) -> None:
    torch.manual_seed(0)
    model = Generated(form, traceable, depth, width, blocks)
    x = example_input(form, batch, width)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.fx could not trace")
        with pytest.raises(RematInfeasibleError) as refused:
            remat(model, x, memory_budget=1024)
        smallest = refused.value.min_budget_bytes
        assert smallest is not None and smallest > 1024
        planned = remat(model, x, memory_budget=smallest)
    assert planned.budget_bytes == smallest
    assert planned.plan.guaranteed_peak_bytes <= smallest or planned.plan.solver == "auto:plain"
