"""What a forward changes besides its outputs: buffers, attributes and hooks happen once per
step, as in plain training, whatever the plan recomputes; capturing the forward leaves the
user's module as it was; what cannot be kept is refused with the module and the line."""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_remat import remat
from lightning_remat.errors import SideEffectError
from lightning_remat.graph.trace import trace_module
from lightning_remat.runtime.module import apply_plan
from lightning_remat.solvers import min_budget
from lightning_remat.solvers.simulate import simulate
from tests.test_apply import segments_plan

STEPS = 3


# ---- models -----------------------------------------------------------------------------------
class Counted(nn.Module):
    """A step counter that the computation also reads (so a recomputation reading another
    count than the forward did would give other gradients)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("n", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return torch.tanh(self.lin(x)) * (1 + 0.1 * self.n)


class Counters(nn.Module):
    """``self.n += 1`` in submodules, ``self.steps.add_(1)`` and a token count
    ``self.seen += x.shape[0]`` on the root, a rebinding ``self.total = self.total + ...``."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a = Counted(width)
        self.b = nn.Linear(width, width)
        self.c = Counted(width)
        self.head = nn.Linear(width, width)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("total", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        self.seen += x.shape[0]
        h = torch.relu(self.b(self.a(x)))
        self.total = self.total + h.detach().sum()
        return self.head(self.c(h))


class Seen(nn.Module):
    """The issue's token counter alone."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.lin(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class CallCount(nn.Module):
    """A Python attribute counted in forward (fx cannot record it: the model's own forward runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Block()
        self.second = Block()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.second(self.first(x))


class Unkeepable(nn.Module):
    """A Python counter and no submodule to checkpoint where the forward calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # the line the refusal names
        return x @ self.w


# ---- helpers ----------------------------------------------------------------------------------
def train(module: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """SGD steps; the loss of each."""
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    losses = []
    for x in batches:
        opt.zero_grad()
        loss = module(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def batches(n: int = STEPS, rows: int = 4, grow: int = 1) -> list[torch.Tensor]:
    """``n`` batches of ``rows``, ``rows + grow``, ... rows (a token count differs by step)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(rows + grow * k, 8, generator=g) for k in range(n)]


def plans(graph: Any) -> dict[str, Any]:
    """Hand plans that recompute every stage but the last, or all of them, or none."""
    return {
        "keep": segments_plan(graph, 1, "keep"),
        "recompute-first": segments_plan(graph, 2, ["recompute", "keep"]),
        "recompute-all": segments_plan(graph, 3, "recompute"),
    }


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        diff = (sa[key].double() - sb[key].double()).abs().max().item()
        assert torch.allclose(sa[key].double(), sb[key].double(), rtol=1e-4, atol=1e-5), (key, diff)


# ---- buffers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("plan_name", ["keep", "recompute-first", "recompute-all"])
def test_buffer_updates_happen_once_per_step_under_any_plan(plan_name: str) -> None:
    torch.manual_seed(0)
    plain = Counters()
    model = copy.deepcopy(plain)
    data = batches()
    traced = trace_module(model, (data[0],))
    plan = plans(traced.graph)[plan_name]
    assert plan_name == "keep" or any(s.action == "recompute" for s in plan.stages)
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge)
    expected = train(plain, data)
    got = train(remat_model, data)
    assert int(model.steps) == int(model.a.n) == int(model.c.n) == STEPS
    assert int(model.seen) == sum(x.shape[0] for x in data)
    # Everything else too: the rebinding's total, the parameters the counts scaled.
    assert_same_state(model, plain)
    for e, g in zip(expected, got):
        assert torch.allclose(e, g, atol=1e-6)


