"""No solver crashes on a traced graph (the first half of the solver contract of
tests/test_solver_contract.py) on graphs hypothesis generates.

The graphs are traced and profiled from the generated models of tests/test_schedule.py
(Linear, LayerNorm, GELU, in-place ReLU, ``mul_`` and ``add_`` on fresh values, dropout,
views, a tuple producer, skips, an in-place op on the step's input), of random length.
For every registered solver, from its smallest budget up to the plain step's, ``solve``
returns a plan that fits or raises ``RematInfeasibleError``, nothing else. The exact
Kusumoto DPs decline a graph with more lower sets than their ``max_lower_sets`` with
``SolverDeclinedError``, a ``RematInfeasibleError`` naming the approximate DP instead.

Such graphs made the simulator raise ``KeyError`` where a recomputed stage kept a view of
a value it recomputes (a ViT's ``norm_pre``, an Identity, over the recomputed position
embedding's ``add``): the ``LayerNorm`` reading the view saved the recomputed copy, already
freed. (A view is no longer kept: the policy has no op of it to save.)
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_remat import remat
from lightning_remat.errors import RematInfeasibleError, SolverDeclinedError
from lightning_remat.graph.ir import Graph, Node
from lightning_remat.graph.profile import profile_module
from lightning_remat.graph.trace import trace_module
from lightning_remat.solvers import (
    SOLVERS,
    Stage,
    fits,
    make_plan,
    min_budget,
    plain_plan,
    simulate,
    solve,
)
from lightning_remat.solvers.schedule import make_schedule
from tests.test_schedule import BATCH, WIDTH, Generated
from tests.test_solver_contract import BANDWIDTH_BYTES_PER_S, budgets

EXACT = {"kusumoto-exact-tc", "kusumoto-exact-mc"}
DATA = Path(__file__).parent / "data"


@cache
def traced_graph(seed: int, length: int) -> Graph:
    """The profiled graph of ``Generated(seed, length)`` (one trace and profile per model)."""
    torch.manual_seed(seed)
    model = Generated(seed, length)
    x = torch.randn(BATCH, WIDTH)
    traced = trace_module(model, (x.clone(),))
    graph = profile_module(model, x.clone(), traced=traced, warmup=0, repeats=1)
    graph.meta.bandwidth_bytes_per_s = BANDWIDTH_BYTES_PER_S  # for the offloading solvers
    return graph


def check_any_solver(solver: str, graph: Graph) -> None:
    """``min_budget`` answers, and from it up to the plain step's budget ``solve`` returns a
    valid plan that fits or raises ``RematInfeasibleError``; nothing else. The exact DPs
    decline a graph too wide for them at every budget alike."""
    try:
        least = min_budget(graph, solver)
    except SolverDeclinedError as refused:
        assert solver in EXACT and "lower sets" in str(refused), (solver, refused)
        with pytest.raises(SolverDeclinedError):
            solve(graph, plain_plan(graph).guaranteed_peak_bytes, solver)
        return
    for budget in budgets(graph, least):
        try:
            plan = solve(graph, budget, solver)
        except RematInfeasibleError:
            continue
        plan.validate(graph)
        assert fits(plan, budget), (solver, budget, plan.guaranteed_peak_bytes)


@pytest.mark.slow
# Up to 10 ops: the exact DPs enumerate lower sets, and CI has 2 cores.
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), length=st.integers(3, 10))
def test_no_solver_crashes_on_a_generated_graph(seed: int, length: int) -> None:
    graph = traced_graph(seed, length)
    for solver in sorted(SOLVERS):
        check_any_solver(solver, graph)


def check_auto_is_monotone(graph: Graph) -> None:
    """The smallest budget ``auto`` names is accepted, and so is every larger one up to the
    plain step's: a user who raises the budget never gets a refusal. Budgets in steps of
    a hundredth of the range and of 16 bytes at its low end, where the DP's choices change
    fastest."""
    least = min_budget(graph, "auto")
    top = max(least, plain_plan(graph).guaranteed_peak_bytes)
    steps = set(range(least, top + 1, max(1, (top - least) // 100)))
    steps |= set(range(least, min(top, least + 1024) + 1, 16)) | {top}
    for budget in sorted(steps):
        plan = solve(graph, budget, "auto")  # raises RematInfeasibleError if refused
        assert fits(plan, budget), (budget, plan.guaranteed_peak_bytes)


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), length=st.integers(3, 10))
def test_auto_accepts_every_budget_from_its_smallest(seed: int, length: int) -> None:
    check_auto_is_monotone(traced_graph(seed, length))


def test_auto_accepts_every_budget_above_a_plan_the_dp_misjudges() -> None:
    """A generated graph (``Generated(101, 10)``, as profiled once, read as a graph of no
    device so that no random-number stash outweighs its few kilobytes) where, at some
    budgets above its smallest, the approximate DP's strategy sums a cache that the
    simulator's liveness puts higher: it does not fit, where the plan at the smallest budget
    does. ``auto`` keeps the smaller budget's plan there rather than refusing a budget above
    one it accepted."""
    graph = Graph.load(DATA / "generated_seed101_len10.json")
    graph.meta.device = None
    least = min_budget(graph, "kusumoto-tc")
    plain = plain_plan(graph).guaranteed_peak_bytes
    misjudged = []
    for budget in range(least, plain + 1, 16):
        try:
            solve(graph, budget, "kusumoto-tc")
        except RematInfeasibleError:
            misjudged.append(budget)
    assert misjudged, "the stored graph no longer shows the DP's misjudgement"
    for budget in misjudged:
        assert fits(solve(graph, budget, "auto"), budget)
    check_auto_is_monotone(graph)


def test_a_kept_view_of_a_recomputed_value_is_what_its_reader_saves() -> None:
    """The ViT case the module docstring describes, on a graph built by hand: ``add``,
    its alias ``drop`` and its alias ``ident`` (kept at the boundary), read by a LayerNorm
    that saves its input. Every solver plans it at every budget from its smallest."""
    nodes = [Node("cat", "cat", mem=4096, t_fwd=1e-5, t_bwd=1e-5),
             Node("add", "add", mem=4096, t_fwd=1e-5, t_bwd=1e-5),
             Node("drop", "Dropout", mem=4096, t_fwd=1e-6, t_bwd=1e-6),
             Node("ident", "Identity", mem=4096, t_fwd=1e-6, t_bwd=1e-6),
             Node("norm", "layer_norm", mem=4096, saved=4096 + 64, t_fwd=1e-4, t_bwd=2e-4),
             Node("fc", "Linear", mem=8192, saved=4096, t_fwd=1e-3, t_bwd=2e-3),
             Node("out", "add", mem=8192, t_fwd=1e-5, t_bwd=1e-5)]
    edges = [("cat", "add"), ("add", "drop"), ("drop", "ident"), ("ident", "norm"),
             ("norm", "fc"), ("fc", "out"), ("ident", "out")]
    graph = Graph(nodes, edges, {
        "saved_refs": {"cat": [], "add": [], "drop": [], "ident": [], "norm": ["add"],
                       "fc": ["norm"], "out": []},
        "aliases": {"drop": "add", "ident": "add"},
        "param_bytes": {"norm": 64, "fc": 1024}, "outputs": ["out"],
        "bandwidth_bytes_per_s": BANDWIDTH_BYTES_PER_S})
    plan = make_plan(graph, [Stage(graph.ids[:6], "recompute"), Stage(["out"], "keep")], "test")
    # ident, a view, is made again over the recomputed add, not kept; fc, the last saving op,
    # only packs its input, so the stage runs under plain checkpoint.
    assert make_schedule(graph, plan).stages[0].kept == set()
    assert make_schedule(graph, plan, keep_boundaries=True).stages[0].kept == {"ident", "fc"}
    recomputed = [e.node for e in simulate(graph, plan).events if e.phase == "recompute"]
    assert recomputed == graph.ids[:6]
    for solver in sorted(SOLVERS):
        check_any_solver(solver, graph)


def test_a_view_past_an_inplace_op_run_out_of_place_lives_in_its_new_storage() -> None:
    """An EfficientNet block's pattern, on a graph built by hand: a batch norm, an Identity
    over it, an in-place SiLU (all one storage in the profile, named by its first owner
    ``bn``), the stage boundary, then an Identity over the SiLU read by a squeeze-excite mean
    and a multiply that saves it. The SiLU crosses the boundary of a recomputed stage, so it
    runs out of place into a storage of its own: the next stage's Identity and what its
    readers save live there, not in ``bn``'s (the simulator raised ``KeyError`` on it)."""
    nodes = [Node("conv", "Conv2d", mem=4096, saved=4096, t_fwd=1e-4, t_bwd=2e-4),
             Node("bn", "batch_norm", mem=4096, saved=4096 + 64, t_fwd=1e-5, t_bwd=2e-5),
             Node("drop", "Identity", mem=4096, t_fwd=1e-6),
             Node("act", "SiLU", mem=4096, saved=4096, t_fwd=1e-5, t_bwd=1e-5),
             Node("aa", "Identity", mem=4096, t_fwd=1e-6),
             Node("mean", "mean", mem=64, t_fwd=1e-6, t_bwd=1e-6),
             Node("gate", "Linear", mem=64, saved=64, t_fwd=1e-5, t_bwd=1e-5),
             Node("mul", "mul", mem=4096, saved=4096 + 64, t_fwd=1e-5, t_bwd=1e-5),
             Node("out", "Conv2d", mem=4096, saved=4096, t_fwd=1e-4, t_bwd=2e-4)]
    edges = [("conv", "bn"), ("bn", "drop"), ("drop", "act"), ("act", "aa"), ("aa", "mean"),
             ("mean", "gate"), ("aa", "mul"), ("gate", "mul"), ("mul", "out")]
    graph = Graph(nodes, edges, {
        "saved_refs": {"conv": [], "bn": ["conv"], "drop": [], "act": ["bn"], "aa": [],
                       "mean": [], "gate": ["mean"], "mul": ["bn", "gate"], "out": ["mul"]},
        "aliases": {"drop": "bn", "act": "bn", "aa": "bn"},
        "param_bytes": {"conv": 1024, "bn": 64, "gate": 256, "out": 1024}, "outputs": ["out"],
        "bandwidth_bytes_per_s": BANDWIDTH_BYTES_PER_S})
    plan = make_plan(graph, [Stage(graph.ids[:4], "recompute"), Stage(graph.ids[4:8], "recompute"),
                             Stage(["out"], "keep")], "test")
    assert "act" in make_schedule(graph, plan).rewritten
    assert simulate(graph, plan).peak_bytes > 0
    for solver in sorted(SOLVERS):
        check_any_solver(solver, graph)


