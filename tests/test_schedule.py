"""One schedule: the simulator and the executor follow the same compiled plan, op for op.

Generated models mix the parts real models use (Linear, LayerNorm, GELU, in-place ReLU, ``mul_``
and ``add_`` on fresh values, dropout, views, a tuple producer, skips, an in-place op on
the step's input); random plans cut them into kept and recomputed stages. For each:

- the aten ops the executor runs again in the backward are, in order, those of the
  schedule's ``recomputed`` vertices and the unkeepable ops of its ``kept`` ones;
- the simulator's events are :meth:`Schedule.steps`, vertex for vertex;
- gradients and the step's outputs equal the plain module's.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_remat.graph.effects import preserved_state
from lightning_remat.graph.ops import keepable
from lightning_remat.graph.profile import profile_module
from lightning_remat.graph.trace import trace_module
from lightning_remat.runtime.module import apply_plan
from lightning_remat.solvers.kusumoto import solve_in_forward_order
from lightning_remat.solvers.plan import Stage
from lightning_remat.solvers.policy import in_forward_order
from lightning_remat.solvers.schedule import Schedule, make_schedule, order_note
from lightning_remat.solvers.scoring import make_plan
from lightning_remat.solvers.simulate import simulate

WIDTH, BATCH = 8, 4
BINARY = ("iadd", "skip")
KINDS = ("linear", "norm", "gelu", "relu_", "iadd", "mul_", "dropout", "view", "skip", "chunk")


class Generated(nn.Module):
    """A forward built from a recipe of ops over earlier values (fx unrolls the loop)."""

    def __init__(self, seed: int, length: int = 14) -> None:
        super().__init__()
        rng = random.Random(seed)
        self.recipe: list[tuple[str, int, int]] = []
        self.linears = nn.ModuleList()
        self.norms = nn.ModuleList()
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.25)
        self.input_inplace = rng.random() < 0.5
        for k in range(length):
            kind = rng.choice(KINDS) if k else "linear"
            a, b = rng.randrange(k + 1), rng.randrange(k + 1)
            if kind == "linear":
                self.linears.append(nn.Linear(WIDTH, WIDTH))
            if kind == "norm":
                self.norms.append(nn.LayerNorm(WIDTH))
            self.recipe.append((kind, a, b))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_inplace:
            x.mul_(1.0)  # an in-place op on the step's input (which needs no gradient)
        values = [x]
        linears, norms = iter(self.linears), iter(self.norms)
        for kind, a, b in self.recipe:
            u, w = values[a], values[b]
            if kind == "linear":
                out = next(linears)(u)
            elif kind == "norm":
                out = next(norms)(u)
            elif kind == "gelu":
                out = F.gelu(u)
            elif kind == "relu_":  # in place on a fresh value, as a ResNet's bn -> relu
                out = self.relu(u * 1.5)
            elif kind == "iadd":  # later readers of ``out`` read what add_ wrote into it
                out = u * 0.5
                out.add_(w)
            elif kind == "mul_":
                out = (u + 1.0).mul_(0.5)
            elif kind == "dropout":
                out = self.drop(u)
            elif kind == "view":
                out = u.view(BATCH, 2, WIDTH // 2).transpose(1, 2).flatten(1)
            elif kind == "skip":
                out = u + w
            else:  # a tuple producer and its parts
                first, second = u.chunk(2, dim=1)
                out = torch.cat([second, first], dim=1)
            values.append(out)
        # Every value reaches the loss: torch's checkpoint recomputes a stage when the
        # backward first needs what it saved, which a value off the gradient's path never is.
        read = {i for kind, a, b in self.recipe for i in ((a, b) if kind in BINARY else (a,))}
        rest = [v for i, v in enumerate(values[1:-1], start=1) if i not in read]
        return values[-1], sum(rest, torch.zeros_like(values[-1]))


def random_plan(graph: Any, seed: int) -> Any:
    rng = random.Random(seed)
    ids = graph.ids
    cuts = sorted(rng.sample(range(1, len(ids)), k=min(len(ids) - 1, rng.randint(1, 4))))
    bounds = [0, *cuts, len(ids)]
    actions = [rng.choice(["keep", "recompute", "recompute"]) for _ in bounds[1:]]
    return make_plan(graph, [Stage(ids[a:b], act) for a, b, act in zip(bounds, bounds[1:], actions)],
                     "test-random")


class _Ops(TorchDispatchMode):
    """The aten ops run under it, by name (in-place and out-of-place forms alike: the
    executor runs the in-place ops the schedule rewrites out of place, or on a clone)."""

    def __init__(self, only_recomputation: bool = False) -> None:
        super().__init__()
        self.only_recomputation = only_recomputation
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # A recomputation runs inside the backward with grad mode on; the backward's own
        # ops run with it off.
        recomputing = torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
        if not self.only_recomputation or recomputing:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _name(op: Any) -> str:
    return op._schema.name.rstrip("_")


def _names(ops: list[Any]) -> list[str]:
    return [_name(op) for op in ops if _name(op) != "aten::clone"]


def ops_per_vertex(traced: Any, x: torch.Tensor, model: nn.Module) -> dict[str, list[Any]]:
    """Each vertex's aten ops in a plain forward, node by node (a tuple producer's with the
    vertex the trace charges it to)."""
    per_vertex: dict[str, list[Any]] = {}

    class ByNode(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            with _Ops() as ops:
                value = super().run_node(n)
            vertex = traced.charge.get(n.name)
            if vertex is not None:
                per_vertex.setdefault(vertex, []).extend(ops.ops)
            return value

    with preserved_state(model), torch.no_grad():
        ByNode(traced.runner).run(x.clone())
    return per_vertex


def expected_recomputation(schedule: Schedule, per_vertex: dict[str, list[Any]]) -> list[Any]:
    """What the backward runs again, in order: each recomputed stage (last first), its
    recomputed vertices' ops and its kept vertices' unkeepable ones (a rewritten in-place
    op runs in its out-of-place form, which is keepable)."""
    expected: list[Any] = []
    for stage in reversed(schedule.stages):
        if stage.action != "recompute" or not stage.runs_again:
            continue  # a stage that saves nothing is never run again
        for v in stage.vertices:
            ops = per_vertex.get(v, [])
            if v in stage.kept:
                ops = [op for op in ops if not (keepable(op) or (v in stage.rewritten and _writes(op)))]
            expected.extend(ops)
    return expected


def _writes(op: Any) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


_SETUPS: dict[int, tuple[Any, Any]] = {}


def _setup(seed: int, policy_seconds: float | None = None) -> tuple[nn.Module, torch.Tensor, Any, Any, Any, Schedule]:
    """A generated model, its input, its trace, its profiled graph, a random plan on it
    and the plan's schedule (the trace and profile are made once per seed).
    ``policy_seconds``: what the selective policy costs per op (a second: every stage
    whose outputs the step does not hold runs under plain checkpoint, its kept values
    run again)."""
    torch.manual_seed(seed)
    model = Generated(seed)
    x = torch.randn(BATCH, WIDTH)
    if seed not in _SETUPS:
        traced = trace_module(model, (x.clone(),))
        _SETUPS[seed] = traced, profile_module(model, x.clone(), traced=traced, warmup=0, repeats=1)
    traced, graph = _SETUPS[seed]
    if policy_seconds is not None:
        graph = copy.deepcopy(graph)
        graph.meta.recompute_vertex_seconds = policy_seconds
    plan = random_plan(graph, seed)
    return model, x, traced, graph, plan, make_schedule(graph, plan)


SEEDS = list(range(int(__import__("os").environ.get("SCHEDULE_SEEDS", "16"))))


@pytest.mark.parametrize("policy_seconds", [None, 1.0])
@pytest.mark.parametrize("seed", SEEDS)
def test_the_executor_runs_again_exactly_what_the_schedule_recomputes(seed: int, policy_seconds: float | None) -> None:
    model, x, traced, graph, plan, schedule = _setup(seed, policy_seconds)
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=graph)
    expected = _names(expected_recomputation(schedule, ops_per_vertex(traced, x, model)))

    with preserved_state(model):
        # Torch's early stop ends a recomputation once the last tensor it must give back
        # is made, which drops a suffix of the schedule: off, the whole schedule runs.
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            out = remat_model(x.clone())
            loss = out[0].square().sum() + out[1].sum()
            with _Ops(only_recomputation=True) as seen:
                loss.backward()
    assert _names(seen.ops) == expected

    # As users run it (early stop on): nothing runs again that the schedule does not say.
    with preserved_state(model):
        out = remat_model(x.clone())
        loss = out[0].square().sum() + out[1].sum()
        with _Ops(only_recomputation=True) as seen_default:
            loss.backward()
    remaining = list(expected)
    for name in _names(seen_default.ops):
        assert name in remaining, f"{name} ran again but the schedule does not recompute it"
        remaining.remove(name)


@pytest.mark.parametrize("policy_seconds", [None, 1.0])
@pytest.mark.parametrize("seed", SEEDS)
def test_the_simulator_steps_through_the_schedule(seed: int, policy_seconds: float | None) -> None:
    _, _, _, graph, plan, schedule = _setup(seed, policy_seconds)
    steps = [("recompute" if s.phase == "hand_on" else s.phase, s.vertex, s.stage)
             for s in schedule.steps() if s.vertex is not None]
    events = [(e.phase, e.node, e.stage) for e in simulate(graph, plan).events]
    restores = [e for e in events if e[0] == "restore"]
    assert not restores
    assert events == steps


@pytest.mark.parametrize("policy_seconds", [None, 1.0])
@pytest.mark.parametrize("seed", SEEDS)
def test_a_scheduled_step_trains_as_plain(seed: int, policy_seconds: float | None) -> None:
    model, x, traced, graph, plan, _ = _setup(seed, policy_seconds)
    _trains_to_the_bit(seed, model, x, traced, graph, plan)


def _trains_to_the_bit(seed: int, model, x, traced, graph, plan) -> None:
    """Two steps of ``plan`` on ``model`` and of a plain copy: outputs and every gradient
    ``torch.equal``."""
    plain = Generated(seed)
    plain.load_state_dict(model.state_dict())
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=graph)
    for step in range(2):
        torch.manual_seed(100 + step)
        a = plain(x.clone())
        torch.manual_seed(100 + step)
        b = remat_model(x.clone())
        for got, want in zip(b, a):
            assert torch.equal(got, want)
        (a[0].square().sum() + a[1].sum()).backward()
        (b[0].square().sum() + b[1].sum()).backward()
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("seed", SEEDS)
def test_a_stage_left_to_plain_checkpoint_runs_the_same_again_and_holds_no_more(seed: int) -> None:
    """A recomputed stage keeps nothing where plain checkpoint's early stop runs none of its
    boundary again: the same ops run again as when it keeps its boundary (the stage-cost
    fold's schedule, ``keep_boundaries``), and the step's predicted peak is no higher. A
    stage that keeps an in-place op (which the policy runs out of place, at the op's own
    time each run) may instead run it again under plain checkpoint, in place."""
    _, _, _, graph, plan, schedule = _setup(seed)
    kept = make_schedule(graph, plan, keep_boundaries=True)
    inplace = graph.meta.inplace or {}
    for plain, keeping in zip(schedule.stages, kept.stages):
        if plain.recomputed != keeping.recomputed:
            assert not plain.kept and set(plain.recomputed) > set(keeping.recomputed)
            assert any(v in inplace for v in keeping.kept)
    assert simulate(graph, plan).peak_bytes <= simulate(graph, plan, schedule=kept).peak_bytes
    # Where the policy costs more than running the kept values again, they run again: more
    # is recomputed, and still no more is held.
    _, _, _, costly, plan, schedule = _setup(seed, 1.0)
    for plain, keeping in zip(schedule.stages, kept.stages):
        assert set(plain.recomputed) >= set(keeping.recomputed)
    assert simulate(costly, plan).peak_bytes <= simulate(costly, plan, schedule=kept).peak_bytes


def test_the_schedule_is_the_plan_compiled_once() -> None:
    """Kept values are boundary values, never random or left-in-place ops; what is kept is
    not recomputed; an in-place op on a recomputed stage's input is rewritten."""
    for seed in SEEDS:
        _, _, _, graph, plan, schedule = _setup(seed)
        stage_of = plan.stage_of()
        random_ops = set(graph.meta.random or ())
        inplace = graph.meta.inplace or {}
        for k, stage in enumerate(schedule.stages):
            assert set(stage.kept).isdisjoint(stage.recomputed)
            if stage.action != "recompute":
                assert not stage.kept and not stage.recomputed
                continue
            saves = any(graph[v].saved or (graph.meta.saved_refs or {}).get(v) for v in stage.vertices)
            assert stage.runs_again == saves
            # The recomputation reaches up to the stage's last saving op (checkpoint stops
            # there): what it reaches is kept, run again or, the last, packed only.
            refs = graph.meta.saved_refs or {}
            savers = [v for v in stage.vertices if graph[v].saved or refs.get(v)]
            assert stage.reached == (stage.vertices[:stage.vertices.index(savers[-1]) + 1] if saves else ())
            packed = {stage.packed_only} - {None}
            assert (set(stage.kept) & set(stage.reached)) | set(stage.recomputed) | packed == set(stage.reached)
            if stage.packed_only:
                assert stage.packed_only == stage.reached[-1]
                aliases = graph.meta.aliases or {}
                read = {aliases.get(u, u) for u in graph.predecessors(stage.packed_only)}
                assert {aliases.get(r, r) for r in refs.get(stage.packed_only, ())} <= read
            for v in stage.kept:
                assert v not in random_ops
                assert v not in inplace or v in stage.rewritten
                readers = graph.successors(v)
                assert v in (graph.meta.outputs or ()) or any(stage_of[w] != k for w in readers)
            for v, t in inplace.items():
                if stage_of[v] == k and (t in stage.vertices) != (v in stage.vertices):
                    assert v in schedule.rewritten


def test_random_and_inplace_ops_are_read_from_torch() -> None:
    """The trace records dropout (an aten op tagged nondeterministic_seeded) as random and the
    in-place ops with the value each writes."""
    torch.manual_seed(0)
    model = Generated(3)
    x = torch.randn(BATCH, WIDTH)
    traced = trace_module(model, (x,))
    graph = traced.graph
    dropouts = {v for v in graph.ids if graph[v].op == "Dropout"}
    assert set(graph.meta.random or ()) == dropouts
    writes = graph.meta.inplace or {}
    for v, operand in writes.items():
        assert graph[v].op in {"ReLU", "add_", "mul_"}
        assert operand in graph.predecessors(v) or operand not in graph
    recipe_inplace = sum(kind in {"relu_", "iadd", "mul_"} for kind, _, _ in model.recipe)
    assert len(writes) == recipe_inplace + model.input_inplace


class NormAct(nn.Module):
    """timm's ``BatchNormAct2d`` pattern: a batch norm, an Identity (its ``drop``), an
    in-place activation on the Identity's output and another Identity (EfficientNet's ``aa``),
    between two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.bn, self.drop, self.act = nn.BatchNorm1d(WIDTH), nn.Identity(), nn.SiLU(inplace=True)
        self.aa = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.aa(self.act(self.drop(self.bn(self.fc1(x))))))


def _profiled(kind: type[nn.Module]) -> tuple[nn.Module, torch.Tensor, nn.Module, Any, Any]:
    """A seeded ``kind()``, its input, a copy to train plainly, its trace and its profile."""
    torch.manual_seed(0)
    model, x = kind(), torch.randn(BATCH, WIDTH)
    plain = copy.deepcopy(model)
    traced = trace_module(model, (x.clone(),))
    return model, x, plain, traced, profile_module(model, x.clone(), traced=traced, warmup=0, repeats=1)


def _trains_as_plain(plain: nn.Module, model: nn.Module, remat_model: nn.Module, x: torch.Tensor) -> None:
    """Two steps of ``remat_model`` (``model`` under a plan) give ``plain``'s gradients and
    leave its buffers, to the bit."""
    for step in range(2):
        plain(x.clone()).square().sum().backward()
        remat_model(x.clone()).square().sum().backward()
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)
    for (name, b), c in zip(plain.named_buffers(), model.buffers()):
        assert torch.equal(b, c), name


def test_an_inplace_op_behind_an_identity_writes_the_storage_of_the_stage_before() -> None:
    """A recomputed stage that starts at the Identity: the in-place activation writes the
    batch norm's output, which the stage before keeps at its boundary, so it runs out of
    place; left in place, the backward found the activation's saved output modified
    (EfficientNet's step failed so)."""
    model, x, plain, traced, graph = _profiled(NormAct)
    ids = graph.ids
    cut = ids.index("drop")
    end = ids.index("aa") + 1
    plan = make_plan(graph, [Stage(ids[:cut], "recompute"), Stage(ids[cut:end], "recompute"),
                             Stage(ids[end:], "keep")], "test")
    assert "act" in make_schedule(graph, plan).rewritten
    _trains_as_plain(plain, model, apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=graph), x)


def test_only_a_stage_that_draws_random_numbers_stashes_the_generator_state() -> None:
    """checkpoint's stash of the random-number state (a few kilobytes per recomputed stage
    on the CPU, a device query per stage on CUDA) is made for a stage whose recomputation
    draws, and no other; the model still trains as plain, dropout included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                          nn.Linear(WIDTH, WIDTH))
    x = torch.randn(BATCH, WIDTH)
    plain = copy.deepcopy(model)
    traced = trace_module(model, (x.clone(),))
    graph = profile_module(model, x.clone(), traced=traced, warmup=0, repeats=1)
    ids = graph.ids
    plan = make_plan(graph, [Stage(ids[:2], "recompute"), Stage(ids[2:4], "recompute"), Stage(ids[4:], "keep")],
                     "test")
    schedule = make_schedule(graph, plan)
    assert [s.draws_random for s in schedule.stages[:2]] == [True, False]
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=graph)
    programs = remat_model.current.stages.programs
    assert [p.preserve_rng_state for p in programs[:2]] == [True, False]
    for step in range(2):
        torch.manual_seed(step)
        plain(x.clone()).square().sum().backward()
        torch.manual_seed(step)
        remat_model(x.clone()).square().sum().backward()
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)


class _ThreeReaders(nn.Module):
    """``h`` read by three linear layers, whose gradients the backward sums into ``h``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.a, self.b, self.c = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.f(x))
        return (self.a(h) * 1.3 + self.b(h) * 0.7 + self.c(h) * 1.1).sum()


