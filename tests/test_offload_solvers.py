"""Offloading solvers (Beaumont, Eyraud-Dubois and Shilova, Euro-Par 2020): the lower bound,
GREEDY, DYNPROG, the vDNN-style baseline and the no-wait ordered schedule simulator."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_remat.graph.ir import Graph, Node
from lightning_remat.solvers import get_solver, min_budget, plain_plan
from lightning_remat.solvers.beaumont import (
    Chain,
    articulation_stages,
    chain_from_graph,
    dynprog_offload,
    greedy_fractional_amounts,
    greedy_offload,
    lower_bound,
    min_memory,
    peak_memory,
    simulate_schedule,
    vdnn_offload,
)
from lightning_remat.solvers.beaumont.dynprog import _discretize, _dynprog_core

DATA = Path(__file__).parent / "data"


# ---- strategies -------------------------------------------------------------------------
@st.composite
def chains(draw, max_ops: int = 5) -> Chain:
    """A random chain with a memory limit between its minimum and its plain peak."""
    n = draw(st.integers(1, max_ops))
    sizes = st.integers(0, 12)
    times = st.floats(0.0, 2.0, allow_nan=False, allow_infinity=False)
    x = [float(draw(st.integers(0, 3)))] + [float(draw(st.integers(1, 12))) for _ in range(n)]
    chain = Chain(
        u_F=[draw(times) for _ in range(n)], u_B=[draw(times) for _ in range(n)], x=x,
        y=[0.0] + [float(draw(st.integers(0, 4))) for _ in range(n)],
        ex_F=[float(draw(sizes)) / 4 for _ in range(n)],
        ex_B=[float(draw(sizes)) / 4 for _ in range(n)],
        M_GPU=1.0, beta=draw(st.sampled_from([0.5, 2.0, 8.0, 40.0])),
    )
    lo, hi = min_memory(chain), peak_memory(chain)
    fraction = draw(st.floats(0.0, 1.0))
    return chain.with_memory(lo + (hi - lo) * fraction)


def all_subsets(chain: Chain):
    idx = chain.offloadable()
    for r in range(len(idx) + 1):
        yield from (list(c) for c in itertools.combinations(idx, r))


def tol(chain: Chain) -> float:
    return 1e-9 * max(1.0, chain.compute_time + sum(chain.x) / chain.beta)


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- the simulator on a hand-worked case ------------------------------------------------
def test_simulator_hand_worked_schedule():
    # x_1 must go (peak 12 > 8): offloaded during F_1 (t=1..3), F_2 waits for it until t=3,
    # B_2 runs 4..5, x_1 can only come back once B_2 has freed x_3 (5..7), so B_1 waits:
    # makespan 9 = 6 of compute + 3 idle. LB = max(6, 2 * (12 - 8) / 2) = 6.
    chain = Chain([1, 1, 1], [1, 1, 1], [0, 4, 4, 4], [0, 0, 0, 0], [0, 0, 0], [0, 0, 0],
                  M_GPU=8, beta=2)
    assert peak_memory(chain) == 12 and min_memory(chain) == 8
    sched = simulate_schedule(chain, [1])
    assert sched.feasible
    assert sched.op_start == pytest.approx({"F0": 0, "F1": 1, "F2": 3, "B2": 4, "B1": 7, "B0": 8})
    assert sched.makespan == pytest.approx(9) and sched.idle == pytest.approx(3)
    assert sched.peak_bytes <= 8
    assert lower_bound(chain) == pytest.approx(6)
    nothing = simulate_schedule(chain, [])
    assert not nothing.feasible and math.isinf(nothing.makespan) and "F_2" in nothing.reason
    with pytest.raises(ValueError, match="offloadable indices"):
        simulate_schedule(chain, [3])


def test_no_offload_needed_gives_plain_makespan():
    chain = Chain([1, 2], [2, 3], [0, 5, 5], [0, 1, 1], [0, 0], [0, 0], M_GPU=100, beta=1)
    for choose in (greedy_offload, dynprog_offload, vdnn_offload):
        assert choose(chain) == []
    assert simulate_schedule(chain, []).makespan == pytest.approx(8)


# ---- properties on random chains ----------------------------------------------------------
@PROPERTY
@given(chains())
def test_no_schedule_beats_the_lower_bound(chain: Chain):
    lb = lower_bound(chain)
    for subset in all_subsets(chain):
        for fractional in (False, True):
            sched = simulate_schedule(chain, subset, fractional=fractional)
            if sched.feasible:
                assert sched.makespan >= lb - tol(chain)
                assert sched.peak_bytes <= chain.M_GPU * (1 + 1e-9)
    frac = simulate_schedule(chain, amounts=greedy_fractional_amounts(chain), fractional=True)
    assert frac.makespan >= lb - tol(chain)


@PROPERTY
@given(chains())
def test_greedy_matches_the_fractional_optimum(chain: Chain):
    """Theorem 2: when transfers may be split, offloading exactly M_peak - M_GPU, first
    activations first, is optimal. Oracle: every whole-activation subset and every eager
    schedule offloading more, all simulated with split (fractional) transfers."""
    greedy = simulate_schedule(chain, amounts=greedy_fractional_amounts(chain), fractional=True)
    others = [simulate_schedule(chain, s, fractional=True) for s in all_subsets(chain)]
    need = max(peak_memory(chain) - chain.M_GPU, 0.0)
    total = sum(chain.x[i] for i in chain.offloadable())
    for q in (need + (total - need) * k / 6 for k in range(1, 7)):
        amounts = [0.0] * (chain.n + 1)
        for i in chain.offloadable():
            amounts[i] = min(chain.x[i], max(q - sum(amounts), 0.0))
        others.append(simulate_schedule(chain, amounts=amounts, fractional=True))
    feasible = [s.makespan for s in others if s.feasible]
    if feasible:
        assert greedy.feasible
        assert greedy.makespan <= min(feasible) + tol(chain)
    assert greedy.offloaded_bytes == pytest.approx(min(need, total))


@PROPERTY
@given(chains())
def test_dynprog_is_never_worse_than_greedy(chain: Chain):
    greedy = simulate_schedule(chain, greedy_offload(chain))
    dynprog = simulate_schedule(chain, dynprog_offload(chain, slots=100))
    vdnn = simulate_schedule(chain, vdnn_offload(chain))
    best = min((simulate_schedule(chain, s) for s in all_subsets(chain)),
               key=lambda s: s.makespan)
    if greedy.feasible:
        assert dynprog.feasible
        assert dynprog.makespan <= greedy.makespan + tol(chain)
    if best.feasible:  # "offload everything" is a DYNPROG candidate: it is never stuck
        assert dynprog.feasible
        assert dynprog.makespan >= best.makespan - tol(chain)
    if vdnn.feasible:
        assert vdnn.makespan >= best.makespan - tol(chain)


@PROPERTY
@given(chains())
def test_dynprog_programme_alone_finds_idle_free_schedules_with_a_fast_link(chain: Chain):
    """Algorithm 1 without GREEDY's help or the local search: with a link so fast that
    transfers take no time, the chosen set's schedule has no idle time."""
    fast = Chain(chain.u_F, [u + 1.0 for u in chain.u_B], chain.x, chain.y, chain.ex_F,
                 chain.ex_B, chain.M_GPU, beta=1e9)
    result = _dynprog_core(fast, _discretize(fast, 400))
    if min_memory(fast) * 1.01 > fast.M_GPU:
        return  # slot rounding may make the tightest limits infeasible for the programme
    assert result is not None
    sched = simulate_schedule(fast, result[0][0])
    assert sched.feasible
    assert sched.idle <= 1e-6 * fast.compute_time + 1e-6


