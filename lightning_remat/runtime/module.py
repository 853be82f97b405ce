"""The module that runs a forward stage by stage under a Plan (docs/design.md section 5).

:class:`RematModule` adopts the original module's top-level children, parameters and buffers
under their own names, so its ``state_dict`` keys and its Parameter objects are the
original's: a checkpoint saved from either form loads into the other. It runs one
:class:`Variant` (a plan and its compiled stages, :mod:`lightning_remat.runtime.stages`) at a
time; whoever plans for it (:mod:`lightning_remat.planner`) may install a selector that picks
or makes the variant for each call's inputs.

How each stage runs:

- ``keep``: its generated function, plainly;
- ``recompute``: under non-reentrant ``torch.utils.checkpoint`` with the RNG state replayed
  (dropout draws the same masks) and autocast recorded; the running statistics of its norm
  layers are restored around the recomputation, so they are updated once per step;
- ``offload``: under saved-tensor hooks that move what autograd saves to host memory
  (:class:`~lightning_remat.runtime.offload.OffloadHooks`);
- in ``eval()`` or under ``torch.no_grad()`` every stage runs plainly.

Length: the module, its variants and the contexts each stage runs in belong together: the
contexts read the variant's programs and the module's state on every call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Collection, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from lightning_remat.device import fsdp_unit_types
from lightning_remat.errors import warn_caller
from lightning_remat.graph.effects import OncePerStep, call_with_hooks, has_forward_hooks
from lightning_remat.graph.ir import Graph
from lightning_remat.graph.trace import CHILDREN, EXPORT, Traced
from lightning_remat.graph.vertices import fx_vertex_graph
from lightning_remat.imports import sympy_imported
from lightning_remat.runtime.contexts import (
    Contexts,
    KeptOnce,
    ProfilerRangesAside,
    UncachedAutocast,
)
from lightning_remat.runtime.hooked import SubmoduleCheckpointing
from lightning_remat.runtime.offload import OffloadHooks, plan_offload_bytes
from lightning_remat.runtime.stages import (
    CompiledStages,
    KeptRegion,
    RestoreNormStatistics,
    StageProgram,
    boundary_policy,
    compile_stages,
    observed_stages,
    rebuild_output,
    with_output_containers,
)
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.schedule import Schedule, make_schedule, order_note

__all__ = ["RematModule", "Variant", "VariantSelector", "apply_plan", "build_traced_variant",
           "build_variant"]

OffloadHooksFactory = Callable[[int, Stage], contextlib.AbstractContextManager]
"""Called as ``factory(stage_index, stage)``; returns the context (saved-tensor hooks)
an offloaded stage's forward runs under."""

_RESERVED = ("plan", "graph", "variants", "budget_bytes")


