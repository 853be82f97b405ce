"""Apply a Plan to a module: one generated function per stage, recomputed stages under
non-reentrant checkpoint, offloaded stages under saved-tensor hooks (DESIGN.md section 5).

The rewritten module (:class:`RematModule`) adopts the original module's top-level children,
parameters and buffers under their own names, so its ``state_dict`` keys and its Parameter
objects are the original's: a checkpoint saved from either form loads into the other. Stage
code is generated from the fx graph with ``self`` bound to the RematModule, so it reaches
the very same submodules (no copies, nothing registered twice).

Placement: a vertex runs in its plan stage; a node the trace charges to a vertex (a tuple
producer such as ``chunk``) runs with that vertex; every other node (``size()``, asserts)
runs as early as its inputs allow, so what crosses a boundary is a small value rather than
the tensor it was read from; ``get_attr`` nodes are repeated in each stage that reads them.

The traps of section 5 and how each is handled here:

- in-place ops at stage boundaries: an in-place op whose operand comes from another stage
  (or is read by another stage, or is the input of a recomputed stage) is rewritten to act
  on a clone, and the later readers of the operand read the op's result instead
  (functionalisation of that one op). Recomputation then starts from the unmodified stage
  input; ``checkpoint_sequential`` recomputes from the modified one or trips the version
  counter.
- BatchNorm running statistics: during recomputation the running statistics (and
  ``num_batches_tracked``) of the stage's norm layers are snapshotted and restored, so they
  are updated exactly once per step, as in the plain run.
- dropout and other RNG: ``checkpoint(preserve_rng_state=True)`` replays the RNG state.
- autocast: non-reentrant checkpoint records the autocast state and replays it.
- ``eval()`` or ``torch.no_grad()``: stages run directly, no checkpoint, no hooks.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from lightning_remat.solvers.plan import Plan, Stage

__all__ = ["RematModule", "apply_plan", "remat"]

OffloadHooksFactory = Callable[[int, Stage], contextlib.AbstractContextManager]
"""Called as ``factory(stage_index, stage)``; returns the context (saved-tensor hooks)
an offloaded stage's forward runs under."""

_RESERVED = ("plan", "graph", "variants")

# ---------------------------------------------------------------------------------------
# in-place detection
# ---------------------------------------------------------------------------------------
_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
}


