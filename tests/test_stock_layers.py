"""Plans on torch's own layers and on torchvision's ResNet-18 and MobileNetV3: every
non-offloading solver's plan, at two budgets each (on the transformer its own smallest
budget and half-way to the plain step's; on the torchvision models the memory-centric DP's
smallest and half-way), trains with gradients (and BatchNorm statistics) equal to plain.

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
from lightning_remat.solvers.plan import Plan


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


NON_OFFLOADING = sorted(s for s, entry in SOLVERS.items() if not entry.offloads and s != "plain")


def _step(model: nn.Module, inputs: tuple) -> list[torch.Tensor]:
    torch.manual_seed(1)  # the same dropout draws for plain and planned
    model(*inputs).square().mean().backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.slow
def test_every_solvers_plan_trains_the_transformer_layers_as_plain() -> None:
    torch.manual_seed(0)
    model, inputs = seq2seq()
    model.train()
    traced = trace_module(model, inputs)
    graph = profile_module(model, inputs, traced=traced, warmup=0, repeats=1)
    expected = _step(copy.deepcopy(model), inputs)
    top = plain_plan(graph).guaranteed_peak_bytes
    ran = 0
    for solver in NON_OFFLOADING:
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


def torchvision_model(name: str) -> tuple[nn.Module, tuple]:
    """torchvision's ResNet-18 (BatchNorm, residual adds, in-place ReLU) and MobileNetV3-Small
    (in-place Hardswish, squeeze-excitation)."""
    torchvision = pytest.importorskip("torchvision")
    model = getattr(torchvision.models, name)(num_classes=10)
    return model, (torch.randn(8, 3, 64, 64),)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer.clone() for name, buffer in model.named_buffers()}


class _Profiled:
    """A model in training mode, traced and profiled once, with plain's gradients and
    buffers after one step from its weights; :meth:`check` runs a plan's step against them."""

    def __init__(self, model: nn.Module, inputs: tuple) -> None:
        self.model, self.inputs = model.train(), inputs
        self.traced = trace_module(model, inputs)
        self.graph = profile_module(model, inputs, traced=self.traced, warmup=0, repeats=1)
        plain = copy.deepcopy(model)
        self.grads, self.buffers = _step(plain, inputs), _state(plain)

    def check(self, plan: Plan, *label: object) -> None:
        """One step under ``plan`` from the same weights: plain's gradients and buffers."""
        assert plan.count("recompute") > 0, label
        planned = copy.deepcopy(self.model)
        runner = apply_plan(self.traced.runner, plan, root=planned, charge=self.traced.charge, graph=self.graph)
        grads = _step(runner, self.inputs)
        for key, got, want in zip([n for n, _ in planned.named_parameters()], grads, self.grads):
            assert torch.equal(got, want), (*label, key)
        for key, value in _state(planned).items():
            assert torch.equal(value, self.buffers[key]), (*label, key)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_every_solvers_plan_at_several_budgets_trains_torchvision_models_as_plain(name: str) -> None:
    """Each non-offloading solver's own plan at two budgets, fitting or not (a plan over its
    budget still runs): the memory-centric DP's smallest budget and half-way from it to the
    plain peak (the same two for every solver: the bisecting solvers' own smallest budgets
    take minutes on two cores). One step from the same weights gives plain's gradients and
    BatchNorm statistics, bit for bit."""
    torch.manual_seed(0)
    profiled = _Profiled(*torchvision_model(name))
    graph = profiled.graph
    top = plain_plan(graph).guaranteed_peak_bytes
    least = min_budget(graph, "kusumoto-mc")
    assert least < top
    fitted = set()
    for solver in NON_OFFLOADING:
        for budget in (least, (least + top) // 2):
            try:
                plan = SOLVERS[solver].solve(graph, budget)
            except RematInfeasibleError:  # the exact DPs decline a graph this wide
                continue
            profiled.check(plan, solver, budget)
            if plan.feasible and plan.guaranteed_peak_bytes <= budget:
                fitted.add(solver)
    assert {"auto", "kusumoto-tc", "kusumoto-mc"} <= fitted, fitted  # the recomputing solvers fit


class StockGPT(nn.Module):
    """Six of torch's own pre-norm encoder layers with dropout, a learned position parameter
    sliced to the length, a final LayerNorm and the embedding tied to the head."""

    def __init__(self, vocab: int = 1000, width: int = 256, length: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(1, length, width) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True, norm_first=True)
            for _ in range(6))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[:, : tokens.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "solver", "fractions"), [
    ("gpt", "auto", (0.6, 0.75)),
    ("mobilenet_v3_large", "kusumoto-mc", (0.75,)),
])
def test_the_plans_that_once_found_a_cached_tensor_mutated_train_as_plain(
        name: str, solver: str, fractions: tuple[float, ...]) -> None:
    """The two plans that stopped in torch's selective checkpointing ("Tensor cached during
    selective activation checkpoint has been mutated"): a GPT of stock encoder layers at 60%
    and 75% (the attention's dropout mask drawn in place), MobileNetV3-Large at 75% with the
    memory-centric DP (in-place Hardswish after BatchNorm). Each trains a step with plain's
    gradients and BatchNorm statistics."""
    torch.manual_seed(0)
    if name == "gpt":
        model, inputs = StockGPT(), (torch.randint(0, 1000, (8, 256)),)
    else:
        torchvision = pytest.importorskip("torchvision")
        model, inputs = torchvision.models.mobilenet_v3_large(num_classes=10), (torch.randn(8, 3, 128, 128),)
    profiled = _Profiled(model, inputs)
    for fraction in fractions:
        profiled.check(solve(profiled.graph, int(plain_plan(profiled.graph).guaranteed_peak_bytes * fraction), solver),
                       fraction)


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
