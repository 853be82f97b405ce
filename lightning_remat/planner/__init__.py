"""The one planner: a plan per input of a module, made the same way for ``remat()``, the
Lightning strategies and the batch-size search.

For a call whose input key (:func:`~lightning_remat.inputs.input_key`) is new,
:class:`Planner` traces the module, takes the plan restored from a checkpoint or the plan
cache when there is one, or else profiles the module on its device, turns the budget into
bytes and solves. Under DDP (:class:`~lightning_remat.messages.Ranks`) the ranks first
agree, at every training call, whether any rank meets a key it has no plan for; if one
does, they gather the keys, the lowest rank holding each new key plans it and broadcasts
the plan (:class:`~lightning_remat.messages.Exchange`), and every rank applies the plan made
for its own key. No collective is ever called by some ranks only (a short last batch or a
per-rank padding gives ranks different keys). Under sharded data parallelism (torch FSDP)
tracing and profiling run FSDP's own collectives, so every rank traces and profiles each
new key together, on the inputs of the rank that owns it; that rank alone solves and
broadcasts. The plan is compiled into a variant of one
:class:`~lightning_remat.runtime.module.RematModule`, which then runs every call with that key.

A budget given as a fraction (``"60%"``, ``0.6``) is a fraction of the plain step's
profiled peak for the input being planned: each new input shape is held to its own share.
``None`` is the device's free memory less a margin on CUDA and no limit elsewhere.

Length: the steps of planning one input (the agreement across ranks, the checkpoint and the
cache, profiling, the budget, solving, applying) share the planner's state and are read top
to bottom as one flow, so they stay in one module; the input key and the messages between
ranks have modules of their own (:mod:`lightning_remat.inputs`, :mod:`lightning_remat.messages`).

This module holds no Lightning code; the strategy passes in its ranks and a callback.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd import _profiler_enabled
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _len_torch_dispatch_stack

from lightning_remat import meter
from lightning_remat.budget import format_bytes, parse_budget, validate_budget
from lightning_remat.cache import PlanBasis, PlanCache, StoredPlan, describe_change, resimulated
from lightning_remat.device import (
    default_budget,
    device_name,
    module_device,
    move_to_device,
)
from lightning_remat.errors import (
    RematInfeasibleError,
    SolverDeclinedError,
    TraceError,
    warn_caller,
)
from lightning_remat.graph.calls import CACHE_OFF_NOTE, cache_configs, caches_off
from lightning_remat.graph.effects import preserved_state, preserved_training_state
from lightning_remat.graph.ir import Graph
from lightning_remat.graph.meaning import StateRead, guard_owners, read_state
from lightning_remat.graph.profile import profile_module
from lightning_remat.graph.trace import (
    CHILDREN,
    Traced,
    loop_loss,
    sharded_gradients_kept,
    sharding_of,
    trace_module,
)
from lightning_remat.imports import sympy_imported
from lightning_remat.inputs import (
    InputKey,
    autocast_state,
    input_key,
    key_changes,
    moved_state,
    precision_leaf,
    same_values,
    stored_key,
    without_precision,
)
from lightning_remat.messages import (
    Exchange,
    ProfileTogether,
    Ranks,
    SharedCall,
    SharedPlan,
    world_size,
)
from lightning_remat.meter import TimelinePoint, peak_bytes, record_timeline
from lightning_remat.runtime.hooked import every_submodule_recomputed, per_submodule_plan
from lightning_remat.runtime.module import (
    RematModule,
    Variant,
    build_traced_variant,
    measure_recompute_overhead,
)
from lightning_remat.runtime.offload import measure_bandwidth
from lightning_remat.runtime.stepcheck import (
    CudaStepMeter,
    StepTimes,
    correct_times,
    metered_step,
    predicted_extra_seconds,
    time_error,
    timed_steps,
    watch_backward,
)
from lightning_remat.solvers import SOLVERS, min_budget, plain_plan, simulate, solve
from lightning_remat.solvers.plan import Plan
from lightning_remat.solvers.simulate import Timeline
from lightning_remat.step_budget import StepBudget

__all__ = ["STEP_REPLANS", "PlanSettings", "Planned", "Planner", "plain_peak_bytes", "remat"]

STEP_REPLANS = 2
"""How many times an input whose first planned step measured over its prediction is
planned again, each new plan's step measured in turn, before a step still over its budget
is refused (docs/design.md section 4.7)."""


def plain_peak_bytes(graph: Graph) -> int:
    """The plain step's peak: measured by the profiler, else simulated. The profiler
    measures steps that allocate the parameters' gradients; where they are resident before
    the step (``meta.grads_resident``) they are taken off, down to no less than the
    simulated peak with resident gradients."""
    measured = graph.meta.plain_peak_bytes
    if not measured:
        return int(simulate(graph).peak_bytes)
    if graph.meta.grads_resident:
        gradients = sum(int(b) for b in (graph.meta.param_bytes or {}).values())
        return max(int(measured) - gradients, int(simulate(graph).peak_bytes))
    return int(measured)


def grads_resident(module: nn.Module) -> bool:
    """Whether every parameter that trains already has a gradient (the loop keeps them
    between steps)."""
    training = [p for p in module.parameters() if p.requires_grad]
    return bool(training) and all(p.grad is not None for p in training)


def has_host_memory(device: torch.device) -> bool:
    """Whether ``device`` has a memory apart from the host's, so offloading frees some."""
    return torch.device(device).type == "cuda"


def check_solver_for_device(solver: str, device: torch.device) -> None:
    """Refuse an offloading solver where offloading frees nothing (the CPU: "offloaded"
    bytes stay in the same RAM, and the copies only add time and memory)."""
    entry = SOLVERS.get(solver)
    if entry is not None and entry.offloads and not has_host_memory(device):
        recomputing = sorted(name for name, other in SOLVERS.items() if not other.offloads)
        raise ValueError(
            f"solver={solver!r} offloads saved tensors to host memory, but the model is on "
            f"{torch.device(device).type}, whose memory is the host's: offloading frees nothing "
            f"there. Choose a recomputation solver ({', '.join(recomputing)}), or train on a "
            "CUDA device"
        )


def solver_options(solver: str, device: torch.device, offload: bool = True) -> dict[str, Any]:
    """Options of ``solver="auto"`` on a device: offloading only where a host memory apart
    from the device's exists (on the CPU, "offloaded" bytes stay in the same RAM)."""
    if solver != "auto":
        return {}
    return {"allow_offload": offload and has_host_memory(device)}


def parameter_dtypes(module: nn.Module) -> str:
    """The module's parameter dtypes, e.g. ``"torch.float32"`` (sorted, comma separated)."""
    return ",".join(sorted({str(p.dtype) for p in module.parameters()})) or "none"


@dataclass(frozen=True)
class PlanSettings:
    """What decides a plan besides the module and its inputs."""

    memory_budget: int | float | str | None = None
    """Bytes, a size string (``"4GiB"``), a fraction of the plain peak (``"60%"``, 0.6) or
    None (free device memory less a margin on CUDA, no limit elsewhere)."""
    solver: str = "auto"
    profile_repeats: int = 3
    """The most timed steps when profiling (a second runs only while op times vary)."""
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

    def budget_bytes(self, graph: Graph, device: torch.device,
                     free_memory: Callable[[torch.device], int | None] | None = None) -> int | None:
        """The budget in bytes for the input ``graph`` was profiled on. ``free_memory``:
        reads the device's memory for a budget of None (default: :func:`default_budget`)."""
        if self.memory_budget is None:
            return (free_memory or default_budget)(device)
        return parse_budget(self.memory_budget, plain_peak_bytes(graph))