def _mutated_operand(node: fx.Node, owner: nn.Module) -> fx.Node | None:
    """The node whose tensor ``node`` modifies in place, or None."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    first = node.args[0]
    if node.op == "call_module":
        try:
            module = owner.get_submodule(str(node.target))
        except AttributeError:
            return None
        return first if getattr(module, "inplace", False) is True else None
    if node.op == "call_function":
        if node.kwargs.get("inplace") is True or node.target in _INPLACE_OPERATORS:
            return first
        name = getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.startswith("_"):
            return first
        return None
    if node.op == "call_method":
        name = str(node.target)
        if (name.endswith("_") and not name.endswith("__")) or node.kwargs.get("inplace") is True:
            return first
    return None


# ---------------------------------------------------------------------------------------
# stage assignment
# ---------------------------------------------------------------------------------------
def _assign_stages(graph: fx.Graph, plan: Plan, charge: dict[str, str] | None = None) -> dict[str, int]:
    """Stage index of every compute node. A vertex takes its plan stage, and so does a node
    ``charge`` maps to a vertex (trace_module charges a tuple producer such as ``chunk`` to
    its first ``getitem``; the chain fallback names nodes after children). Every other node
    (sizes, asserts: no tensor of its own) runs as early as its inputs allow, so what
    crosses a stage boundary is a small value, not the tensor it was read from. get_attr
    nodes are not assigned: each stage reads them itself."""
    plan_stage = plan.stage_of()
    charge = dict(charge or {})
    names = {n.name for n in graph.nodes}
    known = names | set(charge.values())
    unknown = [v for v in plan_stage if v not in known]
    if unknown:
        raise ValueError(
            f"the plan names vertices the traced graph does not have: {unknown[:8]}; "
            "plan and module must come from the same trace"
        )
    stage: dict[str, int] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        input_stages = [stage[a.name] for a in node.all_input_nodes if a.name in stage]
        earliest = max(input_stages, default=0)
        vertex = charge.get(node.name, node.name)
        if vertex in plan_stage:
            stage[node.name] = plan_stage[vertex]
            if stage[node.name] < earliest:
                late = next(a.name for a in node.all_input_nodes if stage.get(a.name, -1) == earliest)
                raise ValueError(
                    f"the plan puts {vertex!r} in stage {stage[node.name]} but its input "
                    f"{late!r} is computed in stage {earliest}; the plan does not fit this graph"
                )
        else:
            stage[node.name] = earliest
    return stage


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    copied = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        env[node] = copied.node_copy(node, lambda a: env[a])
    return copied


def _functionalize_crossing_inplace(
    graph: fx.Graph, stage: dict[str, int], actions: list[str], owner: nn.Module
) -> list[str]:
    """Rewrite the in-place ops that would break under the plan (see the module docstring)
    to act on a clone; return the names of the rewritten ops."""
    position = {node: k for k, node in enumerate(graph.nodes)}
    rewritten: list[str] = []
    for op_node in list(graph.nodes):
        if op_node.op not in ("call_module", "call_function", "call_method"):
            continue
        operand = _mutated_operand(op_node, owner)
        if operand is None or operand.op == "get_attr":
            continue  # in-place updates of parameters/buffers are state, not values
        op_stage = stage[op_node.name]
        other_users = [u for u in operand.users if u is not op_node and u.op != "output"]
        from_outside = operand.op == "placeholder" or stage[operand.name] != op_stage
        needs = (from_outside and actions[op_stage] == "recompute") or any(
            stage[u.name] != op_stage
            and (actions[stage[u.name]] == "recompute"
                 or (position[u] < position[op_node]) != (stage[u.name] < op_stage))
            for u in other_users
        )
        if not needs:
            continue
        with graph.inserting_before(op_node):
            clone = graph.call_method("clone", (operand,))
        stage[clone.name] = op_stage
        op_node.update_arg(0, clone)
        # Readers after the op saw the modified tensor: they now read the op's result
        # (setitem returns None, so its readers read the modified clone).
        result = clone if op_node.target is operator.setitem else op_node
        for user in list(operand.users):
            if user is clone or user not in position or position[user] <= position[op_node]:
                continue
            if user.op != "output" and stage[user.name] < op_stage:
                raise ValueError(
                    f"{user.name!r} (stage {stage[user.name]}) reads {operand.name!r} after the "
                    f"in-place op {op_node.name!r} (stage {op_stage}) changed it; put them in "
                    "the same stage or keep the reader after the op"
                )
            user.replace_input_with(operand, result)
        rewritten.append(op_node.name)
    return rewritten


# ---------------------------------------------------------------------------------------
# stage programs
# ---------------------------------------------------------------------------------------
@dataclass
class _Ref:
    """A value of the forward's environment, by node name (in the output structure)."""

    name: str


