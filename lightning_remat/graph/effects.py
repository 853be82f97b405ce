"""What a forward changes besides its outputs: buffers, module attributes, hooks
(docs/design.md section 5, "Side effects").

Plain training runs each module's forward once per step, so a step counter ``self.n += 1``,
``self.steps.add_(1)`` or a token count ``self.seen += x.shape[0]`` advances once per step,
and each hook fires once per call. The rematerialized module must do the same, whether a
stage runs once or is recomputed in the backward, and capturing the forward must leave the
user's module as it was. Three parts:

- **Capture** (:class:`StateTracer`, :func:`trace_keeping_state`): ``torch.fx`` treats buffers
  as constants, so an in-place update of a buffer runs once at trace time and is not in the
  graph, and ``self.seen += proxy`` leaves an fx ``Proxy`` in the module. The tracer takes a
  :class:`ModuleState` snapshot, notes every buffer written in place and every attribute
  rebound (with the user's source line), and puts the module back as it found it. When
  buffers were written, it traces again with buffers as graph values
  (``proxy_buffer_attributes``), so each update is a node of the graph; a buffer rebound to
  a traced value (``self.n = self.n + 1``) gets a node writing that value into it, where the
  forward assigned it. What the graph cannot hold (a Python attribute rebound, a buffer
  written through a path fx does not see) raises :class:`~lightning_remat.errors.SideEffectError`,
  naming the module and the line; the tracer's caller then runs the model's own forward
  instead (``runtime.hooked``), which keeps such effects, or refuses. A module carrying
  forward hooks is a leaf of the trace, so its hooks fire when it runs, not once at trace time.
- **Once per step** (:class:`OncePerStep`): a recomputed stage runs its code twice. Around
  the recomputation, the state the stage writes is set back to what it was when the
  stage's forward began (the recomputed values read what the forward read) and afterwards
  to what the forward left (the update counts once); forward hooks of the modules it calls
  are held back, as the forward fired them already. Forward pre-hooks do fire again: they
  prepare what the recomputed forward reads (``weight_norm``, pruning masks, FSDP gathering
  a unit's parameters), and without them the recomputation would differ from the forward.
- **Root hooks** (:func:`call_with_hooks`): the hooks registered on the module handed to
  ``remat`` fire around each call of the rematerialized module, with that module and the
  call's arguments and output, as in plain training.

Length: capture's bookkeeping of module state (what a forward writes, how a run puts it
back, how a recomputation keeps it to once per step) is one concern used by capture,
profile and executor alike.
"""

from __future__ import annotations

import linecache
import operator
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_remat.device import is_sharded_unit
from lightning_remat.errors import SideEffectError

__all__ = [
    "AUGMENTED_ASSIGNMENTS", "AugmentedProxy", "ModuleState", "OncePerStep", "StateChange", "StateTracer", "call_with_hooks", "has_forward_hooks",
    "augmented_out_of_place", "preserved_state", "preserved_training_state", "state_write_target",
    "trace_keeping_state",
    "write_buffer",
]

_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"forward"}
"""Attributes every ``nn.Module`` keeps for torch itself (hook tables, the parameter and
buffer tables, ``training``), and an instance ``forward`` (a route or a checkpointing
wrapper set around calls): not the module's own state."""

_SKIPPED_FILES = (os.path.dirname(torch.__file__) + os.sep,
                  os.path.dirname(os.path.dirname(__file__)) + os.sep)


