"""Beaumont, Eyraud-Dubois and Shilova, "Optimal GPU-CPU Offloading Strategies for Deep Neural
Network Training" (Euro-Par 2020; docs/design.md section 4.5): DYNPROG (section 5.3, Algorithm 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_remat.solvers.beaumont.chain import Chain, peak_memory
from lightning_remat.solvers.beaumont.greedy import greedy_offload
from lightning_remat.solvers.beaumont.schedule import simulate_schedule

__all__ = ["dynprog_offload"]


@dataclass
class _Discrete:
    """The chain in memory slots of size ``M_GPU / S`` (section 5.3.2); times as bytes
    transferable in that time (``u * beta``), also in slots."""

    x: list[int]
    y: list[int]
    ex_F: list[int]
    ex_B: list[int]
    uF: list[int]
    uB: list[int]
    S: int


def _discretize(chain: Chain, S: int, x_slots: list[int] | None = None) -> _Discrete:
    scale = S / chain.M_GPU

    def up(v: float) -> int:
        return int(math.ceil(v * scale - 1e-9))

    def from_partial_sums(values: Sequence[float], round_up: bool) -> list[int]:
        # Section 5.3.2: round the partial sums, then take differences.
        out: list[int] = []
        prev = 0
        acc = 0.0
        for v in values:
            acc += v
            cur = int(math.ceil(acc * scale - 1e-9)) if round_up else int(math.floor(acc * scale + 1e-9))
            out.append(cur - prev)
            prev = cur
        return out

    x = x_slots if x_slots is not None else from_partial_sums(chain.x, round_up=True)
    return _Discrete(
        x=list(x), y=[up(v) for v in chain.y], ex_F=[up(v) for v in chain.ex_F],
        ex_B=[up(v) for v in chain.ex_B],
        uF=from_partial_sums([u * chain.beta for u in chain.u_F], round_up=False),
        uB=from_partial_sums([u * chain.beta for u in chain.u_B], round_up=False), S=S,
    )


def _prune_dominated(table: dict) -> dict:
    """Drop states another state dominates: same ``(M_F, Delta_F)``, no larger ``Delta_B``
    and no larger idle time. Every quantity downstream ((6)-(10)) is non-decreasing in
    ``Delta_B``, so a dominated state never leads to a better schedule."""
    fronts: dict[tuple[int, int], list[tuple[int, float, tuple[int, int, int]]]] = {}
    for key, value in table.items():
        fronts.setdefault(key[:2], []).append((key[2], value[0], key))
    kept = {}
    for front in fronts.values():
        front.sort()
        best = math.inf
        for _, idle, key in front:
            if idle < best:
                kept[key] = table[key]
                best = idle
    return kept


def _dynprog_core(chain: Chain, d: _Discrete, top: int = 1) -> list[tuple[list[int], float]] | None:
    """Algorithm 1 on the discretised chain: the ``top`` offload sets with the smallest total
    idle time over final states ``(M_F, Delta_F, Delta_B)``, best first, each with its idle
    time in seconds as the programme predicts it; None when no state survives the memory
    checks."""
    n, S = len(d.uF), d.S
    offloadable = set(chain.offloadable())
    # Negative Delta values (time the link has been idle, in slots) are forgotten by (2)/(7)
    # and only compared, in (9)/(10), with amounts that fit in the memory (at most S) or with
    # terms that are <= S - U_j: clamping them at -S keeps every comparison's outcome.
    floor = -(S + 1)
    # table: state -> (idle, back-pointer)
    layers: list[dict[tuple[int, int, int], tuple[float, tuple[int, int, int] | None, bool]]] = []
    layers.append({(d.x[0], 0, 0): (0.0, None, False)})
    for i in range(n):
        nxt: dict[tuple[int, int, int], tuple[float, tuple[int, int, int] | None, bool]] = {}
        for state, (idle, _, _) in layers[i].items():
            MF, dF, dB = state
            dFp, dBp = max(dF, 0), max(dB, 0)
            MB = d.y[i] + dBp + MF - dFp  # Algorithm 1
            if MF + d.ex_F[i] - dFp + d.x[i + 1] > S:
                continue
            if MB + d.ex_B[i] + d.x[i + 1] + d.y[i + 1] - dBp > S:
                continue
            eps_F = max(0, MF + d.ex_F[i] + d.x[i + 1] - S)  # (1)
            eps_B = max(0, MB + d.ex_B[i] + d.x[i + 1] + d.y[i + 1] - S)  # (6)
            span_F = eps_F + d.uF[i]
            span_B = eps_B + d.uB[i]
            cost = idle + eps_F + eps_B
            choices = [False]
            if i in offloadable and d.x[i] > 0:
                choices.append(True)
            for off in choices:
                if off:
                    nF = dFp + d.x[i] - span_F  # (2)
                    nM = MF + d.x[i + 1] - min(dFp + d.x[i], span_F)  # (3)
                    nB = d.x[i] + max(0, dB - span_B)  # (7)
                else:
                    nF = dF - span_F  # (4)
                    nM = MF + d.x[i + 1] - min(dFp, span_F)  # (5)
                    nB = dB - span_B  # (8)
                key = (nM, max(nF, floor), max(nB, floor))
                old = nxt.get(key)
                if old is None or cost < old[0]:
                    nxt[key] = (cost, state, off)
        if not nxt:
            return None
        layers.append(_prune_dominated(nxt))

    # eps_G between the phases: equations (9) and (10).
    U_B = [0] * (n + 1)  # U_B[j] = sum_{i>j} uB_i
    U_F = [0] * (n + 1)
    for j in range(n - 1, -1, -1):
        U_B[j] = U_B[j + 1] + (d.uB[j + 1] if j + 1 < n else 0)
        U_F[j] = U_F[j + 1] + (d.uF[j + 1] if j + 1 < n else 0)
    x_after = [0] * (n + 2)  # sum_{i > j+1} x_i
    for j in range(n - 1, -1, -1):
        x_after[j] = x_after[j + 1] + (d.x[j + 2] if j + 2 <= n else 0)

    totals: list[tuple[float, tuple[int, int, int]]] = []
    for state, (idle, _, _) in layers[n].items():
        MF, dF, dB = state
        if dF <= 0 and dB <= 0:
            eps_G = 0.0
        elif dF > 0 and dB > 0:
            eps_G = float(dF + dB)
        elif dF > 0:
            av_B = -dB
            eps_G = float(max(0, dF - av_B))  # (9)
            for j in range(n):
                if U_B[j] < av_B:
                    R = d.ex_B[j] + d.y[j] + d.y[j + 1] - x_after[j]
                    eps_G = max(eps_G, R + MF - S - U_B[j])
        else:
            av_F = -dF
            MB = d.y[n] + max(dB, 0) + MF - max(dF, 0)
            eps_G = float(max(0, dB - av_F))  # (10)
            for j in range(n):
                if U_F[j] < av_F:
                    R = d.ex_F[j] - x_after[j]
                    eps_G = max(eps_G, R + MB - S - U_F[j])
        totals.append((idle + eps_G, state))
    totals.sort()
    # Backtrack (Algorithm 1, last line) from the best final states.
    results: list[tuple[list[int], float]] = []
    seen: set[tuple[int, ...]] = set()
    for total, final in totals:
        chosen: list[int] = []
        state: tuple[int, int, int] | None = final
        for i in range(n, 0, -1):
            assert state is not None
            _, prev, off = layers[i][state]
            if off:
                chosen.append(i - 1)
            state = prev
        key = tuple(sorted(chosen))
        if key not in seen:
            seen.add(key)
            results.append((sorted(chosen), total * chain.M_GPU / S / chain.beta))
            if len(results) >= top:
                break
    return results or None


def dynprog_offload(
    chain: Chain, slots: int = 500, max_fixes: int | None = None, top: int = 32,
    polish_passes: int = 2,
) -> list[int]:
    """DYNPROG (section 5.3): the offload set Algorithm 1 finds on the chain discretised into
    ``slots`` memory slots, simulated as a no-wait ordered schedule.

    Section 5.3.2's rounding: ``ex``, ``y`` up; ``u * beta`` by partial sums rounded down;
    ``x`` optimistically by partial sums rounded up, then, while the simulated schedule is
    infeasible, the discretised ``x_i`` furthest below its true value goes up by one slot.
    The programme's model of a schedule is not exact for whole transfers (it is for
    interruptible ones), so the ``top`` best final states of the table are backtracked and
    simulated, and GREEDY's set and "offload everything" are candidates too (both are points
    of the programme's space that the rounded programme may miss); the best simulated
    schedule is then improved by ``polish_passes`` rounds of one-activation local search on
    the simulator (:func:`_polish`; 0 turns it off) and returned.
    """
    if peak_memory(chain) <= chain.M_GPU:
        return []
    if slots < 2:
        raise ValueError(f"slots={slots}: DYNPROG needs at least 2 memory slots (default 500)")
    scale = slots / chain.M_GPU
    d = _discretize(chain, slots)
    candidates: list[list[int]] = [greedy_offload(chain), chain.offloadable()]
    fixes = max_fixes if max_fixes is not None else 2 * chain.n + 2
    x_slots = list(d.x)
    for _ in range(fixes + 1):
        result = _dynprog_core(chain, _discretize(chain, slots, x_slots), top)
        if result is not None:
            candidates[:0] = [chosen for chosen, _ in result]
            if any(simulate_schedule(chain, chosen).feasible for chosen, _ in result):
                break
        # Iterative fix (5.3.2): raise the rounded-down x_i closest to its true value.
        below = [(chain.x[i] * scale - x_slots[i], i) for i in range(chain.n + 1)
                 if x_slots[i] < chain.x[i] * scale - 1e-9]
        if not below:
            break
        _, i = min(below)
        x_slots[i] += 1
    best: tuple[bool, float, list[int]] = (False, math.inf, candidates[-1])
    for chosen in candidates:
        sched = simulate_schedule(chain, chosen)
        if (sched.feasible, -sched.makespan) > (best[0], -best[1]):
            best = (sched.feasible, sched.makespan, chosen)
    if polish_passes and best[0]:
        best = _polish(chain, best[2], best[1], polish_passes)
    return best[2]


def _polish(chain: Chain, chosen: list[int], makespan: float, passes: int
            ) -> tuple[bool, float, list[int]]:
    """Local search on the simulated schedule (not in the paper): add or drop one activation
    at a time while that shortens the simulated makespan. It repairs the cases where the
    programme's interruptible-transfer model is optimistic for whole transfers."""
    current = set(chosen)
    for _ in range(passes):
        improved = False
        for i in chain.offloadable():
            trial = sorted(current ^ {i})
            sched = simulate_schedule(chain, trial)
            if sched.feasible and sched.makespan < makespan * (1 - 1e-9):
                current, makespan, improved = set(trial), sched.makespan, True
        if not improved:
            break
    return True, makespan, sorted(current)
