"""Capture a module's forward as a graph of tensor-producing vertices (docs/design.md section 2).

``trace_module`` runs ``torch.fx.symbolic_trace`` with the default leaf policy (standard
``torch.nn`` layers stay one call; functional ops and tensor methods such as ``add``, ``cat``,
``flatten``, ``view`` become vertices of their own). Vertex ids are the fx node names, so a
plan over the :class:`~lightning_remat.graph.ir.Graph` maps back onto the traced module.

Which fx nodes are vertices is found by running the traced module once on the example input
(under ``no_grad``, in eval mode, buffers and RNG restored afterwards), and the vertex graph
built from what each node's value was (:mod:`lightning_remat.graph.vertices`).

Under sharded data parallelism (torch FSDP: ``fully_shard`` or ``FullyShardedDataParallel``)
each sharded unit below the traced module is a leaf: one vertex, called through its own
``__call__`` so FSDP's hooks gather its parameters before it runs and free them after (its
inside holds sharded parameters that only those hooks make usable). A plan then keeps,
recomputes or offloads whole units; a parameter counts at the size of the shard this rank
holds, as its gradient does (docs/design.md section 7, "Sharded training").

Length: the fx trace, the fallback and the sharded units' leaf policy decide together what a
vertex is (a unit the tracer keeps whole is one the fallback and the profiler call whole),
so they stay in one module.

When fx cannot trace the module (data-dependent control flow, iteration over a tensor, a
call that needs a tensor's value, ``*args``/``**kwargs``), or its graph does not reproduce
``module(x)`` on the example input, non-strict ``torch.export`` captures it
(:mod:`lightning_remat.graph.export`, kind ``"export"``: a vertex per ATen op, checked on
the example input as an fx trace is). When that fails too, no forward is rebuilt: the model's own forward keeps
running, with its control flow, and the submodules it calls exactly once become the vertices
(kind ``"children"``), to be checkpointed where the forward calls them
(:mod:`lightning_remat.runtime.hooked`). A ``UserWarning`` says why fx and export failed. When the
forward calls no submodule once (or fails on the example input), :class:`TraceError` names
the module class, what fx rejected and why the fallback cannot apply.

A graph that gives ``module(x)``'s output must also train as the forward does: the forward
and the graph's replay run again with grad (:mod:`lightning_remat.graph.meaning`), and a
grad-mode region or custom autograd function the graph drops sends the forward to the
fallback without trying export (which keeps neither), or is refused naming the module, the
construct and its line. The plain attribute values the forward read are the capture's
guards (:attr:`Traced.state_reads`; docs/design.md section 3, "What the capture keeps").
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from lightning_remat.device import fsdp_unit_types, is_sharded_unit
from lightning_remat.errors import SideEffectError, TraceError, warn_caller
from lightning_remat.graph.effects import (
    ModuleState,
    augmented_out_of_place,
    preserved_state,
    trace_keeping_state,
)
from lightning_remat.graph.export import export_graph_module
from lightning_remat.graph.ir import Graph, GraphMeta, Node
from lightning_remat.graph.meaning import MeaningLostError, StateRead, lost_meaning
from lightning_remat.graph.sharding import call_through
from lightning_remat.graph.vertices import (
    ValueRecorder,
    build_fx_graph,
    local_bytes,
    readers_follow_inplace,
)
from lightning_remat.inputs import unpadded_masks

__all__ = [
    "CHILDREN", "EXPORT", "Traced", "as_tuple", "default_loss", "loop_loss", "trace_module",
]


CHILDREN = "children"
"""``Traced.kind`` of the fallback: the model's own forward with its submodules as vertices."""
EXPORT = "export"
"""``Traced.kind`` of a forward captured by non-strict ``torch.export`` (ATen ops as vertices)."""


