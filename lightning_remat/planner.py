"""Plans for a module, one per input shape: trace, then the cache or profile + solve, then apply.

This is the engine behind both ``remat()`` and the Lightning strategy. It holds no Lightning
code; the strategy passes in its logger and, under DDP, a ``broadcast`` so every rank uses
rank zero's plan.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_remat.budget import parse_budget, validate_budget
from lightning_remat.cache import CacheKey, PlanCache
from lightning_remat.errors import format_bytes
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan

log = logging.getLogger(__name__)


def shape_key(args: tuple, kwargs: dict) -> tuple:
    """The shapes and dtypes of the tensors in a call, in order (what a plan depends on)."""
    out: list = []

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out.append((tuple(value.shape), str(value.dtype)))
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                visit(value[k])

    visit(args)
    visit(kwargs)
    return tuple(out)


def device_of(module: nn.Module, args: tuple) -> torch.device:
    for value in list(args):
        if isinstance(value, torch.Tensor):
            return value.device
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@dataclass
class PlannedModule:
    """A plan applied to a module for one input shape."""

    module: nn.Module
    graph: Graph
    plan: Plan
    budget_bytes: int | None
    from_cache: bool
    example: tuple[tuple, dict] | None = None
    """The call it was planned for, kept on the host (for dashboards that replay it)."""

    def predicted_timeline(self):  # -> solvers.simulate.Timeline
        """Live bytes after every op of a step under this plan, as the simulator predicts."""
        from lightning_remat.solvers.simulate import simulate

        return simulate(self.graph, self.plan)

    def measure_timeline(self) -> list:
        """Live bytes after every op of one real step of the planned module on the planned
        call; parameters, gradients and buffers are restored afterwards."""
        from lightning_remat.meter import record_timeline
        from lightning_remat.runtime.state import preserved_training_state

        if self.example is None:
            return []
        device = device_of(self.module, ())
        args, kwargs = _to_device(self.example, device)
        with preserved_training_state(self.module):
            return record_timeline(self.module, args if not kwargs else (*args, *kwargs.values()))


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


class ShapePlanner:
    """Builds and keeps one planned module per input shape of ``module``."""

    def __init__(
        self,
        module: nn.Module,
        memory_budget: int | float | str | None = None,
        solver: str = "auto",
        *,
        cache: PlanCache | None = None,
        profile_repeats: int = 3,
        safe_profile: bool = False,
        broadcast: Callable[[Any], Any] | None = None,
        on_plan: Callable[[PlannedModule, tuple], None] | None = None,
        restored: dict[str, tuple[str, str]] | None = None,
        keep_example: bool = False,
        solver_options: dict[str, Any] | None = None,
    ) -> None:
        validate_budget(memory_budget)  # fail now on a malformed budget
        self.module = module
        self.memory_budget = memory_budget
        self.solver = solver
        self.cache = cache
        self.profile_repeats = profile_repeats
        self.safe_profile = safe_profile
        self.broadcast = broadcast
        self.on_plan = on_plan
        self.planned: dict[tuple, PlannedModule] = {}
        self.restored = restored if restored is not None else {}
        """Graph and plan JSON by ``repr(shape key)``, e.g. from a checkpoint: used before
        the cache."""
        self.busy = False
        """True while planning: the module's own forward must run plainly then."""
        self.keep_example = keep_example
        self.solver_options = dict(solver_options or {})
        self.last: PlannedModule | None = None
        """The entry used by the latest call."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self.planned_for(args, kwargs)
        return self.last.module(*args, **kwargs)

    def planned_for(self, args: tuple, kwargs: dict) -> PlannedModule:
        key = shape_key(args, kwargs)
        entry = self.planned.get(key)
        if entry is None:
            if self.planned:
                warnings.warn(
                    f"lightning-remat: input shapes changed to {[s for s, _ in key]}; planning "
                    "again for them (the budget holds for every shape planned)", stacklevel=3,
                )
            self.busy = True
            try:
                entry = self._plan(args, kwargs, key)
            finally:
                self.busy = False
            self.planned[key] = entry
            if self.on_plan is not None:
                self.on_plan(entry, key)
        return entry

    def _plan(self, args: tuple, kwargs: dict, key: tuple) -> PlannedModule:
        # The same steps as remat(): trace, profile, budget, solve, apply; plus the cache,
        # plans restored from a checkpoint, and rank zero's plan broadcast under DDP.
        from lightning_remat.graph.trace import preserved_state
        from lightning_remat.runtime.module import (
            _device_budget,
            _plain_peak,
            _trace,
            apply_plan,
            measured_bandwidth,
        )
        from lightning_remat.solvers import plain_plan, solve

        device = device_of(self.module, args)
        with preserved_state(self.module, [device]):
            traced = _trace(self.module, args, kwargs)
        cache_key = None
        graph: Graph | None = None
        plan: Plan | None = None
        from_cache = False
        if repr(key) in self.restored:
            graph_json, plan_json = self.restored[repr(key)]
            graph, plan, from_cache = Graph.from_json(graph_json), Plan.from_json(plan_json), True
        if plan is None and (self.broadcast is None or self._is_rank_zero()):
            if self.cache is not None:
                budget_key = self.memory_budget if isinstance(self.memory_budget, int) else str(self.memory_budget)
                options = ",".join(f"{k}={v}" for k, v in sorted(self.solver_options.items()))
                cache_key = CacheKey(
                    traced.graph.graph_hash(), tuple(s for s, _ in key),
                    ",".join(sorted({d for _, d in key})), device_name(device),
                    budget_key, f"{self.solver}[{options}]",  # type: ignore[arg-type]
                )
                hit = self.cache.get(cache_key)
                if hit is not None:
                    graph, plan, from_cache = hit.graph, hit.plan, True
            if plan is None:
                from lightning_remat.graph.profile import profile_module

                graph = profile_module(
                    self.module, args, example_kwargs=kwargs or None, repeats=self.profile_repeats,
                    safe=self.safe_profile, traced=traced,
                )
                if graph.meta.bandwidth_bytes_per_s is None:
                    graph.meta.bandwidth_bytes_per_s = measured_bandwidth(device)
                budget = parse_budget(self.memory_budget, _plain_peak(graph))
                if budget is None:
                    budget = _device_budget(device)
                if budget is None:
                    plan = plain_plan(graph)
                else:
                    plan = solve(graph, budget, self.solver, **self.solver_options)
                if cache_key is not None:
                    self.cache.put(cache_key, graph, plan)
        if self.broadcast is not None:
            payload = self.broadcast(
                None if plan is None else (graph.to_json(), plan.to_json(), from_cache)
            )
            graph, plan = Graph.from_json(payload[0]), Plan.from_json(payload[1])
            from_cache = payload[2]
        assert graph is not None and plan is not None
        budget = parse_budget(self.memory_budget, _plain_peak(graph)) or _device_budget(device)
        module = apply_plan(traced.runner, plan, root=self.module, charge=traced.charge)
        example = _to_device((tuple(args), dict(kwargs)), torch.device("cpu")) if self.keep_example else None
        return PlannedModule(module, graph, plan, budget, from_cache, example)

    def _is_rank_zero(self) -> bool:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank() == 0
        return True


def summary(entry: PlannedModule, shapes: tuple) -> str:
    """One screen: plain peak, budget, predicted peak, solver, stages, extra time."""
    graph, plan = entry.graph, entry.plan
    plain = graph.meta.plain_peak_bytes
    lines = [
        "lightning-remat plan" + (" (from cache)" if entry.from_cache else ""),
        f"  input shapes     : {[list(s) for s, _ in shapes]}",
        f"  plain peak       : {format_bytes(plain) if plain else 'not measured'}",
        f"  budget           : {format_bytes(entry.budget_bytes) if entry.budget_bytes else 'none'}",
        f"  predicted peak   : {format_bytes(plan.predicted_peak_bytes)}",
        f"  solver           : {plan.solver}",
        f"  stages           : {len(plan.stages)} ({plan.count('recompute')} recomputed, "
        f"{plan.count('offload')} offloaded, {plan.count('keep')} kept)",
        f"  predicted extra  : {plan.predicted_extra_seconds * 1e3:.2f} ms per step",
    ]
    step = graph.meta.step_seconds
    if step:
        lines[-1] += f" ({100 * plan.predicted_extra_seconds / step:.1f}% of the profiled step)"
    return "\n".join(lines)
