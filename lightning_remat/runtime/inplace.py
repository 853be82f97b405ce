"""The in-place ops a schedule rewrites (``Schedule.rewritten``: where a recomputation would
read the value an op overwrote, docs/design.md section 5), run out of place or on a copy of
the tensor a view is of, and the step inputs a forward writes in place."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from lightning_remat.graph.ops import mutated_operand, viewed_operand

__all__ = ["call_out_of_place", "functionalize_inplace", "last_input_writes"]


def _reads_after_in_its_stage(reader: fx.Node, value: fx.Node, op_node: fx.Node,
                              stage: dict[str, int]) -> None:
    """Raise where ``reader``, which reads ``value`` after the in-place op ``op_node``
    changed it, is placed in an earlier stage than the op: it would read it unchanged."""
    if reader.op != "output" and stage[reader.name] < stage[op_node.name]:
        raise ValueError(
            f"{reader.name!r} (stage {stage[reader.name]}) reads {value.name!r} after the "
            f"in-place op {op_node.name!r} (stage {stage[op_node.name]}) changed it; put them in "
            "the same stage or keep the reader after the op")


def functionalize_inplace(graph: fx.Graph, stage: dict[str, int], rewrite: set[str],
                           owner: nn.Module) -> list[str]:
    """Rewrite the in-place ops named in ``rewrite`` (the schedule's ``rewritten``,
    ``solvers.schedule``) to leave their operand unchanged: the out-of-place form of the op
    where there is one (``ReLU(inplace=True)`` run with ``inplace=False``, ``relu_`` ->
    ``relu``, ``+=`` -> ``+``), else the op on a clone; the operand's later readers read the
    op's result instead. Return the names of the rewritten ops."""
    position = {node: k for k, node in enumerate(graph.nodes)}
    rewritten: list[str] = []
    for op_node in list(graph.nodes):
        if op_node.name not in rewrite:
            continue
        operand = mutated_operand(op_node, owner)
        if operand is None or operand.op == "get_attr":
            continue  # in-place updates of parameters/buffers are state, not values
        op_stage = stage[op_node.name]
        if viewed_operand(operand, owner) is not None:
            _write_a_copy_through_the_view(graph, op_node, operand, stage, position, owner)
            rewritten.append(op_node.name)
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
            _reads_after_in_its_stage(user, operand, op_node, stage)
            user.replace_input_with(operand, result)
        rewritten.append(op_node.name)
    return rewritten


def _write_a_copy_through_the_view(graph: fx.Graph, op_node: fx.Node, operand: fx.Node,
                                   stage: dict[str, int], position: dict[fx.Node, int],
                                   owner: nn.Module) -> None:
    """Rewrite ``op_node``, an in-place write through a view (``h[:, :8].mul_(0.5)``,
    ``shifted[:, 1:].copy_(ids)``), to leave the tensor it writes unchanged: the tensor the
    view is of is cloned, the view taken again on the clone and written there, and every
    later reader of that tensor, of a view of it or of a write into it reads the clone's
    instead. Writing a copy of the view alone would leave the readers of the tensor
    without the write."""
    op_stage = stage[op_node.name]

    def source(node: fx.Node) -> fx.Node | None:
        return viewed_operand(node, owner) or mutated_operand(node, owner)

    root = operand
    while (parent := source(root)) is not None:
        root = parent
    with graph.inserting_before(op_node):
        clone = graph.call_method("clone", (root,))
    stage[clone.name], position[clone] = op_stage, position[op_node]
    remade: dict[fx.Node, fx.Node] = {root: clone}

    def remake(node: fx.Node) -> fx.Node:
        """``node`` (the root, a view of it or a write into it, made before ``op_node``) as
        it stands on the clone."""
        if node not in remade:
            if viewed_operand(node, owner) is None:  # a write: the tensor it wrote
                remade[node] = remake(mutated_operand(node, owner))  # type: ignore[arg-type]
            else:
                parent = node.args[0]
                base = remake(parent)  # type: ignore[arg-type]
                with graph.inserting_before(op_node):
                    copy = graph.node_copy(node, lambda a: base if a is parent else a)
                stage[copy.name], position[copy] = op_stage, position[op_node]
                remade[node] = copy
        return remade[node]

    op_node.update_arg(0, remake(operand))
    made = set(remade.values())
    # The storage's values made before the write: the root, its views, the writes into it.
    before = [n for n in graph.nodes if n in position and position[n] < position[op_node]]
    storage = {root}
    for node in before:
        parent = source(node)
        if parent is not None and parent in storage:
            storage.add(node)
    for value in [n for n in before if n in storage]:
        for user in list(value.users):
            if user is op_node or user in made or user not in position or position[user] <= position[op_node]:
                continue
            _reads_after_in_its_stage(user, value, op_node, stage)
            user.replace_input_with(value, remake(value))
            made = set(remade.values())


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


def last_input_writes(graph: fx.Graph, owner: nn.Module) -> dict[str, str]:
    """Placeholder name -> the last node writing it in place, following chains of in-place
    ops (``x.sub_(m).div_(s)``: the tracer points the later readers of a written tensor at
    its writer, ``trace.readers_follow_inplace``)."""
    root: dict[fx.Node, fx.Node] = {}
    last: dict[str, str] = {}
    for node in graph.nodes:
        operand = mutated_operand(node, owner) if node.op != "placeholder" else None
        if operand is None:
            continue
        base = root.get(operand, operand)
        root[node] = base
        if base.op == "placeholder":
            last[base.name] = node.name
    return last