def _symbolic_trace(module: nn.Module, concrete_args: dict[str, Any] | None) -> fx.GraphModule:
    """``fx.symbolic_trace`` keeping the forward's updates of buffers in the graph and the
    module as it was (:func:`~lightning_remat.graph.effects.trace_keeping_state`), with FSDP
    units as leaves when the module holds any."""
    if not fsdp_unit_types() or not any(is_sharded_unit(m) for m in module.modules()):
        return trace_keeping_state(module, concrete_args)
    gm = trace_keeping_state(module, concrete_args, leaf=is_sharded_unit)
    graph = gm.graph
    # GraphModule copies each parameter it reads into a table of its own; FSDP2 swaps the
    # gathered parameter onto the owning module for each forward, so read the owner's table.
    for node in graph.nodes:
        if node.op == "get_attr":
            path = str(node.target).rpartition(".")[0]
            copy, real = gm.get_submodule(path), module.get_submodule(path)
            if copy is not real:
                object.__setattr__(copy, "_parameters", real._parameters)
    return gm


@dataclass
class Traced:
    """A traced module: the fx graph (or the submodules of the fallback) and the IR graph
    (zero costs).

    ``gm`` is None for the fallback (kind ``"children"``); ``children`` lists the
    ``(qualified name, module)`` of the submodules its forward calls once, in call order,
    and ``repeated`` the names of those it calls more than once (they run as they are).
    ``charge`` maps every fx node that computes something (every ``call_*`` node with tensor
    outputs) to the vertex id its time and saved bytes are charged to: a vertex to itself, a
    tuple-producing node to its first ``getitem`` vertex. ``call_args`` turns the example
    inputs into the positional arguments of ``gm``.
    """

    gm: fx.GraphModule | None
    graph: Graph
    kind: str
    children: list[tuple[str, nn.Module]] = field(default_factory=list)
    charge: dict[str, str] = field(default_factory=dict)
    fx_failure: str = ""
    """Why fx was not used (export and fallback only)."""
    export_failure: str = ""
    """Why torch.export was not used (fallback only; empty when it was not tried)."""
    repeated: list[str] = field(default_factory=list)
    export_branches: str = ""
    """For an export capture that could not run the forward as plain training runs it
    (:func:`~lightning_remat.graph.export.as_plain_training`): why; its graph holds the
    branches the forward takes under ``torch.export``, whose ops may round otherwise."""
    output_spec: pytree.TreeSpec | None = None
    """The pytree structure of the module's own output on the example call. fx records an
    ``OrderedDict`` or a ``defaultdict`` it returns as a plain dict; an exported graph
    returns the output's flat leaves, which this structure rebuilds."""
    unpadded: bool = False
    """The export capture skips Hugging Face's attention masks as plain training skips them
    on the example's values (none pads a token): the planner plans a call whose masks pad
    tokens on its own (:func:`~lightning_remat.inputs.masks_leaf`)."""
    state_reads: list[StateRead] = field(default_factory=list)
    """The plain Python values the forward read from the module's attributes, which a
    captured graph is specialised to (:mod:`lightning_remat.graph.meaning`): the planner
    captures and plans again when one changes. Empty for the fallback, whose own forward
    reads them live."""
    _signature_names: list[str] = field(default_factory=list, repr=False)
    _defaults: dict[str, Any] = field(default_factory=dict, repr=False)

    def granularity(self) -> str:
        """How finely the forward was captured, for the plan's notes: the capture path, the
        number of vertices and, for the fallback, which submodules are opaque and why."""
        count = len(self.graph)
        if self.kind == EXPORT:
            branches = (f"; the branches it takes under torch.export, not plain training's "
                        f"({self.export_branches}): its ops may round otherwise than plain's"
                        if self.export_branches else "")
            return (f"capture: torch.export (non-strict), {count} vertices, one per ATen op "
                    f"(torch.fx could not trace it: {self.fx_failure}){branches}")
        if self.kind == CHILDREN:
            why = f"torch.fx: {self.fx_failure}" + (
                f"; torch.export: {self.export_failure}" if self.export_failure else "")
            return (f"capture: the module's own forward, {count} vertices; opaque submodules, each "
                    f"kept or recomputed whole: {', '.join(name for name, _ in self.children)} ({why})")
        return f"capture: torch.fx, {count} vertices"

    def coarse_cause(self) -> str:
        """For the fallback, why a refused budget is out of reach and what captures the
        forward finely; "" for a capture at op granularity."""
        if self.kind != CHILDREN:
            return ""
        fix = ("call it with use_cache=False" if "Cache" in (self.export_failure or "")
               else "make its forward traceable by torch.fx or torch.export")
        return (f"The model was captured coarsely: its own forward runs with {len(self.graph)} "
                f"submodules, each kept or recomputed whole (torch.fx: {self.fx_failure}"
                + (f"; torch.export: {self.export_failure}" if self.export_failure else "")
                + f"): no plan goes below what recomputing them whole reaches; for a plan at op "
                f"granularity, {fix}")

    @property
    def runner(self) -> fx.GraphModule:
        """The GraphModule that runs the forward node by node (fx only: the fallback runs
        the model's own forward)."""
        if self.gm is None:
            raise TraceError(f"no fx graph: the module could not be traced ({self.fx_failure})")
        return self.gm

    def call_args(self, example_inputs: Any, example_kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Positional arguments for :attr:`runner` from the module's inputs."""
        inputs = list(as_tuple(example_inputs))
        kwargs = dict(example_kwargs or {})
        args = list(inputs)
        for name in self._signature_names[len(inputs):]:
            if name in kwargs:
                args.append(kwargs.pop(name))
            else:
                args.append(self._defaults.get(name))
        if kwargs:
            raise TraceError(f"unknown keyword inputs {sorted(kwargs)} for the traced forward")
        return args


def as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    """The example inputs as a tuple of positional arguments (a lone tensor becomes ``(x,)``)."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def loop_loss(outputs: Any) -> torch.Tensor:
    """The loss the profile stands in for the user's when none is given: a cross-entropy
    over each floating output's last dimension (a scalar output: its sum), the loss a
    training loop most often takes, whose gradient is as large as the outputs and which
    holds the log-probabilities beside them (docs/design.md section 4.7)."""
    terms = []
    for t in pytree.tree_leaves(outputs):
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            continue
        value = t.real if t.is_complex() else t
        if value.dim() == 0 or value.numel() == 0:
            terms.append(value.float().sum())
            continue
        logits = value.float().reshape(-1, value.shape[-1])
        target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        terms.append(torch.nn.functional.cross_entropy(logits, target))
    if not terms:
        raise ValueError("the module's output holds no floating tensor to build a loss from; pass loss_fn=")
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def default_loss(outputs: Any) -> torch.Tensor:
    """Sum of every floating tensor in the output structure (as float32)."""
    terms = [
        t.float().sum()
        for t in pytree.tree_leaves(outputs)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]
    if not terms:
        raise ValueError("the module's output holds no floating tensor to build a loss from; pass loss_fn=")
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total.real if total.is_complex() else total


# ---- running a module without leaving a trace ----------------------------------------------


def _devices_of(module: nn.Module, inputs: Sequence[Any]) -> list[torch.device]:
    devices = {p.device for p in module.parameters()} | {b.device for b in module.buffers()}
    devices |= {t.device for t in pytree.tree_leaves(list(inputs)) if isinstance(t, torch.Tensor)}
    return sorted(devices, key=str)


def _same(a: Any, b: Any) -> bool:
    """Equal output structures (same key paths; fx returns immutable dicts and lists) with
    allclose tensors."""
    pa, _ = pytree.tree_flatten_with_path(a)
    pb, _ = pytree.tree_flatten_with_path(b)
    if [str(path) for path, _ in pa] != [str(path) for path, _ in pb]:
        return False
    for (_, x), (_, y) in zip(pa, pb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if x.is_floating_point() or x.is_complex():
                if not torch.allclose(x, y, rtol=1e-3, atol=1e-5, equal_nan=True):
                    return False
            elif not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _compare_runs(module: nn.Module, run_a: Any, run_b: Any, devices: Sequence[torch.device]) -> tuple[Any, Any]:
    """Both callables' outputs, each run from the same RNG state (so dropout draws the same
    masks) and the same buffers and attributes (a forward may update them), without grad, in
    the module's current mode; buffers restored afterwards."""
    cuda_devices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    with preserved_state(module, devices), torch.no_grad():
        state = ModuleState(module, skip=is_sharded_unit)  # both start from it (graph.effects)
        with torch.random.fork_rng(devices=cuda_devices):
            out_a = run_a()
        state.restore()
        out_b = run_b()
    return out_a, out_b


