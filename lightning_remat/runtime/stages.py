"""The fx graph of a forward cut into one generated program per plan stage.

``compile_stages`` is a pure function of the traced graph, the plan and the module whose
submodules the stages call: it assigns every fx node to a stage, rewrites the in-place ops
that would break under the plan, and generates each stage's code with ``self`` bound to the
module that runs it (:class:`~lightning_remat.runtime.module.RematModule`), so the stages
reach the very same submodules (no copies, nothing registered twice).

Placement: a vertex runs in its plan stage; a node the trace charges to a vertex (a tuple
producer such as ``chunk``) runs with that vertex; every other node (``size()``, asserts)
runs as early as its inputs allow, so what crosses a boundary is a small value rather than
the tensor it was read from; ``get_attr`` nodes are repeated in each stage that reads them.

In-place ops at stage boundaries: an in-place op whose operand comes from another stage (or
is read by another stage, or is the input of a recomputed stage) is rewritten to act on a
clone, and the later readers of the operand read the op's result instead (functionalisation
of that one op). Recomputation then starts from the unmodified stage input;
``checkpoint_sequential`` recomputes from the modified one or trips the version counter.

BatchNorm running statistics: :class:`RestoreNormStatistics` snapshots and restores the
running statistics of a stage's norm layers around its recomputation, so they are updated
exactly once per step, as in the plain run (docs/design.md section 5).

Kept boundary values: a recomputed stage's boundary nodes run between markers that
:func:`boundary_policy`, the stage's selective-checkpoint policy, reads, so their outputs
are kept from the forward and only the rest of the stage runs again.

Length: placement, the in-place rewrites, code generation and the kept-boundary policy all
decide together what one stage program does under a plan; split, each would need the
others' rules.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import CheckpointPolicy

from lightning_remat.solvers.plan import Plan
from lightning_remat.solvers.simulate import RANDOM_OPS

__all__ = ["CompiledStages", "KeptRegion", "Ref", "RestoreNormStatistics", "StageProgram", "boundary_policy",
           "call_out_of_place", "compile_stages", "keep_boundary_begin", "keep_boundary_end",
           "rebuild_output"]

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
    to leave their operand unchanged: the out-of-place form of the op where there is one
    (``ReLU(inplace=True)`` run with ``inplace=False``, ``relu_`` -> ``relu``, ``+=`` -> ``+``),
    else the op on a clone. Return the names of the rewritten ops.

    An op is rewritten when its operand comes from another stage and either stage is
    recomputed (recomputation must start from, and a kept boundary value must stay, the
    unmodified tensor), when another stage reads the operand and is recomputed or runs on
    the other side of the op, or when the op is in a recomputed stage and its result or its
    operand crosses the stage boundary: a boundary value is kept from the forward
    (docs/design.md section 5), and an in-place op cannot hand back a kept tensor in the
    recomputation. ``lightning_remat.solvers.simulate.rewritten_inplace`` states the same
    rule on the vertex graph."""
    position = {node: k for k, node in enumerate(graph.nodes)}
    rewritten: list[str] = []

    def crosses(node: fx.Node) -> bool:
        return any(u.op == "output" or (u.name in stage and stage[u.name] != stage[node.name])
                   for u in node.users)

    for op_node in list(graph.nodes):
        if op_node.op not in ("call_module", "call_function", "call_method"):
            continue
        operand = _mutated_operand(op_node, owner)
        if operand is None or operand.op == "get_attr":
            continue  # in-place updates of parameters/buffers are state, not values
        op_stage = stage[op_node.name]
        recomputed = actions[op_stage] == "recompute"
        other_users = [u for u in operand.users if u is not op_node and u.op != "output"]
        from_outside = operand.op == "placeholder" or stage[operand.name] != op_stage
        operand_recomputed = operand.op != "placeholder" and actions[stage[operand.name]] == "recompute"
        needs = (
            (from_outside and (recomputed or operand_recomputed))
            or any(
                stage[u.name] != op_stage
                and (actions[stage[u.name]] == "recompute"
                     or (position[u] < position[op_node]) != (stage[u.name] < op_stage))
                for u in other_users
            )
            or (recomputed and (crosses(op_node) or (not from_outside and crosses(operand))))
        )
        if not needs:
            continue
        if _make_out_of_place(graph, op_node, owner):
            result = op_node
        else:
            with graph.inserting_before(op_node):
                clone = graph.call_method("clone", (operand,))
            stage[clone.name] = op_stage
            op_node.update_arg(0, clone)
            position[clone] = position[op_node]
            # setitem returns None, so its readers read the modified clone.
            result = clone if op_node.target is operator.setitem else op_node
        # Readers after the op saw the modified tensor: they now read the op's result.
        for user in list(operand.users):
            if user is result or user is op_node or user not in position or position[user] <= position[op_node]:
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