@pytest.mark.parametrize("first", [["f", "tanh"], ["f", "tanh", "c"]], ids=["in-order", "c-first"])
def test_a_plan_whose_stages_leave_the_forwards_order_says_so_and_one_in_order_trains_to_the_bit(
        first: list[str]) -> None:
    """Autograd runs the readers of a value in the order the forward made them (design.md
    section 5, "Plain's order"): a recomputed first stage that holds ``c`` makes its node
    before ``a``'s and ``b``'s, and the plan's notes name ``tanh``, whose three readers then
    run out of the forward's order. Stages in the forward's order, recomputed or not, train
    to the bit and say nothing, and so does the plan :func:`in_forward_order` makes of the
    first where it fits the budget."""
    torch.manual_seed(0)
    model = _ThreeReaders()
    plain = copy.deepcopy(model)
    traced = trace_module(model, torch.randn(8, 64))
    rest = [v for v in traced.graph.ids if v not in first]
    plan = make_plan(traced.graph, [(first, "recompute"), (rest, "keep")], "hand")
    remat_model = apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=traced.graph)
    notes = [n for n in plan.notes if n.startswith("order:")]
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    remat_model(x).backward()
    plain(x).backward()
    if first[-1] != "c":
        assert not notes, notes
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), name
        return
    (note,) = notes
    assert "the first: a after c" in note and note.endswith("tanh (1)"), note
    for name in ("a", "b", "c"):  # after tanh: summed as plain sums them
        assert torch.equal(getattr(model, name).weight.grad, getattr(plain, name).weight.grad), name

    # The policy's plan for a budget moves the boundary to the forward's order where that fits.
    ordered = in_forward_order(traced.graph, plan, plan.guaranteed_peak_bytes * 2)
    assert [s.action for s in ordered.stages] == ["recompute", "keep"] and not order_note(traced.graph, ordered)
    assert "in the forward's order" in ordered.notes[-1], ordered.notes
    model.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    apply_plan(traced.runner, ordered, root=model, charge=traced.charge, graph=traced.graph)(x).backward()
    plain(x).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("seed", SEEDS[:8])