_SCALARS = (bool, int, float, str, type(None))
"""Argument values fx specialises (``concrete_args``) rather than tracing as proxies."""


def _signature(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """Forward's parameter names, their defaults, and concrete_args: the arguments left at
    their defaults and the non-tensor scalars given (a flag, a mode string), so that
    ``if mask is not None`` and ``if flag:`` trace. A new value of such an argument is a new
    input for the planner, which traces again rather than run a graph traced for another."""
    sig = inspect.signature(module.forward)
    names: list[str] = []
    defaults: dict[str, Any] = {}
    for p in sig.parameters.values():
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise ValueError(f"{type(module).__name__}.forward takes *args/**kwargs")
        names.append(p.name)
        if p.default is not inspect.Parameter.empty:
            defaults[p.name] = p.default
    unknown = sorted(set(kwargs) - set(names))
    if unknown or len(inputs) > len(names):
        raise TraceError(f"{type(module).__name__}.forward does not take inputs {unknown or inputs}")
    given = dict(zip(names, inputs)) | kwargs
    concrete = {name: defaults[name] for name in names if name not in given and name in defaults}
    concrete.update({name: value for name, value in given.items() if isinstance(value, _SCALARS)})
    return names, defaults, concrete


def _trace_fx(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], devices: list[torch.device]) -> Traced:
    names, defaults, concrete = _signature(module, inputs, kwargs)
    gm = _symbolic_trace(module, concrete or None)
    traced = Traced(gm=gm, graph=Graph([], []), kind="fx", _signature_names=names, _defaults=defaults)
    return _checked(module, traced, inputs, kwargs, devices)