_OUT_OF_PLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod, operator.ipow: operator.pow, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor, operator.ilshift: operator.lshift,
    operator.irshift: operator.rshift, operator.imatmul: operator.matmul,
}


def call_out_of_place(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call a module that has an ``inplace`` flag (``nn.ReLU(inplace=True)``) with the flag
    off for this call only."""
    module.inplace = False
    try:
        return module(*args, **kwargs)
    finally:
        module.inplace = True


def _make_out_of_place(graph: fx.Graph, node: fx.Node, owner: nn.Module) -> bool:
    """Turn the in-place op ``node`` into its out-of-place form, if it has one."""
    if node.op == "call_module":
        with graph.inserting_before(node):
            module_ref = graph.get_attr(str(node.target))
        node.op, node.target = "call_function", call_out_of_place
        node.args = (module_ref, *node.args)
        return True
    if node.kwargs.get("inplace") is True:
        node.kwargs = {**node.kwargs, "inplace": False}
        return True
    if node.op == "call_function":
        if node.target in _OUT_OF_PLACE_OPERATORS:
            node.target = _OUT_OF_PLACE_OPERATORS[node.target]
            return True
        name = getattr(node.target, "__name__", "")
        plain = getattr(torch, name[:-1], None) if name.endswith("_") else None
        if plain is not None and getattr(torch, name, None) is node.target:
            node.target = plain
            return True
        return False
    if node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and hasattr(torch.Tensor, name[:-1]):
            node.target = name[:-1]
            return True
    return False


# ---------------------------------------------------------------------------------------
# stage programs
# ---------------------------------------------------------------------------------------
@dataclass
class Ref:
    """A value of the forward's environment, by node name (in the output structure)."""

    name: str


@dataclass
class StageProgram:
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
    kept_boundary: list[str] = field(default_factory=list)
    """For a recomputed stage: the nodes whose aten ops' outputs are kept from the forward
    and not run again (the stage's boundary values, docs/design.md section 5); their code
    runs between :func:`keep_boundary_begin` and :func:`keep_boundary_end`."""
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


_FUNCTIONAL_NORMS = (torch.nn.functional.batch_norm, torch.nn.functional.instance_norm)


def _compile_stage(stage_graph: fx.Graph, index: int) -> tuple[str, Callable[..., tuple]]:
    code = stage_graph.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(compile(code.src, f"<lightning_remat stage {index}>", "exec"), namespace)  # noqa: S102
    return code.src, namespace["forward"]


def _build_programs(
    graph: fx.Graph, stage: dict[str, int], plan: Plan, owner: nn.Module
) -> tuple[list[StageProgram], Any]:
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

    programs: list[StageProgram] = []
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
        outputs = [
            n.name for n in stage_nodes
            if n.name in output_values or last_reader.get(n.name, -1) > k
        ]
        kept = _kept_boundary(stage_nodes, outputs, owner) if plan.stages[k].action == "recompute" else []
        for node in stage_nodes:
            if node.name in kept:
                stage_graph.call_function(keep_boundary_begin, ())
            env[node.name] = stage_graph.node_copy(node, lookup)
            if node.name in kept:
                stage_graph.call_function(keep_boundary_end, ())
            if node.op == "call_module":
                module = owner.get_submodule(str(node.target))
                for sub_name, sub in module.named_modules(prefix=str(node.target)):
                    if isinstance(sub, _NormBase) and sub.track_running_stats:
                        norm_modules.append(sub_name)
            elif node.op == "call_function" and node.target in _FUNCTIONAL_NORMS:
                for arg in list(node.args[1:3]) + [node.kwargs.get("running_mean"), node.kwargs.get("running_var")]:
                    if isinstance(arg, fx.Node) and arg.op == "get_attr":
                        state_buffers.append(str(arg.target))
        stage_graph.output(tuple(env[name] for name in outputs))
        source, fn = _compile_stage(stage_graph, k)
        drop = sorted(
            name for name, last in last_reader.items()
            if last == k and name not in output_values
        )
        programs.append(StageProgram(
            index=k, action=plan.stages[k].action, input_names=inputs, output_names=outputs,
            source=source, fn=fn, norm_modules=sorted(set(norm_modules)),
            state_buffers=sorted(set(state_buffers)), drop_after=drop,
            kept_boundary=[n.name for n in stage_nodes if n.name in kept], stage_graph=stage_graph,
        ))
    output_structure = fx.node.map_arg(output_node.args[0], lambda n: Ref(n.name))
    return programs, output_structure


def _kept_boundary(stage_nodes: list[fx.Node], outputs: list[str], owner: nn.Module) -> set[str]:
    """The nodes of a recomputed stage whose results are kept from the forward: those whose
    value a later stage or the forward's output reads (for a ``getitem`` of a tuple producer
    such as ``chunk``, the producer), except in-place ops (an in-place op cannot hand back
    a kept tensor in the recomputation; :func:`_functionalize_crossing_inplace` has made
    the crossing ones out-of-place) and random ops (``RANDOM_OPS``: a random op writes its
    draws into a tensor it made, which a kept tensor must not see, and a skipped draw would
    shift the stage's later ones)."""
    members = {n.name for n in stage_nodes}
    by_name = {n.name: n for n in stage_nodes}
    kept: set[str] = set()
    for name in outputs:
        node = by_name[name]
        if (node.op == "call_function" and node.target is operator.getitem
                and isinstance(node.args[0], fx.Node) and node.args[0].name in members):
            node = node.args[0]
        if (node.op in ("call_module", "call_function", "call_method")
                and _mutated_operand(node, owner) is None and _op_name(node, owner) not in RANDOM_OPS):
            kept.add(node.name)
    return kept


def _op_name(node: fx.Node, owner: nn.Module) -> str:
    """The op name the trace gives a vertex (``graph.trace``): a module's class name, a
    method's name, a function's name."""
    if node.op == "call_module":
        return type(owner.get_submodule(str(node.target))).__name__
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


class KeptRegion:
    """Whether the running code is inside a kept boundary node (see
    :func:`boundary_policy`). Entered around a recomputed stage's forward and its
    recomputation, it starts and ends outside: checkpoint stops a recomputation early by
    raising, which can leave a node's end marker unrun."""

    inside = False

    def __enter__(self) -> None:
        KeptRegion.inside = False

    def __exit__(self, *exc: object) -> None:
        KeptRegion.inside = False


def keep_boundary_begin() -> None:
    """Marks the start of a kept boundary node in generated stage code."""
    KeptRegion.inside = True


def keep_boundary_end() -> None:
    """Marks the end of a kept boundary node in generated stage code."""
    KeptRegion.inside = False


_KEEPABLE: dict[Any, bool] = {}


def _keepable(op: Any) -> bool:
    """Whether an aten op's outputs can be kept from the forward: not an in-place op (its
    result must be the tensor it modified in the recomputation too), not a random op (a
    kept random op draws nothing in the recomputation, which would shift the numbers every
    later random op of the stage draws) and not a view (a kept view holds its base's whole
    storage, which may be a value the plan recomputes, such as the input a ``Linear``
    reshapes; a view costs nothing to make again from its recomputed or kept base). Only
    ops that return tensors: a profiler range that FSDP's hooks open inside a boundary
    node has nothing to keep, and its calls need not repeat in the recomputation."""
    known = _KEEPABLE.get(op)
    if known is None:
        aliases = any(r.alias_info is not None for r in op._schema.returns)
        random = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
        known = _KEEPABLE[op] = _returns_tensors(op._schema) and not (aliases or random)
    return known


def _returns_tensors(schema: Any) -> bool:
    """Whether every return of an op schema is a tensor (or an optional or a list of them)."""
    for value in schema.returns:
        kind = value.type
        if isinstance(kind, torch._C.OptionalType):
            kind = kind.getElementType()
        if isinstance(kind, torch._C.ListType):
            kind = kind.getElementType()
        if not isinstance(kind, torch._C.TensorType):
            return False
    return bool(schema.returns)


def boundary_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective-checkpoint policy of a recomputed stage (``torch.utils.checkpoint``'s
    ``create_selective_checkpoint_contexts``): the aten ops of its kept boundary nodes are
    saved, every other op runs again in the backward. Torch calls it for each op of the
    forward and replays its choices in the recomputation by the op's position."""
    if KeptRegion.inside and _keepable(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# ---------------------------------------------------------------------------------------
# recomputation context: norm statistics updated once
# ---------------------------------------------------------------------------------------
def _resolve(owner: nn.Module, qualified: str) -> Any:
    value: Any = owner
    for part in qualified.split("."):
        value = getattr(value, part)
    return value


class RestoreNormStatistics:
    """Entered around a recomputation: restores the norm layers' running statistics and
    ``num_batches_tracked`` to what they were when recomputation began, so a recomputed
    forward does not update them a second time (torch's checkpoint has no such option)."""

    def __init__(self, owner: nn.Module, program: StageProgram) -> None:
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



def rebuild_output(structure: Any, env: dict[str, Any]) -> Any:
    """The forward's output from its traced structure: plain dicts and lists (fx stores
    them as immutable_dict/immutable_list), tuples and named tuples as they were."""
    if isinstance(structure, Ref):
        return env[structure.name]
    if isinstance(structure, tuple):
        items = [rebuild_output(v, env) for v in structure]
        return type(structure)(*items) if hasattr(structure, "_fields") else tuple(items)
    if isinstance(structure, list):
        return [rebuild_output(v, env) for v in structure]
    if isinstance(structure, dict):
        return {k: rebuild_output(v, env) for k, v in structure.items()}
    if isinstance(structure, slice):
        return slice(rebuild_output(structure.start, env), rebuild_output(structure.stop, env),
                     rebuild_output(structure.step, env))
    return structure



@dataclass
class CompiledStages:
    """Everything a module needs to run one traced form of a forward under a plan."""

    programs: list[StageProgram]
    output: Any
    """The forward's output structure with :class:`Ref` leaves (see :func:`rebuild_output`)."""
    placeholders: list[tuple[str, str]]
    """(node name, placeholder target) in the order of the traced signature."""
    inplace_rewritten: list[str]
    """In-place ops rewritten to act on a clone."""


def compile_stages(
    graph: fx.Graph, plan: Plan, owner: nn.Module, charge: dict[str, str] | None = None
) -> CompiledStages:
    """The stage programs of ``graph`` (a traced forward; ``plan``'s vertex ids are its node
    names, or ``charge`` maps node names to vertex ids) run by ``owner``. ``graph`` itself is
    not changed."""
    if not plan.stages:
        raise ValueError("the plan has no stages")
    stage = _assign_stages(graph, plan, charge)
    graph = _copy_graph(graph)
    actions = [s.action for s in plan.stages]
    rewritten: list[str] = []
    if len(plan.stages) > 1:
        rewritten = _functionalize_crossing_inplace(graph, stage, actions, owner)
    programs, output = _build_programs(graph, stage, plan, owner)
    placeholders = [(n.name, str(n.target)) for n in graph.nodes if n.op == "placeholder"]
    return CompiledStages(programs, output, placeholders, rewritten)