def test_a_saved_storage_freed_before_its_saver_counts_as_the_savers_own() -> None:
    """A forward run around its submodules: block ``a``'s output is read by ``act`` alone and
    freed, then ``b`` saves a tensor the forward made at that address, so the profile names
    ``a`` as what ``b`` saves. Every solver plans the graph (the simulator held the freed
    storage: ``KeyError``), and ``b``'s saved bytes count at every budget."""
    nodes = [Node("a", "Sequential", mem=4096, saved=4096, t_fwd=1e-4, t_bwd=2e-4),
             Node("act", "Tanh", mem=4096, saved=4096, t_fwd=1e-5, t_bwd=1e-5),
             Node("b", "Sequential", mem=4096, saved=4096, t_fwd=1e-4, t_bwd=2e-4),
             Node("out", "Linear", mem=4096, saved=4096, t_fwd=1e-4, t_bwd=2e-4)]
    edges = [("a", "act"), ("act", "b"), ("b", "out")]
    meta = {"saved_refs": {"a": [], "act": ["act"], "b": ["a"], "out": ["b"]},
            "param_bytes": {"a": 1024, "b": 1024, "out": 1024}, "outputs": ["out"],
            "bandwidth_bytes_per_s": BANDWIDTH_BYTES_PER_S}
    graph = Graph(nodes, edges, meta)
    # The same step with b's save named as its own block: the same peak.
    own = Graph(nodes, edges, {**meta, "saved_refs": {**meta["saved_refs"], "b": []}})
    assert simulate(graph).peak_bytes == simulate(own).peak_bytes
    for solver in sorted(SOLVERS):
        check_any_solver(solver, graph)


