"""Capture a forward torch.fx cannot trace with ``torch.export`` (docs/design.md section 2).

``torch.fx.symbolic_trace`` gives up on forwards that take ``*args``/``**kwargs``, branch on
their arguments or call code fx cannot proxy (the Hugging Face transformers models). Those
reach :func:`export_graph_module`, which runs ``torch.export.export(..., strict=False)``: the
forward runs as Python on fake tensors, its control flow resolved for the example's shapes
and arguments (the shapes become guards; the planner keys plans by input shape and captures
each new shape again), and its ATen ops are recorded in training IR (ops are not decomposed
further; dropout stays one op; in-place updates of buffers stay in-place ops).

The exported program lifts parameters, buffers and tensor constants to inputs. The graph
this module returns reads them back as ``get_attr`` nodes with the module's own qualified
names (from the program's graph signature), so a parameter in the graph is the module's own
Parameter object, as in an fx trace, and the executor reaches it through the module's
children. Its placeholders are the call's top-level arguments, named after the forward's
parameters: a tensor argument is used as it is, one holding tensors in a tuple, list or
dict is read with ``getitem`` nodes, and a non-tensor argument (a flag, ``None``) is an
unused placeholder, its value specialised in the graph. The output is the flat tuple of the
forward's output leaves; :class:`StructuredOutput` (the graph's code generator) rebuilds the
forward's own structure (a ``ModelOutput``, a dict) where the graph is interpreted, and
:attr:`ExportedGraph.output_spec` is what the executor rebuilds it with.

The graph is specialised to the module's mode when captured (training: dropout draws);
outside training the module's own forward runs instead.

The forward is captured as plain training runs it (:func:`as_plain_training`; docs/design.md
section 3, "Plain's ops"): its own code reads ``torch.compiler.is_exporting()`` as False (torch's
own code reads the true flag), and a Hugging Face cache the planner's calls turn off is on, as
the config sets it, and dropped from the captured output. A forward that cannot be exported
so is captured again as ``torch.export`` runs it (``ExportedGraph.plain_failure`` says why).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from lightning_remat.graph.calls import caches_as_configured, without_caches
from lightning_remat.graph.functions import opaque_functions, replay_call

__all__ = ["ExportedGraph", "PlainReads", "StructuredOutput", "as_plain_training", "export_graph_module"]


class StructuredOutput(fx.graph.CodeGen):
    """fx's default code generator, whose interpreted output (``fx.Interpreter.run``: the
    tracer's checks, the profiler) is the forward's own output structure rebuilt from the
    graph's flat tuple of leaves with ``out_spec``."""

    def __init__(self, out_spec: pytree.TreeSpec) -> None:
        super().__init__()
        self.out_spec = out_spec

    def process_outputs(self, outputs: Any) -> Any:
        return pytree.tree_unflatten(list(outputs), self.out_spec)


@dataclass
class ExportedGraph:
    """What :func:`export_graph_module` captured."""

    gm: fx.GraphModule
    """The forward's ATen graph: parameters and buffers as ``get_attr`` of the module's own
    names, one placeholder per top-level argument of the call, the flat output leaves."""
    argument_names: list[str]
    """The placeholders' names, in the order of the call's positional then keyword arguments."""
    output_spec: pytree.TreeSpec
    """The forward's output structure over the graph's output leaves."""
    plain_failure: str = ""
    """Empty where the forward was captured as plain training runs it; else why that capture
    failed (the graph then holds the branches the forward takes under ``torch.export``)."""
    unpadded: bool = False
    """The graph skips Hugging Face's attention masks, which pad no token on the example (as
    plain training skips them on their values): it holds for calls whose masks pad none."""


@dataclass
class PlainReads:
    """What :func:`as_plain_training` changed for the forward it ran."""

    exporting: bool = False
    """The forward's own code asked ``torch.compiler.is_exporting()`` (and was told False)."""
    caches: bool = False
    """A cache the planner's calls turn off was on (:func:`~lightning_remat.graph.calls.caches_as_configured`)."""
    unpadded: bool = False
    """Hugging Face's masks were skipped on the example's values (an attention mask that pads
    no token), as plain training skips them: the graph is specialised to such masks."""

    @property
    def changed(self) -> bool:
        return self.exporting or self.caches or self.unpadded


def _torchs_own(frame_globals: dict[str, Any]) -> bool:
    name = str(frame_globals.get("__name__", ""))
    return name == "torch" or name.startswith("torch.")


