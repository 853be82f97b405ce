"""apply_plan: a planned module trains exactly like the plain one (docs/design.md section 5).

Every hard case compares a rematerialized copy against the plain module over several
optimizer steps from the same state and inputs: outputs, gradients, parameters, optimizer
state and buffers (BatchNorm running statistics) within 1e-6 on CPU.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_remat.graph.effects import preserved_state
from lightning_remat.graph.trace import default_loss, trace_module
from lightning_remat.graph.vertices import build_fx_graph
from lightning_remat.runtime.module import RematModule, apply_plan
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.scoring import make_plan
from tests.models import ResidualCNN, tiny_lm

TOL = 1e-6


# ---- helpers ---------------------------------------------------------------------------------
def segments_plan(graph, n_segments: int, actions: list[str] | str = "recompute") -> Plan:
    """Contiguous segments of the topological order (always a valid lower-set chain)."""
    ids = graph.ids
    n_segments = min(n_segments, len(ids))
    bounds = [round(k * len(ids) / n_segments) for k in range(n_segments + 1)]
    if isinstance(actions, str):
        actions = [actions] * n_segments
    stages = [Stage(ids[a:b], act) for a, b, act in zip(bounds, bounds[1:], actions)]
    return make_plan(graph, stages, "test-segments")


def cut_plan(graph, first_of_stage: list[str], actions: list[str]) -> Plan:
    """Stages that start at the named vertices (topological order)."""
    ids = graph.ids
    starts = [0] + [ids.index(v) for v in first_of_stage] + [len(ids)]
    stages = [Stage(ids[a:b], act) for a, b, act in zip(starts, starts[1:], actions)]
    return make_plan(graph, stages, "test-cuts")


def rematerialize(model: nn.Module, inputs: tuple, kwargs: dict | None = None,
                  plan_fn: Callable[[Any], Plan] | None = None, **apply_kwargs: Any) -> RematModule:
    traced = trace_module(model, inputs, kwargs or {})
    plan = plan_fn(traced.graph) if plan_fn else segments_plan(traced.graph, 3)
    return apply_plan(traced.runner, plan, root=model, charge=traced.charge, **apply_kwargs)


def fx_rematerialize(model: nn.Module, call_args: tuple, concrete_args: dict | None,
                     plan_fn: Callable[[Any], Plan]) -> RematModule:
    """Trace with torch.fx directly (concrete_args specialise non-tensor arguments) and build
    the IR graph with trace.build_fx_graph."""
    gm = fx.symbolic_trace(model, concrete_args=concrete_args)
    kinds: dict[str, str] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            leaves = pytree.tree_leaves(value)
            kinds[n.name] = ("tensor" if isinstance(value, torch.Tensor) else
                             "tensors" if any(isinstance(t, torch.Tensor) for t in leaves) else "other")
            return value

    with preserved_state(model), torch.no_grad():
        Recorder(gm).run(*call_args)
    graph, charge = build_fx_graph(gm, kinds)
    return apply_plan(gm, plan_fn(graph), root=model, charge=charge)


def assert_close_tree(a: Any, b: Any, what: str) -> None:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert sa == sb, f"{what}: structures differ"
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, what
            assert torch.allclose(x.double(), y.double(), atol=TOL, rtol=0), \
                f"{what}: max diff {(x.double() - y.double()).abs().max().item()}"
        else:
            assert x == y, what


def train_side_by_side(
    model: nn.Module, remat_model: nn.Module, plain: nn.Module, batches: list[tuple[tuple, dict]],
    optimizer: str = "sgd", autocast: bool = False,
) -> None:
    """Same steps on both; compare everything a user relies on after each step."""
    def make_opt(m: nn.Module) -> torch.optim.Optimizer:
        if optimizer == "adam":
            return torch.optim.Adam(m.parameters(), lr=1e-2)
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    opt_plain, opt_remat = make_opt(plain), make_opt(remat_model)
    for step, (args, kwargs) in enumerate(batches):
        results = []
        for module, opt in ((plain, opt_plain), (remat_model, opt_remat)):
            torch.manual_seed(1000 + step)  # same dropout masks on both sides
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
            with ctx:
                out = module(*copy.deepcopy(args), **copy.deepcopy(kwargs))
                loss = default_loss(out)
            loss.backward()
            grads = [p.grad.clone() if p.grad is not None else None for p in module.parameters()]
            opt.step()
            opt.zero_grad()
            results.append((out, grads))
        (out_p, grads_p), (out_r, grads_r) = results
        assert_close_tree(out_p, out_r, f"outputs at step {step}")
        assert_close_tree(grads_p, grads_r, f"gradients at step {step}")
        assert_close_tree(plain.state_dict(), remat_model.state_dict(), f"state_dict after step {step}")
        assert_close_tree(
            [s for s in opt_plain.state_dict()["state"].values()],
            [s for s in opt_remat.state_dict()["state"].values()],
            f"optimizer state after step {step}",
        )


def twins(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The model and a plain deep copy of it (same weights and buffers)."""
    return model, copy.deepcopy(model)