def _trace_export(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any],
                  devices: list[torch.device], unpadded: frozenset[tuple[int, ...]] | None = None) -> Traced:
    """The forward captured by non-strict ``torch.export`` (:mod:`lightning_remat.graph.export`),
    the example's attention masks that pad no token skipped as plain training skips them
    (``unpadded``: their shapes; None: found in the call, :func:`~lightning_remat.inputs.unpadded_masks`)."""
    unpadded = unpadded_masks(inputs, kwargs) if unpadded is None else unpadded
    with preserved_state(module, devices):
        exported = export_graph_module(module, inputs, kwargs, unpadded)
    traced = Traced(gm=exported.gm, graph=Graph([], []), kind=EXPORT, output_spec=exported.output_spec,
                    export_branches=exported.plain_failure, _signature_names=exported.argument_names,
                    unpadded=exported.unpadded)
    try:
        return _checked(module, traced, inputs, kwargs, devices)
    except RuntimeError:
        if not traced.unpadded:
            raise
    # A mask of an unpadded shape was not the example's own (the forward padded one itself):
    # the masks as torch.export takes them, for every call.
    return _trace_export(module, inputs, kwargs, devices, frozenset())


def _checked(module: nn.Module, traced: Traced, inputs: tuple[Any, ...], kwargs: dict[str, Any],
             devices: list[torch.device]) -> Traced:
    """``traced`` with its vertex graph, once its graph was run on the example input and
    gave what ``module(...)`` gives."""
    gm = traced.runner
    args = traced.call_args(inputs, kwargs)
    recorder = ValueRecorder(gm)
    expected, got = _compare_runs(module, lambda: module(*inputs, **kwargs),
                                  lambda: call_through(module, lambda: recorder.run(*args)), devices)
    # The interpreter ran each node on values, so the run is right before the graph is: an
    # augmented assignment on an int becomes a binary op again, then the readers of a tensor
    # written in place read the write.
    if augmented_out_of_place(gm.graph, recorder.kind):
        gm.recompile()
    readers_follow_inplace(gm)
    if not _same(expected, got):
        raise RuntimeError(
            "the traced graph's output differs from module(...) on the example input "
            "(Python control flow was specialised at trace time)"
        )
    # The output check runs without grad: grad-mode regions and custom autograd functions
    # the graph does not replay are found by running both with grad (graph.meaning). Not
    # under FSDP, whose units expect a backward after each forward with grad.
    lost: list[str] = []
    if not any(is_sharded_unit(m) for m in module.modules()):
        lost, traced.state_reads = lost_meaning(
            module, lambda: module(*inputs, **kwargs),
            lambda: call_through(module, lambda: fx.Interpreter(gm).run(*args)), devices)
    if lost:
        raise MeaningLostError(f"a captured graph would drop {'; '.join(lost)}")
    if traced.kind != EXPORT:  # export's own spec is over its flat output leaves
        traced.output_spec = pytree.tree_structure(expected)
    traced.graph, traced.charge = build_fx_graph(gm, recorder.kind)
    traced.graph.meta.random = sorted(
        {traced.charge[n] for n in recorder.random if n in traced.charge}, key=traced.graph.position)
    if not len(traced.graph):
        raise RuntimeError("the traced graph computes no tensor")
    return traced


