"""Beaumont, Eyraud-Dubois and Shilova, "Optimal GPU-CPU Offloading Strategies for Deep Neural
Network Training" (Euro-Par 2020; docs/design.md section 4.5): the no-wait, ordered schedule of a set of
offloaded activations (Proposition 1, Lemma 3), which scores every solver's offload set.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lightning_remat.budget import format_bytes
from lightning_remat.solvers.beaumont.chain import Chain

__all__ = ["Schedule", "simulate_schedule"]

_REL_EPS = 1e-9


@dataclass
class Schedule:
    """One simulated no-wait ordered schedule."""

    amounts: list[float]
    """Bytes of each ``x_i`` offloaded (0: kept on the device)."""
    feasible: bool
    makespan: float
    """Seconds from the start of ``F_0`` to the end of ``B_0`` (inf when infeasible)."""
    idle: float
    """``makespan - sum(u_F + u_B)``: time the device waits for memory or data."""
    peak_bytes: float
    """Largest device memory in use at any instant."""
    reason: str = ""
    """Why it is infeasible."""
    op_start: dict[str, float] = field(default_factory=dict, repr=False)
    transfers: list[tuple[str, int, float, float]] = field(default_factory=list, repr=False)
    """``(kind, i, start, end)`` of each offload / prefetch."""

    @property
    def offloaded(self) -> list[int]:
        return [i for i, a in enumerate(self.amounts) if a > 0]

    @property
    def offloaded_bytes(self) -> float:
        return float(sum(self.amounts))


def _infeasible(amounts: list[float], reason: str) -> Schedule:
    return Schedule(amounts, False, math.inf, math.inf, math.inf, reason)


def _amounts_of(chain: Chain, offload: Iterable[int], amounts: Sequence[float] | None) -> list[float]:
    if amounts is not None:
        if len(amounts) != chain.n + 1:
            raise ValueError(f"amounts has {len(amounts)} entries; the chain has {chain.n + 1} "
                             "activations")
        out = [min(max(float(v), 0.0), chain.x[i]) for i, v in enumerate(amounts)]
    else:
        out = [0.0] * (chain.n + 1)
        for i in offload:
            if not 0 <= int(i) < chain.n:
                raise ValueError(f"cannot offload x_{i}: offloadable indices are 0..{chain.n - 1}")
            out[int(i)] = float(chain.x[int(i)])
    out[chain.n] = 0.0
    return out


def simulate_schedule(
    chain: Chain,
    offload: Iterable[int] = (),
    amounts: Sequence[float] | None = None,
    fractional: bool = False,
) -> Schedule:
    """The no-wait, ordered schedule (Proposition 1; Lemma 3) that offloads the activations
    ``offload`` (indices), or ``amounts[i]`` bytes of each ``x_i`` (a prefix of an activation
    may be offloaded in the fractional relaxation of section 4).

    ``fractional``: offloaded memory is released as it is transferred (section 4) instead of
    when the transfer completes (assumption (E)). Prefetches always reserve their bytes when
    they start.

    Rules: offloads run in increasing index order, each as soon as its activation exists and
    the link is free; prefetches run after every offload, in decreasing order, each as soon
    as the link is free and reserving its bytes leaves room for every op up to its consumer;
    an op starts as soon as its predecessor is done, its inputs are on the device and its
    memory fits (waiting for offloads to release memory when needed).
    """
    return _NoWaitSchedule(chain, _amounts_of(chain, offload, amounts), fractional).run()


class _NoWaitSchedule:
    """:func:`simulate_schedule` step by step: every op alone with the rest offloaded, the
    forward with its offloads, the backward with its prefetches, then the peak. A step that
    finds the schedule infeasible returns why (None when it is not).

    Phases ``0 .. n-1`` are ``F_0 .. F_{n-1}``; phase ``n + k`` is ``B_{n-1-k}``."""

    def __init__(self, chain: Chain, amounts: list[float], fractional: bool) -> None:
        self.chain = chain
        self.amounts = amounts
        self.fractional = fractional
        M = chain.M_GPU
        self.tol = _REL_EPS * max(M if math.isfinite(M) else 0.0, sum(chain.x), 1.0)
        self.kept_prefix = [0.0]
        for i in range(chain.n + 1):
            self.kept_prefix.append(self.kept_prefix[-1] + chain.x[i] - amounts[i])
        self.items: list[tuple[int, float, float, float]] = []  # offloads (i, start, end, bytes)
        self.transfers: list[tuple[str, int, float, float]] = []
        self.op_start: dict[str, float] = {}
        self.link_free = 0.0
        self.offload_end = 0.0  # when the last offload ends
        self.t = 0.0  # when the last op scheduled ends
        self.phase_end: list[float] = []
        self.prefetch_start: dict[int, float] = {}
        self.prefetch_end: dict[int, float] = {}
        self.prefetch_phase: dict[int, int] = {}  # the first phase that runs with x_j reserved

    def run(self) -> Schedule:
        reason = self._check_ops_alone() or self._forward() or self._backward()
        if reason:
            return _infeasible(self.amounts, reason)
        n = self.chain.n
        starts = ([self.op_start[f"F{i}"] for i in range(n)]
                  + [self.op_start[f"B{i}"] for i in range(n - 1, -1, -1)])
        peak = max(self._device_bytes(k, s) for k, s in enumerate(starts))
        return Schedule(self.amounts, True, self.t, self.t - self.chain.compute_time, peak, "",
                        self.op_start, self.transfers)

    # ---- each op with, of the offloaded data, only its own inputs/outputs resident ----------
    def _base_F(self, i: int) -> float:
        amounts = self.amounts
        return self.kept_prefix[i + 2] + amounts[i] + amounts[i + 1] + self.chain.ex_F[i]

    def _base_B(self, i: int) -> float:
        amounts, y = self.amounts, self.chain.y
        return (self.kept_prefix[i + 2] + amounts[i] + amounts[i + 1] + self.chain.ex_B[i] + y[i]
                + y[i + 1])

    def _check_ops_alone(self) -> str | None:
        M = self.chain.M_GPU
        for i in range(self.chain.n):
            for name, need in ((f"F_{i}", self._base_F(i)), (f"B_{i}", self._base_B(i))):
                if need > M + self.tol:
                    return (f"{name} needs {format_bytes(need)} with everything else offloaded "
                            f"(M_GPU {format_bytes(M)})")
        return None

    # ---- offloads ----------------------------------------------------------------------------
    def _released(self, upto: int, at: float) -> float:
        """Bytes of ``x_0 .. x_{upto-1}`` the offloads have released by time ``at``."""
        total = 0.0
        for i, s, e, a in self.items:
            if i >= upto or s >= at:
                break
            if at >= e:
                total += a
            elif self.fractional:
                total += a * (at - s) / (e - s)
        return total

    def _when_released(self, upto: int, need: float, after: float) -> float | None:
        """Earliest time >= ``after`` by which ``need`` bytes of ``x_<upto`` are released."""
        if need <= self.tol:
            return after
        cum = 0.0
        for i, s, e, a in self.items:
            if i >= upto:
                break
            if cum + a >= need - self.tol:
                at = s + max(need - cum, 0.0) / self.chain.beta if self.fractional else e
                return max(at, after)
            cum += a
        return None

    def _start_offload(self, i: int, ready: float) -> None:
        amount = self.amounts[i]
        if amount > 0:
            start = max(ready, self.link_free)
            end = start + amount / self.chain.beta
            self.items.append((i, start, end, amount))
            self.transfers.append(("offload", i, start, end))
            self.link_free = end

    # ---- forward -----------------------------------------------------------------------------
    def _forward(self) -> str | None:
        chain, x = self.chain, self.chain.x
        self._start_offload(0, 0.0)
        used = x[0]  # device bytes before offload releases
        for i in range(chain.n):
            start = self._when_released(i, used + x[i + 1] + chain.ex_F[i] - chain.M_GPU, self.t)
            if start is None:
                return f"F_{i} cannot fit: offloading x_<{i} frees too little"
            self.op_start[f"F{i}"] = start
            self.t = start + chain.u_F[i]
            self.phase_end.append(self.t)
            used += x[i + 1]
            if i + 1 < chain.n:
                self._start_offload(i + 1, self.t)
        self.offload_end = self.link_free
        return None

    # ---- backward ----------------------------------------------------------------------------
    def _backward(self) -> str | None:
        n = self.chain.n
        pending = sorted((i for i in range(n) if self.amounts[i] > 0), reverse=True)
        for i in range(n - 1, -1, -1):
            phase = 2 * n - 1 - i
            while pending and pending[0] >= i:
                j = pending.pop(0)
                if not self._schedule_prefetch(j, phase):
                    return f"no room to prefetch x_{j} before B_{j}"
            start = self._backward_start(i)
            if start is None:
                return f"B_{i} cannot fit while offloads are in flight"
            self.op_start[f"B{i}"] = start
            self.t = start + self.chain.u_B[i]
            self.phase_end.append(self.t)
        return None

    def _backward_start(self, i: int) -> float | None:
        """When ``B_i`` can start: after its predecessor and its inputs' prefetches, and
        once the memory it needs is free."""
        prefetched = (self.prefetch_end[m] for m in (i, i + 1) if m in self.prefetch_end)
        start = max([self.t, *prefetched])
        if start >= self.offload_end:
            return start
        # Offloads still in flight (eq. (9)'s case): B_i may wait for them to release.
        chain, y = self.chain, self.chain.y
        nominal = (self.kept_prefix[i + 2] + sum(self.amounts[: i + 2]) + y[i] + y[i + 1]
                   + chain.ex_B[i])
        return self._when_released(i + 2, nominal - chain.M_GPU, start)

    def _static_need(self, phase: int, resident: Iterable[int]) -> float:
        n = self.chain.n
        i = phase if phase < n else 2 * n - 1 - phase
        base = self._base_F(i) if phase < n else self._base_B(i)
        return base + sum(self.amounts[m] for m in resident if m < i)

    def _schedule_prefetch(self, j: int, consumer: int) -> bool:
        """Start the prefetch of x_j at the first phase from which reserving it leaves room
        for every op up to its consumer ``B_j`` (phase ``consumer``)."""
        ready = max(self.link_free, self.offload_end)
        first = next((k for k, end in enumerate(self.phase_end) if end > ready),
                     len(self.phase_end))
        resident = [*self.prefetch_start, j]
        needs = [self._static_need(q, resident) for q in range(first, consumer + 1)]
        for k in range(first, consumer + 1):
            if max(needs[k - first:]) <= self.chain.M_GPU + self.tol:
                start = max(ready, self.phase_end[k - 1]) if k > first else ready
                end = start + self.amounts[j] / self.chain.beta
                self.prefetch_start[j] = start
                self.prefetch_phase[j] = k
                self.prefetch_end[j] = end
                self.transfers.append(("prefetch", j, start, end))
                self.link_free = end
                return True
        return False

    # ---- peak: device bytes at every op start, counting each prefetch from its phase on ----
    def _share(self, m: int, phase: int, at: float) -> float:
        """Bytes of offloaded x_m on the device during ``phase`` (started at ``at``)."""
        if m in self.prefetch_phase and phase >= self.prefetch_phase[m]:
            return self.amounts[m]
        return self.amounts[m] - self._released(m + 1, at) + self._released(m, at)

    def _device_bytes(self, phase: int, at: float) -> float:
        chain, amounts, n = self.chain, self.amounts, self.chain.n
        i = phase if phase < n else 2 * n - 1 - phase
        data = self.kept_prefix[i + 2] + sum(
            self._share(m, phase, at) for m in range(i + 2) if amounts[m] > 0)
        return data + (chain.ex_F[i] if phase < n else chain.ex_B[i] + chain.y[i] + chain.y[i + 1])
