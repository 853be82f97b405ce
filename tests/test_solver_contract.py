"""The contract every registered solver keeps (``lightning_remat.solvers.SOLVERS``): a solver
is held to it by being registered.

On graphs with views, in-place ops, layer norms and tuple producers (``getitem``), from the
solver's smallest budget (:func:`min_budget`) up to the plain step's:

- ``solve`` returns a plan that covers the graph in an order its edges allow
  (``Plan.validate``) and fits the budget (:func:`fits`), the smallest budget included;
- below the smallest budget ``solve`` raises ``RematInfeasibleError``, and nothing else,
  naming that smallest budget.

What each solver accepts: any graph of the IR, except that the offloading solvers
(``offloads=True``) need the host-device bandwidth (``graph.meta.bandwidth_bytes_per_s``,
a ``ValueError`` says so) and the exact Kusumoto DPs decline a graph with more lower sets
than their ``max_lower_sets`` (``SolverDeclinedError``, a ``RematInfeasibleError``). The offloading solvers and Hong's
work on the graph's chain of articulation stages, so a DAG is accepted by all of them.

The graphs are prefixes of profiled steps (tests/data: a GPT block's LayerNorm, fused qkv
``Linear`` split by ``getitem``, head views and transposes; a U-Net's BatchNorms with
in-place ReLUs), their measured structure and storage kept, their op times drawn afresh.
"""

from __future__ import annotations

import dataclasses
import random
from functools import cache
from pathlib import Path

import pytest

from lightning_remat.errors import RematInfeasibleError
from lightning_remat.graph.ir import Graph, Node
from lightning_remat.solvers import SOLVERS, fits, min_budget, plain_plan, solve

DATA = Path(__file__).parent / "data"
BANDWIDTH_BYTES_PER_S = 12.2e9  # about pinned copies over PCIe 3.0 x16, for the offloading solvers
BISECTION_RESOLUTION = 100_000
"""``min_budget`` bisects to within ``1 / BISECTION_RESOLUTION`` of the budget where a solver
has no smallest budget of its own that fits."""


def prefix_graph(graph: Graph, length: int, seed: int) -> Graph:
    """The step of the first ``length`` vertices of ``graph``: what leaves the prefix becomes
    its outputs, the per-vertex metadata is restricted to it, and the whole-step
    measurements (plain peak, loss peak, step time) are dropped. Op times are drawn again
    (0.5x to 2x the measured ones), so each seed weighs recomputation differently."""
    rng = random.Random(seed)
    ids = graph.ids[:length]
    kept = set(ids)

    def restricted(per_vertex: dict | None) -> dict | None:
        return None if per_vertex is None else {k: v for k, v in per_vertex.items() if k in kept}

    meta = graph.meta
    leaving = {v for v in ids if any(w not in kept for w in graph.successors(v))}
    outputs = [v for v in ids if v in leaving or v in set(meta.outputs or graph.ids[-1:])]
    new_meta = dataclasses.replace(
        meta,
        input_consumers=[v for v in meta.input_consumers or [] if v in kept],
        outputs=outputs,
        param_bytes=restricted(meta.param_bytes),
        param_grad_bytes=restricted(meta.param_grad_bytes),
        shape_edges=None if meta.shape_edges is None
        else [e for e in meta.shape_edges if e[0] in kept and e[1] in kept],
        batch_dependent=restricted(meta.batch_dependent),
        saved_refs=restricted(meta.saved_refs),
        saved_input_bytes=restricted(meta.saved_input_bytes),
        aliases=restricted(meta.aliases),
        requires_grad=restricted(meta.requires_grad),
        resident_views=None if meta.resident_views is None
        else [v for v in meta.resident_views if v in kept],
        plain_peak_bytes=None, loss_peak_bytes=None, output_grad_bytes=None, step_seconds=None,
        bandwidth_bytes_per_s=BANDWIDTH_BYTES_PER_S,
        extra={},
    )
    nodes = [dataclasses.replace(graph[v], t_fwd=graph[v].t_fwd * rng.uniform(0.5, 2.0),
                                 t_bwd=graph[v].t_bwd * rng.uniform(0.5, 2.0)) for v in ids]
    edges = [(u, v) for u, v in graph.edges if u in kept and v in kept]
    return Graph(nodes, edges, new_meta)


PROFILES = {"gpt": "gpt_cpu_b8.json", "unet": "unet_cpu_b8.json"}


@cache
def profiled(name: str) -> Graph:
    return Graph.load(DATA / PROFILES[name])