class CountingCheckpoint:
    """Stands in for torch.utils.checkpoint.checkpoint and counts calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.real = torch.utils.checkpoint.checkpoint

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.real(*args, **kwargs)


@pytest.fixture
def checkpoint_counter(monkeypatch: pytest.MonkeyPatch) -> CountingCheckpoint:
    counter = CountingCheckpoint()
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counter)
    return counter


# ---- the structure of the rewrite --------------------------------------------------------------
def test_keeps_parameter_objects_and_state_dict_keys_both_ways() -> None:
    model = ResidualCNN()
    x = torch.randn(2, 3, 8, 8)
    remat_model = rematerialize(model, (x,))
    assert [id(p) for p in remat_model.parameters()] == [id(p) for p in model.parameters()]
    assert list(remat_model.state_dict()) == list(model.state_dict())
    # A checkpoint of either form loads into the other (strict).
    other = ResidualCNN()
    other.load_state_dict(remat_model.state_dict())
    remat_model.load_state_dict(ResidualCNN().state_dict())
    assert_close_tree(model.state_dict(), remat_model.state_dict(), "loaded state")
    assert len(remat_model.plan.stages) == 3
    assert all("def forward" in src for src in remat_model.stage_sources())


def test_a_graph_module_alone_keeps_its_own_keys_and_modes() -> None:
    """Without ``root`` the GraphModule's members are adopted; a child the user froze in
    eval mode stays in eval mode."""
    torch.manual_seed(0)
    model = ResidualCNN()
    model.bn2.eval()  # a frozen BatchNorm inside a training model
    plain = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    traced = trace_module(model, (x,))
    remat_model = apply_plan(traced.runner, segments_plan(traced.graph, 2))
    assert list(remat_model.state_dict()) == list(traced.runner.state_dict())
    assert remat_model.training and not remat_model.bn2.training
    train_side_by_side(model, remat_model, plain, [((torch.randn(2, 3, 8, 8),), {}) for _ in range(2)])


def test_unused_parameters_keep_their_keys() -> None:
    class WithUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.spare = nn.Linear(4, 4)  # fx drops it from the GraphModule
            self.register_buffer("counter", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x).relu() * 2

    model = WithUnused()
    remat_model = rematerialize(model, (torch.randn(3, 4),), plan_fn=lambda g: segments_plan(g, 2))
    assert list(remat_model.state_dict()) == list(model.state_dict())


def test_a_plan_for_another_graph_is_refused() -> None:
    model = ResidualCNN()
    traced = trace_module(model, (torch.randn(2, 3, 8, 8),))
    plan = segments_plan(traced.graph, 2)
    plan.stages[0].nodes.append("no_such_node")
    with pytest.raises(ValueError, match="no_such_node"):
        apply_plan(traced.runner, plan, root=model)


# ---- hard cases -----------------------------------------------------------------------------
class InplaceAtCuts(nn.Module):
    """ReLU(inplace=True) right after a cut, and a non-idempotent in-place op (mul_) that
    starts a recomputed stage: recomputing from the modified input would double it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(8, 8)
        self.act2 = nn.ReLU(inplace=True)
        self.fc3 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn(self.fc1(x)))
        h = self.fc2(h)
        h = h.mul_(2.0)
        return self.fc3(self.act2(h))


