"""Beaumont, Eyraud-Dubois and Shilova, "Optimal GPU-CPU Offloading Strategies for Deep Neural
Network Training" (Euro-Par 2020; docs/design.md section 4.5): GREEDY (section 4.2, Theorem 2) and the vDNN-style
baseline (section 6.1).
"""

from __future__ import annotations

import math

from lightning_remat.solvers.beaumont.chain import Chain, peak_memory
from lightning_remat.solvers.beaumont.schedule import simulate_schedule

__all__ = ["greedy_fractional_amounts", "greedy_offload", "vdnn_offload"]


def greedy_fractional_amounts(chain: Chain) -> list[float]:
    """Theorem 2: offload exactly ``M_peak - M_GPU`` bytes, the first activations first (the
    last one partly): optimal when transfers may be split."""
    need = max(peak_memory(chain) - chain.M_GPU, 0.0)
    amounts = [0.0] * (chain.n + 1)
    for i in chain.offloadable():
        if need <= 0:
            break
        amounts[i] = min(chain.x[i], need)
        need -= amounts[i]
    return amounts


def greedy_offload(chain: Chain) -> list[int]:
    """GREEDY (section 4.2): the first ``k`` activations, ``k`` the smallest with
    ``sum_{i<=k} |x_i| >= M_peak - M_GPU`` (Theorem 2 rounded up to whole activations)."""
    need = peak_memory(chain) - chain.M_GPU
    chosen: list[int] = []
    for i in chain.offloadable():
        if need <= 0:
            break
        chosen.append(i)
        need -= chain.x[i]
    return chosen


# =============================================================================================
# vDNN-style baseline (section 6.1)
# =============================================================================================
def vdnn_offload(chain: Chain) -> list[int]:
    """The vDNN-style heuristic of section 6.1: for every threshold on ``u_F_i / |x_i|``,
    offload all inputs whose ratio reaches it, or every other one of them; keep the best
    simulated schedule (feasible first, then the shortest)."""
    if peak_memory(chain) <= chain.M_GPU:
        return []
    candidates = chain.offloadable()
    ratio = {i: chain.u_F[i] / chain.x[i] for i in candidates}
    best: tuple[bool, float, list[int]] = (False, math.inf, [])
    seen: set[tuple[int, ...]] = set()
    for threshold in sorted(set(ratio.values()), reverse=True):
        chosen = [i for i in candidates if ratio[i] >= threshold]
        for subset in (chosen, chosen[::2]):
            key = tuple(subset)
            if key in seen:
                continue
            seen.add(key)
            sched = simulate_schedule(chain, subset)
            if (sched.feasible, -sched.makespan) > (best[0], -best[1]):
                best = (sched.feasible, sched.makespan, list(subset))
    return best[2]