# ---- the chain of a graph -------------------------------------------------------------------
def residual_graph(bandwidth: float | None = 1e9) -> Graph:
    nodes = [Node(id=i, op="op", mem=100, saved=100, t_fwd=1.0, t_bwd=2.0)
             for i in ("a", "b", "c", "add", "d")]
    edges = [("a", "b"), ("b", "c"), ("c", "add"), ("a", "add"), ("add", "d")]
    meta = {} if bandwidth is None else {"bandwidth_bytes_per_s": bandwidth}
    return Graph(nodes, edges, meta)


def test_articulation_chain_groups_the_residual_branch():
    assert articulation_stages(residual_graph()) == [["a"], ["b", "c", "add"], ["d"]]
    chain = chain_from_graph(residual_graph())
    assert chain.n == 3
    assert chain.x == [0, 100, 300, 100]
    assert chain.u_F == [1, 3, 1] and chain.u_B == [2, 6, 2]
    assert chain.y == [0, 100, 100, 100]
    assert chain.beta == 1e9


def test_chain_needs_a_bandwidth():
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        chain_from_graph(residual_graph(bandwidth=None))
    assert chain_from_graph(residual_graph(None), bandwidth=5.0).beta == 5.0
    with pytest.raises(ValueError, match="cover every vertex"):
        chain_from_graph(residual_graph(), stages=[["a"], ["b"]])