def test_inplace_ops_right_after_cuts_train_like_plain() -> None:
    torch.manual_seed(0)
    model, plain = twins(InplaceAtCuts())
    x = torch.randn(5, 6)
    traced = trace_module(model, (x,))
    ids = traced.graph.ids
    assert ids == ["fc1", "bn", "act", "fc2", "mul_", "act2", "fc3"]
    plan = cut_plan(traced.graph, ["act", "mul_", "fc3"], ["recompute", "recompute", "recompute", "keep"])
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge)
    # act2's result leaves its recomputed stage: it is a kept boundary value, so it is
    # computed out of place (an in-place op cannot hand back a kept tensor).
    assert set(remat_model.current.stages.inplace_rewritten) == {"act", "mul_", "act2"}
    batches = [((torch.randn(5, 6),), {}) for _ in range(3)]
    train_side_by_side(model, remat_model, plain, batches)


def test_checkpoint_sequential_fails_where_we_do_not() -> None:
    """The peer: torch's checkpoint_sequential on the same layers trips the version counter
    (or computes different gradients) with ReLU(inplace=True) after a segment boundary."""
    torch.manual_seed(0)
    layers = nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True),
        nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 3),
    )
    plain = copy.deepcopy(layers)
    x = torch.randn(5, 6)
    plain(x).sum().backward()
    peer = copy.deepcopy(layers)
    try:
        torch.utils.checkpoint.checkpoint_sequential(peer, 3, x, use_reentrant=False).sum().backward()
        same = all(torch.allclose(a.grad, b.grad) for a, b in zip(plain.parameters(), peer.parameters()))
    except RuntimeError:
        same = False
    assert not same
    ours = copy.deepcopy(layers)
    traced = trace_module(ours, (x,))
    remat_model = apply_plan(traced.runner, segments_plan(traced.graph, 3), root=ours)
    remat_model(x).sum().backward()
    assert_close_tree([p.grad for p in plain.parameters()], [p.grad for p in ours.parameters()], "grads")


def test_batchnorm_statistics_updated_once(checkpoint_counter: CountingCheckpoint) -> None:
    torch.manual_seed(0)
    model, plain = twins(ResidualCNN())
    bn_runs = []
    # A pre-hook: recomputation fires pre-hooks again, not forward hooks (graph.effects).
    model.bn1.register_forward_pre_hook(lambda *_: bn_runs.append(1))
    x = torch.randn(4, 3, 8, 8)
    # Each BatchNorm is followed in its recomputed stage by an op that saves its output
    # (ReLU), so recomputation must run the BatchNorm again (checkpoint stops early otherwise).
    remat_model = rematerialize(model, (x,), plan_fn=lambda g: cut_plan(
        g, ["conv2", "pool"], ["recompute", "recompute", "keep"]))
    assert remat_model.plan.count("recompute") == 2
    batches = [((torch.randn(4, 3, 8, 8),), {}) for _ in range(3)]
    bn_runs.clear()
    train_side_by_side(model, remat_model, plain, batches, optimizer="adam")
    assert checkpoint_counter.calls == 2 * 3
    assert len(bn_runs) == 2 * 3, "bn1 must run in the forward and again in the recomputation"
    assert int(model.bn1.num_batches_tracked) == int(plain.bn1.num_batches_tracked) == 3


def test_batchnorm_without_momentum_cumulative_average() -> None:
    torch.manual_seed(0)
    model = ResidualCNN()
    model.bn1.momentum = None  # cumulative average: depends on num_batches_tracked
    model, plain = twins(model)
    remat_model = rematerialize(model, (torch.randn(4, 3, 8, 8),), plan_fn=lambda g: segments_plan(g, 3))
    batches = [((torch.randn(4, 3, 8, 8),), {}) for _ in range(3)]
    train_side_by_side(model, remat_model, plain, batches)


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.fc1(x)))
        h = F.dropout(self.fc2(h), p=0.3, training=self.training) + torch.rand_like(h) * 0.1
        return self.fc3(h)