@pytest.mark.slow
def test_remat_keeps_counters_at_every_budget() -> None:
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(512, 64, generator=g) for _ in range(STEPS)]  # activations outweigh parameters
    graph = None
    for budget in ("none", "between"):
        torch.manual_seed(0)
        plain = Counters(width=64)
        model = copy.deepcopy(plain)
        if graph is None:
            remat_model = remat(model, data[0])
            graph = remat_model.graph
        else:  # halfway between the smallest budget and the plain peak: some stage recomputed
            plain_peak = min(simulate(graph).peak_bytes, graph.meta.plain_peak_bytes or 0)
            bytes_ = (min_budget(graph, "auto") + plain_peak) // 2
            remat_model = remat(model, data[0], memory_budget=bytes_)
            assert any(s.action == "recompute" for s in remat_model.plan.stages)
        assert_same_state(model, plain)  # planning ran the forward: nothing left of it
        train(plain, data)
        train(remat_model, data)
        assert int(model.steps) == int(model.a.n) == STEPS, budget
        assert int(model.seen) == sum(x.shape[0] for x in data)
        assert_same_state(model, plain)


def test_token_counter_is_kept_and_capture_leaves_no_proxy() -> None:
    model = Seen()
    before = state_of(model)
    buffer = model.seen
    remat_model = remat(model, torch.randn(4, 8))
    # Capture left the user's module as it was: the very buffer, its value, picklable.
    assert model.seen is buffer and type(model.seen) is torch.Tensor
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    pickle.dumps(model)
    torch.save(model.state_dict(), _Sink())
    train(remat_model, batches())
    assert int(model.seen) == sum(x.shape[0] for x in batches())


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)

    def flush(self) -> None:
        pass


# ---- Python attributes --------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [None, "recompute-all"])
def test_python_attribute_counted_once_per_step(budget: str | None) -> None:
    torch.manual_seed(0)
    plain = CallCount()
    model = copy.deepcopy(plain)
    data = batches()
    with pytest.warns(UserWarning, match=r"CallCount\.forward assigns its attribute 'calls' at .*test_side_effects\.py"):
        traced = trace_module(model, (data[0],))
    assert model.calls == 0  # capture ran the forward, and put the count back
    plan = plans(traced.graph)["recompute-all" if budget else "keep"]
    remat_model = remat(model, data[0]) if budget is None else _apply_children(model, traced, plan)
    assert model.calls == 0
    train(plain, data)
    train(remat_model, data)
    assert model.calls == plain.calls == STEPS
    assert_same_state(model, plain)


def _apply_children(model: nn.Module, traced: Any, plan: Any) -> nn.Module:
    from lightning_remat.runtime.module import RematModule, build_traced_variant

    owner = RematModule(model)
    owner.set_current(build_traced_variant(traced, plan, owner, model))
    return owner


def test_unkeepable_side_effect_is_refused_with_module_and_line() -> None:
    model = Unkeepable()
    before = state_of(model)
    attributes = dict(model.__dict__)
    with pytest.raises(SideEffectError) as caught:
        remat(model, torch.randn(4, 8))
    message = str(caught.value)
    assert "Unkeepable.forward assigns its attribute 'calls'" in message
    assert "test_side_effects.py:" in message and "self.calls += 1" in message
    assert "register_buffer" in message  # what to do
    # The failed capture left the module as it was.
    assert model.calls == 0 and model.__dict__.keys() == attributes.keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    pickle.dumps(model)


