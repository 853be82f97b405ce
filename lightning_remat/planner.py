"""The one planner: a plan per input of a module, made the same way for ``remat()``, the
Lightning strategies and the batch-size search.

For a call whose input key (:func:`input_key`) is new, :class:`Planner` traces the module,
takes the plan restored from a checkpoint or the plan cache when there is one, or else
profiles the module on its device, turns the budget into bytes and solves. Under DDP
(:class:`Ranks`) the ranks first agree, at every training call, whether any rank meets a
key it has no plan for; if one does, they gather the keys, the lowest rank holding each new
key plans it and broadcasts the plan, and every rank applies the plan made for its own key.
No collective is ever called by some ranks only (a short last batch or a per-rank padding
gives ranks different keys). The plan is compiled into a
variant of one :class:`~lightning_remat.runtime.module.RematModule`, which then runs every
call with that key.

A budget given as a fraction (``"60%"``, ``0.6``) is a fraction of the plain step's
profiled peak for the input being planned: each new input shape is held to its own share.
``None`` is the device's free memory less a margin on CUDA and no limit elsewhere.

This module holds no Lightning code; the strategy passes in its :class:`Ranks` and a callback.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from lightning_remat.budget import parse_budget, validate_budget
from lightning_remat.cache import CacheKey, PlanCache
from lightning_remat.device import (
    default_budget,
    device_name,
    module_device,
    move_to_device,
    preserved_state,
    preserved_training_state,
)
from lightning_remat.graph.ir import Graph
from lightning_remat.graph.profile import profile_module
from lightning_remat.graph.trace import trace_module
from lightning_remat.meter import TimelinePoint, record_timeline
from lightning_remat.runtime.module import RematModule, Variant, build_variant
from lightning_remat.runtime.offload import measure_bandwidth
from lightning_remat.solvers import SOLVERS, plain_plan, simulate, solve
from lightning_remat.solvers.plan import Plan
from lightning_remat.solvers.simulate import Timeline

__all__ = [
    "DistributedRanks", "InputKey", "PlanSettings", "Planned", "Planner", "Ranks", "input_key",
    "plain_peak_bytes", "remat",
]

InputKey = tuple
"""What a plan depends on in a call: every tensor's shape, dtype and device type, every
other argument's value, with the forward's defaults filled in."""


def input_key(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> InputKey:
    """The :data:`InputKey` of a call of a forward with ``signature`` (None: unknown, the
    arguments are taken as given). ``f(x)`` and ``f(x, flag=True)`` share a key when
    ``True`` is the default."""
    values: Any = (args, kwargs)
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            pass
        else:
            bound.apply_defaults()
            values = (tuple(bound.arguments.values()), {})
    leaves: list[Hashable] = []

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            leaves.append(("tensor", tuple(value.shape), str(value.dtype), value.device.type))
        elif isinstance(value, (list, tuple)):
            leaves.append(type(value).__name__)
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for key in sorted(value, key=repr):
                leaves.append(repr(key))
                visit(value[key])
        else:
            leaves.append(repr(value))

    visit(values)
    return tuple(leaves)


def _same_values(key_a: InputKey, key_b: InputKey) -> bool:
    """Whether two input keys differ in tensor shapes only (same non-tensor values)."""
    if len(key_a) != len(key_b):
        return False
    return all(
        (isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == b[:1] == ("tensor",)
         and a[2:] == b[2:]) or a == b
        for a, b in zip(key_a, key_b)
    )


def shapes_of(key: InputKey) -> list[list[int]]:
    """The tensor shapes in an input key, in order."""
    return [list(leaf[1]) for leaf in key if isinstance(leaf, tuple) and leaf[:1] == ("tensor",)]


def plain_peak_bytes(graph: Graph) -> int:
    """The plain step's peak: measured by the profiler, else simulated."""
    measured = graph.meta.plain_peak_bytes
    return int(measured) if measured else int(simulate(graph).peak_bytes)


def solver_options(solver: str, device: torch.device, offload: bool = True) -> dict[str, Any]:
    """Options of ``solver="auto"`` on a device: offloading only where a host memory apart
    from the device's exists (on the CPU, "offloaded" bytes stay in the same RAM)."""
    if solver != "auto":
        return {}
    return {"allow_offload": offload and torch.device(device).type == "cuda"}