def two_output_step() -> Graph:
    """A stem, a skip connection that leaves the step (a second output, as a U-Net's does
    when only its encoder is traced) and a head."""
    nodes = [Node("stem", "Conv2d", mem=400, t_fwd=1e-3, t_bwd=2e-3),
             Node("skip", "ReLU", mem=400, saved=400, t_fwd=1e-4, t_bwd=1e-4),
             Node("down", "Conv2d", mem=100, saved=400, t_fwd=1e-3, t_bwd=2e-3),
             Node("head", "Linear", mem=50, saved=100, t_fwd=1e-3, t_bwd=2e-3)]
    edges = [("stem", "skip"), ("skip", "down"), ("down", "head")]
    return Graph(nodes, edges, {
        "outputs": ["skip", "head"], "aliases": {}, "bandwidth_bytes_per_s": 1e9,
        "saved_refs": {"stem": [], "skip": ["skip"], "down": ["skip"], "head": ["down"]}})


def test_the_chain_counts_every_output_of_the_step():
    """The other outputs' values (held by the loss) and gradients (from the backward's start
    to their own op's) are in the chain's memory: its plain peak is at least the simulator's,
    so an offloading plan the chain accepts is not one the simulator finds over the budget.
    Counting the last output alone, the chain's peak was 1200 bytes to the simulator's 1300,
    and near the plain peak DYNPROG kept everything and missed a budget a smaller one met."""
    graph = two_output_step()
    assert peak_memory(chain_from_graph(graph)) >= plain_plan(graph).predicted_peak_bytes
    least = min_budget(graph, "dynprog")
    for budget in (least, plain_plan(graph).guaranteed_peak_bytes):
        assert get_solver("dynprog")(graph, budget).guaranteed_peak_bytes <= budget


def test_chain_from_plan_stages():
    chain = chain_from_graph(residual_graph(), stages=[["a", "b"], ["c", "add", "d"]])
    assert chain.n == 2 and chain.x == [0, 200, 300]


# ---- registry wrappers ---------------------------------------------------------------------
def chain_graph() -> Graph:
    # Five stages, 4 MB each, 1 ms of compute; 1 GB/s link.
    return Graph.chain([4_000_000] * 5, [1e-3] * 5, [2e-3] * 5,
                       meta={"bandwidth_bytes_per_s": 1e9})


@pytest.mark.parametrize("name", ["greedy", "dynprog", "vdnn"])
def test_solvers_return_offload_plans(name: str):
    graph = chain_graph()
    chain = chain_from_graph(graph)
    budget = int((min_memory(chain) + peak_memory(chain)) / 2)
    plan = get_solver(name)(graph, budget)
    assert plan.solver == name and plan.feasible
    offloaded = [s for s in plan.stages if s.action == "offload"]
    assert offloaded, "half the peak cannot be met without offloading"
    chosen = [k + 1 for k, s in enumerate(plan.stages) if s.action == "offload"]
    sched = simulate_schedule(chain.with_memory(budget), chosen)
    assert plan.predicted_extra_seconds == pytest.approx(sched.makespan - chain.compute_time)
    assert plan.predicted_extra_seconds >= 0
    assert any("makespan" in note for note in plan.notes)
    # No budget: nothing offloaded, no extra time.
    free = get_solver(name)(graph, None)
    assert free.count("offload") == 0 and free.predicted_extra_seconds == pytest.approx(0)