def test_dropout_and_random_ops_see_the_same_numbers(checkpoint_counter: CountingCheckpoint) -> None:
    torch.manual_seed(0)
    model, plain = twins(DropoutNet())
    remat_model = rematerialize(model, (torch.randn(6, 8),), plan_fn=lambda g: segments_plan(g, 2))
    batches = [((torch.randn(6, 8),), {}) for _ in range(3)]
    train_side_by_side(model, remat_model, plain, batches)
    assert checkpoint_counter.calls > 0


def test_autocast_bf16_matches_plain_under_the_same_autocast() -> None:
    torch.manual_seed(0)
    model, plain = twins(ResidualCNN())
    remat_model = rematerialize(model, (torch.randn(4, 3, 8, 8),), plan_fn=lambda g: segments_plan(g, 3))
    batches = [((torch.randn(4, 3, 8, 8),), {}) for _ in range(3)]
    train_side_by_side(model, remat_model, plain, batches, autocast=True)


class TiedTwice(nn.Module):
    """One Linear applied twice, and an output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = torch.tanh(self.mix(h))
        h = torch.tanh(self.mix(h))
        return self.head(h)


def test_module_called_twice_and_tied_weights() -> None:
    torch.manual_seed(0)
    model, plain = twins(TiedTwice())
    ids = torch.randint(0, 20, (3, 5))
    traced = trace_module(model, (ids,))
    assert traced.graph.ids == ["embed", "mix", "tanh", "mix_1", "tanh_1", "head"]
    plan = cut_plan(traced.graph, ["tanh", "tanh_1"], ["recompute", "recompute", "keep"])
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge)
    assert remat_model.head.weight is remat_model.embed.weight
    assert "head.weight" in remat_model.state_dict() and "embed.weight" in remat_model.state_dict()
    batches = [((torch.randint(0, 20, (3, 5)),), {}) for _ in range(3)]
    train_side_by_side(model, remat_model, plain, batches, optimizer="adam")


def test_transformer_with_tuple_producers_trains_like_plain() -> None:
    torch.manual_seed(0)
    model, plain = twins(tiny_lm())
    tokens = torch.randint(0, 50, (2, 6))
    remat_model = rematerialize(model, (tokens,), plan_fn=lambda g: segments_plan(g, 5))
    batches = [((torch.randint(0, 50, (2, 6)),), {}) for _ in range(2)]
    train_side_by_side(model, remat_model, plain, batches, optimizer="adam")


class StructuredIO(nn.Module):
    """Keyword inputs, a float and a flag among them, tuple and dict outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.ctx = nn.Linear(3, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, context: torch.Tensor, scale: float = 1.0,
                use_context: bool = True) -> dict[str, Any]:
        h = torch.relu(self.enc(x))
        if use_context:
            h = h + self.ctx(context)
        h = h * scale
        logits = self.out(h)
        return {"logits": logits, "extra": (h.mean(dim=1), logits.softmax(-1)), "n": x.shape[0]}


def test_tuple_and_dict_outputs_keyword_and_non_tensor_inputs() -> None:
    torch.manual_seed(0)
    model, plain = twins(StructuredIO())
    x, context = torch.randn(5, 4), torch.randn(5, 3)
    remat_model = fx_rematerialize(model, (x, context, 0.5, True), {"use_context": True},
                                   lambda g: segments_plan(g, 3))
    assert remat_model.plan.count("recompute") == 3
    batches = [((torch.randn(5, 4),), {"context": torch.randn(5, 3), "scale": 0.5}) for _ in range(3)]
    train_side_by_side(model, remat_model, plain, batches)
    out = remat_model(x, context, 2.0)  # positionally as well as by keyword
    assert type(out) is dict and set(out) == {"logits", "extra", "n"} and out["n"] == 5
    assert type(out["extra"]) is tuple
    assert_close_tree(out, plain(x, context=context, scale=2.0), "outputs with scale=2")


def test_specialised_flag_argument_via_concrete_args() -> None:
    """A flag specialised with concrete_args is taken under its original name (fx renames
    it) and a value it was not traced for is refused, not silently ignored."""
    torch.manual_seed(0)
    model, plain = twins(StructuredIO())
    x, context = torch.randn(5, 4), torch.randn(5, 3)
    remat_model = fx_rematerialize(model, (x, context, 1.0, False), {"use_context": False},
                                   lambda g: segments_plan(g, 2))
    batches = [((torch.randn(5, 4), torch.randn(5, 3)), {"use_context": False}) for _ in range(2)]
    train_side_by_side(model, remat_model, plain, batches)
    with pytest.raises(AssertionError, match="specialized"):
        remat_model(x, context, use_context=True)