_MASK_SKIPS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
"""Hugging Face's tests (``transformers.masking_utils``) of whether sdpa can run without a
materialised mask: on a mask's values, which they do not read on fake tensors."""


@contextlib.contextmanager
def _masks_read_as_plain(unpadded: frozenset[tuple[int, ...]], reads: PlainReads) -> Iterator[None]:
    """Inside, Hugging Face's mask-skipping tests answer for a traced padding mask of a shape
    in ``unpadded`` (the example's masks that pad no token) as plain training answers for
    the example's values: as for no mask at all."""
    masking = sys.modules.get("transformers.masking_utils")
    originals = {name: getattr(masking, name, None) for name in _MASK_SKIPS} if unpadded and masking else {}

    def reading(original: Any) -> Any:
        @functools.wraps(original)
        def skip(padding_mask: Any, *args: Any, **kwargs: Any) -> Any:
            # A real tensor is read by the test itself; export's (fake, functional) are not.
            if (isinstance(padding_mask, torch.Tensor) and type(padding_mask) is not torch.Tensor
                    and tuple(padding_mask.shape) in unpadded):
                reads.unpadded = True
                return original(None, *args, **kwargs)
            return original(padding_mask, *args, **kwargs)
        return skip

    try:
        for name, original in originals.items():
            if original is not None:
                setattr(masking, name, reading(original))
        yield
    finally:
        for name, original in originals.items():
            if original is not None:
                setattr(masking, name, original)


@contextlib.contextmanager
def as_plain_training(module: nn.Module,
                      unpadded: frozenset[tuple[int, ...]] = frozenset()) -> Iterator[PlainReads]:
    """Inside, ``module``'s forward takes the branches it takes in plain training while
    ``torch.export`` runs it: code outside torch reads ``torch.compiler.is_exporting()`` as
    False (Hugging Face's masks then skip the causal mask for sdpa's ``is_causal`` where no
    token is padded, a choice made on shapes alone, which the graph is specialised to
    anyway); a Hugging Face cache the planner's calls turn off reads as the config sets it,
    and the forward's output holds None in its place (a training step never reads it). The
    module's ``forward`` and the flag are as they were after. ``unpadded``: the shapes of
    the example's attention masks that pad no token (:func:`~lightning_remat.inputs.unpadded_masks`),
    whose masks Hugging Face's code then skips as plain training does on their values."""
    reads = PlainReads()
    flag = torch.compiler.is_exporting

    def is_exporting() -> bool:
        if _torchs_own(sys._getframe(1).f_globals):
            return flag()
        reads.exporting = True
        return False

    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    own = module.forward

    @functools.wraps(own)  # export binds the call to the forward's own signature
    def forward(*args: Any, **kwargs: Any) -> Any:
        return without_caches(own(*args, **kwargs))

    with caches_as_configured() as reads.caches, _masks_read_as_plain(unpadded, reads):
        torch.compiler.is_exporting = is_exporting  # type: ignore[assignment]
        module.forward = forward  # type: ignore[method-assign]
        try:
            yield reads
        finally:
            torch.compiler.is_exporting = flag  # type: ignore[assignment]
            if had:
                module.forward = previous  # type: ignore[method-assign]
            else:
                module.__dict__.pop("forward", None)


def _argument_names(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The forward's parameter name of each positional input (``args_k`` past its named
    ones), then the keyword inputs' names."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    named = [p.name for p in parameters
             if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    names = [named[k] if k < len(named) else f"args_{k}" for k in range(len(inputs))]
    return names + list(kwargs)


def _read_leaf(graph: fx.Graph, argument: fx.Node, path: tuple[Any, ...]) -> fx.Node:
    """``getitem`` nodes reading the leaf at key ``path`` inside ``argument``."""
    node = argument
    for key in path:
        if isinstance(key, pytree.SequenceKey):
            node = graph.call_function(operator.getitem, (node, key.idx))
        elif isinstance(key, pytree.MappingKey):
            node = graph.call_function(operator.getitem, (node, key.key))
        else:
            raise NotImplementedError(
                f"an input holds tensors in a {type(key).__name__} structure; only tuples, "
                "lists and dicts of tensors are captured")
    return node


