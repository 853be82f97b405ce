"""What kind of op a vertex, an fx node or an aten op is, decided in one place.

The schedule (``solvers.schedule``), the simulator and the executor (``runtime.stages``)
all ask here, so they cannot disagree on what an op is:

- **random**: an aten op carrying torch's ``nondeterministic_seeded`` tag draws random
  numbers. The tracer runs each fx node once, noting the vertices that dispatched such an
  op (``meta.random``); a graph without that record (one
  written by hand, or an older profile) falls back to the op names in :data:`RANDOM_OPS`.
- **in place**: an fx node that writes the tensor of its first argument
  (:func:`mutated_operand`: a module called with ``inplace=True``, an ``inplace=True``
  keyword, a ``+=``, a method or function whose name ends in one underscore, aten's naming
  of in-place variants). The tracer records each one with the vertex it writes
  (``meta.inplace``); without that record the profiler's storage aliases stand in
  (:func:`inplace_operands`).
- **keepable** (an aten op whose outputs a recomputation may take from the forward): from
  its schema, it returns tensors and no alias of an input, and it is not random.
- **views** and **gradient pass-through** by op name, for the simulator's storage and
  gradient model of graphs that carry no profiled aliases.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from lightning_remat.graph.ir import Graph

__all__ = [
    "CAST_OPS", "GRAD_PASSTHROUGH_OPS", "INTERNAL_GRADIENT_OPS", "RANDOM_OPS", "VIEW_OPS",
    "draws_random", "inplace_operands", "keepable", "mutated_operand", "random_vertices",
    "viewed_operand", "written_attributes",
]

VIEW_OPS = frozenset({
    "view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose", "permute",
    "t", "getitem", "narrow", "select", "split", "chunk", "unbind", "view_as", "expand",
    "Flatten", "Unflatten", "Identity", "detach", "contiguous",
})
"""Op names whose output shares its input's storage (``contiguous`` is a no-op on the
contiguous tensors a traced forward usually passes it)."""

GRAD_PASSTHROUGH_OPS = frozenset({
    "add", "iadd", "__add__", "__iadd__", "view", "reshape", "flatten", "unflatten", "squeeze", "alias",
    "unsqueeze", "transpose", "permute", "t", "view_as", "Flatten", "Unflatten", "Identity",
    "contiguous", "cat", "concat", "concatenate", "stack", "hstack", "vstack",
})
"""Op names whose backward passes the incoming gradient on without a new buffer. For a
concatenation each input's gradient is a slice of the output's (autograd narrows it), so
the whole buffer lives until the last slice is consumed: a U-Net's skip connection holds
its decoder level's full gradient until the encoder's backward."""

RANDOM_OPS = frozenset({
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout",
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm",
    "bernoulli", "multinomial", "normal", "RReLU", "rrelu",
})
"""Op names that draw random numbers: the fallback for graphs without ``meta.random``."""

CAST_OPS = frozenset({"to", "type", "type_as", "float", "double", "half", "bfloat16"})
"""Casts: where the tensor has the dtype and device asked for they return it itself (its
storage, no autograd node), and the gradient goes on as it came; where they copied (a new
storage), their backward casts the gradient into a new buffer."""

INTERNAL_GRADIENT_OPS = frozenset({"cross_entropy", "cross_entropy_loss"})
"""Composite ops whose backward runs as several autograd nodes with an internal gradient
between them as large as what they save besides their inputs: ``cross_entropy`` (``aten.
cross_entropy_loss`` in a torch.export capture) is
``nll_loss(log_softmax(x))``; NLL's backward makes the gradient of the log-probabilities
(the size of the saved log-softmax) and log-softmax's backward then makes the gradient of
``x`` while it is live. Where the profiler measured no backward workspace (on CPU it cannot)
this internal gradient is the op's backward workspace."""


# ---- aten ops: torch's tags and schemas ---------------------------------------------------
def draws_random(op: Any) -> bool:
    """Whether an aten op draws random numbers (torch's ``nondeterministic_seeded`` tag)."""
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


_KEEPABLE: dict[Any, bool] = {}