def test_eval_and_no_grad_run_without_recomputation(checkpoint_counter: CountingCheckpoint) -> None:
    torch.manual_seed(0)
    model, plain = twins(ResidualCNN())
    x = torch.randn(4, 3, 8, 8)
    remat_model = rematerialize(model, (x,), plan_fn=lambda g: segments_plan(g, 3))
    plain(x)  # running statistics differ from their initial values
    remat_model(x)
    checkpoint_counter.calls = 0
    remat_model.eval()
    plain.eval()
    assert_close_tree(plain(x), remat_model(x), "eval outputs")
    assert checkpoint_counter.calls == 0
    remat_model.train()
    plain.train()
    with torch.no_grad():
        expected = plain(x)
        got = remat_model(x)
    assert_close_tree(expected, got, "no_grad outputs")
    assert checkpoint_counter.calls == 0
    remat_model(x).sum().backward()
    assert checkpoint_counter.calls == 3  # training does recompute


class RecordingHooks(torch.autograd.graph.saved_tensors_hooks):
    """A trivial stand-in for the offload executor: packs copies, counts what it saw."""

    packed: list[int] = []

    def __init__(self) -> None:
        super().__init__(self.pack, lambda t: t)

    @classmethod
    def pack(cls, tensor: torch.Tensor) -> torch.Tensor:
        cls.packed.append(tensor.numel())
        return tensor.clone()


def test_offload_stages_run_under_the_factory_hooks() -> None:
    torch.manual_seed(0)
    model, plain = twins(ResidualCNN())
    calls: list[tuple[int, str]] = []

    def factory(index: int, stage: Stage) -> RecordingHooks:
        calls.append((index, stage.action))
        return RecordingHooks()

    RecordingHooks.packed = []
    remat_model = rematerialize(
        model, (torch.randn(4, 3, 8, 8),),
        plan_fn=lambda g: segments_plan(g, 3, ["offload", "recompute", "keep"]),
        offload_hooks_factory=factory,
    )
    batches = [((torch.randn(4, 3, 8, 8),), {}) for _ in range(2)]
    train_side_by_side(model, remat_model, plain, batches)
    assert calls == [(0, "offload")] * 2
    assert RecordingHooks.packed, "the offloaded stage's saved tensors went through the hooks"


def test_default_offload_hooks_train_like_plain() -> None:
    torch.manual_seed(0)
    model, plain = twins(ResidualCNN())
    make = lambda: torch.randn(8, 3, 48, 48)  # noqa: E731 - activations above the 64 KiB floor
    remat_model = rematerialize(model, (make(),), plan_fn=lambda g: segments_plan(g, 2, ["offload", "keep"]))
    batches = [((make(),), {}) for _ in range(2)]
    train_side_by_side(model, remat_model, plain, batches)
    executor = remat_model._remat_offload_factory.hooks
    if executor is not None:  # runtime.offload present: its hooks moved the stage's tensors
        assert executor.stats.offloaded_tensors > 0


def test_stage_boundary_values_are_released() -> None:
    """A value no later stage reads is dropped from the forward's environment after its
    last reader, so the rewrite does not hold what the plan frees."""
    model = ResidualCNN()
    remat_model = rematerialize(model, (torch.randn(2, 3, 8, 8),), plan_fn=lambda g: segments_plan(g, 4))
    programs = remat_model.current.stages.programs
    crossing = {name for p in programs for name in p.input_names if name != "x"}
    dropped = {name for p in programs for name in p.drop_after}
    assert crossing - {"fc"} <= dropped | {"x"}


def test_deepcopy_and_whole_module_pickling(tmp_path) -> None:
    """Lightning and users copy or torch.save whole modules: the generated stage code must
    survive both (it is rebuilt from the stage graphs on load)."""
    torch.manual_seed(0)
    model, plain = twins(ResidualCNN())
    remat_model = rematerialize(model, (torch.randn(4, 3, 8, 8),), plan_fn=lambda g: segments_plan(g, 3))
    copied = copy.deepcopy(remat_model)
    assert copied.conv1 is not remat_model.conv1
    torch.save(remat_model, tmp_path / "whole.pt")
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    batches = [((torch.randn(4, 3, 8, 8),), {}) for _ in range(2)]
    train_side_by_side(model, copied, copy.deepcopy(plain), batches)
    train_side_by_side(model, loaded, plain, batches)