def test_infeasible_budget_is_reported_not_raised():
    graph = chain_graph()
    plan = get_solver("dynprog")(graph, 1000)
    assert not plan.feasible
    assert any("infeasible" in note for note in plan.notes)


def test_lower_bound_plan_says_it_is_a_bound():
    graph = chain_graph()
    chain = chain_from_graph(graph)
    budget = int(min_memory(chain))
    plan = get_solver("lower-bound")(graph, budget)
    lb = lower_bound(chain.with_memory(budget))
    assert plan.predicted_extra_seconds == pytest.approx(lb - chain.compute_time)
    assert any("not a schedule" in note for note in plan.notes)
    assert plan.count("offload") == 0


def test_min_budget_matches_the_chain_minimum():
    graph = chain_graph()
    chain = chain_from_graph(graph)
    assert min_budget(graph, "dynprog") == math.ceil(min_memory(chain))
    assert get_solver("dynprog")(graph, min_budget(graph, "dynprog")).feasible
    greedy_min = min_budget(graph, "greedy")
    assert min_memory(chain) <= greedy_min <= peak_memory(chain)
    assert get_solver("greedy")(graph, greedy_min).feasible


def test_unknown_option_is_rejected():
    with pytest.raises(ValueError, match="unknown options"):
        get_solver("greedy")(chain_graph(), 10**7, slot=3)


# ---- recorded CNN profiles (tests/data/make_cnn_profiles.py) -----------------------------------
@pytest.mark.parametrize("name,slots", [("resnet50_224", 500), ("densenet121_224", 500)])
def test_dynprog_within_1_2_of_the_lower_bound_on_cnn_profiles(name: str, slots: int):
    chain = chain_from_graph(Graph.load(DATA / f"{name}.json"))
    lo, hi = min_memory(chain), peak_memory(chain)
    ratios = []
    for k in range(6):
        limited = chain.with_memory(lo + (hi - lo) * k / 5)
        sched = simulate_schedule(limited, dynprog_offload(limited, slots))
        assert sched.feasible
        ratios.append(sched.makespan / lower_bound(limited))
    assert max(ratios) <= 1.2, ratios
    assert min(ratios) >= 1.0 - 1e-9


@PROPERTY
@given(chains(max_ops=6), st.integers(20, 600))
def test_discretisation_follows_section_5_3_2(chain: Chain, slots: int):
    """ex and y rounded up; u * beta by partial sums rounded down (never more transfer time
    than there is); x by partial sums rounded up (within one slot of the truth per prefix)."""
    d = _discretize(chain, slots)
    scale = slots / chain.M_GPU
    assert all(v >= chain.ex_F[i] * scale - 1e-6 for i, v in enumerate(d.ex_F))
    assert all(v >= chain.y[i] * scale - 1e-6 for i, v in enumerate(d.y))
    for disc, real in ((d.uF, chain.u_F), (d.uB, chain.u_B)):
        assert all(v >= 0 for v in disc)
        for k in range(1, len(real) + 1):
            exact = sum(real[:k]) * chain.beta * scale
            assert exact - 1 - 1e-6 <= sum(disc[:k]) <= exact + 1e-6
    for k in range(1, len(chain.x) + 1):
        exact = sum(chain.x[:k]) * scale
        assert exact - 1e-6 <= sum(d.x[:k]) <= exact + 1 + 1e-6


def test_cnn_profile_chains_count_each_saved_storage_once():
    for name, stages in (("resnet50_224", 38), ("densenet121_224", 78)):
        graph = Graph.load(DATA / f"{name}.json")
        chain = chain_from_graph(graph)
        assert chain.n == stages
        # Conv and the ReLU before it save the same storage: the chain counts it once.
        assert 0 < sum(chain.x) < sum(n.saved for n in graph)
        assert chain.beta == graph.meta.bandwidth_bytes_per_s
        assert min_memory(chain) < peak_memory(chain)
