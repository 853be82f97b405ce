"""What the forward means is what trains (docs/design.md sections 3 and 4.8): grad-mode regions,
custom autograd functions and the Python values a forward branches on, each trained through
``remat()`` against plain PyTorch from the same seed, step by step, with no budget and at
50% (or the smallest budget a plan fits); one through ``Trainer(strategy="remat")``."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_remat import RematInfeasibleError, TraceError, remat
from tests.lit_models import trainer_kwargs

WIDTH = 64
STEPS = 3
BATCH = 256
"""Rows per step: activations several times the parameters, so half the peak has a plan."""


class Round(torch.autograd.Function):
    """A straight-through estimator: rounds forward, passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Student(nn.Module):
    """Three layers: enough activations for a plan at half the peak to recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 10)
        self.teacher = nn.Linear(WIDTH, 10)

    def hidden(self, x):
        return torch.tanh(self.l2(torch.tanh(self.l1(x))))


class NoGrad(Student):
    def forward(self, x):
        with torch.no_grad():
            t = self.teacher(x)
        return self.l3(self.hidden(x)) - t


class SetGradFalse(Student):
    def forward(self, x):
        with torch.set_grad_enabled(False):
            t = self.teacher(x)
        return self.l3(self.hidden(x)) - t


class InferenceMode(Student):
    def forward(self, x):
        with torch.inference_mode():
            t = self.teacher(x)
        return self.l3(self.hidden(x)) * t.clone()


class EnableGrad(Student):
    """``enable_grad`` inside: the teacher's output records its graph even when the forward
    is called under ``no_grad`` (the loop below trains it that way)."""

    def forward(self, x):
        h = self.l3(self.hidden(x))
        with torch.enable_grad():
            u = self.teacher(x)
        return h, u


class Straight(Student):
    def forward(self, x):
        return self.l3(Round.apply(self.hidden(x) * 4)) + self.teacher(x)


class Quantizer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return Round.apply(self.lin(x) * 4)


class StraightInside(Student):
    """The custom function inside a submodule, which a plan may recompute (whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.quantize = Quantizer()

    def forward(self, x):
        return self.l3(torch.tanh(self.quantize(self.hidden(x)))) + self.teacher(x)


class Frozen(Student):
    """A Python flag the training loop turns off after the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = True

    def forward(self, x):
        h = self.hidden(x)
        if self.frozen:
            h = h.detach()
        return self.l3(h) + self.teacher(x)


class Scheduled(Student):
    """A branch on a step counter the training loop advances."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    def forward(self, x):
        h = self.hidden(x)
        if self.step >= 1:
            h = h * 0.5
        return self.l3(h) + self.teacher(x)


def _plan(module: nn.Module, x: torch.Tensor, budget):
    """``remat(module, x, budget)``; where no plan fits that fraction of the peak, the
    fraction (in steps of 10%) at the smallest budget a plan fits, which applies to each
    input planned later as well (100% where even that one is refused)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's and the re-plans' notes
        try:
            return remat(module, x, budget)
        except RematInfeasibleError as refused:
            if budget is None or refused.min_budget_bytes is None:
                raise
            needed = 10 * math.ceil(float(budget.rstrip("%")) * refused.min_budget_bytes / refused.budget_bytes / 10)
        try:
            return remat(module, x, f"{min(needed, 100)}%")
        except RematInfeasibleError:
            return remat(module, x, "100%")


def _square(outputs):
    return outputs.pow(2).mean()


def _train_both(cls, budget, before_step=lambda module, step: None, loss_of=_square, grad=True, steps=STEPS):
    """Train ``cls`` plainly and through ``remat`` from the same seed for ``STEPS`` SGD steps,
    asserting the losses and every gradient equal at each step (the forward called with grad
    enabled as ``grad``, the loss ``loss_of(outputs)`` taken outside it); returns (plain, planned
    module as the user holds it, the planned wrapper, the initial state)."""
    torch.manual_seed(0)
    plain = cls()
    initial = copy.deepcopy(plain.state_dict())
    mine = copy.deepcopy(plain)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    planned = _plan(mine, x, budget)
    optimizers = [torch.optim.SGD(plain.parameters(), lr=0.05), torch.optim.SGD(mine.parameters(), lr=0.05)]
    for step in range(steps):
        losses = []
        for module, run, optimizer in ((plain, plain, optimizers[0]), (mine, planned, optimizers[1])):
            before_step(module, step)
            optimizer.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with torch.set_grad_enabled(grad):
                    outputs = run(x)
                loss = loss_of(outputs)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0])
        for (name, p), q in zip(plain.named_parameters(), mine.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step}: {name}'s gradient"
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")
        for optimizer in optimizers:
            optimizer.step()
    for (name, p), q in zip(plain.named_parameters(), mine.parameters()):
        torch.testing.assert_close(q, p, msg=lambda m, name=name: f"{name} after training: {m}")
    return plain, mine, planned, initial


BUDGETS = [None, "50%"]


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("cls", [NoGrad, SetGradFalse, InferenceMode])
def test_frozen_teacher_stays_frozen(cls, budget):
    plain, mine, _, initial = _train_both(cls, budget)
    for name in ("teacher.weight", "teacher.bias"):
        assert mine.get_parameter(name).grad is None
        torch.testing.assert_close(mine.state_dict()[name], initial[name], rtol=0, atol=0)


@pytest.mark.parametrize("budget", BUDGETS)
def test_enable_grad_inside_trains_what_it_encloses(budget):
    # Called under no_grad, the enable_grad region still records, as plain's forward does.
    _, mine, _, initial = _train_both(EnableGrad, budget, loss_of=lambda out: out[1].pow(2).mean(), grad=False)
    assert mine.l1.weight.grad is None
    assert not torch.equal(mine.state_dict()["teacher.weight"], initial["teacher.weight"])


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("cls", [Straight, StraightInside])
def test_custom_function_runs_its_own_backward(cls, budget):
    _, mine, _, _ = _train_both(cls, budget)
    # The straight-through backward passes gradient to the layers before the rounding
    # (the autograd of round would give them zeros).
    assert mine.l1.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("budget", BUDGETS)
def test_flag_turned_off_after_the_first_step(budget):
    def unfreeze(module, step):
        if step == 1:
            module.frozen = False

    _, mine, planned, initial = _train_both(Frozen, budget, unfreeze)
    assert not torch.equal(mine.state_dict()["l1.weight"], initial["l1.weight"])
    assert len(planned.variants) == 2  # planned once per value of the flag, not once per step


@pytest.mark.parametrize("budget", BUDGETS)
def test_branch_on_a_step_counter(budget):
    def advance(module, step):
        module.step = step

    try:
        _, _, planned, _ = _train_both(Scheduled, budget, advance, steps=5)
    except RematInfeasibleError as refused:
        # The own forward checkpoints whole submodules only, and its first step measures
        # what the ops between them hold: under a budget the captures held, it may refuse,
        # naming the smallest budget it holds, which then trains as plain.
        assert budget is not None and refused.min_budget_bytes is not None, refused
        assert refused.measured_peak_bytes > refused.budget_bytes
        _, _, planned, _ = _train_both(Scheduled, refused.min_budget_bytes, advance, steps=5)
    # Captured for steps 0 and 1; the counter changing again, the forward runs as its own
    # (reading the counter live) instead of a capture and a plan per step.
    assert len(planned.variants) == 3


class Stops(Student):
    """Raises once the loop's counter reaches 2, as plain training would."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    def forward(self, x):
        if self.step >= 2:
            raise ValueError("stop at step 2")
        return self.l3(self.hidden(x)) + self.teacher(x)


def test_raise_on_a_later_step_fires():
    torch.manual_seed(0)
    model = Stops()
    x = torch.randn(16, WIDTH)
    planned = _plan(model, x, None)
    for step in range(2):
        model.step = step
        planned(x).sum().backward()
    model.step = 2
    with pytest.raises(Exception, match="stop at step 2"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned(x)


class Bare(nn.Module):
    """No submodule to checkpoint in place: a no_grad region no capture keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH, 10))
        self.t = nn.Parameter(torch.randn(WIDTH, 10))
        self.calls = 0

    def forward(self, x):
        with torch.no_grad():
            t = x @ self.t
        return torch.tanh(x @ self.w) - t


def test_meaning_no_capture_keeps_is_refused_before_training():
    model = Bare()
    state = copy.deepcopy(model.state_dict())
    attributes = dict(model.__dict__)
    with pytest.raises(TraceError) as refused:
        remat(model, torch.randn(4, WIDTH), None)
    message = str(refused.value)
    assert "Bare" in message and "torch.no_grad()" in message
    assert "t = x @ self.t" in message and "test_forward_meaning.py" in message
    assert type(model) is Bare and model.__dict__ == attributes
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name])
    assert all(p.grad is None for p in model.parameters())


class Distiller(pl.LightningModule):
    """A student trained against a frozen teacher; from the second step its hidden layers
    train too (a branch on the trainer's step)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = NoGrad()

    def forward(self, x):
        with torch.no_grad():
            t = self.net.teacher(x)
        h = self.net.hidden(x)
        if self.global_step < 1:
            h = h.detach()
        return self.net.l3(h) - t

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit_distiller(tmp_path, strategy):
    pl.seed_everything(0)
    model = Distiller()
    initial = copy.deepcopy(model.state_dict())
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(48, WIDTH, generator=torch.Generator().manual_seed(1))),
        batch_size=16)
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(tmp_path, max_epochs=1, max_steps=STEPS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    return model, initial


def test_strategy_keeps_no_grad_and_the_step_branch(tmp_path):
    plain, initial = _fit_distiller(tmp_path / "plain", "auto")
    planned, _ = _fit_distiller(tmp_path / "remat", "remat")
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(planned.state_dict()[name], value, msg=lambda m, name=name: f"{name}: {m}")
    for name in ("net.teacher.weight", "net.teacher.bias"):
        torch.testing.assert_close(planned.state_dict()[name], initial[name], rtol=0, atol=0)
    assert not torch.equal(planned.state_dict()["net.l1.weight"], initial["net.l1.weight"])


@pytest.mark.parametrize("cls, construct, line", [
    (NoGrad, "torch.no_grad()", "t = self.teacher(x)"),
    (InferenceMode, "torch.inference_mode()", "t = self.teacher(x)"),
])
def test_the_warning_names_the_construct_and_its_line(cls, construct, line):
    from lightning_remat.graph.trace import CHILDREN, trace_module

    with pytest.warns(UserWarning) as caught:
        traced = trace_module(cls(), torch.randn(4, WIDTH))
    assert traced.kind == CHILDREN and not traced.state_reads
    said = " ".join(str(w.message) for w in caught)
    assert construct in said and line in said and "test_forward_meaning.py" in said


@pytest.mark.parametrize("cls", [Straight, StraightInside])
def test_a_custom_function_is_one_vertex_of_a_fine_grained_capture(cls):
    """torch.export records a custom function as one op (graph.functions), which the
    replay runs through ``Function.apply``: the forward is captured op by op, the function
    one vertex, with no warning; its own backward runs (test above)."""
    from lightning_remat.graph.trace import EXPORT, trace_module

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        traced = trace_module(cls(), torch.randn(4, WIDTH))
    assert traced.kind == EXPORT
    ops = [node.op for node in traced.graph.nodes]
    assert ops.count("Round") == 1 and len(ops) > 5, ops