def keepable(op: Any) -> bool:
    """Whether an aten op's outputs can be kept from the forward for a recomputation: not
    an in-place op or a view (its schema's returns alias an input: an in-place op's result
    must be the tensor it modified in the recomputation too, and a kept view holds its
    base's whole storage, which may be a value the plan recomputes), not random (a kept
    random op draws nothing in the recomputation, which would shift every later draw of the
    stage), only ops that return tensors (a profiler range opened inside a kept node has
    nothing to keep), and not an allocation of uninitialised memory (``empty_like`` and its
    kin): the next ops fill it in place (dropout's mask: ``empty_like`` then ``bernoulli_``,
    inside ``nn.Dropout`` and ``nn.MultiheadAttention``), so what the forward kept would be
    the tensor after those writes, which ``torch.utils.checkpoint``'s selective
    checkpointing refuses as mutated; it is allocated again in the recomputation, at no
    cost."""
    known = _KEEPABLE.get(op)
    if known is None:
        aliases = any(r.alias_info is not None for r in op._schema.returns)
        uninitialised = op._schema.name.rpartition("::")[2] in _UNINITIALISED
        known = _KEEPABLE[op] = _returns_tensors(op._schema) and not (
            aliases or draws_random(op) or uninitialised)
    return known


_UNINITIALISED = frozenset({"empty", "empty_like", "new_empty", "empty_strided",
                            "new_empty_strided", "empty_permuted"})
"""aten ops that return uninitialised memory, which the ops after them write in place."""


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


# ---- fx nodes -----------------------------------------------------------------------------
_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
}


def mutated_operand(node: fx.Node, owner: nn.Module) -> fx.Node | None:
    """The node whose tensor ``node`` modifies in place, or None (``owner``: the module the
    node's ``call_module`` targets live in)."""
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
        if isinstance(node.target, torch._ops.OpOverload):  # an ATen op (an exported graph): its schema says
            written = node.target._schema.arguments[0].alias_info if node.target._schema.arguments else None
            return first if written is not None and written.is_write else None
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


def viewed_operand(node: fx.Node, owner: nn.Module) -> fx.Node | None:
    """The node whose storage ``node``'s value is a view of, or None: an ATen op whose
    schema says its result aliases its first argument without writing it, a ``getitem``,
    and the ops and modules :data:`VIEW_OPS` names (``reshape`` and ``contiguous`` may
    copy: taken as views, they only add order to the writes around them)."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        aliased = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        return node.args[0] if aliased else None
    if node.op == "call_module":
        try:
            name = type(owner.get_submodule(str(node.target))).__name__
        except AttributeError:
            return None
    elif node.target is operator.getitem and _fresh_outputs(node.args[0]):
        return None  # an element of an op's own new outputs (topk's values), not a view
    elif node.op in ("call_function", "call_method"):
        name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    else:
        return None
    return node.args[0] if name in VIEW_OPS else None


def _fresh_outputs(node: fx.Node) -> bool:
    """Whether ``node`` is an ATen op returning several tensors (``topk``, ``max.dim``,
    ``native_layer_norm``) that alias none of its arguments: a ``getitem`` on it picks a new
    tensor. ``split`` and ``unbind`` alias their input, so their elements stay views."""
    if getattr(node.target, "fresh_outputs", False):  # graph.functions.FunctionCall
        return True
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    returns = node.target._schema.returns
    several = len(returns) > 1 or (len(returns) == 1 and isinstance(returns[0].type, torch.ListType))
    return several and all(r.alias_info is None for r in returns)


def written_attributes(node: fx.Node) -> list[fx.Node]:
    """The ``get_attr`` nodes (buffers) an ATen op writes in place, from its schema: an
    exported graph's ``batch_norm`` writes its running statistics, an ``add_`` on a buffer
    its counter."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    written: list[fx.Node] = []
    for k, argument in enumerate(node.target._schema.arguments):
        value = node.args[k] if k < len(node.args) else node.kwargs.get(argument.name)
        if (argument.alias_info is not None and argument.alias_info.is_write
                and isinstance(value, fx.Node) and value.op == "get_attr"):
            written.append(value)
    return written


# ---- vertices of a graph ------------------------------------------------------------------
def random_vertices(graph: Graph) -> set[str]:
    """The vertices whose op draws random numbers: as the tracer recorded them, or by op
    name for a graph without that record."""
    if graph.meta.random is not None:
        return set(graph.meta.random)
    return {v for v in graph.ids if graph[v].op in RANDOM_OPS}


def inplace_operands(graph: Graph) -> dict[str, str | None]:
    """Each in-place op's vertex and the vertex whose value it writes (None: a step input).
    From the tracer's record; a graph without it takes the profiler's storage aliases: an
    op sharing the storage of an earlier vertex that it reads, and not a view."""
    recorded = graph.meta.inplace
    if recorded is not None:
        return {v: (t if t in graph else None) for v, t in recorded.items() if v in graph}
    aliases = graph.meta.aliases or {}
    found: dict[str, str | None] = {}
    for v in graph.ids:
        root = aliases.get(v)
        if root is None or graph[v].op in VIEW_OPS:
            continue
        same = [u for u in graph.predecessors(v) if u == root or aliases.get(u) == root]
        if same:
            found[v] = max(same, key=graph.position)
    return found