class Ranks(Protocol):
    """The collectives the planner needs from a group of data-parallel processes. Every
    method is a collective: every rank calls it, in the same order."""

    rank: int

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        ...

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        ...

    def broadcast(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        ...


class DistributedRanks:
    """:class:`Ranks` over ``torch.distributed``'s default process group.

    The agreement runs on a gloo group on the host, so the per-call check costs no device
    synchronisation; with a gloo default group that group is used as it is."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self._group = None
        if dist.get_backend() != "gloo":
            # CUDA only (NCCL): a host-side group for the plan exchange; every rank creates it.
            self._group = dist.new_group(backend="gloo")

    def any(self, flag: bool) -> bool:
        value = torch.tensor([int(flag)], dtype=torch.int32)
        self._dist.all_reduce(value, op=self._dist.ReduceOp.MAX, group=self._group)
        return bool(value.item())

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._dist.get_world_size(self._group)
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast(self, obj: Any, src: int) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]


@dataclass(frozen=True)
class PlanSettings:
    """What decides a plan besides the module and its inputs."""

    memory_budget: int | float | str | None = None
    """Bytes, a size string (``"4GiB"``), a fraction of the plain peak (``"60%"``, 0.6) or
    None (free device memory less a margin on CUDA, no limit elsewhere)."""
    solver: str = "auto"
    profile_repeats: int = 3
    """Measured repeats when profiling."""
    safe_profile: bool = False
    """Profile op by op, so profiling fits where a plain step would not."""
    offload: bool = True
    """Let ``solver="auto"`` fall back to offloading (on CUDA only)."""

    def __post_init__(self) -> None:
        validate_budget(self.memory_budget)  # a malformed budget fails before any profiling
        if self.solver not in SOLVERS:
            raise ValueError(f"solver={self.solver!r}: choose one of {sorted(SOLVERS)}")
        if isinstance(self.profile_repeats, bool) or not isinstance(self.profile_repeats, int) \
                or self.profile_repeats < 1:
            raise ValueError(f"profile_repeats={self.profile_repeats!r} must be an int >= 1")

    def budget_bytes(self, graph: Graph, device: torch.device) -> int | None:
        """The budget in bytes for the input ``graph`` was profiled on."""
        if self.memory_budget is None:
            return default_budget(device)
        return parse_budget(self.memory_budget, plain_peak_bytes(graph))


@dataclass
class Planned:
    """A plan made for one input key, and the module that runs it."""

    key: InputKey
    variant: Variant
    module: RematModule
    example: tuple[tuple, dict] | None = field(default=None, repr=False)
    """The call it was planned for, kept on the host (for dashboards that replay it)."""

    @property
    def graph(self) -> Graph:
        assert self.variant.graph is not None
        return self.variant.graph

    @property
    def plan(self) -> Plan:
        return self.variant.plan

    @property
    def budget_bytes(self) -> int | None:
        return self.variant.budget_bytes

    @property
    def from_cache(self) -> bool:
        return self.variant.from_cache

    def predicted_timeline(self) -> Timeline:
        """Live bytes after every op of a step under this plan, as the simulator predicts."""
        return simulate(self.graph, self.plan)

    def measure_timeline(self) -> list[TimelinePoint]:
        """Live bytes after every op of one real step of the planned module on the planned
        call; parameters, gradients and buffers are restored afterwards."""
        if self.example is None:
            return []
        args, kwargs = move_to_device(self.example, module_device(self.module))
        selector = self.module._remat_select
        # This very plan, whatever the selector would pick for a traced or hooked call.
        self.module.set_variant_selector(None)
        self.module.set_current(self.variant)
        try:
            with preserved_training_state(self.module):
                return record_timeline(self.module, args if not kwargs else (*args, *kwargs.values()))
        finally:
            self.module.set_variant_selector(selector)


class Planner:
    """Plans ``module`` once per input key and runs every call through the plan for its key.

    ``cache``: plans on disk, looked up before profiling. ``restored``: graph and plan JSON
    by ``repr(input key)`` (from a checkpoint; every rank holds the same), used before the
    cache. ``ranks``: the data-parallel group (DDP): the ranks agree at every training call
    whether a key is new anywhere, the lowest rank holding a new key profiles and solves it,
    and every rank applies the plan for its own key. ``on_plan(planned)``: called after each
    new plan. ``keep_example``: keep each planned call on the host for
    :meth:`Planned.measure_timeline`.
    """

    def __init__(
        self,
        module: nn.Module,
        settings: PlanSettings | None = None,
        *,
        cache: PlanCache | None = None,
        restored: dict[str, tuple[str, str]] | None = None,
        ranks: Ranks | None = None,
        on_plan: Callable[[Planned], None] | None = None,
        keep_example: bool = False,
    ) -> None:
        self.module = module
        self.settings = settings or PlanSettings()
        self.cache = cache
        self.restored = restored if restored is not None else {}
        self.ranks = ranks
        self.on_plan = on_plan
        self.keep_example = keep_example
        self.planned: dict[InputKey, Planned] = {}
        self.agreed: dict[str, tuple[str, str, bool]] = {}
        """Plans other ranks made for keys this rank has not met yet, by ``repr(key)``."""
        self.last: Planned | None = None
        """The plan of the latest training call."""
        self.busy = False
        """True while planning: a forward the strategy wraps must then run plainly."""
        self.remat_module = RematModule(module)
        self.remat_module.set_variant_selector(self._select)
        try:
            self._signature: inspect.Signature | None = inspect.signature(module.forward)
        except (TypeError, ValueError):
            self._signature = None
        self._warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.remat_module(*args, **kwargs)

    def key(self, args: tuple, kwargs: dict) -> InputKey:
        return input_key(self._signature, args, kwargs)

    def planned_for(self, args: tuple, kwargs: dict) -> Planned:
        """The plan for this call's inputs, made now if they are new. Under DDP a
        collective: every rank calls it once per training call."""
        key = self.key(args, kwargs)
        entry = self.planned.get(key)
        needs_plan = entry is None and repr(key) not in self.restored and repr(key) not in self.agreed
        if self.ranks is not None and self.ranks.any(needs_plan):
            self._agree(args, kwargs, key if needs_plan else None)
            entry = self.planned.get(key)
        if entry is not None:
            return entry
        return self._add(args, kwargs, key, self._plan_locally)

    def _add(self, args: tuple, kwargs: dict, key: InputKey,
             make: Callable[[tuple, dict, InputKey, Any], tuple[Graph, Plan, bool]],
             stacklevel: int = 7) -> Planned:
        """Plan ``key`` (``make`` gives the graph, plan and whether it came from a store) and
        make it the variant its calls run."""
        if self.planned and not self._warned:
            previous = next(reversed(self.planned))
            warnings.warn(
                "lightning_remat: the inputs differ from the ones the plan was made for "
                f"(shapes {shapes_of(previous)} -> {shapes_of(key)}, or non-tensor arguments); "
                "re-planning for them (each new input is planned once and cached)",
                # The caller of the module: _add < planned_for < _select < forward < nn.Module x2.
                stacklevel=stacklevel,
            )
            self._warned = True
        self.busy = True
        try:
            entry = self._plan(args, kwargs, key, make)
        finally:
            self.busy = False
        self.planned[key] = entry
        self.remat_module.variants[key] = entry.variant
        if self.on_plan is not None:
            self.on_plan(entry)
        return entry

    def _agree(self, args: tuple, kwargs: dict, new_key: InputKey | None) -> None:
        """Every rank: gather the keys new somewhere, have the lowest rank holding each plan
        it and broadcast the plan; plan this rank's own new key with the agreed plan."""
        assert self.ranks is not None
        keys = self.ranks.gather(new_key)
        owners: dict[str, int] = {}
        for rank, key in enumerate(keys):
            if key is not None:
                owners.setdefault(repr(key), rank)
        for key_repr, owner in sorted(owners.items()):
            if owner == self.ranks.rank:
                assert new_key is not None and repr(new_key) == key_repr
                self._plan_and_share(args, kwargs, new_key)
            else:
                payload = self.ranks.broadcast(None, owner)
                if payload[0] == "error":
                    raise RuntimeError(
                        f"lightning_remat: rank {owner} could not plan its input "
                        f"({payload[1]}); every rank stops with it"
                    )
                self.agreed[key_repr] = payload

    def _plan_and_share(self, args: tuple, kwargs: dict, key: InputKey) -> None:
        """Plan this rank's new ``key`` and broadcast the plan, or the error that stopped it
        (the other ranks wait in the broadcast and must not hang)."""
        assert self.ranks is not None
        ranks, shared = self.ranks, []

        def share(args: tuple, kwargs: dict, key: InputKey, traced: Any) -> tuple[Graph, Plan, bool]:
            graph, plan, from_cache = self._plan_locally(args, kwargs, key, traced)
            shared.append(True)
            ranks.broadcast((graph.to_json(), plan.to_json(), from_cache), ranks.rank)
            return graph, plan, from_cache

        try:
            self._add(args, kwargs, key, share, stacklevel=9)  # < _plan_and_share < _agree
        except Exception as exc:
            if not shared:
                ranks.broadcast(("error", f"{type(exc).__name__}: {exc}"), ranks.rank)
            raise

    def _select(self, args: tuple, kwargs: dict, training: bool) -> Variant:
        if not training and self.last is not None:
            key = self.key(args, kwargs)
            if key not in self.planned and _same_values(key, self.last.key):
                # Nothing is recomputed here and the traced code is shape-generic: an
                # evaluation batch of another size needs no plan of its own.
                return self.last.variant
        self.last = self.planned_for(args, kwargs)
        return self.last.variant

    # ---- planning one input ---------------------------------------------------------------
    def _plan(self, args: tuple, kwargs: dict, key: InputKey,
              make: Callable[[tuple, dict, InputKey, Any], tuple[Graph, Plan, bool]]) -> Planned:
        module, settings = self.module, self.settings
        device = module_device(module, args)
        with preserved_state(module, [device]):
            traced = trace_module(module, args, kwargs)
        graph, plan, from_cache = make(args, kwargs, key, traced)
        variant = build_variant(traced.runner, plan, self.remat_module, module, traced.charge)
        variant.graph = graph
        variant.budget_bytes = settings.budget_bytes(graph, device)
        variant.from_cache = from_cache
        example = move_to_device((tuple(args), dict(kwargs)), torch.device("cpu")) if self.keep_example else None
        return Planned(key, variant, self.remat_module, example)

    def _plan_locally(self, args: tuple, kwargs: dict, key: InputKey, traced: Any) -> tuple[Graph, Plan, bool]:
        """The graph and plan for ``key``: agreed by the ranks, restored from a checkpoint,
        cached, or profiled and solved here; and whether it came from such a store."""
        if repr(key) in self.agreed:
            graph_json, plan_json, from_cache = self.agreed[repr(key)]
            return Graph.from_json(graph_json), Plan.from_json(plan_json), from_cache
        if repr(key) in self.restored:
            graph_json, plan_json = self.restored[repr(key)]
            return Graph.from_json(graph_json), Plan.from_json(plan_json), True
        module, settings = self.module, self.settings
        device = module_device(module, args)
        options = solver_options(settings.solver, device, settings.offload)
        cache_key = None
        if self.cache is not None:
            cache_key = CacheKey(
                graph_hash=traced.graph.graph_hash(), input_key=repr(key),
                device_name=device_name(device), budget=str(settings.memory_budget),
                solver=settings.solver + repr(sorted(options.items())),
            )
            hit = self.cache.get(cache_key)
            if hit is not None:
                return hit.graph, hit.plan, True
        graph = profile_module(
            module, args, example_kwargs=kwargs or None, repeats=settings.profile_repeats,
            safe=settings.safe_profile, traced=traced,
        )
        # The offloading solvers (and "auto", which ends with them) need beta.
        if graph.meta.bandwidth_bytes_per_s is None:
            graph.meta.bandwidth_bytes_per_s = measure_bandwidth(device)
        budget = settings.budget_bytes(graph, device)
        plan = plain_plan(graph) if budget is None else solve(graph, budget, settings.solver, **options)
        if cache_key is not None:
            self.cache.put(cache_key, graph, plan)
        return graph, plan, False


def remat(
    module: nn.Module,
    example_input: Any,
    memory_budget: int | float | str | None = None,
    solver: str = "auto",
    device: str | torch.device | None = None,
) -> RematModule:
    """``module`` rematerialized to train within ``memory_budget``.

    ``example_input``: a tensor, a tuple of positional inputs, or a dict of keyword inputs.
    ``memory_budget``: bytes, a size string (``"4GiB"``, ``"512MB"``) or a fraction of the
    plain step's profiled peak (``"60%"``, ``0.6``; for each input shape, of that shape's own
    plain peak); None means the device's free memory on CUDA and no limit on CPU (the result
    then runs the plain plan, with its profile in ``.graph``). ``device``: where to profile
    and train (the module is moved there; default: where its parameters are).

    The result shares the module's Parameter objects and state_dict keys, has ``.plan``,
    ``.graph`` and ``.budget_bytes``, and plans once more for each new input shape (with a
    one-time warning) so a changed shape never silently exceeds the budget. Raises
    ``ValueError`` for a malformed budget and
    :class:`~lightning_remat.errors.RematInfeasibleError` (with the smallest feasible budget)
    when no plan fits.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"remat() needs a torch.nn.Module, got {type(module).__name__}")
    settings = PlanSettings(memory_budget, solver)
    if device is not None:
        module.to(torch.device(device))
    target = module_device(module)
    if isinstance(example_input, dict):
        inputs, kwargs = (), dict(example_input)
    elif isinstance(example_input, (tuple, list)):
        inputs, kwargs = tuple(example_input), {}
    else:
        inputs, kwargs = (example_input,), {}
    inputs, kwargs = move_to_device(inputs, target), move_to_device(kwargs, target)
    planner = Planner(module, settings)
    planner.last = planner.planned_for(inputs, kwargs)
    planner.remat_module.set_current(planner.last.variant)
    return planner.remat_module