# (profile, prefix length, seed): the GPT's first attention block (LayerNorm, the fused qkv
# Linear and its getitem pieces, head views, transposes, masked_fill, softmax) and the
# U-Net's first down blocks (BatchNorm, in-place ReLU, MaxPool).
GRAPHS = [("gpt", 12, 0), ("gpt", 19, 1), ("unet", 10, 2)]
SLOW_GRAPHS = [("gpt", 30, 3), ("unet", 24, 4), ("gpt", 45, 5)]


@cache
def generated(name: str, length: int, seed: int) -> Graph:
    return prefix_graph(profiled(name), length, seed)


def test_the_generated_graphs_have_what_the_contract_is_about() -> None:
    ops = set()
    aliased = {"view": False, "inplace": False}
    for spec in GRAPHS:
        graph = generated(*spec)
        ops |= {node.op for node in graph}
        for v, base in (graph.meta.aliases or {}).items():
            aliased["inplace" if graph[v].op == "ReLU" else "view"] = True
            assert base in graph
    assert {"LayerNorm", "getitem", "view", "transpose", "ReLU"} <= ops
    assert all(aliased.values())


def budgets(graph: Graph, least: int) -> list[int]:
    """From ``least`` up to the plain step's budget (its peak plus the plan's margin), or
    ``least`` alone where the solver's smallest budget is above it."""
    plain = plain_plan(graph).guaranteed_peak_bytes
    top = max(least, plain)
    return sorted({least, least + (top - least) // 3, least + 2 * (top - least) // 3, top})


def check_contract(solver: str, graph: Graph) -> None:
    least = min_budget(graph, solver)
    assert least > 0
    for budget in budgets(graph, least):
        plan = solve(graph, budget, solver)
        plan.validate(graph)
        assert fits(plan, budget), (solver, budget, plan.guaranteed_peak_bytes)
    below = least - 1 - least // BISECTION_RESOLUTION
    with pytest.raises(RematInfeasibleError) as raised:
        solve(graph, below, solver)
    assert raised.value.min_budget_bytes == least
    unbounded = solve(graph, None, solver)
    unbounded.validate(graph)


@pytest.mark.parametrize("spec", GRAPHS, ids=lambda s: f"{s[0]}{s[1]}-seed{s[2]}")
@pytest.mark.parametrize("solver", sorted(SOLVERS))
def test_every_solver_keeps_the_contract(solver: str, spec: tuple[str, int, int]) -> None:
    check_contract(solver, generated(*spec))


@pytest.mark.slow
@pytest.mark.parametrize("spec", SLOW_GRAPHS, ids=lambda s: f"{s[0]}{s[1]}-seed{s[2]}")
@pytest.mark.parametrize("solver", sorted(SOLVERS))
def test_every_solver_keeps_the_contract_on_larger_graphs(solver: str, spec: tuple[str, int, int]) -> None:
    check_contract(solver, generated(*spec))


def test_a_tuple_producer_that_saves_a_later_part_is_planned() -> None:
    """``values, indices = x.max(dim)``: the profiler records the op at the first getitem
    (``values``), saving ``indices``, the second getitem, which comes after it."""
    nodes = [Node("linear", "Linear", mem=2048, saved=2048, t_fwd=1e-4, t_bwd=2e-4),
             Node("values", "getitem", mem=256, saved=512, t_fwd=1e-5, t_bwd=1e-5),
             Node("indices", "getitem", mem=512),
             Node("mul", "mul", mem=2048, saved=2304, t_fwd=1e-5, t_bwd=1e-5)]
    edges = [("linear", "values"), ("values", "indices"), ("linear", "mul"), ("values", "mul")]
    graph = Graph(nodes, edges, {
        "saved_refs": {"linear": [], "values": ["indices"], "indices": [], "mul": ["values", "linear"]},
        "requires_grad": {"linear": True, "values": True, "indices": False, "mul": True},
        "aliases": {}, "outputs": ["mul"], "bandwidth_bytes_per_s": BANDWIDTH_BYTES_PER_S})
    check_contract("auto", graph)


@pytest.mark.parametrize("solver", sorted(name for name, entry in SOLVERS.items() if entry.offloads))
def test_an_offloading_solver_asks_for_the_bandwidth(solver: str) -> None:
    graph = prefix_graph(profiled("gpt"), 12, 0)
    graph.meta.bandwidth_bytes_per_s = None
    with pytest.raises(ValueError, match="bandwidth"):
        solve(graph, plain_plan(graph).guaranteed_peak_bytes, solver)
