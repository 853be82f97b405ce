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

from lightning_remat.solvers.plan import Plan

__all__ = ["CompiledStages", "Ref", "RestoreNormStatistics", "StageProgram", "compile_stages",
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
        programs.append(StageProgram(
            index=k, action=plan.stages[k].action, input_names=inputs, output_names=outputs,
            source=source, fn=fn, norm_modules=sorted(set(norm_modules)),
            state_buffers=sorted(set(state_buffers)), drop_after=drop, stage_graph=stage_graph,
        ))
    output_structure = fx.node.map_arg(output_node.args[0], lambda n: Ref(n.name))
    return programs, output_structure


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
