"""Offloading activations to host memory: Beaumont, Eyraud-Dubois and Shilova, "Optimal GPU-CPU
Offloading Strategies for Deep Neural Network Training" (Euro-Par 2020;
docs/design.md section 4.5).

The model (paper section 3.1) is a chain of forward and backward ops whose activations may be
copied to the host at bandwidth ``beta``, one transfer at a time overlapping compute
(assumptions (A)-(E)); :mod:`.chain` states it.

One module per part of the paper, as each solver reads the same chain model and is scored by
the same no-wait schedule simulator:

- :mod:`.chain`: :class:`Chain` and :func:`chain_from_graph` (the chain of a :class:`Graph`),
  :func:`lower_bound` (Proposition 3), :func:`peak_memory` (``M_peak``), :func:`min_memory`;
- :mod:`.schedule`: :func:`simulate_schedule`, the no-wait, ordered schedule of a set of
  offloaded activations (Proposition 1, Lemma 3): its makespan, idle time and peak;
- :mod:`.greedy`: :func:`greedy_offload` (Theorem 2 rounded up to whole activations, and the
  fractional form) and :func:`vdnn_offload` (the vDNN-style baseline of section 6.1);
- :mod:`.dynprog`: :func:`dynprog_offload` (Algorithm 1 with equations (1)-(10), the
  discretisation and the iterative rounding fix of section 5.3.2);
- here: the registry wrappers ``solve_lower_bound``, ``solve_greedy``, ``solve_dynprog`` and
  ``solve_vdnn`` (``fn(graph, budget_bytes, **options) -> Plan``) and their smallest budgets.

Indices follow the paper: ``x`` and ``y`` have ``n + 1`` entries, ``u_F``/``u_B``/``ex_F``/
``ex_B`` have ``n``. ``x_n`` (the last output) is never offloaded: its backward reads it at once.
"""

from __future__ import annotations

import math

from lightning_remat.budget import format_bytes
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.beaumont.chain import (
    Chain,
    articulation_stages,
    chain_from_graph,
    lower_bound,
    min_memory,
    peak_memory,
)
from lightning_remat.solvers.beaumont.dynprog import dynprog_offload
from lightning_remat.solvers.beaumont.greedy import (
    greedy_fractional_amounts,
    greedy_offload,
    vdnn_offload,
)
from lightning_remat.solvers.beaumont.schedule import Schedule, simulate_schedule
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.scoring import make_plan

__all__ = [
    "Chain", "Schedule", "chain_from_graph", "articulation_stages", "lower_bound", "peak_memory",
    "min_memory", "simulate_schedule", "greedy_offload", "greedy_fractional_amounts",
    "dynprog_offload", "vdnn_offload", "solve_lower_bound", "solve_greedy", "solve_dynprog",
    "solve_vdnn",
]


def _plan_from_chain(
    graph: Graph, chain: Chain, chosen: list[int], solver: str, budget_bytes: int | None,
    notes: list[str],
) -> Plan:
    assert chain.stages is not None
    offloaded_stages = {i - 1 for i in chosen if i >= 1}  # x_{k+1} is what stage k keeps
    if 0 in chosen and chain.x[0] > 0:
        notes.append("x_0 (the step's input) offloaded: not representable as a stage action")
    stages = [Stage(list(ids), "offload" if k in offloaded_stages else "keep")
              for k, ids in enumerate(chain.stages)]
    sched = simulate_schedule(chain, chosen)
    extra = sched.makespan - chain.compute_time if sched.feasible else math.inf
    notes = list(notes)
    notes.append(
        f"chain of {chain.n} stages, beta={chain.beta:.3g} B/s, M_GPU="
        f"{'unlimited' if not math.isfinite(chain.M_GPU) else format_bytes(chain.M_GPU)}; "
        f"offloaded {len(offloaded_stages)} stages ({format_bytes(sched.offloaded_bytes)}); "
        f"makespan {sched.makespan:.6g} s, LB {lower_bound(chain):.6g} s, "
        f"chain-model peak {format_bytes(sched.peak_bytes) if sched.feasible else 'n/a'}"
    )
    if not sched.feasible:
        notes.append(f"infeasible in the offloading model: {sched.reason}")
    plan = make_plan(graph, stages, solver, budget_bytes,
                     extra_seconds=extra if math.isfinite(extra) else 0.0, notes=notes)
    if plan.feasible != sched.feasible:
        plan.notes.append(
            f"feasible={sched.feasible} from the offloading schedule model (the graph simulator "
            f"predicts a peak of {format_bytes(plan.predicted_peak_bytes)} and says "
            f"{plan.feasible}; its model keeps nothing of an offloaded stage on the device)"
        )
        plan.feasible = sched.feasible
    return plan


