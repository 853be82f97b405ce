"""The vertex graph of a captured forward: which fx nodes are vertices, and the edges between
them (docs/design.md section 2). The capture (:mod:`lightning_remat.graph.trace`) runs the
graph once on the example input (:class:`ValueRecorder`) and builds the vertex graph from what
each node's value was:

- a node whose value is a tensor is a vertex;
- a node whose value is a tuple/list of tensors (``chunk``, ``split``, an ``LSTM``) whose users
  are all ``getitem`` is not: its ``getitem`` users are the vertices, and its cost is charged
  to the first of them (the charge map);
- placeholders, ``get_attr`` (parameters, buffers), ``output`` and nodes with non-tensor
  values (``x.size(0)``) are not vertices; edges pass through them, so ``x.size()`` followed
  by ``view`` still gives the edge from the producer of ``x`` to ``view``. An edge through
  which only such non-tensor values flow (``h.view(h.size(0), -1)`` reads ``x`` only for its
  size when ``x`` is another tensor) is listed in ``meta.shape_edges``: the consumer
  does not need the tensor itself alive;
- writes to one storage keep the forward's order (:func:`storage_order_edges`), and a
  reader after an in-place op reads that op's node (:func:`readers_follow_inplace`).

Meta: ``input_consumers``, ``outputs``, ``param_bytes`` (see :mod:`lightning_remat.graph.ir`)
and ``shape_edges`` (``[[u, v], ...]``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_remat.graph.effects import (
    state_write_target,
)
from lightning_remat.graph.functions import FunctionCall
from lightning_remat.graph.ir import Graph, GraphMeta, Node
from lightning_remat.graph.ops import draws_random, mutated_operand, viewed_operand

__all__ = [
    "ValueRecorder", "build_fx_graph", "fetch_attr", "fx_vertex_graph", "is_getitem", "local_bytes",
    "op_name", "readers_follow_inplace", "storage_order_edges",
]


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` this process holds: a sharded parameter (a ``DTensor``) counts its local
    shard, which is also the size of its gradient."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _RandomOps(TorchDispatchMode):
    """Notes whether an aten op run under it draws random numbers (``graph.ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.drew = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.drew = self.drew or draws_random(func)
        return func(*args, **(kwargs or {}))


class ValueRecorder(fx.Interpreter):
    """Records what each node's value is: a tensor, a structure holding tensors, or other."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.kind: dict[str, str] = {}
        self.numel: dict[str, int] = {}
        self.random: set[str] = set()
        """Nodes that dispatched an aten op drawing random numbers (``graph.ops``)."""

    def run_node(self, n: fx.Node) -> Any:
        recorder = _RandomOps()
        with recorder:
            value = super().run_node(n)
        if recorder.drew:
            self.random.add(n.name)
        if isinstance(value, torch.Tensor):
            self.kind[n.name] = "tensor"
            self.numel[n.name] = value.numel()
        elif any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value)):
            self.kind[n.name] = "tensors"
            self.numel[n.name] = sum(
                t.numel() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)
            )
        else:
            self.kind[n.name] = "other"
        return value


# ---- fx path ---------------------------------------------------------------------------------


def op_name(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))).__name__
    if n.op == "call_method":
        return str(n.target)
    if isinstance(n.target, torch._ops.OpOverload):  # an exported graph's ATen op: "view", not "view.default"
        return n.target.overloadpacket.__name__
    if is_getitem(n) and isinstance(n.args[0], fx.Node) and isinstance(n.args[0].target, FunctionCall):
        return n.args[0].target.__name__  # a custom function's output: the vertex is the call
    return getattr(n.target, "__name__", str(n.target))


def is_getitem(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is operator.getitem


def _input_nodes(n: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), lambda a: found.append(a) or a)
    return list(dict.fromkeys(found))


def build_fx_graph(gm: fx.GraphModule, kind: dict[str, str]) -> tuple[Graph, dict[str, str]]:
    """The IR graph (zero costs) of a traced module given each node's value kind
    (``tensor``/``tensors``/``other``), and the charge map (fx node -> vertex id)."""
    nodes = list(gm.graph.nodes)
    vertex: set[str] = set()
    for n in nodes:
        if n.op in ("placeholder", "get_attr", "output") or state_write_target(n, gm) is not None:
            continue  # an update of a buffer is state, not a value (graph.effects)
        k = kind.get(n.name, "other")
        if k == "tensor":
            vertex.add(n.name)
        elif k == "tensors":
            users = list(n.users)
            if not users or not all(is_getitem(u) for u in users):
                vertex.add(n.name)
    # A tuple producer is charged to the first vertex among its getitem descendants.
    charge: dict[str, str] = {v: v for v in vertex}
    order = {m.name: i for i, m in enumerate(nodes)}
    for n in reversed(nodes):
        if n.op.startswith("call") and n.name not in vertex and kind.get(n.name) == "tensors":
            targets = [charge[u.name] for u in n.users if u.name in charge]
            if targets:
                charge[n.name] = min(targets, key=order.__getitem__)
            else:  # pragma: no cover - every user unused: keep it as a vertex
                vertex.add(n.name)
                charge[n.name] = n.name

    # resolved[node] = (vertex ids the node's value depends on, whether it reaches an input,
    # vertex ids whose tensor data flows into it). Non-tensor nodes (x.size(0)) pass the
    # dependency on but not the data: an edge carrying only sizes is a "shape edge".
    # A tuple producer stands for the vertex it is charged to, except for that vertex itself,
    # which depends on the producer's own inputs (tuple_inputs).
    Resolved = tuple[frozenset[str], bool, frozenset[str]]
    resolved: dict[str, Resolved] = {}
    tuple_inputs: dict[str, Resolved] = {}

    def deps_of(n: fx.Node) -> Resolved:
        ids: set[str] = set()
        data: set[str] = set()
        touches = False
        for a in _input_nodes(n):
            if a.name in tuple_inputs and charge[a.name] == n.name:
                got, t, d = tuple_inputs[a.name]
            else:
                got, t, d = resolved[a.name]
            ids |= got
            data |= d
            touches |= t
        return frozenset(ids), touches, frozenset(data)

    none: frozenset[str] = frozenset()
    edges: list[tuple[str, str]] = []
    shape_edges: list[list[str]] = []
    input_consumers: list[str] = []
    outputs: list[str] = []
    for n in nodes:
        if n.op == "placeholder":
            resolved[n.name] = (none, True, none)
        elif n.op == "get_attr":
            resolved[n.name] = (none, False, none)
        elif n.op == "output":
            ids, _, _ = deps_of(n)
            outputs = [m.name for m in nodes if m.name in ids]
        elif n.name in vertex:
            ids, touches, data = deps_of(n)
            for u in sorted(ids, key=order.__getitem__):
                edges.append((u, n.name))
                if u not in data:
                    shape_edges.append([u, n.name])
            if touches:
                input_consumers.append(n.name)
            resolved[n.name] = (frozenset({n.name}), False, frozenset({n.name}))
        elif n.name in charge:
            tuple_inputs[n.name] = deps_of(n)
            owner = frozenset({charge[n.name]})
            resolved[n.name] = (owner, False, owner)
        else:
            ids, touches, _ = deps_of(n)
            resolved[n.name] = (ids, touches, none)

    # Parameters: a call_module owns its module's parameters; a get_attr parameter belongs to
    # the first op using it. Each parameter is counted once (weight tying, modules called twice).
    param_bytes: dict[str, int] = {}
    counted: set[int] = set()
    last_user: dict[int, tuple[str, int]] = {}  # parameter -> (its last op, its bytes)

    def add_params(vid: str, params: Iterator[torch.Tensor]) -> None:
        total = 0
        for p in params:
            if not p.requires_grad:
                continue  # frozen: no gradient, and resident like the step's inputs
            last_user[id(p)] = (vid, local_bytes(p))
            if id(p) not in counted:
                counted.add(id(p))
                total += local_bytes(p)
        if total:
            param_bytes[vid] = param_bytes.get(vid, 0) + total

    for n in nodes:
        if n.name not in charge:
            continue
        if n.op == "call_module":
            add_params(charge[n.name], gm.get_submodule(str(n.target)).parameters())
        for a in _input_nodes(n):
            if a.op == "get_attr":
                value = fetch_attr(gm, str(a.target))
                if isinstance(value, nn.Parameter):
                    add_params(charge[n.name], iter([value]))

    graph_nodes = [Node(id=n.name, op=op_name(gm, n)) for n in nodes if n.name in vertex]
    # A parameter's gradient appears in the backward of its last op (the first to run
    # backward), which for a tied weight is not the op that owns it.
    param_grad_bytes: dict[str, int] = {}
    for vid, nbytes in last_user.values():
        if nbytes:
            param_grad_bytes[vid] = param_grad_bytes.get(vid, 0) + nbytes
    # In-place ops and the value each writes (a placeholder's name: a step input); writes
    # into parameters and buffers (get_attr) are state, not values.
    inplace: dict[str, str] = {}
    for n in nodes:
        operand = mutated_operand(n, gm) if n.name in vertex else None
        if operand is not None and operand.op != "get_attr":
            inplace[n.name] = charge.get(operand.name, operand.name)
    # Writes to one storage keep their order against each other and its readers, whatever
    # view each goes through: edges that order only, no value flows (docs/design.md
    # section 5, "In-place writes").
    have = set(edges)
    for u, v in storage_order_edges(gm, charge):
        if (u, v) not in have:
            have.add((u, v))
            edges.append((u, v))
            shape_edges.append([u, v])
    meta = GraphMeta(input_consumers=input_consumers, outputs=outputs, param_bytes=param_bytes,
                     param_grad_bytes=param_grad_bytes, shape_edges=shape_edges, inplace=inplace)
    return Graph(graph_nodes, edges, meta), charge


def storage_order_edges(gm: fx.GraphModule, charge: dict[str, str]) -> list[tuple[str, str]]:
    """Edges ``(u, v)`` between vertices that order every in-place write to a storage the
    forward writes (a value it made, or a step input) after each op that touches that
    storage before it in the forward's order, and before each op that touches it after: an
    op reading it, through any view, or writing it. ``shift_tokens_right`` in Hugging Face's
    BART writes one tensor with ``copy_`` and ``fill_`` through two views and then with
    ``masked_fill_`` on the tensor itself; nothing else links the first two writes to the
    third, so without these edges a plan may run them in any order. Parameters and buffers
    (``get_attr``) are module state, ordered by ``graph.effects``."""
    nodes = list(gm.graph.nodes)
    order = {n: k for k, n in enumerate(nodes)}
    base: dict[fx.Node, fx.Node] = {}  # a view or an in-place result -> the storage's first node
    writes: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        operand = mutated_operand(n, gm)
        if operand is not None:
            root = base.get(operand, operand)
            base[n] = root
            if root.op != "get_attr":
                writes.setdefault(root, []).append(n)
            continue
        viewed = viewed_operand(n, gm)
        if viewed is not None:
            base[n] = base.get(viewed, viewed)
    if not writes:
        return []
    vertex_order = {n.name: k for k, n in enumerate(nodes)}
    found: list[tuple[str, str]] = []
    for root, written in writes.items():
        is_write = set(written)
        # The ops that touch the storage's data: each write, and each op reading it other
        # than by taking a view of it.
        touching = [n for n in nodes
                    if n in is_write or (n.op.startswith("call") and base.get(n) is not root
                                         and any(base.get(a, a) is root for a in n.all_input_nodes))]
        for w in written:
            vw = charge.get(w.name)
            if vw is None:
                continue
            for n in touching:
                vn = charge.get(n.name)
                if vn is None or vn == vw:
                    continue
                u, v = (vn, vw) if order[n] < order[w] else (vw, vn)
                if vertex_order[u] < vertex_order[v]:
                    found.append((u, v))
    return list(dict.fromkeys(found))


def fx_vertex_graph(gm: fx.GraphModule, plan: Any, charge: dict[str, str] | None = None) -> Graph:
    """The vertex graph (zero costs) of a traced module whose vertices a plan names, from
    its structure alone (no run): the plan's vertices are the tensors, the nodes ``charge``
    maps to another vertex are their tuple producers. Its op kinds are what the fx graph
    shows (``graph.ops``); random ops are known by name."""
    vertices = {v for stage in plan.stages for v in stage.nodes}
    kind = {n: "tensor" for n in vertices}
    kind.update({n: "tensors" for n, v in (charge or {}).items() if n != v})
    return build_fx_graph(gm, kind)[0]


def readers_follow_inplace(gm: fx.GraphModule) -> int:
    """Point every reader of a tensor that comes after an in-place op writing it at that op's
    node, which returns the same tensor; returns how many inputs moved.

    The result of a statement like ``mask.div_(keep)`` (timm's ``drop_path``) has no user in
    the traced graph: its later reader ``x * mask`` reads ``mask``'s node, so the vertex graph
    had no edge from the division to the multiply, a plan could place them in either order,
    and an executor running the division out of place would hand the multiply the unscaled
    mask. Reading the op's node instead makes the dependence an edge. Buffers (``get_attr``)
    are left to the tracing of side effects."""
    order = {node: k for k, node in enumerate(gm.graph.nodes)}
    moved = 0
    for node in list(gm.graph.nodes):
        operand = mutated_operand(node, gm)
        if operand is None or operand.op == "get_attr":
            continue
        for user in list(operand.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(operand, node)
                moved += 1
    if moved:
        gm.recompile()
    return moved