def test_the_dp_over_the_forwards_prefixes_keeps_its_order_and_trains_to_the_bit(seed: int) -> None:
    """Kusumoto's approximate DP over the prefixes of the forward's order (the policy's
    fallback where the solver's stages leave it): stages that are runs of the forward's
    order, so no order note, and two steps equal to plain's to the bit."""
    model, x, traced, graph, _, _ = _setup(seed)
    plan = solve_in_forward_order(graph, int(0.8 * simulate(graph).peak_bytes))
    positions = [[graph.position(v) for v in s.nodes] for s in plan.stages]
    assert sorted(p for ps in positions for p in ps) == list(range(len(graph)))
    assert all(ps == list(range(ps[0], ps[0] + len(ps))) for ps in positions), positions
    assert all(a[-1] < b[0] for a, b in zip(positions, positions[1:]))
    assert not order_note(graph, plan)
    _trains_to_the_bit(seed, model, x, traced, graph, plan)


class ResidualEnd(nn.Module):
    """A ResNet block's end: a norm, ``out += identity``, an in-place ReLU whose output the
    next layer reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.bn, self.relu = nn.BatchNorm1d(WIDTH), nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.fc1(x)
        out = self.bn(self.fc2(identity))
        out += identity
        return self.fc3(self.relu(out))


def test_a_stage_ending_in_place_runs_under_plain_checkpoint_and_its_ops_in_place() -> None:
    """A recomputed stage whose boundary is an in-place ReLU: keeping it, the policy must run
    it out of place (a new buffer, charged at the op's forward time) and costs its time per
    op besides, where plain checkpoint runs the ReLU again in place for its forward time
    alone. So the stage runs under plain checkpoint, nothing is rewritten, the predicted
    extra time charges no rewrite, and the step trains as plain does."""
    from lightning_remat.solvers.scoring import executor_seconds

    model, x, plain, traced, graph = _profiled(ResidualEnd)
    ids = graph.ids
    # The policy's time for the stage's three ops less than the ReLU's: without the rewrite's
    # charge, keeping the ReLU under the policy looked cheaper than running it again.
    graph.meta.recompute_vertex_seconds = per_op = graph["relu"].t_fwd / 10
    end = ids.index("relu") + 1
    assert graph[ids[end - 2]].op == "iadd", ids  # the residual is traced in place
    start = ids.index("bn")
    plan = make_plan(graph, [Stage(ids[:start], "keep"), Stage(ids[start:end], "recompute"),
                             Stage(ids[end:], "keep")], "test")
    schedule = make_schedule(graph, plan)
    keeping = make_schedule(graph, plan, keep_boundaries=True)
    assert "relu" in keeping.rewritten and "relu" in keeping.stages[1].kept
    assert not schedule.rewritten and not schedule.stages[1].kept
    assert "relu" in schedule.stages[1].recomputed
    # The policy's schedule pays the ReLU's time again for its rewrite; plain checkpoint pays
    # it in the recomputation instead.
    rewrite = executor_seconds(graph, keeping) - executor_seconds(graph, schedule)
    assert rewrite >= graph["relu"].t_fwd + per_op * len(plan.stages[1].nodes) - 1e-12
    _trains_as_plain(plain, model, apply_plan(traced.runner, plan, root=model, charge=traced.charge, graph=graph), x)