def _chain_for(graph: Graph, budget_bytes: int | None, options: dict) -> Chain:
    chain = chain_from_graph(graph, stages=options.pop("stages", None),
                             bandwidth=options.pop("bandwidth", None))
    return chain.with_memory(math.inf if budget_bytes is None else float(budget_bytes))


def _check_options(options: dict, allowed: set[str], solver: str) -> None:
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"solver {solver!r} got unknown options {unknown}; allowed: {sorted(allowed)}")


def solve_lower_bound(graph: Graph, budget_bytes: int | None, **options: object) -> Plan:
    """Proposition 3's bound as a plan: ``predicted_extra_seconds = LB - sum(u_F + u_B)``.
    It is a bound on every schedule, not a schedule: the stages are all ``keep``."""
    _check_options(options, {"stages", "bandwidth"}, "lower-bound")
    chain = _chain_for(graph, budget_bytes, dict(options))
    assert chain.stages is not None
    feasible = min_memory(chain) <= chain.M_GPU
    plan = make_plan(graph, [Stage(list(s), "keep") for s in chain.stages], "lower-bound",
                     budget_bytes, extra_seconds=lower_bound(chain) - chain.compute_time,
                     notes=[f"lower bound (Proposition 3), not a schedule: LB = "
                            f"{lower_bound(chain):.6g} s over {chain.n} stages"])
    plan.feasible = feasible
    return plan


def solve_greedy(graph: Graph, budget_bytes: int | None, **options: object) -> Plan:
    """GREEDY (Theorem 2 rounded up to whole activations) on the graph's chain."""
    _check_options(options, {"stages", "bandwidth"}, "greedy")
    chain = _chain_for(graph, budget_bytes, dict(options))
    return _plan_from_chain(graph, chain, greedy_offload(chain), "greedy", budget_bytes,
                            ["GREEDY: the first activations until M_peak - M_GPU is covered"])


def solve_dynprog(graph: Graph, budget_bytes: int | None, **options: object) -> Plan:
    """DYNPROG (section 5.3) on the graph's chain; option ``slots`` (default 500)."""
    _check_options(options, {"stages", "bandwidth", "slots"}, "dynprog")
    opts = dict(options)
    slots = int(opts.pop("slots", 500))  # type: ignore[call-overload]
    chain = _chain_for(graph, budget_bytes, opts)
    return _plan_from_chain(graph, chain, dynprog_offload(chain, slots), "dynprog",
                            budget_bytes, [f"DYNPROG with {slots} memory slots"])


def solve_vdnn(graph: Graph, budget_bytes: int | None, **options: object) -> Plan:
    """The vDNN-style baseline (section 6.1) on the graph's chain."""
    _check_options(options, {"stages", "bandwidth"}, "vdnn")
    chain = _chain_for(graph, budget_bytes, dict(options))
    return _plan_from_chain(graph, chain, vdnn_offload(chain), "vdnn", budget_bytes,
                            ["vDNN-style: offload inputs by u_F/|x| threshold"])


def _min_budget_search(graph: Graph, choose, options: dict) -> int:
    chain = _chain_for(graph, None, dict(options))
    lo = min_memory(chain)
    hi = peak_memory(chain)
    if simulate_schedule(chain.with_memory(lo), choose(chain.with_memory(lo))).feasible:
        return int(math.ceil(lo))
    while hi - lo > max(1.0, hi * 1e-5):
        mid = (lo + hi) / 2
        c = chain.with_memory(mid)
        if simulate_schedule(c, choose(c)).feasible:
            hi = mid
        else:
            lo = mid
    return int(math.ceil(hi))


def min_budget_solve_lower_bound(graph: Graph, **options: object) -> int:
    options.pop("slots", None)
    return int(math.ceil(min_memory(_chain_for(graph, None, dict(options)))))


def min_budget_solve_greedy(graph: Graph, **options: object) -> int:
    return _min_budget_search(graph, greedy_offload, dict(options))


def min_budget_solve_dynprog(graph: Graph, **options: object) -> int:
    # "offload everything" is always a DYNPROG candidate, so its minimum is the chain's.
    options.pop("slots", None)
    return int(math.ceil(min_memory(_chain_for(graph, None, dict(options)))))


def min_budget_solve_vdnn(graph: Graph, **options: object) -> int:
    return _min_budget_search(graph, vdnn_offload, dict(options))
