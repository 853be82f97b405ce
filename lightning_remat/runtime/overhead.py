"""What the executor itself costs per recomputed stage and per vertex of one, measured once
per device on a chain of small ops (docs/design.md section 4.7), for the time model."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch import nn

from lightning_remat.imports import sympy_imported
from lightning_remat.runtime.module import apply_plan
from lightning_remat.solvers.plan import Plan, Stage

__all__ = ["measure_recompute_overhead"]


class _SineChain(nn.Module):
    """``length`` element-wise ops in a row, each saving its input for the backward (so a
    recomputed stage's backward does recompute)."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.length):
            x = torch.sin(x)
        return x


_OVERHEAD_CACHE: dict[str, tuple[float, float]] = {}
_CHAIN_LENGTH = 32
_SHORT, _LONG = 2, 8  # vertices per recomputed stage in the two calibration plans


def measure_recompute_overhead(device: str | torch.device | None = None, *, rounds: int = 3,
                               steps: int = 4, refresh: bool = False) -> tuple[float, float]:
    """``(seconds per recomputed stage, seconds per vertex of one)``: what this executor
    costs beyond the ops it runs again (checkpoint's frame, the RNG state, the
    selective-checkpoint policy every op passes in the forward and in the recomputation;
    docs/design.md section 4.7), measured once per device and cached.

    A chain of ``_CHAIN_LENGTH`` small ops runs plainly and under two plans, recomputed
    stages of ``_SHORT`` and of ``_LONG`` vertices (each keeping its last), the least step
    time of ``rounds`` rounds of ``steps`` steps each. Each stage's excess over the plain
    step, less the forward time of the vertices it runs again, is ``c_stage + c_vertex *
    |Vi|``; the two stage lengths give both. The graph keeps them as
    ``meta.recompute_stage_seconds`` and ``meta.recompute_vertex_seconds``."""
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    key = str(dev)
    if key in _OVERHEAD_CACHE and not refresh:
        return _OVERHEAD_CACHE[key]
    chain = fx.symbolic_trace(_SineChain(_CHAIN_LENGTH))
    ids = [n.name for n in chain.graph.nodes if n.op == "call_function"]
    x = torch.full((64,), 0.5, device=dev, requires_grad=True)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def staged(length: int) -> nn.Module:
        stages = [Stage(ids[i:i + length], "recompute") for i in range(0, len(ids), length)]
        stages[-1].action = "keep"
        return apply_plan(chain, Plan(stages, [], 0, 0.0, "calibration", True))

    def least_step(run: Callable[[], Any]) -> float:
        best = float("inf")
        for _ in range(rounds + 1):  # the first round warms up
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                run()
            sync()
            best = min(best, (time.perf_counter() - start) / steps)
        return best

    def step(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            module(x).sum().backward()
            x.grad = None
        return run

    def forward_only() -> None:
        with torch.no_grad():
            chain(x)

    with sympy_imported(), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        op_seconds = least_step(forward_only) / _CHAIN_LENGTH
        plain = least_step(step(chain))
        per_stage = []
        for length in (_SHORT, _LONG):
            stages = _CHAIN_LENGTH // length - 1  # the last stage is kept
            excess = (least_step(step(staged(length))) - plain) / stages
            per_stage.append(excess - (length - 1) * op_seconds)  # all but the kept last run again
    vertex = max((per_stage[1] - per_stage[0]) / (_LONG - _SHORT), 0.0)
    stage = max(per_stage[0] - _SHORT * vertex, 0.0)
    _OVERHEAD_CACHE[key] = (stage, vertex)
    return stage, vertex