@dataclass
class _StageProgram:
    index: int
    action: str
    input_names: list[str]
    output_names: list[str]
    source: str
    fn: Callable[..., tuple]
    norm_modules: list[str] = field(default_factory=list)
    """Qualified names of norm layers whose running statistics recomputation must not
    update a second time."""
    state_buffers: list[str] = field(default_factory=list)
    """Qualified names of buffers functional norms in the stage update."""
    drop_after: list[str] = field(default_factory=list)
    """Environment values no later stage reads: released after this stage."""
    stage_graph: fx.Graph | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Generated functions do not pickle; the stage's fx graph does, and recompiles.
        state = dict(self.__dict__)
        state["fn"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.fn is None and self.stage_graph is not None:
            self.source, self.fn = _compile_stage(self.stage_graph, self.index)


@dataclass
class _Variant:
    """Everything forward needs for one traced form of the module."""

    plan: Plan
    programs: list[_StageProgram]
    placeholders: list[tuple[str, str]]
    """(node name, placeholder target) in the order of the traced signature."""
    signature: inspect.Signature
    output: Any
    inplace_rewritten: list[str]
    graph: Any = None


_FUNCTIONAL_NORMS = (torch.nn.functional.batch_norm, torch.nn.functional.instance_norm)


def _compile_stage(stage_graph: fx.Graph, index: int) -> tuple[str, Callable[..., tuple]]:
    code = stage_graph.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(compile(code.src, f"<lightning_remat stage {index}>", "exec"), namespace)  # noqa: S102
    return code.src, namespace["forward"]


def _build_programs(
    graph: fx.Graph, stage: dict[str, int], plan: Plan, owner: nn.Module
) -> tuple[list[_StageProgram], Any]:
    n_stages = len(plan.stages)
    nodes = list(graph.nodes)
    output_node = next(n for n in nodes if n.op == "output")
    members: list[list[fx.Node]] = [[] for _ in range(n_stages)]
    for node in nodes:
        if node.name in stage:
            members[stage[node.name]].append(node)

    def value_stage(node: fx.Node) -> int:
        return -1 if node.op == "placeholder" else stage[node.name]

    # Which stage reads each environment value last (output: after every stage).
    last_reader: dict[str, int] = {}
    for k, stage_nodes in enumerate(members):
        for node in stage_nodes:
            for arg in node.all_input_nodes:
                if arg.op != "get_attr" and value_stage(arg) != k:
                    last_reader[arg.name] = max(last_reader.get(arg.name, -1), k)
    output_values = {a.name for a in output_node.all_input_nodes if a.op != "get_attr"}

    programs: list[_StageProgram] = []
    for k, stage_nodes in enumerate(members):
        stage_graph = fx.Graph()
        env: dict[str, fx.Node] = {}
        inputs: list[str] = []
        norm_modules: list[str] = []
        state_buffers: list[str] = []

        def lookup(arg: fx.Node, stage_graph: fx.Graph = stage_graph, env: dict = env,
                   inputs: list = inputs) -> fx.Node:
            if arg.name in env:
                return env[arg.name]
            if arg.op == "get_attr":
                env[arg.name] = stage_graph.get_attr(str(arg.target))
            else:  # produced by an earlier stage or a forward input
                env[arg.name] = stage_graph.placeholder(arg.name)
                inputs.append(arg.name)
            return env[arg.name]

        # Placeholders first: fx wants them at the top of the graph.
        for node in stage_nodes:
            for arg in node.all_input_nodes:
                if arg.op != "get_attr" and value_stage(arg) != k:
                    lookup(arg)
        for node in stage_nodes:
            env[node.name] = stage_graph.node_copy(node, lookup)
            if node.op == "call_module":
                module = owner.get_submodule(str(node.target))
                for sub_name, sub in module.named_modules(prefix=str(node.target)):
                    if isinstance(sub, _NormBase) and sub.track_running_stats:
                        norm_modules.append(sub_name)
            elif node.op == "call_function" and node.target in _FUNCTIONAL_NORMS:
                for arg in list(node.args[1:3]) + [node.kwargs.get("running_mean"), node.kwargs.get("running_var")]:
                    if isinstance(arg, fx.Node) and arg.op == "get_attr":
                        state_buffers.append(str(arg.target))
        outputs = [
            n.name for n in stage_nodes
            if n.name in output_values or last_reader.get(n.name, -1) > k
        ]
        stage_graph.output(tuple(env[name] for name in outputs))
        source, fn = _compile_stage(stage_graph, k)
        drop = sorted(
            name for name, last in last_reader.items()
            if last == k and name not in output_values
        )
        programs.append(_StageProgram(
            index=k, action=plan.stages[k].action, input_names=inputs, output_names=outputs,
            source=source, fn=fn, norm_modules=sorted(set(norm_modules)),
            state_buffers=sorted(set(state_buffers)), drop_after=drop, stage_graph=stage_graph,
        ))
    output_structure = fx.node.map_arg(output_node.args[0], lambda n: _Ref(n.name))
    return programs, output_structure


# ---------------------------------------------------------------------------------------
# recomputation context: norm statistics updated once
# ---------------------------------------------------------------------------------------
def _resolve(owner: nn.Module, qualified: str) -> Any:
    value: Any = owner
    for part in qualified.split("."):
        value = getattr(value, part)
    return value


class _RestoreNormStatistics:
    """Entered around a recomputation: restores the norm layers' running statistics and
    ``num_batches_tracked`` to what they were when recomputation began, so a recomputed
    forward does not update them a second time (torch's checkpoint has no such option)."""

    def __init__(self, owner: nn.Module, program: _StageProgram) -> None:
        self.owner = owner
        self.program = program
        self.snapshot: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        tensors: list[torch.Tensor] = []
        for name in self.program.norm_modules:
            tensors.extend(b for b in _resolve(self.owner, name).buffers(recurse=False) if b is not None)
        tensors.extend(_resolve(self.owner, name) for name in self.program.state_buffers)
        self.snapshot = [(t, t.detach().clone()) for t in tensors if isinstance(t, torch.Tensor)]

    def __exit__(self, *exc: object) -> None:
        # Also runs when checkpoint stops recomputation early (it raises to stop).
        with torch.no_grad():
            for tensor, saved in self.snapshot:
                tensor.copy_(saved)
        self.snapshot = []


# ---------------------------------------------------------------------------------------
# the rewritten module
# ---------------------------------------------------------------------------------------
class _DefaultOffloadHooks:
    """The offload executor (runtime.offload.OffloadHooks: side-stream copies to pinned host
    memory, prefetch in the backward), one instance shared by the module's offloaded
    stages so its prefetch order spans them; ``torch.autograd.graph.save_on_cpu`` where
    that executor is not available."""

    def __init__(self) -> None:
        self.hooks: Any = None

    def __call__(self, stage_index: int, stage: Stage) -> contextlib.AbstractContextManager:
        if self.hooks is None:
            try:
                from lightning_remat.runtime.offload import OffloadHooks
            except ImportError:
                return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
            self.hooks = OffloadHooks()
        return self.hooks

    def __deepcopy__(self, memo: dict) -> _DefaultOffloadHooks:
        return _DefaultOffloadHooks()  # hooks hold streams and step state: start fresh


def _input_key(args: tuple, kwargs: dict) -> tuple:
    """What a plan depends on: every tensor's shape and dtype, every other value itself."""
    leaves: list[Any] = []

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

    visit(args)
    visit(kwargs)
    return tuple(leaves)


def _bound_key(variant: _Variant | None, args: tuple, kwargs: dict) -> tuple:
    """The input key with defaults filled in, so ``f(x)`` and ``f(x, flag=True)`` (the
    default) share a plan."""
    if variant is not None:
        try:
            bound = variant.signature.bind(*args, **kwargs)
        except TypeError:
            pass
        else:
            bound.apply_defaults()
            return _input_key(tuple(bound.arguments.values()), {})
    return _input_key(args, kwargs)


def _rebuild(structure: Any, env: dict[str, Any]) -> Any:
    """The forward's output from its traced structure: plain dicts and lists (fx stores
    them as immutable_dict/immutable_list), tuples and named tuples as they were."""
    if isinstance(structure, _Ref):
        return env[structure.name]
    if isinstance(structure, tuple):
        items = [_rebuild(v, env) for v in structure]
        return type(structure)(*items) if hasattr(structure, "_fields") else tuple(items)
    if isinstance(structure, list):
        return [_rebuild(v, env) for v in structure]
    if isinstance(structure, dict):
        return {k: _rebuild(v, env) for k, v in structure.items()}
    if isinstance(structure, slice):
        return slice(_rebuild(structure.start, env), _rebuild(structure.stop, env),
                     _rebuild(structure.step, env))
    return structure


def _same_values(key_a: tuple | None, key_b: tuple | None) -> bool:
    """Whether two input keys differ in tensor shapes only (same non-tensor values)."""
    if key_a is None or key_b is None or len(key_a) != len(key_b):
        return False
    return all(
        (isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == b[:1] == ("tensor",)
         and a[2:] == b[2:]) or a == b
        for a, b in zip(key_a, key_b)
    )


def _shapes(key: tuple | None) -> str:
    return ", ".join(
        "x".join(map(str, leaf[1])) or "scalar"
        for leaf in (key or ()) if isinstance(leaf, tuple) and leaf[:1] == ("tensor",)
    )


class RematModule(nn.Module):
    """A module run stage by stage under a Plan. Build it with :func:`apply_plan` or
    :func:`remat`. ``.plan`` is the plan for the input shapes last seen, ``.graph`` its
    profiled Graph (None when built from a hand-made plan)."""

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
        for name, param in root._parameters.items():
            self.register_parameter(name, param)
        for name, buf in root._buffers.items():
            self.register_buffer(name, buf, persistent=name not in root._non_persistent_buffers_set)
        self.training = root.training  # not .train(): children keep their own modes
        self._remat_variants: dict[tuple | None, _Variant] = {}
        self._remat_current: _Variant | None = None
        self._remat_planned_key: tuple | None = None
        self._remat_planner: Callable[..., _Variant] | None = None
        self._remat_warned = False
        self._remat_offload_factory: OffloadHooksFactory = _DefaultOffloadHooks()

    # ---- public views -------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        assert self._remat_current is not None
        return self._remat_current.plan

    @property
    def graph(self) -> Any:
        assert self._remat_current is not None
        return self._remat_current.graph

    @property
    def variants(self) -> dict[tuple | None, _Variant]:
        """Plans by input key (shapes, dtypes, non-tensor values)."""
        return self._remat_variants

    def stage_sources(self) -> list[str]:
        """The generated code of each stage (for inspection and debugging)."""
        assert self._remat_current is not None
        return [p.source for p in self._remat_current.programs]

    # ---- adoption of what the graph reads -----------------------------------------------
    def _adopt_targets(self, graph: fx.Graph, sources: list[nn.Module]) -> None:
        """Make every call_module/get_attr target resolvable from ``self``: top-level names
        the original did not register (plain tensor attributes, fx's constants) become
        plain attributes, never state_dict entries."""
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
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        variant = self._remat_current
        if self._remat_planner is not None:
            key = _bound_key(variant, args, kwargs)
            found = self._remat_variants.get(key)
            if found is None and not (self.training and torch.is_grad_enabled()) \
                    and variant is not None and _same_values(key, self._remat_planned_key):
                # Nothing is recomputed here, and the traced code is shape-generic: no plan
                # is needed for an evaluation batch of another size.
                found = variant
            if found is None:
                if not self._remat_warned:
                    warnings.warn(
                        "lightning_remat: the inputs differ from the ones the plan was made for "
                        f"(shapes {_shapes(self._remat_planned_key)} -> {_shapes(key)}, or "
                        "non-tensor arguments); re-planning for them (each new input shape is "
                        "planned once and cached)",
                        stacklevel=2,
                    )
                    self._remat_warned = True
                found = self._remat_planner(self, args, kwargs)
                self._remat_variants[key] = found
                self._remat_planned_key = key
            variant = found
            self._remat_current = variant
        assert variant is not None
        return self._run(variant, args, kwargs)

    def _run(self, variant: _Variant, args: tuple, kwargs: dict) -> Any:
        bound = variant.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = list(bound.arguments.values())
        env: dict[str, Any] = {}
        for (node_name, _), value in zip(variant.placeholders, values):
            env[node_name] = value
        grad_mode = torch.is_grad_enabled()
        recompute_now = self.training and grad_mode
        for program in variant.programs:
            inputs = [env[name] for name in program.input_names]
            if program.action == "recompute" and recompute_now:
                outputs = torch.utils.checkpoint.checkpoint(
                    program.fn, self, *inputs, use_reentrant=False, preserve_rng_state=True,
                    context_fn=self._context_fn(program),
                )
            elif program.action == "offload" and grad_mode:
                with self._remat_offload_factory(program.index, variant.plan.stages[program.index]):
                    outputs = program.fn(self, *inputs)
            else:
                outputs = program.fn(self, *inputs)
            del inputs
            for name in program.drop_after:
                env.pop(name, None)
            env.update(zip(program.output_names, outputs))
            del outputs
        return _rebuild(variant.output, env)

    def _context_fn(self, program: _StageProgram) -> Callable[[], tuple[Any, Any]]:
        if not program.norm_modules and not program.state_buffers:
            return torch.utils.checkpoint.noop_context_fn
        return lambda: (contextlib.nullcontext(), _RestoreNormStatistics(self, program))


def _signature_for(root: nn.Module | None, gm: fx.GraphModule, placeholders: list[fx.Node]) -> inspect.Signature:
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


def _build_variant(
    gm: fx.GraphModule, plan: Plan, owner: RematModule, root: nn.Module | None,
    charge: dict[str, str] | None = None,
) -> _Variant:
    if not plan.stages:
        raise ValueError("the plan has no stages")
    stage = _assign_stages(gm.graph, plan, charge)
    graph = _copy_graph(gm.graph)
    actions = [s.action for s in plan.stages]
    rewritten: list[str] = []
    if len(plan.stages) > 1:
        rewritten = _functionalize_crossing_inplace(graph, stage, actions, owner)
    programs, output = _build_programs(graph, stage, plan, owner)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return _Variant(
        plan=plan, programs=programs,
        placeholders=[(n.name, str(n.target)) for n in placeholders],
        signature=_signature_for(root, gm, placeholders), output=output,
        inplace_rewritten=rewritten,
    )


def apply_plan(
    gm: fx.GraphModule,
    plan: Plan,
    *,
    offload_hooks_factory: OffloadHooksFactory | None = None,
    root: nn.Module | None = None,
    charge: dict[str, str] | None = None,
) -> RematModule:
    """The module ``gm`` traces, run under ``plan``.

    ``plan``'s vertex ids are ``gm``'s node names. ``root`` is the module ``gm`` was traced
    from: the result then adopts ``root``'s members (exactly its state_dict keys and
    Parameter objects, unused ones included) and takes its forward signature; without it,
    ``gm``'s members. ``offload_hooks_factory(stage_index, stage)`` gives the saved-tensor
    hooks of offloaded stages (default: runtime.offload.OffloadHooks, or
    ``torch.autograd.graph.save_on_cpu`` without it). ``charge``
    maps fx node names to the vertex ids they belong to when those differ
    (:attr:`lightning_remat.graph.trace.Traced.charge`)."""
    owner = RematModule(root if root is not None else gm)
    owner._adopt_targets(gm.graph, [s for s in (root, gm) if s is not None])
    if offload_hooks_factory is not None:
        owner._remat_offload_factory = offload_hooks_factory
    variant = _build_variant(gm, plan, owner, root, charge)
    owner._remat_variants[None] = variant
    owner._remat_current = variant
    return owner


# ---------------------------------------------------------------------------------------
# remat(): trace, profile, solve, apply
# ---------------------------------------------------------------------------------------
def _estimated_costs(traced: Any, args: list[Any]) -> Any:
    """The traced graph with each vertex's output bytes filled in from one no-grad run (no
    times): what remat() plans with while graph.profile.profile_module is not available."""
    from lightning_remat.graph.ir import Graph, Node

    runner = traced.runner
    charge: dict[str, str] = dict(traced.charge)
    out_bytes: dict[str, int] = {}

    class _Sizes(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            vertex = charge.get(n.name, n.name)
            if vertex in traced.graph and n.op.startswith("call"):
                total = sum(
                    t.numel() * t.element_size()
                    for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)
                )
                out_bytes[vertex] = max(out_bytes.get(vertex, 0), total)
            return value

    with torch.no_grad():
        _Sizes(runner).run(*args)
    nodes = [
        Node(id=n.id, op=n.op, mem=out_bytes.get(n.id, 0), saved=out_bytes.get(n.id, 0))
        for n in traced.graph
    ]
    meta = traced.graph.meta.copy()
    meta.extra["costs"] = "estimated: output bytes only (no profiler available)"
    return Graph(nodes, list(traced.graph.edges), meta)


def _profiled_graph(module: nn.Module, traced: Any, inputs: tuple, kwargs: dict) -> Any:
    """The traced graph with measured costs (graph.profile.profile_module; a size-only
    estimate on a checkout that lacks it)."""
    try:
        from lightning_remat.graph.profile import profile_module
    except ImportError:
        return _estimated_costs(traced, traced.call_args(inputs, kwargs))
    return profile_module(module, inputs, traced=traced, example_kwargs=kwargs)


def _plain_peak(graph: Any) -> int:
    from lightning_remat.solvers.simulate import simulate

    peak = graph.meta.plain_peak_bytes
    return int(peak) if peak else int(simulate(graph).peak_bytes)


_BANDWIDTH_CACHE: dict[str, float] = {}


def measured_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-host copy (pinned host memory on CUDA; a host copy
    elsewhere, where the offload executor copies host to host), measured once per device:
    the offloading solvers' beta (Beaumont et al., section 3)."""
    try:
        from lightning_remat.runtime.offload import measure_bandwidth
    except ImportError:
        pass
    else:
        return float(measure_bandwidth(device))
    key = str(device)
    if key not in _BANDWIDTH_CACHE:
        import time

        nbytes = 32 * 2**20
        source = torch.empty(nbytes, dtype=torch.uint8, device=device)
        target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        best = float("inf")
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            target.copy_(source, non_blocking=device.type == "cuda")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        _BANDWIDTH_CACHE[key] = nbytes / max(best, 1e-9)
    return _BANDWIDTH_CACHE[key]


def auto_options(solver: str, device: torch.device, allow_offload: bool = True) -> dict[str, Any]:
    """Options for ``solver="auto"`` on a device: offloading only where there is a host
    memory apart from the device's (on the CPU, "offloaded" bytes stay in the same RAM)."""
    if solver != "auto":
        return {}
    return {"allow_offload": allow_offload and device.type == "cuda"}


def _device_budget(device: torch.device, margin: float = 0.1) -> int | None:
    """No budget given: the device's free memory less a safety margin (for the allocator's
    fragmentation and what other libraries take) on CUDA, no limit elsewhere."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * (1 - margin))
    return None


def _module_device(module: nn.Module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _move(value: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value
    )


_SCALARS = (bool, int, float, str, type(None))


def _trace(module: nn.Module, inputs: tuple, kwargs: dict) -> Any:
    """trace_module, except when the call gives non-tensor scalars (a flag, a mode string):
    those are specialised with concrete_args, like the arguments left at their defaults, so
    ``if flag:`` traces. A new value of such an argument is a new input key, so it is
    re-planned (and re-traced) rather than run through a graph traced for another value."""
    from lightning_remat.graph.trace import Traced, build_fx_graph, preserved_state, trace_module

    try:
        signature = inspect.signature(module.forward)
        bound = signature.bind(*inputs, **kwargs)
    except (TypeError, ValueError):
        return trace_module(module, inputs, kwargs)
    given_scalars = {n for n, v in bound.arguments.items() if isinstance(v, _SCALARS)}
    kinds_ok = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in signature.parameters.values())
    if not given_scalars or not kinds_ok:
        return trace_module(module, inputs, kwargs)
    bound.apply_defaults()
    concrete = {n: v for n, v in bound.arguments.items() if isinstance(v, _SCALARS)}
    try:
        gm = fx.symbolic_trace(module, concrete_args=concrete)
        kinds: dict[str, str] = {}

        class _Kinds(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                value = super().run_node(n)
                leaves = torch.utils._pytree.tree_leaves(value)
                kinds[n.name] = ("tensor" if isinstance(value, torch.Tensor) else "tensors"
                                 if any(isinstance(t, torch.Tensor) for t in leaves) else "other")
                return value

        with preserved_state(module, [_module_device(module)]), torch.no_grad():
            _Kinds(gm).run(*bound.arguments.values())
        graph, charge = build_fx_graph(gm, kinds)
    except Exception:  # noqa: BLE001 - trace_module explains the failure better
        return trace_module(module, inputs, kwargs)
    defaults = {n: p.default for n, p in signature.parameters.items() if p.default is not p.empty}
    return Traced(gm=gm, graph=graph, kind="fx", charge=charge,
                  _signature_names=list(signature.parameters), _defaults=defaults)


class _Planner:
    """Traces, profiles, solves and builds a variant for one set of inputs (remat() and the
    re-planning of a RematModule when the input shapes change)."""

    def __init__(self, module: nn.Module, memory_budget: Any, solver: str) -> None:
        self.module = module
        self.memory_budget = memory_budget
        self.solver = solver
        self.budget_bytes: int | None = None
        """The budget in bytes fixed at the first plan: a fraction means a fraction of the
        first profiled plain peak, and later shapes are held to the same bytes."""

    def __call__(self, owner: RematModule, inputs: tuple, kwargs: dict, first: bool = False) -> _Variant:
        from lightning_remat.budget import parse_budget
        from lightning_remat.graph.trace import preserved_state
        from lightning_remat.solvers import plain_plan, solve

        module = self.module
        device = _module_device(module)
        grads = [(p, p.grad) for p in module.parameters()]
        with preserved_state(module, [device]):
            for param in module.parameters():
                param.grad = None  # profiling's backward must not add into the user's grads
            try:
                traced = _trace(module, inputs, kwargs)
                graph = _profiled_graph(module, traced, inputs, kwargs)
            finally:
                for param, grad in grads:
                    param.grad = grad
        if first:
            if self.memory_budget is None:
                self.budget_bytes = _device_budget(device)
            else:
                self.budget_bytes = parse_budget(self.memory_budget, _plain_peak(graph))
        # The offloading solvers (and "auto", which ends with them) need beta.
        if graph.meta.bandwidth_bytes_per_s is None:
            graph.meta.bandwidth_bytes_per_s = measured_bandwidth(device)
        budget = self.budget_bytes
        if self.memory_budget is None and device.type == "cuda" and not first:
            budget = _device_budget(device)
        if budget is None:
            plan = plain_plan(graph)
        else:
            plan = solve(graph, budget, self.solver, **auto_options(self.solver, device))
        gm = traced.runner
        owner._adopt_targets(gm.graph, [module, gm])
        variant = _build_variant(gm, plan, owner, module, traced.charge)
        variant.graph = graph
        return variant


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
    plain step's profiled peak (``"60%"``, ``0.6``); None means the device's free memory on
    CUDA and no limit on CPU (the result then runs the plain plan, with its profile in
    ``.graph``). ``device``: where to profile and train (the module is moved there; default:
    where its parameters are).

    The result shares the module's Parameter objects and state_dict keys, has ``.plan`` and
    ``.graph``, and re-plans once per new input shape (with a one-time warning) so a changed
    shape never silently exceeds the budget. Raises ``ValueError`` for a malformed budget and
    :class:`~lightning_remat.errors.RematInfeasibleError` (with the smallest feasible
    budget) when no plan fits.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"remat() needs a torch.nn.Module, got {type(module).__name__}")
    if device is not None:
        module.to(torch.device(device))
    target = _module_device(module)
    if isinstance(example_input, dict):
        inputs, kwargs = (), dict(example_input)
    elif isinstance(example_input, (tuple, list)):
        inputs, kwargs = tuple(example_input), {}
    else:
        inputs, kwargs = (example_input,), {}
    inputs, kwargs = _move(inputs, target), _move(kwargs, target)
    if memory_budget is not None:
        from lightning_remat.budget import parse_budget

        parse_budget(memory_budget, 2**50)  # a malformed budget fails before any profiling
    planner = _Planner(module, memory_budget, solver)
    owner = RematModule(module)
    variant = planner(owner, inputs, kwargs, first=True)
    key = _bound_key(variant, inputs, kwargs)
    owner._remat_variants[key] = variant
    owner._remat_current = variant
    owner._remat_planned_key = key
    owner._remat_planner = planner
    return owner
