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

What a stage does is not decided here: ``schedule`` (``solvers.schedule``, the plan
compiled once on the vertex graph, which the simulator follows too) names the in-place ops
to rewrite and the values a recomputed stage keeps; this module turns that into code.

In-place ops the schedule rewrites run on their out-of-place form or on a clone, and the
later readers of the operand read the op's result instead (functionalisation of that one
op). Recomputation then starts from the unmodified stage input; ``checkpoint_sequential``
recomputes from the modified one or trips the version counter.

BatchNorm running statistics: :class:`RestoreNormStatistics` snapshots and restores the
running statistics of a stage's norm layers around its recomputation, so they are updated
exactly once per step, as in the plain run (docs/design.md section 5).

Kept values: a recomputed stage's kept nodes run between the ``begin`` and ``end`` of the
:class:`KeptRegion` its code takes as an argument, which :func:`boundary_policy`, the
stage's selective-checkpoint policy, reads, so their outputs are kept from the forward and
only the rest of the stage runs again.

The in-place ops the schedule rewrites are rewritten in :mod:`.inplace` before the stages
are cut.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.nn.modules.batchnorm import _NormBase
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy

from lightning_remat.graph.effects import state_write_target
from lightning_remat.graph.ops import keepable, written_attributes
from lightning_remat.runtime.inplace import functionalize_inplace, last_input_writes
from lightning_remat.solvers.plan import Plan
from lightning_remat.solvers.schedule import Schedule

__all__ = ["CompiledStages", "KeptRegion", "Ref", "RestoreNormStatistics", "StageProgram", "boundary_policy",
           "compile_stages", "observed_stages",
           "rebuild_output", "with_output_containers"]

# ---------------------------------------------------------------------------------------
# stage assignment
# ---------------------------------------------------------------------------------------
def _assign_stages(graph: fx.Graph, plan: Plan, charge: dict[str, str] | None = None,
                   owner: nn.Module | None = None) -> dict[str, int]:
    """Stage index of every compute node. A vertex takes its plan stage, and so does a node
    ``charge`` maps to a vertex (trace_module charges a tuple producer such as ``chunk`` to
    its first ``getitem``; the chain fallback names nodes after children). Every other node
    (sizes, asserts: no tensor of its own) runs as early as its inputs allow, so what
    crosses a stage boundary is a small value, not the tensor it was read from. An update
    of a buffer (``graph.effects``) runs where the forward's order puts it: in the stage of
    the node before it, so every reader of the buffer sees what it saw in the forward. get_attr
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
    latest = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        input_stages = [stage[a.name] for a in node.all_input_nodes if a.name in stage]
        earliest = max(input_stages, default=0)
        if state_write_target(node, owner) is not None:
            earliest = max(earliest, latest)
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
        latest = max(latest, stage[node.name]) if vertex in plan_stage else latest
    return stage


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    copied = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        env[node] = copied.node_copy(node, lambda a: env[a])
    return copied


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
    written_state: list[str] = field(default_factory=list)
    """Qualified names of the buffers the forward updates (``self.n += 1``;
    ``graph.effects``) that the stage reads or writes: a recomputation reads them as the
    stage's forward did and leaves them as the whole forward did."""
    called_modules: list[str] = field(default_factory=list)
    """Qualified names of the modules the stage calls, whose forward hooks fire in its
    forward only (``graph.effects.OncePerStep``)."""
    drop_after: list[str] = field(default_factory=list)
    """Environment values no later stage reads: released after this stage."""
    kept_boundary: list[str] = field(default_factory=list)
    """For a recomputed stage: the nodes whose aten ops' outputs are kept from the forward
    and not run again (the schedule's ``kept``, docs/design.md section 5). The stage's code
    then takes a :class:`KeptRegion` after ``self`` and marks each such node's code with its
    ``begin``/``end``."""
    stage_graph: fx.Graph | None = None
    preserve_rng_state: bool = True
    """For a recomputed stage: whether checkpoint stashes the random-number state (the
    schedule's ``draws_random``): a stage that draws nothing needs no stash."""

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
# ATen norms of an exported graph that update their running statistics in place with no
# write in their schema (running_mean and running_var are their 4th and 5th arguments).
_ATEN_NORMS = (torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default)