@dataclass
class Planned:
    """A plan made for one input key, and the module that runs it."""

    key: InputKey
    variant: Variant
    module: RematModule
    example: tuple[tuple, dict] | None = field(default=None, repr=False)
    """The call it was planned for, kept on the host (for dashboards that replay it)."""
    basis: PlanBasis | None = None
    """What decided the plan (stored beside it in the cache and in checkpoints)."""
    checked: bool = False
    """Whether the first training step under the plan was measured (or will not be)."""
    measured_peak_bytes: int | None = None
    """The first training step's measured peak (None: not measured)."""
    traced: Traced | None = field(default=None, repr=False, compare=False)
    """The capture the variant was built from, which a plan made again lower for another
    module of the step is built from too (not pickled: None when loaded)."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "traced": None}

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


REFUSAL_SLACK = 0.01
"""What the budget a measured refusal names holds beyond the smallest one that held here:
the variation of a step's excess over its prediction between plans."""


class Planner:
    """Plans ``module`` once per input key and runs every call through the plan for its key.

    ``cache``: plans on disk, looked up before profiling. ``restored``: stored plans by
    ``repr(input key)`` (from a checkpoint; every rank holds the same), used before the
    cache. A stored plan is used only when its :class:`~lightning_remat.cache.PlanBasis`
    equals this call's; otherwise a warning names what changed and the call is planned
    again. ``ranks``: the data-parallel group (DDP): the ranks agree at every training call
    whether a key is new anywhere, the lowest rank holding a new key plans it (from its
    checkpoint, its cache or a new profile) and broadcasts the plan, and every rank applies
    the plan for its own key. ``on_plan(planned)``: called after each new plan.
    ``keep_example``: keep each planned call on the host for :meth:`Planned.measure_timeline`.
    ``profiler(module, args, kwargs, traced) -> Graph``: the graph of a call that no store
    holds (default: :func:`~lightning_remat.graph.profile.profile_module`; the batch-size
    search passes graphs derived by :mod:`lightning_remat.graph.scale`). ``progress(line)``:
    told each planning phase as it starts, and a summary when a plan is made.
    ``loss_fn(outputs) -> scalar``: the loss the training step takes of the outputs, whose
    memory the profile measures (``meta.loss_peak_bytes``; default: the loop people write,
    :func:`~lightning_remat.graph.trace.loop_loss` with the outputs held to the step's end).
    ``step_peak(step, device) -> bytes``: measures the metered first step of a plan off
    CUDA (default: :func:`~lightning_remat.meter.peak_bytes`); ``check_first_step=False``:
    measure none.
    ``tracer(module, args, kwargs) -> Traced``: the trace of a call (default:
    :func:`~lightning_remat.graph.trace.trace_module`; the batch-size search passes its
    shape family's, which fx code being shape-generic serves every batch size).
    ``free_memory(device) -> bytes | None``: the budget of ``memory_budget=None`` (default:
    :func:`~lightning_remat.device.default_budget`; the strategy reads it with the
    optimizer's state in place, :func:`~lightning_remat.device.optimizer_state_made`).

    Pickled (``torch.save`` of the module :func:`remat` returns), the planner leaves out
    ``loss_fn`` and ``progress``: they are often lambdas, which pickle cannot save, and only
    planning a new input key uses them. The loaded module runs its plans as before; a new
    input key is planned with the default loss, with one warning.
    """

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_loss_fn_left_out"] = state.get("_loss_fn_left_out") or state["loss_fn"] is not None
        state["loss_fn"] = state["progress"] = state["free_memory"] = None
        state["step_peak"] = state["step_times"] = None  # the default meters when loaded
        state["step_budget"] = None  # a module loaded alone plans within its own budget
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Planners pickled before the first step's time and its re-plans were kept.
        self.__dict__.update({"step_times": None, "step_budget": None, "_timed": set(), "_replans": {}})
        self.__dict__.update(state)

    def __deepcopy__(self, memo: dict[int, Any]) -> Planner:
        # A copy in memory (an EMA of the model, say) keeps the loss_fn: only pickling drops it.
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "step_budget"}, memo))
        copied.step_budget = None  # the copy plans within its own budget, not the step's
        return copied

    def __init__(
        self,
        module: nn.Module,
        settings: PlanSettings | None = None,
        *,
        cache: PlanCache | None = None,
        restored: dict[str, StoredPlan] | None = None,
        ranks: Ranks | None = None,
        on_plan: Callable[[Planned], None] | None = None,
        keep_example: bool = False,
        profiler: Profiler | None = None,
        progress: Callable[[str], None] | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        tracer: Tracer | None = None,
        free_memory: Callable[[torch.device], int | None] | None = None,
        step_peak: Callable[[Callable[[], None], torch.device], int] | None = None,
        check_first_step: bool = True,
        step_times: StepTimer | None = None,
    ) -> None:
        self.module = module
        self.free_memory = free_memory
        self.step_peak = step_peak
        self.step_times = step_times
        """Times a new plan's step against the plain step's: ``step_times(plain, planned,
        device)`` runs both kinds of step and returns their
        :class:`~lightning_remat.runtime.stepcheck.StepTimes` (None:
        :func:`~lightning_remat.runtime.stepcheck.timed_steps`)."""
        self.step_budget: StepBudget | None = None
        """The budget this module shares with the other planned modules of a training step
        (None: its own)."""
        self._timed: set[InputKey] = set()
        """Keys whose plan's time was checked (once per key)."""
        """Measures the metered step of a plan off CUDA: ``step_peak(step, device)`` runs
        ``step()`` and returns its peak bytes (None: :func:`~lightning_remat.meter.peak_bytes`)."""
        self.check_first_step = check_first_step
        """Measure the first training step under each plan (the batch-size search, which
        measures its trials' steps itself, turns it off)."""
        self._excess: dict[InputKey, tuple[int, int]] = {}
        """Keys whose first step measured over the plan: (measured peak, excess)."""
        self._replans: dict[InputKey, int] = {}
        """How many times each key was planned again after its first step measured over."""
        self.profiler = profiler
        self.tracer = tracer
        self.loss_fn = loss_fn
        self.progress = progress
        self.settings = settings or PlanSettings()
        self.cache = cache
        self.restored = restored if restored is not None else {}
        self.ranks = ranks
        self.on_plan = on_plan
        self.keep_example = keep_example
        self.planned: dict[InputKey, Planned] = {}
        self.agreed: dict[str, SharedPlan] = {}
        """Plans other ranks made for keys this rank has not met yet, by ``repr(key)``."""
        self.last: Planned | None = None
        """The plan of the latest training call."""
        self.busy = False
        """True while planning: a forward the strategy wraps must then run plainly."""
        self._plan_started: float | None = None
        self._budget_read: int | None = None
        """The budget the plan being made was solved for (read once per plan)."""
        self._loss_fn_left_out = False
        """Unpickled without the ``loss_fn`` it was given (see :meth:`__getstate__`)."""
        check_solver_for_device(self.settings.solver, module_device(module))
        self.remat_module = RematModule(module)
        self.remat_module.set_variant_selector(self._select)
        self.remat_module.set_step_check(self._check_step)
        self._caches = cache_configs(module)
        """The configs in the module that turn on a cache its calls turn off (``graph.calls``)."""
        self._cache_warned = False
        if self._caches:
            self.remat_module.set_call_context(self._calls)
        try:
            self._signature: inspect.Signature | None = inspect.signature(module.forward)
        except (TypeError, ValueError):
            self._signature = None
        self._warned_about: set[str] = set()
        self.sharding = sharding_of(module)
        """How the module is sharded ("none" without FSDP): sharded ranks plan together."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.remat_module(*args, **kwargs)

    def _calls(self) -> contextlib.AbstractContextManager:
        """The context each call of the module and each planning runs in: its caches off
        (``graph.calls``), said once."""
        caches = getattr(self, "_caches", [])
        if not caches:
            return contextlib.nullcontext()
        if not self._cache_warned:
            self._cache_warned = True
            names = [name for name, _ in caches]
            warn_caller("lightning_remat: " + CACHE_OFF_NOTE.format(
                names=", ".join(names), s="s" if len(names) == 1 else ""))
        return caches_off(caches)

    def key(self, args: tuple, kwargs: dict) -> InputKey:
        """The call's :func:`~lightning_remat.inputs.input_key` and the precision it runs at
        (:func:`~lightning_remat.inputs.precision_leaf`), and, once a capture read plain Python
        values from the module's attributes, their values now (the guards a captured graph
        needs: a call where one differs is captured and planned again, as Dynamo recompiles;
        docs/design.md section 3)."""
        inputs = input_key(self._signature, args, kwargs)
        guards = getattr(self, "_guards", None)
        if guards:
            return (precision_leaf(self.module), ("state", guards[0], read_state(guards[1])), *inputs)
        return (precision_leaf(self.module), *inputs)

    def _guard(self, traced: Traced | None) -> None:
        """Guard from now on the attribute values ``traced``'s capture read (None: guard
        nothing from now on)."""
        if traced is None or not hasattr(self, "_guarded"):
            self._guarded: dict[tuple[str, str], StateRead] = {}
        for read in traced.state_reads if traced is not None else ():
            self._guarded.setdefault((read.module, read.attribute), read)
        reads = list(self._guarded.values())
        # (names, owners): what key() reads at every call, resolved once.
        self._guards = (tuple(f"{r.module}.{r.attribute}".lstrip(".") for r in reads),
                        guard_owners(self.module, reads)) if reads else None

    _STATE_CHANGES_KEPT = 2
    """How many times a guarded attribute may change (each a new capture and plan) before the
    forward runs as its own, which reads it live (as Dynamo falls back to eager past its
    recompile limit)."""

    def _count_state_changes(self, old: InputKey, new: InputKey) -> None:
        """Note the guarded attributes whose values differ between two keys; past
        :attr:`_STATE_CHANGES_KEPT` changes of one, later captures take the own forward."""
        counts = self.__dict__.setdefault("_state_changes", {})
        for name in moved_state(old, new):
            counts[name] = counts.get(name, 0) + 1
            if counts[name] >= self._STATE_CHANGES_KEPT and not getattr(self, "_own_forward", ""):
                self._own_forward = (f"its attribute {name} changed on {counts[name]} calls, and a captured "
                                     "graph is specialised to the value it read")

    def _trace(self, module: nn.Module, args: tuple, kwargs: dict) -> Traced:
        """The capture of a call (the planner's ``tracer``, else :func:`trace_module`); once a
        guarded attribute keeps changing, the module's own forward with its submodules as
        vertices, which reads it live (a forward that cannot run so keeps its guards)."""
        if self.tracer is not None:
            return self.tracer(module, args, kwargs)
        because = getattr(self, "_own_forward", "")
        if because:
            try:
                traced = trace_module(module, args, kwargs, own_forward_because=because)
            except TraceError:
                self._own_forward = ""
            else:
                self._guard(None)  # the own forward reads the attributes itself
                return traced
        return trace_module(module, args, kwargs)

    def planned_for(self, args: tuple, kwargs: dict) -> Planned:
        """The plan for this call's inputs, made now if they are new. Under DDP a
        collective: every rank calls it once per training call."""
        with self._calls():
            return self._planned_for(args, kwargs)

    def _planned_for(self, args: tuple, kwargs: dict) -> Planned:
        key = self.key(args, kwargs)
        entry = self.planned.get(key)
        needs_plan = entry is None and repr(key) not in self.agreed
        if self.ranks is not None and self.ranks.any(needs_plan):
            self._agree(args, kwargs, key if needs_plan else None)
            entry = self.planned.get(key)
        if entry is not None:
            return entry
        return self._add(args, kwargs, key)

    def _add(self, args: tuple, kwargs: dict, key: InputKey, exchange: Exchange | None = None) -> Planned:
        """Plan ``key`` and make it the variant its calls run. ``exchange``: the talk with
        the other ranks about this key (None: this rank plans it for itself)."""
        changes = key_changes(next(reversed(self.planned)), key) if self.planned else {}
        if self.planned:
            self._count_state_changes(next(reversed(self.planned)), key)
        if changes.keys() - self._warned_about:
            # Once per kind of change: a run of short last batches warns once, a later change
            # of dtype or precision warns again.
            self._warned_about |= changes.keys()
            warn_caller(
                "lightning_remat: the inputs differ from the ones the plan was made for "
                f"({'; '.join(changes.values())}); re-planning for them (each new input is "
                "planned once and cached)"
            )
        if self._loss_fn_left_out:
            self._loss_fn_left_out = False  # one warning
            warn_caller(
                "lightning_remat: this module was loaded from a pickle, which does not keep the "
                "loss_fn it was planned with; planning its new inputs with the default loss (the loop "
                "people write: the outputs held to the step's end, a cross-entropy over them), whose "
                "memory may differ from your loss's. To count your "
                "loss, save the original module (or its state_dict) and call remat(..., "
                "loss_fn=...) after loading")
        # Tracing, profiling and the metered step run the forward, which may write its inputs
        # in place (``x.sub_(...)``): they run on copies, and the caller's tensors are
        # modified only by the call they make (plain training modifies them once).
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.requires_grad), (args, kwargs))
        self.busy = True
        # Tracing calls into torch._dynamo, which imports sympy on first use: imported whole
        # first, so an interrupt cannot leave half of it behind, and the warning filter sympy
        # adds is removed again (the library changes no global state).
        guard = sympy_imported()
        try:
            # A step meter running around this call (the memory timeline's) would time the
            # profile under torch.profiler and keep the planner's own meter from starting.
            with guard, sharded_gradients_kept(self.module), meter.paused():
                entry = self._plan(args, kwargs, key, exchange)
                # The capture may have found attribute values to guard: the key holds them.
                key = entry.key = self.key(args, kwargs)
                self._check_new_plan(entry, args, kwargs)
        finally:
            self.busy = False
        self.planned[key] = entry
        self.remat_module.variants[key] = entry.variant
        if self.on_plan is not None:
            self.on_plan(entry)
        return entry

    # ---- the ranks agree ------------------------------------------------------------------
    def _agree(self, args: tuple, kwargs: dict, new_key: InputKey | None) -> None:
        """Every rank: gather the keys new somewhere, have the lowest rank holding each plan
        it and broadcast the plan; plan this rank's own new key with the agreed plan."""
        assert self.ranks is not None
        keys = self.ranks.gather(new_key)
        owners: dict[str, int] = {}
        for rank, key in enumerate(keys):
            if key is not None:
                owners.setdefault(repr(key), rank)
        for _key_text, owner in sorted(owners.items()):
            self._plan_together(args, kwargs, new_key, Exchange(self.ranks, owner))

    def _plan_together(self, args: tuple, kwargs: dict, new_key: InputKey | None,
                       exchange: Exchange) -> None:
        """Every rank traces (and, unless the owner holds a stored plan, profiles) the
        owner's new key together, on the owner's inputs: FSDP gathers parameters inside each
        unit's call, and any module may run a collective in its forward (SyncBatchNorm, an
        all-to-all), so no rank runs the module alone. The owner solves and broadcasts the
        plan, and every rank applies it: the owner's measurements decide."""
        if exchange.mine:
            assert new_key is not None
            call = move_to_device((tuple(args), dict(kwargs)), torch.device("cpu"))
            exchange.send(SharedCall(*call, key=new_key))
            self._plan_and_share(args, kwargs, new_key, exchange)
            return
        shared = exchange.receive(SharedCall)
        device = module_device(self.module, args)
        call_args, call_kwargs = move_to_device((shared.args, shared.kwargs), device)
        self._add(call_args, call_kwargs, shared.key, exchange)

    def _plan_and_share(self, args: tuple, kwargs: dict, key: InputKey, exchange: Exchange) -> None:
        """The owner: plan ``key`` and broadcast the plan, or the error that stopped it (the
        other ranks wait in the broadcast and must not hang)."""
        try:
            self._add(args, kwargs, key, exchange)
        except Exception as exc:
            exchange.fail(exc)
            raise

    def _follow(self, args: tuple, kwargs: dict, traced: Traced, exchange: Exchange) -> tuple[Graph, Plan, bool]:
        """A sharded rank that does not own the key: profile when the owner does (this
        rank's share of FSDP's collectives), then take the owner's plan."""
        message = exchange.receive(ProfileTogether, SharedPlan)
        if isinstance(message, ProfileTogether):
            if self.profiler is not None:
                self.profiler(self.module, args, kwargs, traced)
            else:
                profile_module(self.module, args, example_kwargs=kwargs or None,
                               repeats=self.settings.profile_repeats, safe=self.settings.safe_profile,
                               traced=traced, loss_fn=self.loss_fn, agree=exchange.ranks.any)
            message = exchange.receive(SharedPlan)
        return message.unpack()

    def _select(self, args: tuple, kwargs: dict, training: bool) -> Variant:
        if not training and self.last is not None:
            key = self.key(args, kwargs)
            if key not in self.planned and same_values(key, self.last.key):
                # Nothing is recomputed here and the traced code is shape-generic: an
                # evaluation batch of another size needs no plan of its own.
                return self.last.variant
            if key not in self.planned and not self.remat_module.training and not torch.is_grad_enabled():
                # An evaluation call with other arguments (a cache asked for) and no
                # backward to plan: the module's own forward, as plain evaluation runs it.
                return dataclasses.replace(self.last.variant, stages=None, hooked=None, eager=self.module)
        self.last = self.planned_for(args, kwargs)
        if training and self.last.key in self._excess:
            said = self._over_prediction(self.last, args, kwargs, *self._excess.pop(self.last.key))
            if said:
                warn_caller(said)
        return self.last.variant

    # ---- the first real step --------------------------------------------------------------
    def _checks(self, planned: Planned | None) -> bool:
        """Whether ``planned``'s first step is still to be measured. Single-process only:
        ranks must change their plans together."""
        return (planned is not None and not planned.checked and self.check_first_step
                and planned.budget_bytes is not None and world_size() <= 1 and self.sharding == "none")

    def _check_step(self, variant: Variant, args: tuple, kwargs: dict, run: Callable[[Variant], Any]) -> Any:
        """Run a training call (``run(variant)``). On CUDA the first one under each plan is
        measured (:mod:`~lightning_remat.runtime.stepcheck`), from its forward to the end of
        the backward its outputs start (the caller's loss included), and a step over the
        plan's prediction (its margin included) has the next call with that input plan
        again (:meth:`_over_prediction`), whose first step is measured in turn. After the
        first step this costs a lookup."""
        planned = self.last
        if planned is None or planned.variant is not variant or self.busy or not self._checks(planned):
            return run(variant)
        device = module_device(self.module, args)
        if device.type != "cuda":
            return run(variant)  # measured when it was planned (:meth:`_check_new_plan`)
        planned.checked = True
        meter = CudaStepMeter(device)
        meter.start()
        outputs = run(variant)
        watch_backward(outputs, lambda: self._measured(planned, meter.stop()))
        return outputs

    def _check_new_plan(self, planned: Planned, args: tuple, kwargs: dict) -> None:
        """A new plan's first step, run as the last part of planning. Off CUDA its memory:
        one metered step (the CPU meter is thread-local state the autograd engine would put
        back on the caller's thread after its backward, so it is not left running across
        the caller's own step, :mod:`~lightning_remat.runtime.stepcheck`); over the
        prediction (its margin included), the input is planned again at once and the new
        plan's step measured in turn (:meth:`_over_prediction`, at most
        :data:`STEP_REPLANS` times); one warning says so. On every device its time
        (:meth:`_check_time`): off the prediction, the graph's times are corrected and the
        plan chosen again, once per input, its memory then measured again."""
        device = module_device(self.module, args)
        if not self._checks(planned):
            return
        if _len_torch_dispatch_stack() or _profiler_enabled():
            # Planned under a dispatch mode or a profiler (the caller measuring the call,
            # say): a meter inside it would read the caller's, so none is run.
            planned.checked = device.type != "cuda"
            return
        if self.loss_fn is None and not planned.graph.meta.outputs_held:
            planned.checked = True
            return  # planned for a loss this planner no longer has (unpickled)
        if device.type != "cuda":
            self._hold_budget(planned, args, kwargs, device)
        if self._check_time(planned, args, kwargs, device) and device.type != "cuda":
            planned.checked = False
            self._hold_budget(planned, args, kwargs, device)

    def _hold_budget(self, planned: Planned, args: tuple, kwargs: dict, device: torch.device) -> None:
        """Off CUDA: meter the plan's step, plan again while it measures over its
        prediction (:meth:`_over_prediction`), and warn once."""
        planned.checked = True
        said = ""
        while True:
            self._measured(planned, self._metered_step(planned, args, kwargs, device))
            if planned.key not in self._excess:
                break
            said = self._over_prediction(planned, args, kwargs, *self._excess.pop(planned.key)) or said
            if planned.checked:
                break
        planned.checked = True
        if said:
            warn_caller(said)

    def _check_time(self, planned: Planned, args: tuple, kwargs: dict, device: torch.device) -> bool:
        """Time ``planned``'s step against the plain step's, in this process
        (:func:`~lightning_remat.runtime.stepcheck.timed_steps`: the least of a few of
        each, alternating). Where the measured extra time is off the plan's prediction by
        more than :data:`~lightning_remat.runtime.stepcheck.TIME_POINTS` of the plain step
        and by more than the noise (:func:`~lightning_remat.runtime.stepcheck.time_error`),
        the graph's times are set to reproduce the measurement
        (:func:`~lightning_remat.runtime.stepcheck.correct_times`) and the plan chosen
        again by the solver with them; one warning says so. Once per input key; not for a
        plan that recomputes nothing, one from the cache or a checkpoint (timed when it was
        made, its graph stored with the corrected times), nor a graph profiled op by op
        (safe mode: the plain step may not fit). Whether the plan changed."""
        plan, graph = planned.plan, planned.graph
        if planned.key in self._timed or plan.count("recompute") == 0 or graph.meta.safe \
                or planned.from_cache:  # its graph's times were checked when it was made
            return False
        self._timed.add(planned.key)
        wrapper, mode = self.remat_module, self.remat_module.training
        with preserved_state(self.module, [device]), torch.enable_grad():
            self.module.train()
            wrapper.training = True  # not .train(): the module's own flags are restored above
            try:
                measured = (self.step_times or timed_steps)(
                    self._timed_step(planned, args, kwargs, plain=True),
                    self._timed_step(planned, args, kwargs, plain=False), device)
            finally:
                wrapper.training = mode
        predicted = predicted_extra_seconds(graph, plan)
        if time_error(predicted, measured) is None:
            return False
        changed = correct_times(graph, plan, measured.extra_seconds)
        if not changed:
            return False
        options = solver_options(self.settings.solver, device, self.settings.offload)
        budget = planned.budget_bytes
        assert budget is not None
        try:
            again = self._solve(graph, budget, options)
        except RematInfeasibleError:
            return False  # the times changed, not the memory: the same budget is met
        if [(s.nodes, s.action) for s in again.stages] == [(s.nodes, s.action) for s in plan.stages]:
            plan.predicted_extra_seconds = again.predicted_extra_seconds  # as now predicted
            if self.cache is not None and planned.basis is not None:
                self.cache.put(planned.basis, graph, plan)  # with the corrected times
            return False
        plain = measured.plain_seconds
        said = (f"lightning_remat: the planned step took {measured.extra_seconds / plain:+.1%} over "
                f"the plain step's time, where {predicted / plain:+.1%} was predicted; {changed}, and the plan "
                f"chosen again with those times: {again.solver}, {again.count('recompute')} recomputed "
                f"stages, predicted {again.predicted_extra_seconds / plain:+.1%}")
        self._use_plan(planned, args, kwargs, again)
        self._replans.pop(planned.key, None)  # the new plan's memory is measured afresh
        warn_caller(said)
        return True

    def _step_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
        """The call's tensors cut off the caller's graph (inputs another module computed, an
        encoder's output that a planned head reads: a measured backward stops at them,
        leaving the caller's graph for its own), and the tensors that take gradients in
        the step (the module's trainable parameters and those inputs)."""
        args, kwargs = pytree.tree_map(
            lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t,
            (args, kwargs))
        holders = [p for p in self.module.parameters() if p.requires_grad]
        holders += [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        return args, kwargs, holders

    def _timed_step(self, planned: Planned, args: tuple, kwargs: dict, plain: bool) -> Callable[[], None]:
        """One training step, plain (the module's own forward) or under ``planned``'s plan,
        as the profile took it; each parameter's gradient as before it (the caller keeps
        the module's state, :func:`~lightning_remat.graph.effects.preserved_state`)."""
        loss_fn = self.loss_fn or loop_loss
        args, kwargs, holders = self._step_inputs(args, kwargs)
        wrapper, module = self.remat_module, self.module
        held = bool(planned.graph.meta.outputs_held)

        def forward() -> Any:
            return module(*args, **kwargs) if plain else wrapper._run(planned.variant, args, kwargs)

        def run(step: Callable[[], None]) -> int:
            step()
            return 0

        return lambda: metered_step(forward, loss_fn, held, holders, run) and None

    def _metered_step(self, planned: Planned, args: tuple, kwargs: dict, device: torch.device) -> int:
        """One training step of ``planned``'s plan under the meter, as the profile took the
        step (its loss, the outputs held or not), from no gradients; the module's state,
        modes and gradients are as before it. With gradients resident before the step
        (``meta.grads_resident``) the plan counts none allocated: those the metered step
        allocated are taken off its reading (as :func:`plain_peak_bytes` does)."""
        graph = planned.graph
        loss_fn = self.loss_fn or loop_loss
        args, kwargs, holders = self._step_inputs(args, kwargs)
        measure = self.step_peak or peak_bytes
        wrapper = self.remat_module
        mode = wrapper.training
        with preserved_state(self.module, [device]), torch.enable_grad():
            self.module.train()
            wrapper.training = True  # not .train(): the module's own flags are restored above
            try:
                peak = metered_step(lambda: wrapper._run(planned.variant, args, kwargs), loss_fn,
                                    bool(graph.meta.outputs_held), holders, lambda step: measure(step, device))
            finally:
                wrapper.training = mode
        if graph.meta.grads_resident:
            peak -= sum(int(b) for b in (graph.meta.param_bytes or {}).values())
        return max(int(peak), 0)

    def _measured(self, planned: Planned, peak: int) -> None:
        """The first step's reading (on CUDA called when its backward ends)."""
        planned.measured_peak_bytes = int(peak)
        plan = planned.plan
        if peak > plan.guaranteed_peak_bytes:
            self._excess[planned.key] = (int(peak), int(peak) - int(plan.predicted_peak_bytes))

    def _over_prediction(self, planned: Planned, args: tuple, kwargs: dict, peak: int, excess: int) -> str:
        """A first step measured ``peak``, ``excess`` over its plan's prediction and over
        the prediction with its margin. Planned again (:meth:`_plan_again`, the margin raised
        by the excess: the budget handed to the solver lowered by that much), at most
        :data:`STEP_REPLANS` times per input, with ``planned.checked`` False so that the new
        plan's first step is measured in turn. Where no plan fits with that margin, or the
        last new plan measured over too: kept if the step measured within the budget,
        otherwise refused (:class:`~lightning_remat.errors.RematInfeasibleError` with the
        measured peak and the smallest budget that holds with the margin raised; the input
        keeps no plan). Returns the line to warn ("" when there is none)."""
        budget = planned.budget_bytes
        assert budget is not None
        old = planned.plan
        said = (f"lightning_remat: the first training step under the plan measured "
                f"{format_bytes(peak)}, {format_bytes(excess)} over its prediction of "
                f"{format_bytes(old.predicted_peak_bytes)}")
        replans = self._replans.get(planned.key, 0)
        plan = self._plan_again(planned, args, kwargs, excess) if replans < STEP_REPLANS else None
        if plan is not None:
            self._replans[planned.key] = replans + 1
            planned.checked = False  # the new plan's first step is measured too
            times = "" if replans == 0 else f" ({replans + 1} times)"
            return (f"{said}; planned again{times} with the model's margin raised by that much: "
                    f"{plan.solver}, predicted {format_bytes(plan.guaranteed_peak_bytes)} within "
                    f"{format_bytes(budget)}")
        planned.checked = True
        if peak <= budget:
            return f"{said}, within the budget of {format_bytes(budget)}: the plan stays"
        self._refuse(planned, args, peak)
        raise AssertionError("unreachable")

    def _refuse(self, planned: Planned, args: tuple, peak: int) -> None:
        """Raise the refusal of a step measured over its budget: the input's plan is taken
        out (its next call plans it again, and the message is met again unless the budget
        changed), and the error names the smallest budget that holds with the margin raised
        by what the step measured over."""
        budget = planned.budget_bytes
        assert budget is not None
        self.planned.pop(planned.key, None)
        self.remat_module.variants.pop(planned.key, None)
        if self.last is planned:
            self.last = None
        self._replans.pop(planned.key, None)
        device = module_device(self.module, args)
        options = solver_options(self.settings.solver, device, self.settings.offload)
        try:
            least = self.smallest_budget(planned.graph, options, planned.variant.hooked is not None)
        except RematInfeasibleError:
            least = None
        if least is not None:
            # Given that budget, a new planner runs its own first plan, and the margin it
            # raises is what that plan measured over: a step's excess varies between plans
            # by bytes to pages, so the budget named holds that variation too.
            least = int(max(int(least), int(peak)) * (1 + REFUSAL_SLACK)) + 1
        raise RematInfeasibleError(budget, least, measured_peak_bytes=peak)

    def plan_again(self, planned: Planned, args: tuple, kwargs: dict, measured_peak: int) -> bool:
        """Plan ``planned``'s input again after a step of it measured ``measured_peak``, over
        its prediction: the model's margin raised by the excess, solved for the same budget
        and run from the next call on (the batch-size search's trials, which measure their
        steps themselves). False where no plan fits with that margin."""
        excess = int(measured_peak) - int(planned.plan.predicted_peak_bytes)
        if excess <= 0 or planned.budget_bytes is None:
            return False
        return self._plan_again(planned, args, kwargs, excess) is not None

    def _plan_again(self, planned: Planned, args: tuple, kwargs: dict, excess: int) -> Plan | None:
        """Solve ``planned``'s graph again with the model's margin raised by what its first
        step measured above the prediction (``meta.measured_excess_bytes``), and run the new
        plan from this call on; None (the plan unchanged) where no plan fits with it."""
        graph, budget = planned.graph, planned.budget_bytes
        assert budget is not None
        graph.meta.measured_excess_bytes = max(int(graph.meta.measured_excess_bytes or 0), excess)
        device = module_device(self.module, args)
        try:
            plan = self._solve(graph, budget, solver_options(self.settings.solver, device, self.settings.offload))
        except RematInfeasibleError:
            return None
        self._use_plan(planned, args, kwargs, plan)
        return plan

    def _use_plan(self, planned: Planned, args: tuple, kwargs: dict, plan: Plan) -> None:
        """Run ``plan`` (made for ``planned``'s graph and budget) for ``planned``'s input
        from this call on, and store it in the cache in place of the old."""
        graph, budget = planned.graph, planned.budget_bytes
        device = module_device(self.module, args)
        with preserved_state(self.module, [device]):
            traced = self._trace(self.module, args, kwargs)
        if traced.kind == CHILDREN:
            plan = per_submodule_plan(graph, plan, budget)
        if not any(note.startswith("capture: ") for note in plan.notes):
            plan.notes.insert(0, traced.granularity())
        variant = build_traced_variant(traced, plan, self.remat_module, self.module, graph)
        variant.budget_bytes = budget
        planned.variant = variant
        if planned.key in self.remat_module.variants:
            self.remat_module.variants[planned.key] = variant
        if self.cache is not None and planned.basis is not None:
            self.cache.put(planned.basis, graph, plan)

    # ---- planning one input ---------------------------------------------------------------
    def _plan(self, args: tuple, kwargs: dict, key: InputKey, exchange: Exchange | None) -> Planned:
        # Tracing and profiling run the module's backward, several times: from inputs cut
        # off the caller's graph (a head fed by an encoder), which they must not reach.
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), (args, kwargs))
        module, settings = self.module, self.settings
        device = module_device(module, args)
        options = solver_options(settings.solver, device, settings.offload)
        self._plan_started = time.perf_counter()
        if self.progress is not None:
            self.progress("trace: the forward's graph")
        with preserved_state(module, [device]):
            traced = self._trace(module, args, kwargs)
        self._guard(traced)
        basis = PlanBasis(
            graph_hash=traced.graph.graph_hash(), input_key=stored_key(without_precision(key)),
            device_name=device_name(device), budget=repr(settings.memory_budget),
            solver=settings.solver + repr(sorted(options.items())), autocast=autocast_state(device),
            param_dtype=parameter_dtypes(module), torch_version=str(torch.__version__),
            world_size=str(world_size()), sharding=self.sharding,
        )
        if exchange is not None and not exchange.mine:
            graph, plan, from_store = self._follow(args, kwargs, traced, exchange)
        else:
            graph, plan, from_store = self._plan_locally(args, kwargs, key, traced, basis, exchange)
            if exchange is not None:
                exchange.send(SharedPlan.of(graph, plan, from_store))
        if not any(note.startswith("capture: ") for note in plan.notes):
            plan.notes.insert(0, traced.granularity())
        variant = build_traced_variant(traced, plan, self.remat_module, module, graph)
        read = getattr(self, "_budget_read", None)
        variant.budget_bytes = read if read is not None else self._budget(graph, device)
        self._budget_read = None
        variant.from_cache = from_store
        example = move_to_device((tuple(args), dict(kwargs)), torch.device("cpu")) if self.keep_example else None
        return Planned(key, variant, self.remat_module, example, basis=basis, traced=traced)

    def _plan_locally(self, args: tuple, kwargs: dict, key: InputKey, traced: Traced,
                      basis: PlanBasis, exchange: Exchange | None = None) -> tuple[Graph, Plan, bool]:
        """The graph and plan for ``key``: agreed by the ranks, restored from a checkpoint,
        cached, or profiled and solved here; and whether it came from such a store.
        ``exchange``: the owner's talk with the ranks waiting for the plan (sharded ranks
        profile with it)."""
        if repr(key) in self.agreed:
            return self.agreed[repr(key)].unpack()
        module, settings = self.module, self.settings
        device = module_device(module, args)
        stored, explained = self._restored_for(stored_key(key), basis)
        if stored is not None:
            checked = self._trusted(Graph.from_json(stored.graph_json), Plan.from_json(stored.plan_json),
                                    "checkpoint", device, traced.kind == CHILDREN)
            if checked is not None:
                return (*checked, True)
            explained = True
        if self.cache is not None:
            hit = self.cache.get(basis)
            checked = None if hit is None else self._trusted(hit.graph, hit.plan, "plan cache", device,
                                                            traced.kind == CHILDREN)
            if checked is not None:
                return (*checked, True)
            if hit is None and not explained:
                self._say_why_not(basis, self.cache.bases(), "plan cache")
        if exchange is not None:
            exchange.send(ProfileTogether())
        note = self.progress or (lambda line: None)
        started = self._plan_started or time.perf_counter()
        if self.profiler is not None:
            graph = self.profiler(module, args, kwargs, traced)
        else:
            graph = profile_module(
                module, args, example_kwargs=kwargs or None, repeats=settings.profile_repeats,
                safe=settings.safe_profile, traced=traced, progress=note, loss_fn=self.loss_fn,
                agree=None if exchange is None else exchange.ranks.any,
            )
        # The gradients' state is the run's own: a loop that keeps them plans for that.
        graph.meta.grads_resident = grads_resident(module)
        # The offloading solvers (and "auto", which ends with them) need beta.
        if graph.meta.bandwidth_bytes_per_s is None:
            graph.meta.bandwidth_bytes_per_s = measure_bandwidth(device)
        # What each recomputed stage costs the executor itself, in the plans' extra time.
        if graph.meta.recompute_stage_seconds is None:
            (graph.meta.recompute_stage_seconds,
             graph.meta.recompute_vertex_seconds) = measure_recompute_overhead(device)
        profiled = time.perf_counter()
        budget = self._budget_read = self._budget(graph, device)
        options = solver_options(settings.solver, device, settings.offload)
        note(f"solve: {settings.solver} for {'no budget' if budget is None else format_bytes(budget)}")
        try:
            plan = self._accepted_plan(graph, budget, options, traced.kind == CHILDREN)
        except RematInfeasibleError as refused:
            if getattr(self, "step_budget", None) is None or isinstance(refused, SolverDeclinedError) \
                    or self.ranks is not None or self.sharding != "none":
                raise
            # Another module of the step gives up what this one needs, or the step refuses.
            budget = self._budget_read = self.step_budget.over(self, refused)
            plan = self._accepted_plan(graph, budget, options, traced.kind == CHILDREN)
        if self.cache is not None:
            self.cache.put(basis, graph, plan)
        note(planning_summary(time.perf_counter() - started, graph.meta.step_seconds,
                              profiled - started, "derived" if self.profiler is not None else "profile"))
        return graph, plan, False

    def _trusted(self, graph: Graph, plan: Plan, source: str, device: torch.device,
                 per_submodule: bool) -> tuple[Graph, Plan] | None:
        """A stored plan re-simulated on its graph (:func:`~lightning_remat.cache.resimulated`)
        against this run's budget, with its prediction recomputed; None, after one warning,
        when it does not cover its graph or is over the budget (the caller plans afresh, and
        a fresh plan replaces it in the cache)."""
        budget = self._budget_read = self._budget(graph, device)
        excess = int(graph.meta.measured_excess_bytes or 0)
        plain_fits = (budget is not None and self.settings.solver == "auto" and bool(graph.meta.plain_peak_bytes)
                      and plain_peak_bytes(graph) + excess <= budget)
        try:
            return graph, resimulated(graph, plan, budget, whole_stages=per_submodule, plain_fits=plain_fits)
        except (ValueError, KeyError) as exc:
            self._budget_read = None
            warn_caller(f"lightning-remat: the {source}'s plan for this input is not used: {exc}; "
                        "planning again")
            return None

    def _budget(self, graph: Graph, device: torch.device) -> int | None:
        """The budget ``graph`` is planned at: the settings', or where several modules of a
        training step share one (:class:`~lightning_remat.step_budget.StepBudget`), what
        it leaves this one."""
        own = self.settings.budget_bytes(graph, device, getattr(self, "free_memory", None))
        if own is None or getattr(self, "step_budget", None) is None or self.ranks is not None \
                or self.sharding != "none":
            return own  # ranks plan each module on its own (they must re-plan together)
        return self.step_budget.grant(self, graph, own, plain_peak_bytes(graph))

    def least_budget(self, entry: Planned) -> int | None:
        """The smallest budget ``entry``'s graph is planned at (:meth:`smallest_budget`);
        for an entry loaded without its capture, which cannot be planned again here, the
        budget its plan was made for."""
        if entry.traced is None:
            return entry.budget_bytes
        device = module_device(self.module)
        options = solver_options(self.settings.solver, device, self.settings.offload)
        return self.smallest_budget(entry.graph, options, entry.variant.hooked is not None)

    def plan_within(self, entry: Planned, budget: int) -> None:
        """Plan ``entry``'s input again at ``budget`` (lower than it was: another module of
        the step needs the rest), from its next call on."""
        device = module_device(self.module)
        options = solver_options(self.settings.solver, device, self.settings.offload)
        assert entry.traced is not None
        plan = self._accepted_plan(entry.graph, budget, options, entry.traced.kind == CHILDREN)
        if not any(note.startswith("capture: ") for note in plan.notes):
            plan.notes.insert(0, entry.traced.granularity())
        variant = build_traced_variant(entry.traced, plan, self.remat_module, self.module, entry.graph)
        variant.budget_bytes = budget
        entry.variant = variant
        if entry.key in self.remat_module.variants:
            self.remat_module.variants[entry.key] = variant
        if self.cache is not None and entry.basis is not None:
            self.cache.put(entry.basis, entry.graph, plan)

    def _accepted_plan(self, graph: Graph, budget: int | None, options: dict[str, Any],
                       per_submodule: bool) -> Plan:
        """The plan for ``budget`` (``per_submodule``: the model could not be traced, each
        submodule is checkpointed on its own); where there is none,
        :class:`~lightning_remat.errors.RematInfeasibleError` naming the smallest budget
        this very function accepts (:meth:`smallest_budget`), so that budget, given, is."""
        try:
            return self._plan_for(graph, budget, options, per_submodule)
        except SolverDeclinedError:
            raise  # no budget makes the solver plan this graph; the error names another
        except RematInfeasibleError as exc:
            assert budget is not None
            least = self.smallest_budget(graph, options, per_submodule)
            raise RematInfeasibleError(budget, least, exc.tried) from None

    def _plan_for(self, graph: Graph, budget: int | None, options: dict[str, Any],
                  per_submodule: bool) -> Plan:
        plan = plain_plan(graph) if budget is None else self._solve(graph, budget, options)
        if per_submodule:
            plan = per_submodule_plan(graph, plan, budget)
        return plan

    def _accepts(self, graph: Graph, budget: int, options: dict[str, Any], per_submodule: bool) -> bool:
        try:
            self._plan_for(graph, budget, options, per_submodule)
        except RematInfeasibleError:
            return False
        return True

    def smallest_budget(self, graph: Graph, options: dict[str, Any],
                        per_submodule: bool = False) -> int | None:
        """The smallest budget :meth:`_accepted_plan` accepts for ``graph``: the solver's
        smallest budget (:func:`~lightning_remat.solvers.min_budget`) or, for ``auto``, the
        measured plain peak where that is less (``_solve`` takes the plain plan there).
        Checkpointing each submodule on its own also needs a budget its per-submodule plan
        fits (:func:`~lightning_remat.runtime.hooked.per_submodule_plan`): found by binary
        search from the budget every submodule recomputed needs, down to the solver's (None:
        no budget found)."""
        least = min_budget(graph, self.settings.solver, **options)
        if self.settings.solver == "auto" and graph.meta.plain_peak_bytes:
            # The plain plan holds a step's measured excess too (``_plan_locally``).
            least = min(least, plain_peak_bytes(graph) + int(graph.meta.measured_excess_bytes or 0))
        if not per_submodule or self._accepts(graph, least, options, per_submodule):
            return int(least)
        hi = max(least, every_submodule_recomputed(graph).guaranteed_peak_bytes)
        for _ in range(8):  # a split solver plan need not fit where a smaller budget's does
            if self._accepts(graph, hi, options, per_submodule):
                break
            hi *= 2
        else:
            return None
        lo = least
        while hi - lo > max(1, hi // 100_000):
            mid = (lo + hi) // 2
            if self._accepts(graph, mid, options, per_submodule):
                hi = mid
            else:
                lo = mid
        return int(hi)

    def _solve(self, graph: Graph, budget: int, options: dict[str, Any]) -> Plan:
        """The solver's plan; for ``auto``, where the plain step's measured peak is within
        the budget, the plain plan: nothing to recompute, and the measurement is what any
        prediction is held to (docs/design.md section 4.7)."""
        measured = graph.meta.plain_peak_bytes
        excess = int(graph.meta.measured_excess_bytes or 0)
        if self.settings.solver == "auto" and measured and plain_peak_bytes(graph) + excess <= budget:
            # The least extra time is none, and the plain step was measured to fit.
            plan = plain_plan(graph)
            plan.solver, plan.feasible = "auto:plain", True
            plan.notes.append(f"the plain step measured {format_bytes(plain_peak_bytes(graph))}, "
                              f"within {format_bytes(budget)}: nothing recomputed")
            return plan
        return solve(graph, budget, self.settings.solver, **options)

    def _restored_for(self, key_text: str, basis: PlanBasis) -> tuple[StoredPlan | None, bool]:
        """The checkpoint's plan for this key and ``basis``, and whether a warning said why
        there is none (what differs from the nearest plan: one for the same key, or any on
        this run's first plan)."""
        stored = self.restored.get(key_text)
        if stored is not None and stored.basis == basis:
            return stored, False
        if stored is None and (not self.restored or self.planned):
            return None, False
        candidates = [stored] if stored is not None else list(self.restored.values())
        known = [c.basis for c in candidates if c.basis is not None]
        if known:
            return None, self._say_why_not(basis, known, "checkpoint", same_inputs=False)
        warn_caller(describe_change(None, basis, "checkpoint"))
        return None, True

    def _say_why_not(self, basis: PlanBasis, others: list[PlanBasis], source: str,
                     same_inputs: bool = True) -> bool:
        """Warn why the nearest of ``others`` (the same graph and, with ``same_inputs``, the
        same inputs) is not reused for ``basis``; whether it warned. Only the rank that plans
        a key gets here, so the line is written once."""
        near = [b for b in others if b.graph_hash == basis.graph_hash
                and (not same_inputs or b.input_key == basis.input_key)]
        if not near and not same_inputs:
            near = others
        if not near:
            return False
        names = [f.name for f in dataclasses.fields(PlanBasis)]
        nearest = min(near, key=lambda b: sum(getattr(b, n) != getattr(basis, n) for n in names))
        warn_caller(describe_change(nearest, basis, source))
        return True


Profiler = Callable[[nn.Module, tuple, dict, Traced], Graph]
StepTimer = Callable[[Callable[[], None], Callable[[], None], torch.device], StepTimes]
"""Times a plain and a planned step: ``(plain, planned, device) -> StepTimes``."""
Tracer = Callable[[nn.Module, tuple, dict], Traced]
"""Gives the graph of one call: ``(module, args, kwargs, traced) -> Graph``."""


def planning_summary(seconds: float, step_seconds: float | None, profile_seconds: float | None = None,
                     profile_label: str = "profile") -> str:
    """One line: the time planning took, in seconds and in plain steps (``step_seconds``:
    the plain step's time, None when unknown)."""
    steps = f" ({seconds / step_seconds:.1f} plain steps)" if step_seconds else ""
    parts = f"; {profile_label} {profile_seconds:.1f} s" if profile_seconds is not None else ""
    return f"planning took {seconds:.1f} s{steps}{parts}"


def _uncompiled(module: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, with a warning that it is planned and runs
    eagerly (the plan's stage programs are not compiled); any other module as it is."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported by torch.compile
    compiled = getattr(eval_frame, "OptimizedModule", None)
    if compiled is None or not isinstance(module, compiled):
        return module
    inner = module._orig_mod
    warn_caller(
        f"lightning_remat: remat() was given a torch.compile'd module; it plans the "
        f"{type(inner).__name__} inside it, whose planned forward runs eagerly, not compiled "
        "(its parameters are the same objects; docs/limitations.md)")
    return inner


def remat(
    module: nn.Module,
    example_input: Any,
    memory_budget: int | float | str | None = None,
    solver: str = "auto",
    device: str | torch.device | None = None,
    progress: bool = False,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> RematModule:
    """``module`` rematerialized to train within ``memory_budget``.

    ``example_input``: a tensor, a tuple of positional inputs, or a dict of keyword inputs.
    ``memory_budget``: bytes, a size string (``"4GiB"``, ``"512MB"``) or a fraction of the
    plain step's profiled peak (``"60%"``, ``0.6``; for each input shape, of that shape's own
    plain peak); None means the device's free memory on CUDA and no limit on CPU (the result
    then runs the plain plan, with its profile in ``.graph``). ``device``: where to profile
    and train (the module is moved there; default: where its parameters are).
    ``progress``: write one line to stderr as each planning phase starts (trace, profile,
    solve) and a last one with the time planning took, in seconds and in plain steps.
    ``loss_fn(outputs) -> scalar``: the loss your training step takes of the module's
    outputs, as ``loss_fn(model(x)).backward()``; the plan counts the memory it takes (a
    cross-entropy over a large vocabulary holds several times the logits) and the outputs
    freed once it has read them. Default: the loop people write, ``out = model(x); loss =
    F.cross_entropy(out, y); loss.backward()``, the outputs alive to the step's end and a
    cross-entropy over their last dimension (a loss whose gradient is as large as the
    outputs); a known ``loss_fn`` gives a tighter plan. The result pickles (``torch.save``)
    without ``loss_fn`` (a lambda cannot be pickled): loaded, it runs its plans as before and
    plans a new input shape with the default loss, with one warning.

    The first training step under each plan is measured: on CUDA your own step, on the
    caching allocator's peak from the forward to the end of the backward its outputs start
    (over the plan's prediction, the next call plans again); elsewhere one metered step of
    the plan, run as the last part of planning with the loss the plan was made for, which
    leaves the module's state and gradients as they were (over the prediction, the input
    is planned again at once). The new plan's margin is raised by the excess, and one
    warning says so.

    The result shares the module's Parameter objects and state_dict keys, has ``.plan``,
    ``.graph`` and ``.budget_bytes``, and plans once more for each new input shape (with a
    one-time warning) so a changed shape never silently exceeds the budget. Raises
    ``ValueError`` for a malformed budget and
    :class:`~lightning_remat.errors.RematInfeasibleError` (with the smallest feasible budget)
    when no plan fits.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from lightning_remat import remat
        >>> net = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(32, 32), nn.Tanh())])
        >>> x = torch.randn(512, 32)
        >>> model = remat(net, x, memory_budget="50%")  # or bytes: 2**20, "1MiB", "6GiB"
        >>> model.plan.solver  # doctest: +ELLIPSIS
        'auto:...'
        >>> model.plan.guaranteed_peak_bytes <= model.budget_bytes
        True
        >>> model(x).sum().backward()  # the gradients land on net's own Parameters
        >>> net[0].weight.grad.shape
        torch.Size([32, 32])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"remat() needs a torch.nn.Module, got {type(module).__name__}")
    module = _uncompiled(module)
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
    planner = Planner(module, settings, loss_fn=loss_fn,
                      progress=(lambda line: print(f"lightning-remat: {line}", file=sys.stderr, flush=True)) if progress else None)
    planner.last = planner.planned_for(inputs, kwargs)
    planner.remat_module.set_current(planner.last.variant)
    planner.remat_module.fire_hooks_of(module)
    return planner.remat_module