# ---- fallback: the model's own forward, its submodules checkpointed in place --------------


def _called_submodules(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any],
                       devices: list[torch.device]) -> tuple[list[str], list[str]]:
    """Run ``module``'s own forward once (no grad, state restored) and return (the
    submodules it calls exactly once, in call order; those it calls more than once). A
    submodule never called itself (a ``ModuleList``, a branch not taken) is looked into."""
    calls: dict[str, int] = {}
    order: list[str] = []

    def counter(name: str) -> Any:
        def pre_hook(mod: nn.Module, args: Any) -> None:
            calls[name] = calls.get(name, 0) + 1
            if calls[name] == 1:
                order.append(name)
        return pre_hook

    handles = [m.register_forward_pre_hook(counter(name))
               for name, m in module.named_modules() if name]
    try:
        with preserved_state(module, devices), torch.no_grad():
            module(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    units: list[str] = []
    repeated: list[str] = []

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            qualified = prefix + name
            count = calls.get(qualified, 0)
            if count == 1:
                units.append(qualified)
            elif count == 0:
                visit(child, qualified + ".")
            else:
                repeated.append(qualified)

    visit(module, "")
    position = {name: k for k, name in enumerate(order)}
    return sorted(units, key=position.__getitem__), repeated


def _trace_children(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any],
                    devices: list[torch.device]) -> Traced:
    """The fallback's graph: one vertex per submodule the forward calls once, in call
    order, each feeding the next (docs/design.md section 2). The forward itself is not
    rebuilt: :mod:`lightning_remat.runtime.hooked` runs the model's own forward and wraps
    these submodules where it calls them."""
    try:
        unit_names, repeated = _called_submodules(module, inputs, kwargs, devices)
    except Exception as exc:
        raise RuntimeError(f"its forward fails on the example input ({type(exc).__name__}: {exc})") from exc
    if not unit_names:
        raise RuntimeError(
            "its forward calls none of its submodules exactly once, so there is nothing to "
            "checkpoint where the forward calls it"
            + (f" ({', '.join(repeated)} called more than once)" if repeated else "")
        )
    units = [(name, module.get_submodule(name)) for name in unit_names]
    nodes = [Node(id=name, op=type(child).__name__) for name, child in units]
    edges = [(a, b) for (a, _), (b, _) in zip(units, units[1:])]
    counted: set[int] = set()  # a parameter shared by two submodules counts once
    param_bytes: dict[str, int] = {}
    for name, child in units:
        new = [p for p in child.parameters() if id(p) not in counted and p.requires_grad]
        counted.update(id(p) for p in new)
        if new:
            param_bytes[name] = sum(local_bytes(p) for p in new)
    meta = GraphMeta(input_consumers=[units[0][0]], outputs=[units[-1][0]],
                     param_bytes=param_bytes, shape_edges=[])
    return Traced(gm=None, graph=Graph(nodes, edges, meta), kind=CHILDREN, children=units,
                  charge={name: name for name, _ in units}, repeated=repeated)