# ---- hooks --------------------------------------------------------------------------------------
def _record(log: list, tag: str) -> tuple[Any, Any]:
    def pre(module: nn.Module, args: tuple) -> None:
        log.append((tag, "pre", module, args[0].detach().clone()))

    def post(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        log.append((tag, "post", module, args[0].detach().clone(), output.detach().clone()))

    return pre, post


def _hooked_pair() -> tuple[nn.Module, nn.Module, list, list]:
    torch.manual_seed(0)
    plain = nn.Sequential(Block(), nn.Linear(8, 8), nn.Tanh(), Block(), nn.Linear(8, 8))
    model = copy.deepcopy(plain)
    logs: tuple[list, list] = ([], [])
    for module, log in zip((plain, model), logs):
        for name, target in (("root", module), ("block", module[0]), ("leaf", module[1]), ("last", module[4])):
            pre, post = _record(log, name)
            target.register_forward_pre_hook(pre)
            target.register_forward_hook(post)
    return plain, model, *logs


def _assert_same_calls(plain_log: list, remat_log: list, plain: nn.Module, model: nn.Module) -> None:
    """The same forward hooks fired with the same modules and values, and the root's
    pre-hooks; a submodule's pre-hooks fire again when its stage is recomputed (they may
    prepare what it computes: weight_norm, pruning, FSDP's gathering), so they are left out."""
    plain_log = [c for c in plain_log if c[0] == "root" or c[1] == "post"]
    remat_log = [c for c in remat_log if c[0] == "root" or c[1] == "post"]
    names = dict(zip((id(m) for m in plain.modules()), (n for n, _ in plain.named_modules())))
    names_remat = dict(zip((id(m) for m in model.modules()), (n for n, _ in model.named_modules())))
    assert [(c[0], c[1]) for c in remat_log] == [(c[0], c[1]) for c in plain_log]
    for p, r in zip(plain_log, remat_log):
        assert names[id(p[2])] == names_remat[id(r[2])]  # the same module, the user's own
        for a, b in zip(p[3:], r[3:]):
            assert torch.allclose(a, b, atol=1e-6)


def test_root_and_submodule_hooks_fire_as_in_plain_training_with_recomputation() -> None:
    plain, model, plain_log, remat_log = _hooked_pair()
    data = batches()
    traced = trace_module(model, (data[0],))
    remat_log.clear()  # capture may run the forward; the steps are what is compared
    plan = plans(traced.graph)["recompute-all"]
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge)
    remat_model.fire_hooks_of(model)
    train(plain, data)
    train(remat_model, data)
    assert sum(1 for c in remat_log if c[:2] == ("leaf", "post")) == STEPS
    assert sum(1 for c in remat_log if c[:2] == ("root", "pre")) == STEPS
    _assert_same_calls(plain_log, remat_log, plain, model)


def test_remat_fires_root_hooks() -> None:
    plain, model, plain_log, remat_log = _hooked_pair()
    data = batches(grow=0)  # one shape: planning, which runs the forward, happens before
    remat_model = remat(model, data[0])
    remat_log.clear()
    train(plain, data)
    train(remat_model, data)
    assert [c[2] for c in remat_log if c[0] == "root"] == [model] * (2 * STEPS)
    _assert_same_calls(plain_log, remat_log, plain, model)


class Branchy(nn.Module):
    """Control flow on a tensor's value: fx cannot trace it, the model's own forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Block()
        self.second = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if h.sum() > -1e9:
            h = h * 2
        return self.second(h)


def test_hooks_in_recomputed_submodule_of_the_fallback_fire_once() -> None:
    torch.manual_seed(0)
    plain = Branchy()
    model = copy.deepcopy(plain)
    logs: tuple[list, list] = ([], [])
    for module, log in zip((plain, model), logs):
        pre, post = _record(log, "inner")
        module.first.lin.register_forward_hook(post)
    data = batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_module(model, (data[0],))
    logs[1].clear()
    assert traced.kind == "children"
    remat_model = _apply_children(model, traced, plans(traced.graph)["recompute-all"])
    assert remat_model.plan.stages[0].action == "recompute"
    train(plain, data)
    train(remat_model, data)
    _assert_same_calls(logs[0], logs[1], plain, model)


# ---- under Lightning ------------------------------------------------------------------------
def test_trainer_fit_keeps_the_token_counter(tmp_path: Any) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    class Counting(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("seen", torch.zeros((), dtype=torch.long))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen += x.shape[0]
            return self.lin(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self(batch[0]).square().mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    module = Counting()
    loader = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)
    trainer = pl.Trainer(strategy="remat", accelerator="cpu", devices=1, max_steps=2,
                         logger=CSVLogger(tmp_path), enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(module, loader)
    assert trainer.global_step == 2
    assert int(module.seen) == 8
    pickle.dumps(module.state_dict())
