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

Length: the steps of planning one input (the agreement across ranks, profiling, the budget,
solving, applying) share the planner's state and read top to bottom here. What a plan for a
budget is lives with the solvers (:mod:`lightning_remat.solvers.policy`); the settings and
what a plan gives in :mod:`.settings`, the first planned step's check in :mod:`.first_step`,
the stored plans in :mod:`.stores`, ``remat()`` in :mod:`.api`; the input key and the
messages between ranks in :mod:`lightning_remat.inputs` and :mod:`lightning_remat.messages`.

This module holds no Lightning code; the strategy passes in its ranks and a callback.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_remat.budget import format_bytes
from lightning_remat.cache import PlanBasis, PlanCache, StoredPlan
from lightning_remat.device import device_name, module_device, move_to_device
from lightning_remat.errors import (
    RematInfeasibleError,
    SolverDeclinedError,
    TraceError,
    warn_caller,
)
from lightning_remat.graph.calls import CACHE_OFF_NOTE, cache_configs, caches_off
from lightning_remat.graph.effects import preserved_state
from lightning_remat.graph.ir import Graph
from lightning_remat.graph.meaning import StateRead, guard_owners, read_state
from lightning_remat.graph.profile import profile_module
from lightning_remat.graph.sharding import sharded_gradients_kept, sharding_of
from lightning_remat.graph.trace import (
    CHILDREN,
    Traced,
    trace_module,
)
from lightning_remat.imports import sympy_imported
from lightning_remat.inputs import (
    InputKey,
    autocast_state,
    input_key,
    key_changes,
    masks_leaf,
    moved_state,
    precision_leaf,
    same_values,
    stored_key,
    without_precision,
)
from lightning_remat.measure.allocations import paused
from lightning_remat.measure.peak import collector_settled
from lightning_remat.messages import (
    Exchange,
    ProfileTogether,
    Ranks,
    SharedCall,
    SharedPlan,
    world_size,
)
from lightning_remat.planner.first_step import FirstStepCheck
from lightning_remat.planner.settings import (
    Planned,
    PlanSettings,
    Profiler,
    StepTimer,
    Tracer,
    grads_resident,
    parameter_dtypes,
    planning_summary,
)
from lightning_remat.planner.stores import StoredPlans
from lightning_remat.runtime.module import (
    RematModule,
    Variant,
    build_traced_variant,
)
from lightning_remat.runtime.offload import measure_bandwidth
from lightning_remat.runtime.overhead import measure_recompute_overhead
from lightning_remat.solvers.plan import Plan
from lightning_remat.solvers.policy import (
    accepted_plan,
    check_solver_for_device,
    plain_peak_bytes,
    smallest_budget,
    solver_options,
)
from lightning_remat.step_budget import StepBudget

__all__ = ["Planned", "Planner", "PlanSettings"]


class Planner(FirstStepCheck, StoredPlans):
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
    CUDA (default: :func:`~lightning_remat.measure.peak.peak_bytes`); ``check_first_step=False``:
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
        ``step()`` and returns its peak bytes (None: :func:`~lightning_remat.measure.peak.peak_bytes`)."""
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
        docs/design.md section 3), and once a capture skipped attention masks that padded no
        token, which of the call's masks pad none (:func:`~lightning_remat.inputs.masks_leaf`)."""
        inputs = input_key(self._signature, args, kwargs)
        if getattr(self, "_masks_guarded", False):
            inputs = (masks_leaf(args, kwargs), *inputs)
        guards = getattr(self, "_guards", None)
        if guards:
            return (precision_leaf(self.module), ("state", guards[0], read_state(guards[1])), *inputs)
        return (precision_leaf(self.module), *inputs)

    def _guard(self, traced: Traced | None) -> None:
        """Guard from now on the attribute values ``traced``'s capture read (None: guard
        nothing from now on)."""
        if traced is None or not hasattr(self, "_guarded"):
            self._guarded: dict[tuple[str, str], StateRead] = {}
        if traced is not None and traced.unpadded:
            self._masks_guarded = True  # from now on, calls with padded masks are new inputs
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
        # Planning measures many steps, and the CPU meter collects garbage before each: with
        # the objects alive now out of the collector's reach until the plan is made, each of
        # those collections meets only what planning itself made, not every object in the
        # process (docs/design.md section 6). Garbage from before is kept, not freed,
        # meanwhile: no measured step sees it go.
        if self.ranks is not None and self.ranks.any(needs_plan):
            with collector_settled(collect=False):
                self._agree(args, kwargs, key if needs_plan else None)
            entry = self.planned.get(key)
        if entry is not None:
            return entry
        with collector_settled(collect=False):
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
            with guard, sharded_gradients_kept(self.module), paused():
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
        budget = self._budget_read = self._budget(graph, device)
        if self.profiler is None and budget is not None and exchange is None:
            # ... and on this model's own step, which a chain of small ops does not predict.
            note("calibrate: the executor's own time on the model")
            for line in self._calibrate_executor(graph, traced, args, kwargs, device):
                note(line)
        profiled = time.perf_counter()
        options = solver_options(settings.solver, device, settings.offload)
        note(f"solve: {settings.solver} for {'no budget' if budget is None else format_bytes(budget)}")
        try:
            try:
                plan = accepted_plan(graph, budget, self.settings.solver, options, traced.kind == CHILDREN)
            except RematInfeasibleError as refused:
                if getattr(self, "step_budget", None) is None or isinstance(refused, SolverDeclinedError) \
                        or self.ranks is not None or self.sharding != "none":
                    raise
                # Another module of the step gives up what this one needs, or the step refuses.
                budget = self._budget_read = self.step_budget.over(self, refused)
                plan = accepted_plan(graph, budget, self.settings.solver, options, traced.kind == CHILDREN)
        except RematInfeasibleError as refused:
            if isinstance(refused, SolverDeclinedError):
                raise
            named = refused.with_room()
            cause = traced.coarse_cause()
            if cause and not named.cause:
                named = named.because(cause)
            if named is refused:
                raise
            raise named from None
        if self.cache is not None:
            self.cache.put(basis, graph, plan)
        note(planning_summary(time.perf_counter() - started, graph.meta.step_seconds,
                              profiled - started, "derived" if self.profiler is not None else "profile"))
        return graph, plan, False

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
        return smallest_budget(entry.graph, self.settings.solver, options, entry.variant.hooked is not None)

    def plan_within(self, entry: Planned, budget: int) -> None:
        """Plan ``entry``'s input again at ``budget`` (lower than it was: another module of
        the step needs the rest), from its next call on."""
        device = module_device(self.module)
        options = solver_options(self.settings.solver, device, self.settings.offload)
        assert entry.traced is not None
        plan = accepted_plan(entry.graph, budget, self.settings.solver, options, entry.traced.kind == CHILDREN)
        if not any(note.startswith("capture: ") for note in plan.notes):
            plan.notes.insert(0, entry.traced.granularity())
        variant = build_traced_variant(entry.traced, plan, self.remat_module, self.module, entry.graph)
        variant.budget_bytes = budget
        entry.variant = variant
        if entry.key in self.remat_module.variants:
            self.remat_module.variants[entry.key] = variant
        if self.cache is not None and entry.basis is not None:
            self.cache.put(entry.basis, entry.graph, plan)