def _user_line() -> str:
    """``file:line: code`` of the innermost frame outside torch and this package (the user's
    forward, where it assigns or updates state)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_FILES):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "an unknown line"
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" + (f": {code}" if code else "")


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or not isinstance(a, (bool, int, float, str, bytes, type(None), tuple)):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a tuple holding tensors compares elementwise
        return False


@dataclass
class StateChange:
    """One thing a forward changed: ``kind`` is ``"written"`` (a buffer updated in place),
    ``"rebound"`` (a buffer or attribute assigned a new object) or ``"added"``/``"deleted"``."""

    module: str
    """Qualified name of the module (``""``: the root)."""
    cls: str
    attribute: str
    kind: str
    buffer: bool
    where: str = ""

    def describe(self) -> str:
        owner = f"{self.cls}.forward" + (f" (module {self.module!r})" if self.module else "")
        what = "buffer" if self.buffer else "attribute"
        verb = {"written": "updates", "rebound": "assigns", "added": "adds", "deleted": "deletes"}[self.kind]
        return f"{owner} {verb} its {what} {self.attribute!r}" + (f" at {self.where}" if self.where else "")


class ModuleState:
    """A snapshot of what a forward may change in ``module`` and its submodules: each
    buffer's object, version counter and value, and each attribute that is the module's own
    (not torch's hook and parameter tables). :meth:`changes` lists what differs now;
    :meth:`restore` puts it all back. Sharded units (torch FSDP) keep their own attributes,
    which their hooks change by design."""

    def __init__(self, module: nn.Module, *, values: bool = True, skip: Callable[[nn.Module], bool] | None = None,
                 private: bool = True) -> None:
        self.entries: list[tuple[str, nn.Module, dict[str, Any], dict[str, Any]]] = []
        self.versions: dict[int, tuple[torch.Tensor, int, torch.Tensor | None]] = {}
        self.private = private
        for name, sub in module.named_modules():
            own = {} if skip is not None and skip(sub) else {
                k: v for k, v in sub.__dict__.items() if self._own(k)}
            self.entries.append((name, sub, own, dict(sub._buffers)))
            for buf in sub._buffers.values():
                if isinstance(buf, torch.Tensor) and id(buf) not in self.versions:
                    saved = buf.detach().clone() if values else None
                    self.versions[id(buf)] = (buf, buf._version, saved)
        self.skip = skip
        self.ignored: set[tuple[int, str]] = set()
        """(id of a module, attribute) set by the tracer itself (fx's ``_tensor_constant0``):
        neither a change nor undone."""
        self.lines: dict[tuple[int, str], str] = {}
        """Where each change was made, by (id of the module or buffer, attribute), when known."""

    def changes(self) -> list[StateChange]:
        found: list[StateChange] = []
        for name, sub, attrs, buffers in self.entries:
            cls = type(sub).__name__
            for key, buf in buffers.items():
                now = sub._buffers.get(key, None) if key in sub._buffers else _MISSING
                if now is _MISSING:
                    found.append(StateChange(name, cls, key, "deleted", True, self._line(sub, key)))
                elif now is not buf:
                    found.append(StateChange(name, cls, key, "rebound", True, self._line(sub, key)))
                elif isinstance(buf, torch.Tensor) and buf._version != self.versions[id(buf)][1]:
                    found.append(StateChange(name, cls, key, "written", True,
                                             self.lines.get((id(buf), ""), "")))
            if self.skip is not None and self.skip(sub):
                continue
            for key in sub._buffers.keys() - buffers.keys():
                found.append(StateChange(name, cls, key, "added", True, self._line(sub, key)))
            now_attrs = {k: v for k, v in sub.__dict__.items() if self._own(k) and (id(sub), k) not in self.ignored}
            for key, value in attrs.items():
                if key not in now_attrs:
                    found.append(StateChange(name, cls, key, "deleted", False, self._line(sub, key)))
                elif not _same_value(now_attrs[key], value):
                    found.append(StateChange(name, cls, key, "rebound", False, self._line(sub, key)))
            for key in now_attrs.keys() - attrs.keys():
                found.append(StateChange(name, cls, key, "added", False, self._line(sub, key)))
        return found

    def _own(self, key: str) -> bool:
        return key not in _MODULE_INTERNALS and (self.private or not key.startswith("_"))

    def _line(self, sub: nn.Module, key: str) -> str:
        return self.lines.get((id(sub), key), "")

    def restore(self) -> None:
        for _, sub, attrs, buffers in self.entries:
            for key in list(sub._buffers):
                if key not in buffers:
                    del sub._buffers[key]
            for key, buf in buffers.items():
                now = sub._buffers.get(key)
                # A buffer moved or cast meanwhile (.to(), .half()) stays as it is now.
                if not (isinstance(now, torch.Tensor) and isinstance(buf, torch.Tensor)
                        and (now.device, now.dtype) != (buf.device, buf.dtype)):
                    sub._buffers[key] = buf
            if self.skip is not None and self.skip(sub):
                continue
            for key in [k for k in sub.__dict__ if self._own(k) and k not in attrs
                        and (id(sub), k) not in self.ignored]:
                del sub.__dict__[key]
            for key, value in attrs.items():
                if sub.__dict__.get(key, _MISSING) is not value:
                    sub.__dict__[key] = value
        with torch.no_grad():
            for buf, version, saved in self.versions.values():
                if saved is not None and buf._version != version:
                    buf.copy_(saved)


_MISSING = object()


# ---- capture ------------------------------------------------------------------------------
def has_forward_hooks(module: nn.Module) -> bool:
    """Whether hooks are registered on ``module`` that run when it is called (forward,
    forward pre- and backward hooks; torch's global module hooks aside)."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or module._backward_hooks or module._backward_pre_hooks)


class _BufferWrites(TorchDispatchMode):
    """Notes the user's line of each aten op that writes one of ``buffers`` in place (at
    trace time such a write runs on the real buffer, outside the graph)."""

    def __init__(self, state: ModuleState) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        schema = func._schema
        if schema.is_mutable:
            for arg, value in zip(schema.arguments, args):
                if (arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor)
                        and id(value) in self.state.versions and (id(value), "") not in self.state.lines):
                    self.state.lines[(id(value), "")] = _user_line()
        return func(*args, **(kwargs or {}))


AUGMENTED_ASSIGNMENTS = {
    "__iadd__": operator.iadd, "__isub__": operator.isub, "__imul__": operator.imul,
    "__itruediv__": operator.itruediv, "__ifloordiv__": operator.ifloordiv, "__imod__": operator.imod,
    "__ipow__": operator.ipow, "__iand__": operator.iand, "__ior__": operator.ior,
    "__ixor__": operator.ixor, "__ilshift__": operator.ilshift, "__irshift__": operator.irshift,
    "__imatmul__": operator.imatmul,
}
"""Python's augmented assignments and the ``operator`` function each is. ``fx.Proxy`` has
none of them, so Python falls back to the binary operator and ``out += identity`` is traced
as ``out + identity``: a new tensor where the forward wrote in place (docs/design.md
section 5, "Augmented assignment is in place")."""


class AugmentedProxy(fx.Proxy):
    """An ``fx.Proxy`` that traces ``a += b`` as ``operator.iadd(a, b)``, as the forward runs
    it: on a tensor it writes in place. On an immutable value (an int) the traced graph
    must not: :func:`augmented_out_of_place` turns those back into ``a + b`` once the graph
    ran on the example input."""


def _augmented(target: Callable[[Any, Any], Any]) -> Callable[[fx.Proxy, Any], fx.Proxy]:
    def method(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", target, (self, other), {})

    return method


for _name, _target in AUGMENTED_ASSIGNMENTS.items():
    setattr(AugmentedProxy, _name, _augmented(_target))


def augmented_out_of_place(graph: fx.Graph, kind: dict[str, str]) -> int:
    """Turn each augmented assignment traced in place (:class:`AugmentedProxy`) whose
    operand was not a tensor on the example input (``kind``: node name -> ``tensor``,
    ``tensors`` or ``other``, ``graph.vertices.ValueRecorder``) into the binary operator:
    ``n += 1`` on an int rebinds ``n`` and leaves the value its other readers hold, which
    fx's generated ``n += 1`` would not. Returns how many were turned."""
    out_of_place = {target: getattr(operator, name.replace("__i", "__", 1))
                    for name, target in AUGMENTED_ASSIGNMENTS.items()}
    turned = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in out_of_place or not node.args:
            continue
        operand = node.args[0]
        if isinstance(operand, fx.Node) and kind.get(operand.name) != "tensor":
            node.target = out_of_place[node.target]
            turned += 1
    return turned


class StateTracer(fx.Tracer):
    """``fx.Tracer`` that leaves the traced module as it found it and records what its
    forward changes (:attr:`changes`, :attr:`assigned`). ``proxy_buffers``: buffers are
    graph values, so in-place updates of them are graph nodes. ``leaf``: more modules to keep
    whole (FSDP units); a module with forward hooks is always one. Augmented assignments are
    traced as the in-place ops they are (:class:`AugmentedProxy`)."""

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return AugmentedProxy(node, self)

    def __init__(self, proxy_buffers: bool = False, leaf: Callable[[nn.Module], bool] | None = None) -> None:
        super().__init__()
        self.proxy_buffer_attributes = proxy_buffers
        self.record_stack_traces = proxy_buffers
        self.leaf = leaf
        self.changes: list[StateChange] = []
        self.assigned: dict[tuple[int, str], tuple[Any, fx.Node | None]] = {}
        """The last value assigned to each (module id, attribute) during the trace, and the
        graph's last node at that moment (where a write of it goes)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if has_forward_hooks(m) or (self.leaf is not None and self.leaf(m)):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        if not isinstance(root, nn.Module):
            return super().trace(root, concrete_args)
        state = ModuleState(root, skip=self.leaf)
        tree = {id(m) for m in root.modules()}
        original = nn.Module.__setattr__
        tracer = self

        def recording_setattr(module: nn.Module, name: str, value: Any) -> None:
            if sys._getframe(1).f_code.co_filename.startswith(_SKIPPED_FILES[0]):
                state.ignored.add((id(module), name))  # fx's own (a constant it keeps)
            elif id(module) in tree and getattr(tracer, "graph", None) is not None:
                state.lines[(id(module), name)] = _user_line()
                tracer.assigned[(id(module), name)] = (value, _last_node(tracer.graph))
            original(module, name, value)

        # Patched for the length of the trace, as fx patches Module.__call__ and __getattr__.
        nn.Module.__setattr__ = recording_setattr  # type: ignore[method-assign]
        try:
            with _BufferWrites(state):
                graph = super().trace(root, concrete_args)
        finally:
            nn.Module.__setattr__ = original  # type: ignore[method-assign]
            self.changes = state.changes()
            state.restore()
        return graph


def _last_node(graph: fx.Graph) -> fx.Node | None:
    nodes = graph.nodes
    return None if not len(nodes) else next(iter(reversed(nodes)))


def write_buffer(buffer: torch.Tensor, value: Any) -> None:
    """``module.name = value`` for a buffer, as a graph node: the value copied into the
    buffer (whose object the optimizer, the state_dict and the rematerialized module share),
    outside autograd, as a rebinding would leave the step's graph alone."""
    if not isinstance(value, torch.Tensor) or value.shape != buffer.shape or value.dtype != buffer.dtype:
        got = (f"a {tuple(value.shape)} {value.dtype} tensor" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise SideEffectError(
            f"the forward assigns {got} to a {tuple(buffer.shape)} {buffer.dtype} buffer; the "
            "rematerialized module updates buffers in place, so the new value must keep the "
            "buffer's shape and dtype: update it in place (buf.copy_(...), buf.add_(...)) or "
            "register it with its final shape and dtype")
    with torch.no_grad():
        buffer.copy_(value)


def state_write_target(node: fx.Node, owner: nn.Module | None = None) -> str | None:
    """The buffer (``get_attr`` target) ``node`` writes: an in-place op on it (``add_``,
    ``+=``) or a :func:`write_buffer`; None for any other node."""
    from lightning_remat.graph.ops import mutated_operand

    if node.op == "call_function" and node.target is write_buffer:
        first = node.args[0]
        return str(first.target) if isinstance(first, fx.Node) and first.op == "get_attr" else None
    if node.op == "call_module" and owner is None:
        return None
    operand = mutated_operand(node, owner)  # type: ignore[arg-type]
    if operand is not None and operand.op == "get_attr":
        return str(operand.target)
    return None


def _keep_rebound_buffers(tracer: StateTracer, graph: fx.Graph) -> None:
    """For each buffer the forward rebound to a traced value, a :func:`write_buffer` node
    where it was assigned (a rebinding to the in-place result on that very buffer, as
    ``+=`` gives, needs none). Anything else rebound cannot be kept in a graph."""
    for change in tracer.changes:
        if change.kind == "written" and change.buffer:
            raise SideEffectError(
                f"{change.describe() or change.cls}: torch.fx does not see this update "
                "(it goes through a path the trace reads as a constant)")
        if change.kind != "rebound" or not change.buffer:
            raise SideEffectError(change.describe())
        module = tracer.root.get_submodule(change.module)
        value, after = tracer.assigned.get((id(module), change.attribute), (None, None))
        if not isinstance(value, fx.Proxy):
            raise SideEffectError(change.describe() + " (a value computed without the inputs)")
        target = f"{change.module}.{change.attribute}" if change.module else change.attribute
        node = value.node
        if state_write_target(node, tracer.root) == target:
            continue  # ``+=`` on the buffer itself: the node already writes it
        anchor = after if after is not None else node
        with graph.inserting_after(anchor):
            buffer = graph.get_attr(target)
        with graph.inserting_after(buffer):
            graph.call_function(write_buffer, (buffer, node))


def trace_keeping_state(module: nn.Module, concrete_args: dict[str, Any] | None = None,
                        leaf: Callable[[nn.Module], bool] | None = None) -> fx.GraphModule:
    """``module``'s forward traced by ``torch.fx`` with every update of its buffers a node of
    the graph, so it runs once per forward (see the module docstring); ``module`` is left as
    it was, whatever happens. Raises :class:`~lightning_remat.errors.SideEffectError` for a
    change the graph cannot hold."""
    tracer = StateTracer(leaf=leaf)
    graph = tracer.trace(module, concrete_args)
    if tracer.changes:
        # A graph can hold updates of buffers only with the buffers as its values.
        unkeepable = [c for c in tracer.changes if not c.buffer]
        if unkeepable:
            raise SideEffectError(_refusal(unkeepable))
        tracer = StateTracer(proxy_buffers=True, leaf=leaf)
        graph = tracer.trace(module, concrete_args)
        try:
            _keep_rebound_buffers(tracer, graph)
        except SideEffectError as exc:
            raise SideEffectError(_refusal([], str(exc))) from None
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


def _refusal(changes: Iterable[StateChange], detail: str = "") -> str:
    lines = [c.describe() for c in changes] + ([detail] if detail else [])
    return ("the forward changes module state that a traced graph cannot keep: " + "; ".join(lines)
            + ". Keep such state in a buffer updated in place (self.register_buffer('n', "
            "torch.zeros(())) and self.n += 1), or move the update out of forward (into "
            "training_step or a callback)")


# ---- once per step ------------------------------------------------------------------------
@dataclass
class OncePerStep:
    """The state one recomputed stage writes, kept as the forward left it
    (see the module docstring). ``tensors()``: the buffers the stage writes;
    ``modules()``: the modules whose forward hooks the recomputation holds back;
    ``attributes``: whether to also set back the modules' own attributes (the fallback
    runs their Python code again). Use one per call: :meth:`forward` and
    :meth:`recompute` are the contexts checkpoint's ``context_fn`` returns."""

    tensors: Callable[[], list[torch.Tensor]]
    modules: Callable[[], list[nn.Module]] = lambda: []
    attributes: bool = False
    before: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    before_attrs: list[tuple[nn.Module, dict[str, Any]]] = field(default_factory=list)

    @contextmanager
    def forward(self) -> Iterator[None]:
        self.before = [(t, t.detach().clone()) for t in self.tensors()]
        if self.attributes:
            self.before_attrs = [(m, _own_attributes(m)) for m in self.modules()]
        yield

    @contextmanager
    def recompute(self) -> Iterator[None]:
        after = [(t, t.detach().clone()) for t, _ in self.before]
        after_attrs = [(m, _own_attributes(m)) for m, _ in self.before_attrs]
        held: list[tuple[nn.Module, Any]] = []
        with torch.no_grad():
            for t, value in self.before:
                t.copy_(value)
        for m, attrs in self.before_attrs:
            _set_attributes(m, attrs)
        for m in self.modules():
            if m._forward_hooks and not _is_sharded(m):
                held.append((m, m._forward_hooks))
                m._forward_hooks = type(m._forward_hooks)()
        try:
            yield
        finally:
            # Also when checkpoint stops the recomputation early (it raises to stop).
            for m, hooks in held:
                m._forward_hooks = hooks
            with torch.no_grad():
                for t, value in after:
                    t.copy_(value)
            for m, attrs in after_attrs:
                _set_attributes(m, attrs)


def _own_attributes(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in module.__dict__.items() if k not in _MODULE_INTERNALS}


def _set_attributes(module: nn.Module, attrs: dict[str, Any]) -> None:
    for key in [k for k in module.__dict__ if k not in _MODULE_INTERNALS and k not in attrs]:
        del module.__dict__[key]
    module.__dict__.update(attrs)


def _is_sharded(module: nn.Module) -> bool:
    return is_sharded_unit(module)


# ---- the root's hooks ---------------------------------------------------------------------
def call_with_hooks(module: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``forward(*args, **kwargs)`` called through ``module``'s own ``__call__``, so its
    hooks fire around it as in a plain call of ``module`` (pre-hooks may change the
    arguments, forward hooks the output). ``module`` keeps its own ``forward``."""
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    routed = True

    def restore() -> None:
        nonlocal routed
        if routed:
            routed = False
            if had:
                module.__dict__["forward"] = previous
            else:
                del module.__dict__["forward"]

    def once(*call_args: Any, **call_kwargs: Any) -> Any:
        restore()  # inside, ``module`` is itself again (planning a new input traces it)
        return forward(*call_args, **call_kwargs)

    module.__dict__["forward"] = once
    try:
        return module(*args, **kwargs)
    finally:
        restore()


# ---- measuring runs leave no trace ------------------------------------------------------
@contextmanager
def preserved_state(module: nn.Module, devices: Sequence[torch.device] = ()) -> Iterator[None]:
    """Restore buffers (BatchNorm running statistics, the objects a forward rebinds them
    to), the module's own public attributes (a counter ``self.calls += 1``), training flags
    and the RNG state on exit, so that measuring runs do not change what training would do
    next."""
    state = ModuleState(module, values=False, skip=is_sharded_unit, private=False)
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    modes = [(m, m.training) for m in module.modules()]
    cuda_devices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda_devices):
        try:
            yield
        finally:
            state.restore()
            with torch.no_grad():
                for buf, saved in buffers:
                    buf.copy_(saved)
            for m, mode in modes:
                m.training = mode


@contextmanager
def preserved_training_state(module: nn.Module) -> Iterator[None]:
    """:func:`preserved_state` plus the parameters and their gradients, for runs that take
    optimizer steps or accumulate gradients (measuring a step, a batch-size trial). The
    copies are kept on the host, so they take no device memory from the run they guard."""
    host = torch.device("cpu")
    params = {name: p.detach().to(host, copy=True) for name, p in module.named_parameters()}
    grads = {name: (None if p.grad is None else p.grad.detach().to(host, copy=True))
             for name, p in module.named_parameters()}
    devices = sorted({p.device for p in module.parameters()}, key=str)
    with preserved_state(module, devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in module.named_parameters():
                    p.copy_(params[name])
                    grad = grads[name]
                    p.grad = None if grad is None else grad.to(p.device)