_REGION = "_remat_region"
"""The name of a recomputed stage's :class:`KeptRegion` argument in its code."""


def _compile_stage(stage_graph: fx.Graph, index: int) -> tuple[str, Callable[..., tuple]]:
    code = stage_graph.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(compile(code.src, f"<lightning_remat stage {index}>", "exec"), namespace)  # noqa: S102
    return code.src, namespace["forward"]


def _build_programs(
    graph: fx.Graph, stage: dict[str, int], owner: nn.Module,
    members: list[list[fx.Node]], schedule: Schedule, kept_nodes: list[set[str]],
    held: set[str] = frozenset(),  # type: ignore[assignment]
) -> tuple[list[StageProgram], Any]:
    """Each stage's program (``members``: its fx nodes in order; ``kept_nodes``: those whose
    outputs a recomputed stage keeps; ``held``: values the caller reads after the last
    stage, as it reads the output), with the action the schedule gives it."""
    output_node = next(n for n in graph.nodes if n.op == "output")

    def value_stage(node: fx.Node) -> int:
        return -1 if node.op == "placeholder" else stage[node.name]

    # Which stage reads each environment value last (output: after every stage).
    last_reader: dict[str, int] = {}
    for k, stage_nodes in enumerate(members):
        for node in stage_nodes:
            for arg in node.all_input_nodes:
                if arg.op != "get_attr" and value_stage(arg) != k:
                    last_reader[arg.name] = max(last_reader.get(arg.name, -1), k)
    output_values = {a.name for a in output_node.all_input_nodes if a.op != "get_attr"} | set(held)
    state_targets = {t for t in (state_write_target(n, owner) for n in graph.nodes) if t is not None}

    programs: list[StageProgram] = []
    for k, stage_nodes in enumerate(members):
        stage_graph = fx.Graph()
        env: dict[str, fx.Node] = {}
        inputs: list[str] = []
        norm_modules: list[str] = []
        state_buffers: list[str] = []
        written: list[str] = []
        called: list[str] = []

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

        kept = kept_nodes[k]
        # Placeholders first: fx wants them at the top of the graph.
        region = stage_graph.placeholder(_REGION) if kept else None
        for node in stage_nodes:
            for arg in node.all_input_nodes:
                if arg.op != "get_attr" and value_stage(arg) != k:
                    lookup(arg)
        outputs = [
            n.name for n in stage_nodes
            if n.name in output_values or last_reader.get(n.name, -1) > k
        ]
        for node in stage_nodes:
            if node.name in kept:
                stage_graph.call_method("begin", (region,))
            env[node.name] = stage_graph.node_copy(node, lookup)
            if node.name in kept:
                stage_graph.call_method("end", (region,))
            written.extend(str(a.target) for a in node.all_input_nodes
                           if a.op == "get_attr" and str(a.target) in state_targets)
            if node.op == "call_module":
                called.append(str(node.target))
                module = owner.get_submodule(str(node.target))
                for sub_name, sub in module.named_modules(prefix=str(node.target)):
                    if isinstance(sub, _NormBase) and sub.track_running_stats:
                        norm_modules.append(sub_name)
            elif node.op == "call_function" and written_attributes(node):
                # An ATen op of an exported graph writing buffers (batch_norm's statistics).
                state_buffers.extend(str(a.target) for a in written_attributes(node))
            elif node.op == "call_function" and node.target in _FUNCTIONAL_NORMS + _ATEN_NORMS:
                statistics = node.args[3:5] if node.target in _ATEN_NORMS else node.args[1:3]
                for arg in list(statistics) + [node.kwargs.get("running_mean"), node.kwargs.get("running_var")]:
                    if isinstance(arg, fx.Node) and arg.op == "get_attr":
                        state_buffers.append(str(arg.target))
        stage_graph.output(tuple(env[name] for name in outputs))
        source, fn = _compile_stage(stage_graph, k)
        drop = sorted(
            name for name, last in last_reader.items()
            if last == k and name not in output_values
        )
        programs.append(StageProgram(
            index=k, action=schedule.stages[k].action, input_names=inputs, output_names=outputs,
            source=source, fn=fn, norm_modules=sorted(set(norm_modules)),
            state_buffers=sorted(set(state_buffers)), drop_after=drop,
            written_state=sorted(set(written)), called_modules=sorted(set(called)),
            kept_boundary=[n.name for n in stage_nodes if n.name in kept], stage_graph=stage_graph,
            preserve_rng_state=schedule.stages[k].draws_random,
        ))
    output_structure = _plain_containers(fx.node.map_arg(output_node.args[0], lambda n: Ref(n.name)))
    return programs, output_structure