class Wide(nn.Module):
    """``branches`` Linear layers side by side on the input, stacked: every subset of the
    branches is a lower set, 2**branches of them."""

    def __init__(self, branches: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(branches))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([branch(x) for branch in self.branches]).sum(0)


def test_the_exact_dps_decline_a_graph_with_too_many_lower_sets() -> None:
    """A graph of 18 parallel branches has over 2**18 lower sets, past the exact DPs'
    100,000: ``min_budget`` and ``solve`` (at any budget) and ``remat`` raise
    ``SolverDeclinedError``, a ``RematInfeasibleError`` that names the approximate DP
    instead, never a ``ValueError``; ``auto`` plans the same graph."""
    torch.manual_seed(0)
    model = Wide(18)
    x = torch.randn(BATCH, WIDTH)
    graph = profile_module(model, x, traced=trace_module(model, (x,)), warmup=0, repeats=1)
    plain = plain_plan(graph).guaranteed_peak_bytes
    for solver in sorted(EXACT):
        with pytest.raises(SolverDeclinedError, match="more than 10000 lower sets") as refused:
            min_budget(graph, solver)
        assert refused.value.tried == solver and "'kusumoto-tc'" in str(refused.value)
        assert refused.value.min_budget_bytes is None
        for budget in (plain // 2, plain, None):
            with pytest.raises(RematInfeasibleError, match="declines this graph"):
                solve(graph, budget, solver)
    with pytest.raises(SolverDeclinedError, match=r"'kusumoto-exact-tc' declines") as refused:
        remat(model, x, memory_budget="60%", solver="kusumoto-exact-tc")
    assert refused.value.budget_bytes > 0  # the budget asked for, as every refusal names it
    least = min_budget(graph, "auto")
    assert fits(solve(graph, max(least, plain // 2), "auto"), max(least, plain // 2))
