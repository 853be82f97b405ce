"""No solver crashes on a traced graph (the first half of the solver contract of
tests/test_solver_contract.py) on graphs hypothesis generates.

The graphs are traced and profiled from the generated models of tests/test_schedule.py
(Linear, LayerNorm, GELU, in-place ReLU, ``mul_`` and ``add_`` on fresh values, dropout,
views, a tuple producer, skips, an in-place op on the step's input), of random length.
For every registered solver, from its smallest budget up to the plain step's, ``solve``
returns a plan that fits or raises ``RematInfeasibleError``, nothing else. The one other
refusal is documented: the exact Kusumoto DPs refuse a graph with more lower sets than
their ``max_lower_sets`` (a ``ValueError`` that says so).

Such graphs made the simulator raise ``KeyError`` where a recomputed stage kept a view of
a value it recomputes (a ViT's ``norm_pre``, an Identity, over the recomputed position
embedding's ``add``): the ``LayerNorm`` reading the view saved the recomputed copy, already
freed.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_remat.errors import RematInfeasibleError
from lightning_remat.graph.ir import Graph, Node
from lightning_remat.graph.profile import profile_module
from lightning_remat.graph.trace import trace_module
from lightning_remat.solvers import SOLVERS, Stage, fits, make_plan, min_budget, simulate, solve
from lightning_remat.solvers.schedule import make_schedule
from tests.test_schedule import BATCH, WIDTH, Generated
from tests.test_solver_contract import BANDWIDTH_BYTES_PER_S, budgets

EXACT = {"kusumoto-exact-tc", "kusumoto-exact-mc"}


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
    valid plan that fits or raises ``RematInfeasibleError``; nothing else (but the exact DPs'
    documented refusal of a graph too wide for them)."""
    try:
        least = min_budget(graph, solver)
    except ValueError as refused:
        if solver not in EXACT or "lower sets" not in str(refused):
            raise
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
    assert make_schedule(graph, plan).stages[0].kept == {"ident", "fc"}
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