# ---- what the backward runs again -------------------------------------------------------------
class _ForwardOps(TorchDispatchMode):
    """Counts compute ops (not views, not factories) by name and input shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable and all(r.alias_info is None for r in func._schema.returns):
            shapes = tuple(tuple(a.shape) for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor))
            if shapes:
                self.counts[(func._schema.name.rstrip("_"), shapes)] += 1
        return out


class Widths(nn.Module):
    """Conv/BatchNorm/ReLU(inplace)/max-pool layers of distinct widths, so each op's name and
    input shapes say which vertex it belongs to."""

    def __init__(self) -> None:
        super().__init__()
        widths = [3, 4, 5, 6, 7]
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU(inplace=True),
                       nn.MaxPool2d(3, stride=1, padding=1)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(7 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.body(x), 1))


class TrailingConvs(nn.Module):
    """Two convolutions of one value, added: the stage ending at the add has as its last
    saving op a convolution that saves only its input (distinct kernel sizes tell the two
    apart by their weights' shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.relu = nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()
        self.conv2, self.conv3 = nn.Conv2d(4, 5, 3, padding=1), nn.Conv2d(4, 5, 1)
        self.head = nn.Conv2d(5, 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.conv1(x))
        return self.head(self.conv2(h) + self.conv3(h))


@pytest.mark.parametrize(("make", "cuts"), [
    (Widths, ["body_2", "body_9"]), (Widths, ["body_4", "body_6", "body_13"]), (Widths, ["body_7"]),
    (TrailingConvs, ["head"])])
def test_the_backward_runs_again_exactly_the_plans_recompute_set(make: type[nn.Module], cuts: list[str]) -> None:
    """Only Vi \\ B(Li) of each recomputed stage runs again in the backward (Kusumoto et al.
    2019, eq. 1), up to the stage's last saving op (checkpoint stops there; a convolution
    there saves its input and stops before it computes): the forward ops seen during
    loss.backward() are exactly those of the vertices the schedule's ``recomputed`` names,
    stage by stage."""
    from lightning_remat.graph.profile import profile_module
    from lightning_remat.solvers.schedule import make_schedule

    torch.manual_seed(0)
    model = make()
    x = torch.randn(2, 3, 6, 6)
    traced = trace_module(model, (x,))
    # The profile says what each op saves, and so where each recomputation stops.
    graph = profile_module(model, (x,), traced=traced, repeats=1)
    ids = graph.ids
    plan = cut_plan(graph, cuts, ["recompute"] * len(cuts) + ["keep"])
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=graph)
    schedule = make_schedule(graph, plan)
    recomputed = schedule.recomputed
    assert any(recomputed) and all(len(r) < len(s.nodes) for r, s in zip(recomputed, plan.stages) if s.action == "recompute")
    if make is TrailingConvs:
        assert schedule.stages[0].packed_only == "conv3" and recomputed[0] == ("conv1", "relu", "conv2")

    # The forward ops of each vertex, from a plain forward node by node.
    per_vertex: dict[str, collections.Counter] = {}

    class ByNode(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            with _ForwardOps() as ops:
                value = super().run_node(n)
            per_vertex[n.name] = ops.counts
            return value

    with preserved_state(model), torch.no_grad():
        ByNode(traced.runner).run(x.clone())
    expected: collections.Counter = collections.Counter()
    for stage_vertices in recomputed:
        for v in stage_vertices:
            expected.update(per_vertex[v])
    forward_kinds = {key for counts in per_vertex.values() for key in counts}

    loss = default_loss(remat_model(x))
    with _ForwardOps() as seen:
        loss.backward()
    ran_again = collections.Counter({k: c for k, c in seen.counts.items() if k in forward_kinds})
    assert ran_again == expected
    assert set(ids) >= {v for r in recomputed for v in r}