def _plain_meta(node: fx.Node) -> dict[str, Any]:
    """The node meta worth keeping: which module each op ran in (strings only; the fake
    tensors export keeps would not pickle with a plan's stages)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return {}
    entries = {key: (str(path), str(kind)) for key, (path, kind) in stack.items()}
    return {"nn_module_stack": entries}


def _export(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.export.ExportedProgram:
    """Non-strict ``torch.export`` without the source location it records on every node
    (``torch.fx.config.do_not_emit_stack_traces``, restored after): nothing here reads it, and
    its tracebacks were 16% of the export's time on the zoo's transformers (2-core CPU). A
    failed capture's error names the user's line all the same."""
    import torch.fx.config as fx_config

    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        return torch.export.export(module, inputs, kwargs, strict=False)
    finally:
        fx_config.do_not_emit_stack_traces = before


def export_graph_module(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any],
                        unpadded: frozenset[tuple[int, ...]] = frozenset()) -> ExportedGraph:
    """``module``'s forward on ``(inputs, kwargs)`` captured with non-strict ``torch.export``
    and turned into a GraphModule over ``module``'s own parameters and buffers (see the
    module docstring). Raises what ``torch.export`` raises when it cannot capture the
    forward, and ``NotImplementedError`` for a program this form cannot hold (custom
    objects, effect tokens, outputs that mutate inputs). ``unpadded``: as for
    :func:`as_plain_training`."""
    from torch.export.graph_signature import InputKind, OutputKind

    plain_failure = ""
    with opaque_functions() as functions, as_plain_training(module, unpadded) as reads:
        try:
            program = _export(module, inputs, kwargs)
        except Exception as exc:  # export raises many kinds (guards on data, unsupported ops)
            if not reads.changed:
                raise
            plain_failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    if plain_failure:  # its branches as torch.export runs it, the planner's calls' cache off
        with opaque_functions() as functions:
            program = _export(module, inputs, kwargs)
    signature = program.graph_signature
    call_signature = program.module_call_graph[0].signature
    assert call_signature is not None
    out_spec = call_signature.out_spec
    unsupported = [o.kind.name for o in signature.output_specs if o.kind != OutputKind.USER_OUTPUT]
    if unsupported:
        raise NotImplementedError(f"the exported forward has {', '.join(sorted(set(unsupported)))} outputs")

    graph = fx.Graph()
    names = _argument_names(module, inputs, kwargs)
    arguments = {name: graph.placeholder(name) for name in names}
    # The user inputs' placeholders are the leaves of (inputs, kwargs), in pytree order.
    leaves = pytree.tree_flatten_with_path((tuple(inputs), dict(kwargs)))[0]
    leaf_nodes: list[fx.Node] = []
    for path, _ in leaves:
        top = names[path[1].idx] if path[0].idx == 0 else path[1].key
        leaf_nodes.append(arguments[top] if len(path) == 2 else _read_leaf(graph, arguments[top], path[2:]))

    holder = nn.Module()
    holder._modules = dict(module._modules)  # the module's own children: their attributes
    holder._parameters = dict(module._parameters)
    holder._buffers = dict(module._buffers)
    env: dict[fx.Node, fx.Node] = {}
    user_inputs = iter(leaf_nodes)
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(signature.input_specs):
        raise NotImplementedError("the exported program's inputs do not match its signature")
    for node, spec in zip(placeholders, signature.input_specs):
        if spec.kind == InputKind.USER_INPUT:
            env[node] = next(user_inputs)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            env[node] = graph.get_attr(str(spec.target))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            name = f"_remat_constant_{len(holder._buffers)}"
            holder.register_buffer(name, program.constants[str(spec.target)], persistent=False)
            env[node] = graph.get_attr(name)
        else:
            raise NotImplementedError(f"the exported forward takes a {spec.kind.name} input")
    if next(user_inputs, None) is not None:
        raise NotImplementedError("the exported program's user inputs do not match the call's")
    for node in program.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            graph.output(tuple(fx.node.map_arg(node.args[0], env.__getitem__)))
            break
        call = replay_call(node, functions)
        if call is not None:  # a custom autograd function: its own apply, forward and backward
            copied = graph.call_function(call, (fx.node.map_arg(node.args[1], env.__getitem__),))
        else:
            copied = graph.node_copy(node, env.__getitem__)
        copied.meta = _plain_meta(node)
        env[node] = copied
    graph.set_codegen(StructuredOutput(out_spec))
    gm = fx.GraphModule(holder, graph, type(module).__name__)
    return ExportedGraph(gm=gm, argument_names=names, output_spec=out_spec, plain_failure=plain_failure[:300],
                         unpadded=reads.unpadded and not plain_failure)