def trace_module(module: nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None = None,
                 *, own_forward_because: str = "") -> Traced:
    """Trace ``module``'s forward into a :class:`Traced` (fx graph + IR graph with zero costs).

    ``example_inputs`` is a tensor or a tuple of positional inputs; ``example_kwargs`` the
    keyword inputs. Forward arguments not given keep their defaults and are specialised.
    When fx fails, captures the forward with non-strict ``torch.export``
    (:mod:`lightning_remat.graph.export`); when that fails too, falls back to the submodules
    the forward calls (with a ``UserWarning`` naming the module and both reasons); raises
    :class:`~lightning_remat.errors.TraceError` when that cannot apply either.
    ``own_forward_because``: go straight to the fallback, for this reason (the planner's
    when the attribute values a captured graph is specialised to keep changing).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"trace_module needs a torch.nn.Module, got {type(module).__name__}")
    inputs = as_tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    # Capture never changes the module: whatever its forward assigns or updates is put back.
    state = ModuleState(module, values=False, skip=is_sharded_unit)
    try:
        with _torch_logs_quiet():
            return _trace_module(module, inputs, kwargs, own_forward_because)
    finally:
        state.restore()


@contextmanager
def _torch_logs_quiet() -> Iterator[None]:
    """torch's own loggers (``torch._dynamo``, ``torch._subclasses.fake_tensor``, ...)
    disabled while a capture runs, and put back as they were after: a forward
    ``torch.export`` cannot capture makes them print the graph and the failed op's stack
    to stderr, which is the capture's business, not the user's (the planner's warning says
    why a capture fell back). The user's own loggers and the warnings are left alone."""
    import torch._dynamo  # noqa: F401  (its loggers exist before they are disabled)

    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    was = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in zip(loggers, was):
            logger.disabled = disabled


def _without_partial_graph(capture: Callable[[], Traced]) -> Traced:
    """``capture()``, what it writes to ``sys.stderr`` passed on after it but for the partial
    graph ``torch.export`` prints there when it fails (``partial_fx_graph``): the forward's
    own writes (the user's prints) reach stderr, the capture's dump does not."""
    written = io.StringIO()
    dropped = ""
    try:
        with contextlib.redirect_stderr(written):
            return capture()
    except Exception as exc:
        dropped = str(getattr(exc, "partial_fx_graph", "") or "")
        raise
    finally:
        text = written.getvalue()
        if dropped:
            text = text.replace(dropped + "\n", "")  # export prints it at each level it passes
        if text:
            sys.stderr.write(text)


def _forward_error(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any],
                   devices: list[torch.device]) -> Exception | None:
    """What the module's own forward raises on the example input, run as plain PyTorch (with
    gradients, as training runs it; its state and the RNG put back after), or None when it
    runs: a forward that fails is the user's error to see as it is, not a capture's."""
    cuda_devices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    try:
        with preserved_state(module, devices), torch.random.fork_rng(devices=cuda_devices), \
                torch.enable_grad():
            module(*inputs, **kwargs)
    except Exception as exc:  # the user's code raises what it raises
        return exc
    return None