def _kept_nodes(stage_nodes: list[fx.Node], kept_vertices: frozenset[str],
                charge: dict[str, str]) -> set[str]:
    """The fx nodes of a recomputed stage whose aten ops' outputs are kept: those of the
    schedule's kept vertices, a tuple producer (``chunk``) with the vertex the trace charges
    it to."""
    return {n.name for n in stage_nodes if charge.get(n.name, n.name) in kept_vertices}


class KeptRegion:
    """Whether a recomputed stage's code is inside one of its kept nodes: one per call of
    the stage, handed to its code (which marks each kept node with :meth:`begin` and
    :meth:`end`) and to its checkpoint policy (:func:`boundary_policy`). :meth:`outside`
    is entered around the forward and the recomputation: checkpoint stops a recomputation
    early by raising, which can leave a node's end unmarked."""

    __slots__ = ("inside",)

    def __init__(self) -> None:
        self.inside = False

    def begin(self) -> None:
        self.inside = True

    def end(self) -> None:
        self.inside = False

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        self.inside = False
        try:
            yield
        finally:
            self.inside = False


def boundary_policy(region: KeptRegion, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective-checkpoint policy of a recomputed stage, with its ``region`` bound
    (``functools.partial``; torch's ``create_selective_checkpoint_contexts``): the aten ops
    of its kept nodes are saved where :func:`~lightning_remat.graph.ops.keepable`, every
    other op runs again in the backward. Torch calls it for each op of the forward and
    replays its choices in the recomputation by the op's position. The ops inside a custom
    autograd function's forward (grad is off there) run again with it: saving them would hold
    the function's intermediates, which its own backward does not read and no model counts."""
    if region.inside and keepable(op) and torch.is_grad_enabled():
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
    """The forward's output from its traced structure (:class:`Ref` leaves), containers and
    named tuples as they were."""
    return pytree.tree_map_only(Ref, lambda ref: env[ref.name], structure)


def with_output_containers(structure: Any, spec: pytree.TreeSpec | None) -> Any:
    """The traced output ``structure`` in the containers of the module's own output
    (``spec``: its pytree structure on the example call, None: unknown), container by
    container where both hold the same keys: fx records an ``OrderedDict`` the forward
    returns as a plain dict. A container fx built as a node of its own (a named tuple) is
    one leaf of ``structure``, and its value at run time already has its type."""
    if spec is None or spec.is_leaf():
        return structure
    found = pytree.tree_flatten_with_path(structure, is_leaf=lambda node: node is not structure)[0]
    if len(found) == 1 and found[0][1] is structure:
        return structure  # a leaf: a Ref or a constant
    children = _spec_children(spec)
    level = pytree.TreeSpec(spec.type, spec.context, [_LEAF] * len(children))
    wanted = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(len(children))), level))[0]
    if [pytree.keystr(p) for p, _ in wanted] != [pytree.keystr(p) for p, _ in found]:
        return structure
    return pytree.tree_unflatten(
        [with_output_containers(child, sub) for (_, child), sub in zip(found, children)], level)


def _spec_children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    # children(): newer torch; children_specs (deprecated there): older ones
    return list(spec.children() if hasattr(spec, "children") else spec.children_specs)


_LEAF = pytree.tree_structure(0)


def _plain_containers(structure: Any) -> Any:
    """fx keeps a forward's output lists and dicts as ``immutable_list``/``immutable_dict``:
    the same structure with the plain types the forward returned."""
    leaves, spec = pytree.tree_flatten(structure)
    return pytree.tree_unflatten(leaves, _plain_spec(spec))


