"""Plans on torch's own layers and on torchvision's MobileNetV3: each solver's plan (every
non-offloading one on the transformer; auto and kusumoto-mc on MobileNetV3), at its
smallest budget and half-way to the plain step's, trains with gradients equal to plain.

These modules run dropout inside one traced vertex (``nn.MultiheadAttention``'s attention
dropout, ``nn.Dropout``): the mask is allocated uninitialised (``empty_like``) and drawn in
place (``bernoulli_``). A recomputed stage keeping such a vertex must not keep the
allocation, which torch's selective checkpointing would then find mutated
(``graph.ops.keepable``). MobileNetV3 adds in-place Hardswish and ReLU after BatchNorm.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from lightning_remat.errors import RematInfeasibleError
from lightning_remat.graph.profile import profile_module
from lightning_remat.graph.trace import trace_module
from lightning_remat.runtime.module import apply_plan
from lightning_remat.runtime.stages import KeptRegion, boundary_policy
from lightning_remat.solvers import SOLVERS, min_budget, plain_plan, solve


class Seq2Seq(nn.Module):
    """An encoder and a decoder layer of torch's own, pre-norm, with dropout."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.1, batch_first=True,
                                                  norm_first=True)
        self.decoder = nn.TransformerDecoderLayer(width, 4, 2 * width, dropout=0.1, batch_first=True,
                                                  norm_first=True)
        self.head = nn.Linear(width, 11)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(tgt, self.encoder(src)))


def seq2seq() -> tuple[nn.Module, tuple]:
    return Seq2Seq(), (torch.randn(4, 16, 32), torch.randn(4, 12, 32))


def mobilenet() -> tuple[nn.Module, tuple]:
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.mobilenet_v3_small(num_classes=10), (torch.randn(2, 3, 32, 32),)


NON_OFFLOADING = sorted(s for s, entry in SOLVERS.items() if not entry.offloads and s != "plain")
# MobileNetV3's 150-odd vertices make the bisecting solvers' smallest budgets (Chen, Feng,
# Hong) take minutes on CI's two cores: there, auto and the memory-centric DP.
SOLVERS_OF = {"transformer": NON_OFFLOADING, "mobilenet_v3": ["auto", "kusumoto-mc"]}


def _step(model: nn.Module, inputs: tuple) -> list[torch.Tensor]:
    torch.manual_seed(1)  # the same dropout draws for plain and planned
    model(*inputs).square().mean().backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SOLVERS_OF))
def test_every_solvers_plan_trains_as_plain(name: str) -> None:
    torch.manual_seed(0)
    model, inputs = {"transformer": seq2seq, "mobilenet_v3": mobilenet}[name]()
    model.train()
    traced = trace_module(model, inputs)
    graph = profile_module(model, inputs, traced=traced, warmup=0, repeats=1)
    expected = _step(copy.deepcopy(model), inputs)
    top = plain_plan(graph).guaranteed_peak_bytes
    ran = 0
    for solver in SOLVERS_OF[name]:
        try:
            least = min_budget(graph, solver)
        except RematInfeasibleError:  # the exact DPs decline a graph this wide
            continue
        for budget in sorted({least, (least + max(least, top)) // 2}):
            plan = solve(graph, budget, solver)
            if not any(stage.action == "recompute" for stage in plan.stages):
                continue
            planned = copy.deepcopy(model)
            remat_model = apply_plan(traced.runner, plan, root=planned, charge=traced.charge, graph=graph)
            grads = _step(remat_model, inputs)
            for name, got, want in zip([n for n, _ in planned.named_parameters()], grads, expected):
                assert torch.equal(got, want), (solver, budget, name)
            ran += 1
    assert ran >= 2  # plans that recompute were run, not only plain ones


@pytest.mark.parametrize("layer", ["attention", "dropout"])
def test_a_kept_dropout_mask_is_recomputed_not_kept(layer: str) -> None:
    """A recomputed stage whose kept region holds dropout (nn.MultiheadAttention's own, an
    nn.Dropout): the stage's policy keeps every keepable op, and the backward gives the
    gradients of the plain step, where keeping the mask's ``empty_like`` raised torch's
    "Tensor cached during selective activation checkpoint has been mutated"."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(16, 4, dropout=0.25, batch_first=True)
    dropout = nn.Dropout(0.25)

    def run(x: torch.Tensor) -> torch.Tensor:
        if layer == "attention":
            return attention(x, x, x, need_weights=False)[0]
        return dropout(x * 2.0)

    region = KeptRegion()
    region.begin()  # every op of the stage is in a kept node
    x = torch.randn(2, 6, 16, requires_grad=True)
    torch.manual_seed(1)
    run(x).square().sum().backward()
    want = [x.grad.clone(), *(p.grad.clone() for p in attention.parameters() if p.grad is not None)]
    x.grad = None
    attention.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    context = functools.partial(create_selective_checkpoint_contexts, functools.partial(boundary_policy, region))
    checkpoint(run, x, use_reentrant=False, context_fn=context).square().sum().backward()
    got = [x.grad, *(p.grad for p in attention.parameters() if p.grad is not None)]
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