def _as_users(error: Exception, module: nn.Module) -> Exception:
    """``error``, raised by the user's forward, with one note saying where it came from."""
    error.add_note(f"lightning_remat: {type(module).__name__}.forward raised this on the example "
                   "input, run as plain PyTorch before its graph was captured; nothing was planned")
    return error


def _trace_module(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], own_forward_because: str = "") -> Traced:
    devices = _devices_of(module, list(inputs) + list(kwargs.values()))
    lost = ""
    try:
        if own_forward_because:
            raise MeaningLostError(own_forward_because)
        return _trace_fx(module, inputs, kwargs, devices)
    except SideEffectError as exc:  # the model's own forward keeps what fx cannot
        fx_reason = str(exc)
        effects = True
    except MeaningLostError as exc:  # export keeps custom functions (graph.functions); the probe checks it
        fx_reason = lost = str(exc)
        effects = bool(own_forward_because)
    except TraceError:
        raise
    except Exception as exc:  # fx raises many kinds: TraceError, TypeError, NotImplementedError
        fx_reason = _reason(exc)
        effects = False
    # Whatever fx rejected, a forward that fails when run as it is fails for the user.
    failure = _forward_error(module, inputs, kwargs, devices)
    if failure is not None:
        raise _as_users(failure, module)
    export_reason = ""
    # Export cannot keep FSDP's units whole, and would run a Python side effect only once.
    if not effects and not any(is_sharded_unit(m) for m in module.modules()):
        try:
            traced = _without_partial_graph(lambda: _trace_export(module, inputs, kwargs, devices))
        except Exception as exc:  # export raises many kinds (user errors, guards on data, unsupported ops)
            export_reason = _reason(exc)
        else:
            traced.fx_failure = fx_reason
            return traced
    try:
        traced = _trace_children(module, inputs, kwargs, devices)
    except Exception as exc:
        if lost:
            raise TraceError(
                f"cannot train {type(module).__name__} as its forward means: {lost}, and its own "
                f"forward cannot run with its submodules checkpointed in place instead: {exc}. Move "
                "that construct into a submodule's forward, called once (its forward then runs as "
                "written), or leave the module unplanned; the module is unchanged") from None
        if effects:
            raise SideEffectError(
                f"cannot capture {type(module).__name__}: {fx_reason}; and its own forward cannot "
                f"run with its submodules checkpointed in place instead: {exc}") from None
        raise TraceError(
            f"cannot trace {type(module).__name__}: torch.fx rejected its forward ({fx_reason})"
            + (f", torch.export too ({export_reason})" if export_reason else "")
            + f", and it cannot be checkpointed in place: {exc}. Make forward fx-traceable (move "
            "the data-dependent part into a submodule) or call each part as a submodule once"
        ) from None
    traced.fx_failure = fx_reason
    traced.export_failure = export_reason
    note = (f"; {', '.join(traced.repeated)} run as they are (called more than once)"
            if traced.repeated else "")
    exported = f"; torch.export could not capture it either ({export_reason})" if export_reason else ""
    if export_reason and "Cache" in export_reason:
        # A Hugging Face cache of past keys and values in the output: the fix is the call's.
        exported += ("; the output holds a cache of past keys and values: call it with "
                     "use_cache=False (the default under a plan where the call does not say)")
    warn_caller(
        f"torch.fx could not trace {type(module).__name__} ({fx_reason}){exported}; its own forward "
        f"runs, with the {len(traced.children)} submodules it calls checkpointed where it "
        f"calls them, one vertex each{note}: a coarse plan, each opaque submodule kept or "
        "recomputed whole")
    return traced


def _reason(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line for a warning: its type and the first line of its message,
    cut at ``limit`` characters (export's messages run to pages of advice)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(exc).__name__}: {text}".strip().rstrip(":")