def _plain_spec(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    if spec.is_leaf():
        return spec
    kind = {immutable_list: list, immutable_dict: dict}.get(spec.type, spec.type)
    return pytree.TreeSpec(kind, spec.context, [_plain_spec(c) for c in _spec_children(spec)])


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
    written_inputs: list[tuple[str, str]] = field(default_factory=list)
    """(placeholder node name, the node whose value is its last in-place write): the step
    inputs the forward writes in place. The stages run on a copy of each, and the value the
    last write leaves is copied into the caller's tensor after the forward, as plain
    training leaves it, while recomputations read the copy as the schedule left it."""


def compile_stages(
    graph: fx.Graph, plan: Plan, owner: nn.Module, schedule: Schedule,
    charge: dict[str, str] | None = None,
) -> CompiledStages:
    """The stage programs of ``graph`` (a traced forward; ``plan``'s vertex ids are its node
    names, or ``charge`` maps node names to vertex ids) run by ``owner``, doing what
    ``schedule`` (``plan`` compiled on the vertex graph, ``solvers.schedule``) says: its
    in-place ops rewritten out of place, its kept values kept. ``graph`` itself is not
    changed."""
    if not plan.stages:
        raise ValueError("the plan has no stages")
    if len(schedule.stages) != len(plan.stages):
        raise ValueError(f"the schedule has {len(schedule.stages)} stages, the plan {len(plan.stages)}")
    stage = _assign_stages(graph, plan, charge, owner)
    graph = _copy_graph(graph)
    last_write = last_input_writes(graph, owner)
    rewritten: list[str] = []
    if schedule.rewritten:
        rewritten = functionalize_inplace(graph, stage, set(schedule.rewritten), owner)
    by_name = {n.name: n for n in graph.nodes}
    written_inputs = []
    for placeholder, write in last_write.items():
        node = by_name[write]
        # A rewritten setitem writes a clone, its first argument now (it returns None).
        final = node.args[0] if node.target is operator.setitem else node
        if isinstance(final, fx.Node):
            written_inputs.append((placeholder, final.name))
    members: list[list[fx.Node]] = [[] for _ in plan.stages]
    for node in graph.nodes:
        if node.name in stage:
            members[stage[node.name]].append(node)
    kept = [_kept_nodes(nodes, s.kept, charge or {}) for nodes, s in zip(members, schedule.stages)]
    programs, output = _build_programs(graph, stage, owner, members, schedule, kept,
                                       {final for _, final in written_inputs})
    placeholders = [(n.name, str(n.target)) for n in graph.nodes if n.op == "placeholder"]
    return CompiledStages(programs, output, placeholders, rewritten, written_inputs)


def observed_stages(stages: CompiledStages, ops: Collection[str],
                    observe: Callable[[str, Any], None]) -> CompiledStages:
    """A copy of ``stages`` whose programs call ``observe(name, value)`` after each node
    named in ``ops`` has run, with the value it computed, in the forward and in a
    recomputation alike; the code is the stages' own otherwise. Each call comes after the
    values the node read last are released and after its kept region ends, so a reading
    taken in it is what the op leaves (the measured timeline, docs/design.md section 6)."""
    programs = []
    for program in stages.programs:
        if program.stage_graph is None:
            programs.append(program)
            continue
        graph = _copy_graph(program.stage_graph)
        for node in list(graph.nodes):
            if node.name not in ops or node.op not in ("call_function", "call_method", "call_module"):
                continue
            anchor = node
            following = node.next
            if (following.op == "call_method" and following.target == "end"
                    and following.args[:1] and getattr(following.args[0], "name", None) == _REGION):
                anchor = following  # KeptRegion.end of a kept node
            with graph.inserting_after(anchor):
                graph.call_function(observe, (node.name, node))
        source, fn = _compile_stage(graph, program.index)
        programs.append(dataclasses.replace(program, source=source, fn=fn, stage_graph=graph))
    return dataclasses.replace(stages, programs=programs)