@dataclass
class Variant:
    """One traced form of the forward under one plan."""

    plan: Plan
    stages: CompiledStages | None
    """The generated stage programs (None for the tracing fallback: see ``hooked``)."""
    signature: inspect.Signature
    """The signature callers use (the original forward's where it lines up)."""
    graph: Graph | None = None
    """The profiled graph the plan was made on (None for a hand-made plan)."""
    budget_bytes: int | None = None
    """The budget the plan was made for (None: no limit)."""
    from_cache: bool = False
    """Whether the plan came from the plan cache or a checkpoint rather than a new solve."""
    hooked: SubmoduleCheckpointing | None = None
    """For a model fx could not trace: its own forward, its submodules checkpointed in place
    (:mod:`lightning_remat.runtime.hooked`)."""
    output_spec: pytree.TreeSpec | None = None
    """For a forward captured by ``torch.export``: its output structure over the flat leaves
    the stages return."""
    eager: nn.Module | None = None
    """For a forward captured by ``torch.export``: the module whose own forward runs outside
    training (the captured graph is specialised to training mode: its dropout draws)."""
    schedule: Schedule | None = None
    """The schedule the stages were compiled to (None for the tracing fallback). Which
    stages keep values reads the graph's times, which the planner may correct after the
    stages are built: the step's prediction follows this schedule, the one that runs."""

    def bind(self, args: tuple, kwargs: dict) -> list[Any]:
        """The call's arguments in the traced order, defaults filled in."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return list(bound.arguments.values())

    def observed(self, ops: Collection[str], observe: Callable[[str, Any], None]) -> Variant:
        """This variant with ``observe(op, value)`` called after each op of ``ops`` (vertex
        ids) has run, in the forward and in a recomputation: the measured timeline's
        readings (docs/design.md section 6). The variant itself is not changed."""
        if self.hooked is not None:
            return dataclasses.replace(self, hooked=self.hooked.observed(observe))
        assert self.stages is not None
        return dataclasses.replace(self, stages=observed_stages(self.stages, ops, observe))


VariantSelector = Callable[[tuple, dict, bool], Variant]
"""Called as ``selector(args, kwargs, training)`` before each forward (``training``: the
module is in training mode with grad enabled); returns the variant to run."""

StepCheck = Callable[[Variant, tuple, dict, Callable[[Variant], Any]], Any]
"""Called as ``check(variant, args, kwargs, run)`` for each training call: runs the forward
of ``variant`` or of another it planned in its place (``run(variant)``) and returns its
outputs."""


class _SharedOffloadHooks:
    """One :class:`OffloadHooks` shared by the module's offloaded stages, so its prefetch
    order spans them; made on first use."""

    def __init__(self) -> None:
        self.hooks: OffloadHooks | None = None

    def __call__(self, stage_index: int, stage: Stage) -> contextlib.AbstractContextManager:
        if self.hooks is None:
            self.hooks = OffloadHooks()
        return self.hooks

    def __deepcopy__(self, memo: dict) -> _SharedOffloadHooks:
        return _SharedOffloadHooks()  # hooks hold streams and step state: start fresh


class RematModule(nn.Module):
    """A module run stage by stage under a Plan. Build it with :func:`apply_plan` or
    :func:`lightning_remat.remat`. ``.plan`` is the plan for the inputs last seen, ``.graph``
    its profiled Graph (None when built from a hand-made plan), ``.variants`` every plan
    made so far by input key."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        members = set(root._modules) | set(root._parameters) | set(root._buffers)
        clashes = [name for name in _RESERVED if name in members]
        if clashes:
            raise ValueError(
                f"the module has attributes named {clashes}, which the rematerialized module "
                "uses itself; rename them to apply a plan"
            )
        # Adopt the original's direct members: same objects, same state_dict keys.
        for name, child in root._modules.items():
            self.add_module(name, child)
        # The parameters by sharing the original's table: a parameter the original swaps in
        # place is the one the stages read (FSDP2 sets a unit's gathered parameters on it for
        # the length of its forward and backward, and the sharded ones back after).
        object.__setattr__(self, "_parameters", root._parameters)
        for name, buf in root._buffers.items():
            self.register_buffer(name, buf, persistent=name not in root._non_persistent_buffers_set)
        self.training = root.training  # not .train(): children keep their own modes
        # Not a submodule: its members are this module's own already (state_dict keys).
        object.__setattr__(self, "_remat_root", root)
        self.variants: dict[Hashable, Variant] = {}
        self._remat_current: Variant | None = None
        self._remat_select: VariantSelector | None = None
        self._remat_call_context: Callable[[], contextlib.AbstractContextManager] | None = None
        self._remat_offload_factory: OffloadHooksFactory = _SharedOffloadHooks()
        self._remat_step_check: StepCheck | None = None

    # ---- public views -------------------------------------------------------------------
    @property
    def current(self) -> Variant:
        """The variant the last call ran (the first one planned before any call)."""
        if self._remat_current is None:
            raise RuntimeError("the rematerialized module has no plan yet")
        return self._remat_current

    @property
    def plan(self) -> Plan:
        return self.current.plan

    @property
    def graph(self) -> Graph | None:
        return self.current.graph

    @property
    def budget_bytes(self) -> int | None:
        """The budget the current plan was made for."""
        return self.current.budget_bytes

    def stage_sources(self) -> list[str]:
        """The generated code of each stage (for inspection and debugging)."""
        variant = self.current
        if variant.hooked is not None:
            return variant.hooked.sources()
        assert variant.stages is not None
        return [p.source for p in variant.stages.programs]

    def set_variant_selector(self, selector: VariantSelector | None) -> None:
        """Install ``selector`` to pick the variant for each call (None: always run the
        current one)."""
        self._remat_select = selector

    def set_call_context(self, context: Callable[[], contextlib.AbstractContextManager] | None) -> None:
        """Install ``context`` (a factory) for each call to run in (the planner's: the
        module's caches off, ``graph.calls``; None: none)."""
        self._remat_call_context = context

    def set_step_check(self, check: StepCheck | None) -> None:
        """Install ``check`` around each training call (the planner measures a plan's first
        step with it; None: none)."""
        self._remat_step_check = check

    def set_current(self, variant: Variant) -> None:
        """Run ``variant`` until a selector picks another."""
        self._remat_current = variant

    @contextlib.contextmanager
    def running(self, variant: Variant) -> Iterator[None]:
        """The calls inside run ``variant``, whatever the selector would pick (a dashboard
        replaying one plan); the selector and the current variant are as before after."""
        selector, current = self._remat_select, self._remat_current
        self._remat_select, self._remat_current = None, variant
        try:
            yield
        finally:
            self._remat_select, self._remat_current = selector, current

    # ---- the original's interface ---------------------------------------------------------
    # What this class does not have itself is the original module's: its attributes and
    # methods (``r.num_classes``, ``r.encode(x)``, which run the original's code plainly on
    # the shared submodules) and a container's indexing, length and iteration (``r[0]``,
    # ``len(r)``, ``iter(r)`` on a Sequential).
    @property
    def original(self) -> nn.Module:
        """The module this one was made from (its forward traced)."""
        return self.__dict__["_remat_root"]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            root = self.__dict__.get("_remat_root")
            if root is None or name.startswith("_remat"):
                raise
            try:
                return getattr(root, name)
            except AttributeError:
                raise AttributeError(
                    f"'{type(self).__name__}' object has no attribute {name!r}, nor has the "
                    f"module it was made from ({type(root).__name__})") from None

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self.original)))

    def __getitem__(self, index: Any) -> Any:
        return _container_call(self.original, "__getitem__", "subscriptable", index)

    def __len__(self) -> int:
        return _container_call(self.original, "__len__", "sized")

    def __iter__(self) -> Iterator[Any]:
        return _container_call(self.original, "__iter__", "iterable")

    def __contains__(self, item: Any) -> bool:
        if hasattr(type(self.original), "__contains__"):
            return item in self.original
        return any(item is value or item == value for value in self)

    def __bool__(self) -> bool:
        return bool(self.original)

    # ---- adoption of what the graph reads -----------------------------------------------
    def adopt_targets(self, graph: fx.Graph, sources: list[nn.Module]) -> None:
        """Make every call_module/get_attr target of ``graph`` resolvable from ``self``:
        top-level names the original did not register (plain tensor attributes, fx's
        constants) become plain attributes, never state_dict entries."""
        for node in graph.nodes:
            if node.op not in ("call_module", "get_attr"):
                continue
            head = str(node.target).split(".")[0]
            if head in self._modules or head in self._parameters or head in self._buffers:
                continue
            if head in self.__dict__:
                continue
            for source in sources:
                if hasattr(source, head):
                    object.__setattr__(self, head, getattr(source, head))
                    break
            else:
                raise ValueError(f"the graph reads {node.target!r}, which the module does not have")

    # ---- forward --------------------------------------------------------------------------
    _remat_hooks_root: nn.Module | None = None

    def fire_hooks_of(self, root: nn.Module) -> None:
        """Fire ``root``'s own hooks (forward, pre-, backward) around each call, with ``root``
        and this call's arguments and output, as a plain call of ``root`` would: for the
        module :func:`lightning_remat.remat` returns, which is called in ``root``'s place
        (the strategy calls ``root`` itself, whose ``__call__`` fires them)."""
        object.__setattr__(self, "_remat_hooks_root", root)

    _remat_said_eager: bool = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Dynamo cannot trace the stage programs (generated code under selective
            # checkpointing): the forward runs outside the compiled graph, as it is.
            return _outside_compile()(self, args, kwargs)
        return self._forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        context = getattr(self, "_remat_call_context", None)
        if context is not None:
            with context():
                return self._forward_in_context(*args, **kwargs)
        return self._forward_in_context(*args, **kwargs)

    def _forward_in_context(self, *args: Any, **kwargs: Any) -> Any:
        root = self._remat_hooks_root
        if root is not None and has_forward_hooks(root):
            return call_with_hooks(root, self._planned_forward, args, kwargs)
        return self._planned_forward(*args, **kwargs)

    def _planned_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._remat_select is not None:
            self._remat_current = self._remat_select(args, kwargs, self.training and torch.is_grad_enabled())
        variant = self.current
        if self._remat_step_check is not None and self.training and torch.is_grad_enabled():
            return self._remat_step_check(variant, args, kwargs, lambda chosen: self._run(chosen, args, kwargs))
        return self._run(variant, args, kwargs)

    def _run(self, variant: Variant, args: tuple, kwargs: dict) -> Any:
        if variant.hooked is not None:
            # The root is not a child of this module: its own flag follows ours.
            variant.hooked.root.training = self.training
            return variant.hooked.run(self.training and torch.is_grad_enabled(), args, kwargs,
                                      self._remat_offload_factory)
        if variant.eager is not None and not self.training:
            variant.eager.training = False  # the root is not a child of this module
            return variant.eager(*args, **kwargs)
        stages = variant.stages
        assert stages is not None
        env: dict[str, Any] = {}
        for (node_name, _), value in zip(stages.placeholders, variant.bind(args, kwargs)):
            env[node_name] = value
        written = stages.written_inputs
        callers = {name: env[name] for name, _ in written if isinstance(env[name], torch.Tensor)}
        swapped: set[str] = set()
        for name, value in callers.items():
            # The stages' own tensor (CompiledStages.written_inputs): a second tensor on the
            # caller's storage, which keeps it when the caller's tensor takes the result; a
            # copy where the caller's tensor is a view or in autograd's graph.
            if value.requires_grad or value._base is not None:
                env[name] = value.clone()
            else:
                env[name] = value.data  # its own version counter: the swap bumps the caller's only
                swapped.add(name)
        grad_mode = torch.is_grad_enabled()
        recompute_now = self.training and grad_mode
        # Once per call, not per stage: a walk over every submodule costs about as much as
        # a small stage's recomputation.
        sharded = recompute_now and _has_fsdp_units(self)
        for program in stages.programs:
            inputs = [env[name] for name in program.input_names]
            if program.action == "recompute" and recompute_now:
                # Selective checkpointing imports sympy on first use: imported whole first
                # (an interrupt leaves none of it), its warning filter removed again.
                guard = sympy_imported()
                region = KeptRegion() if program.kept_boundary else None
                with guard:
                    outputs = torch.utils.checkpoint.checkpoint(
                        program.fn, self, *([region] if region else []), *inputs,
                        use_reentrant=False, preserve_rng_state=program.preserve_rng_state,
                        context_fn=self._context_fn(program, sharded, region),
                    )
            elif program.action == "offload" and grad_mode:
                hooks = self._remat_offload_factory(program.index, variant.plan.stages[program.index])
                if isinstance(hooks, OffloadHooks):
                    # What the profile counts as resident stays (docs/design.md section 5).
                    hooks.keep_resident([*self.parameters(), *self.buffers(), args, kwargs])
                    hooks.reserve(*plan_offload_bytes(variant.graph, variant.plan))
                with hooks:
                    outputs = program.fn(self, *inputs)
            elif program.kept_boundary:  # its code marks the kept nodes of a region
                outputs = program.fn(self, KeptRegion(), *inputs)
            else:
                outputs = program.fn(self, *inputs)
            del inputs
            for name in program.drop_after:
                env.pop(name, None)
            env.update(zip(program.output_names, outputs))
            del outputs
        for name, final in written:
            caller, result = callers.get(name), env.get(final)
            if caller is None or not isinstance(result, torch.Tensor) or _same_storage(caller, result):
                continue  # written in place (the plan kept the writes where they were)
            # The caller's input as plain training leaves it; recomputations read the stages'
            # tensor, which holds the input as the forward found it.
            if name in swapped:
                with torch.no_grad():
                    caller.set_(result.detach())
            else:
                caller.copy_(result)
        if variant.output_spec is not None:
            return pytree.tree_unflatten(list(rebuild_output(stages.output, env)), variant.output_spec)
        return rebuild_output(stages.output, env)

    def _context_fn(self, program: StageProgram, sharded: bool,
                    region: KeptRegion | None) -> Callable[[], tuple[Any, Any]]:
        """The contexts the stage's forward and its recomputation run in: selective
        checkpointing that keeps the boundary values (docs/design.md section 5), its policy
        reading this call's ``region``, and the norm statistics restored around the
        recomputation. ``sharded``: the module holds FSDP units."""
        restores = bool(program.norm_modules or program.state_buffers)
        once = _once_per_step(self, program)
        if region is None:
            if not restores and once is None:
                return torch.utils.checkpoint.noop_context_fn

            def plain() -> tuple[Any, Any]:
                kept = once() if once is not None else None
                forward: Any = kept.forward() if kept is not None else contextlib.nullcontext()
                return forward, Contexts(*([kept.recompute] if kept is not None else []),
                                          *([lambda: RestoreNormStatistics(self, program)] if restores else []))

            return plain

        def contexts() -> tuple[Any, Any]:
            forward, recompute = create_selective_checkpoint_contexts(functools.partial(boundary_policy, region))
            # The snapshots (norm statistics, buffers a stage updates) are taken outside the
            # recomputation mode, which would see their copies; FSDP's profiler ranges are
            # kept out of the op matching.
            kept = once() if once is not None else None
            keep_forward = [kept.forward] if kept is not None else []
            keep_recompute = [kept.recompute] if kept is not None else []
            restore = [lambda: RestoreNormStatistics(self, program)] if restores else []
            aside = [ProfilerRangesAside] if sharded else []
            return (Contexts(UncachedAutocast, region.outside, *keep_forward, lambda: forward, *aside),
                    Contexts(UncachedAutocast, region.outside, *keep_recompute, *restore,
                              lambda: KeptOnce(recompute), *aside))

        return contexts


def _container_call(root: nn.Module, method: str, kind: str, *args: Any) -> Any:
    """``root``'s container method ``method``, or the TypeError Python gives an object
    without it (``kind``: what the object is not, e.g. ``subscriptable``)."""
    if not hasattr(type(root), method):
        raise TypeError(f"'RematModule' object is not {kind}: the module it was made from "
                        f"({type(root).__name__}) is not")
    return getattr(root, method)(*args)


def _once_per_step(owner: nn.Module, program: StageProgram) -> Callable[[], OncePerStep] | None:
    """For a recomputed stage that updates buffers or calls modules with forward hooks: a
    maker of the :class:`~lightning_remat.graph.effects.OncePerStep` of one call, which keeps
    the updates and the hooks to the forward (docs/design.md section 5); else None."""
    called = [m for name in program.called_modules for m in owner.get_submodule(name).modules()]
    hooked = [m for m in called if m._forward_hooks]
    if not program.written_state and not hooked:
        return None
    written = program.written_state
    return lambda: OncePerStep(lambda: [_resolve_attr(owner, name) for name in written], lambda: hooked)


def _resolve_attr(owner: nn.Module, qualified: str) -> Any:
    return functools.reduce(getattr, qualified.split("."), owner)


_OUTSIDE_COMPILE: list[Callable[[RematModule, tuple, dict], Any]] = []


def _outside_compile() -> Callable[[RematModule, tuple, dict], Any]:
    """:func:`_forward_outside_compile` marked for Dynamo to run as it is (a graph break);
    made on first use, under ``torch.compile``, so that importing this package does not
    import Dynamo."""
    if not _OUTSIDE_COMPILE:
        import torch._dynamo

        _OUTSIDE_COMPILE.append(torch._dynamo.disable(_forward_outside_compile))
    return _OUTSIDE_COMPILE[0]


def _forward_outside_compile(module: RematModule, args: tuple, kwargs: dict) -> Any:
    if not module._remat_said_eager:
        object.__setattr__(module, "_remat_said_eager", True)
        warn_caller(
            "lightning_remat: torch.compile of a planned module runs its planned forward "
            "eagerly (Dynamo cannot trace the stage programs' selective checkpointing): the plan "
            "and its memory budget hold, the forward is not compiled (docs/limitations.md)")
    return module._forward(*args, **kwargs)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _has_fsdp_units(module: nn.Module) -> bool:
    """Whether ``module`` holds a unit of torch FSDP (none without a process group)."""
    types = fsdp_unit_types()
    return bool(types) and any(isinstance(m, types) for m in module.modules())


def _signature_for(root: nn.Module | None, gm: fx.GraphModule, placeholders: list[tuple[str, str]]) -> inspect.Signature:
    """The signature callers use: the original forward's when it lines up with the traced
    placeholders (fx renames specialised arguments, e.g. ``flag`` -> ``flag_1``, and makes
    keyword-only ones positional), else the traced one."""
    traced = inspect.signature(gm.forward)
    if root is None or root is gm:
        return traced
    try:
        original = inspect.signature(root.forward)
    except (TypeError, ValueError):
        return traced
    kinds = {p.kind for p in original.parameters.values()}
    if (len(original.parameters) == len(placeholders)
            and inspect.Parameter.VAR_POSITIONAL not in kinds
            and inspect.Parameter.VAR_KEYWORD not in kinds):
        return original
    return traced


def build_variant(
    gm: fx.GraphModule, plan: Plan, owner: RematModule, root: nn.Module | None = None,
    charge: dict[str, str] | None = None, graph: Graph | None = None,
    output_spec: pytree.TreeSpec | None = None,
) -> Variant:
    """``plan`` compiled for ``owner`` to run the forward ``gm`` traces (``root``: the module
    ``gm`` was traced from; ``charge``: fx node name -> vertex id where they differ;
    ``graph``: the vertex graph the plan was made on, whose schedule the stages follow, by
    default the one ``gm``'s structure gives, :func:`~lightning_remat.graph.trace.fx_vertex_graph`;
    ``output_spec``: the pytree structure of ``root``'s own output, whose container types
    the stages' output takes, :attr:`~lightning_remat.graph.trace.Traced.output_spec`)."""
    owner.adopt_targets(gm.graph, [s for s in (root, gm) if s is not None])
    if graph is None:
        graph = fx_vertex_graph(gm, plan, charge)
    note = order_note(graph, plan)
    if note and note not in plan.notes:
        plan.notes.append(note)
    schedule = make_schedule(graph, plan)
    stages = compile_stages(gm.graph, plan, owner, schedule, charge)
    stages.output = with_output_containers(stages.output, output_spec)
    return Variant(plan=plan, stages=stages, signature=_signature_for(root, gm, stages.placeholders),
                   schedule=schedule)


def build_traced_variant(traced: Traced, plan: Plan, owner: RematModule, root: nn.Module,
                         graph: Graph | None = None) -> Variant:
    """``plan`` compiled for ``owner`` to run ``root`` as :func:`trace_module` traced it: the
    fx graph stage by stage, or for the fallback ``root``'s own forward with its submodules
    checkpointed in place. ``graph``: the profiled graph the plan was made on (default: the
    trace's), whose schedule the stages follow."""
    if traced.kind == CHILDREN:
        try:
            signature = inspect.signature(root.forward)
        except (TypeError, ValueError):
            signature = inspect.Signature()
        return Variant(plan=plan, stages=None, signature=signature, graph=graph,
                       hooked=SubmoduleCheckpointing(root, plan))
    variant = build_variant(traced.runner, plan, owner, root, traced.charge,
                            graph if graph is not None else traced.graph,
                            traced.output_spec if traced.kind != EXPORT else None)
    variant.graph = graph
    if traced.kind == EXPORT:
        variant.output_spec, variant.eager = traced.output_spec, root
    return variant


def apply_plan(
    gm: fx.GraphModule,
    plan: Plan,
    *,
    offload_hooks_factory: OffloadHooksFactory | None = None,
    root: nn.Module | None = None,
    charge: dict[str, str] | None = None,
    graph: Graph | None = None,
) -> RematModule:
    """The module ``gm`` traces, run under ``plan``.

    ``plan``'s vertex ids are ``gm``'s node names. ``root`` is the module ``gm`` was traced
    from: the result then adopts ``root``'s members (exactly its state_dict keys and
    Parameter objects, unused ones included) and takes its forward signature; without it,
    ``gm``'s members. ``offload_hooks_factory(stage_index, stage)`` gives the saved-tensor
    hooks of offloaded stages (default: one shared
    :class:`~lightning_remat.runtime.offload.OffloadHooks`). ``charge`` maps fx node names to
    the vertex ids they belong to when those differ
    (:attr:`lightning_remat.graph.trace.Traced.charge`). ``graph``: the vertex graph the plan
    was made on (:attr:`~lightning_remat.graph.trace.Traced.graph` or its profile), whose
    schedule the stages follow; by default the one ``gm``'s structure gives."""
    owner = RematModule(root if root is not None else gm)
    if offload_hooks_factory is not None:
        owner._remat_offload_factory = offload_hooks_factory
    variant = build_variant(gm, plan, owner, root, charge, graph)
    owner.variants[None] = variant
    owner._remat_current = variant
    return owner
