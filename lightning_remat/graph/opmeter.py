"""Op-by-op measurement of a training step (docs/design.md section 3): :class:`OpMeter`
measures one op's forward (time, workspace, output bytes, what autograd saves, which vertex
each output storage belongs to) and hooks its backward; :class:`NodeProfiler` runs the
traced forward node by node through a ``torch.fx.Interpreter`` and :class:`SubmoduleProfiler`
runs the model's own forward with each vertex submodule measured where it is called (the
tracer's fallback). Both measure each op alone from detached copies of its inputs in the
memory-safe mode.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from lightning_remat.graph.instruments import (
    INPUT,
    BackwardTimer,
    Clock,
    OpRecord,
    Workspace,
    output_bytes,
    storage_of,
)
from lightning_remat.graph.trace import Traced
from lightning_remat.graph.vertices import is_getitem
from lightning_remat.measure.peak import StepMeter
from lightning_remat.measure.timeline import tensors_in

__all__ = ["NodeProfiler", "OpMeter", "SubmoduleProfiler"]


class OpMeter:
    """Measures one op's forward (time, workspace, output bytes, what autograd saves, which
    vertex each output storage belongs to) and hooks its backward; shared by the fx
    interpreter and the fallback's submodule profiler."""

    def __init__(self, device: torch.device, excluded_ptrs: set[int], safe: bool, rounds: int,
                 meter: StepMeter | None = None) -> None:
        self.clock = Clock(device)
        self.workspace = Workspace(device, meter)
        self.timer = BackwardTimer(self.clock, self.workspace)
        self.excluded = excluded_ptrs
        self.safe = safe
        self.records = [OpRecord() for _ in range(rounds)]

    @property
    def record(self) -> OpRecord:
        return self.records[0]

    def measure_op(self, rec: OpRecord, vid: str, run: Callable[[], Any], labels: dict[int, str],
                   elements: Callable[[Any], Iterator[tuple[str, Any]]] | None) -> Any:
        """Run ``run()`` as vertex ``vid``'s op. ``labels``: input storage -> the vertex (or
        the input) it came from. ``elements``: for a tuple producer, (vertex, element) of
        its output; None when the op's output is the vertex's own."""
        packed: list[tuple[int, int]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.append(storage_of(t))
            return t

        ws_before = self.workspace.start()
        start = self.clock.begin()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        end = self.clock.mark()
        self.workspace.stop(ws_before, rec.ws_fwd, vid)
        rec.pending.append((vid, "fwd", start, end))

        # Which vertex each output storage belongs to: this node's own, or for a tuple
        # producer the getitem vertex that picks the element.
        own: dict[int, list[str]] = defaultdict(list)
        if elements is None:
            for t in tensors_in(out):
                own[storage_of(t)[0]].append(vid)
            rec.mem[vid] = output_bytes(out)
            rec.requires_grad[vid] = any(t.requires_grad for t in tensors_in(out))
            rec.numel[vid] = sum(t.numel() for t in tensors_in(out))
        else:
            for owner, element in elements(out):
                for t in tensors_in(element):
                    own[storage_of(t)[0]].append(owner)
        # Views and in-place results share an earlier vertex's storage: record the vertex
        # that owns it (the alias root), or that it is the storage of an input/parameter.
        for ptr, owners in own.items():
            source = labels.get(ptr)
            for k, owner in enumerate(dict.fromkeys(owners)):
                if ptr in self.excluded or source == INPUT:
                    rec.resident_views.add(owner)
                elif source is not None and source != owner:
                    rec.aliases[owner] = rec.root(source)
                elif k > 0:
                    rec.aliases[owner] = rec.root(owners[0])

        saved_here = rec.saved_ptrs[vid]
        for ptr, size in packed:
            if ptr in self.excluded or ptr in saved_here:
                continue
            saved_here[ptr] = size
            ref = own[ptr][0] if own.get(ptr) else labels.get(ptr)
            if ref == INPUT:
                rec.saved_input[vid] += size
            elif ref is not None and rec.root(ref) not in rec.saved_refs[vid]:
                rec.saved_refs[vid].append(rec.root(ref))
        self.timer.attach(vid, tensors_in(out), rec)
        return out


class NodeProfiler(fx.Interpreter, OpMeter):
    """Runs the traced forward node by node, measuring each compute node (docs/design.md section 3).

    ``safe=False``: one real step; ``run`` returns the output for the loss.
    ``safe=True``: the forward runs under ``no_grad``; each compute node is first measured
    ``rounds`` times on detached inputs with grad enabled, its own backward included.
    """

    def __init__(self, traced: Traced, device: torch.device, excluded_ptrs: set[int],
                 safe: bool = False, rounds: int = 1, meter: StepMeter | None = None) -> None:
        fx.Interpreter.__init__(self, traced.runner)
        OpMeter.__init__(self, device, excluded_ptrs, safe, rounds, meter)
        self.traced = traced
        self.charge = traced.charge
        ids = set(traced.graph.ids)
        self.vertex_of = {name: vid for name, vid in traced.charge.items() if vid in ids and name == vid}
        self.requires_grad: dict[str, Any] = {}
        """Safe mode: per node, the pytree of requires_grad flags of its grad-enabled output."""

    def run_node(self, n: fx.Node) -> Any:
        if n.name not in self.charge:
            return super().run_node(n)
        if not self.safe:
            return self._measure(n, self.records[0], prepare=None)
        for rec in self.records:
            self._measure_alone(n, rec)
        with torch.no_grad():
            return super().run_node(n)

    # -- one op ----------------------------------------------------------------------------
    def _label(self, a: fx.Node) -> str | None:
        if a.name in self.vertex_of:
            return self.vertex_of[a.name]
        if a.op == "placeholder":
            return INPUT
        return None

    def _measure(self, n: fx.Node, rec: OpRecord, prepare: Callable[[fx.Node, Any], Any] | None) -> Any:
        vid = self.charge[n.name]
        labels: dict[int, str] = {}

        def fetch(a: fx.Node) -> Any:
            value = self.env[a]
            if prepare is not None:
                value = prepare(a, value)
            label = self._label(a)
            if label is not None:
                for t in tensors_in(value):
                    labels.setdefault(storage_of(t)[0], label)
            return value

        args = fx.node.map_arg(n.args, fetch)
        kwargs = fx.node.map_arg(n.kwargs, fetch)
        elements = None if n.name in self.vertex_of else (lambda out: self._elements(n, out))
        return self.measure_op(rec, vid, lambda: getattr(self, n.op)(n.target, args, kwargs),
                               labels, elements)

    def _elements(self, n: fx.Node, value: Any) -> Iterator[tuple[str, Any]]:
        """(vertex id, element) for the getitem vertices under a tuple producer, nested
        tuples (an LSTM's ``(out, (h, c))``) included."""
        for user in n.users:
            if not is_getitem(user):
                continue
            element = value[user.args[1]]
            if user.name in self.vertex_of:
                yield self.vertex_of[user.name], element
            elif isinstance(element, (tuple, list)):
                yield from self._elements(user, element)

    def _measure_alone(self, n: fx.Node, rec: OpRecord) -> None:
        """Safe mode: forward and backward of one node from detached copies of its inputs."""
        inplace = _looks_inplace(n, self.module)
        try:
            self._measure_copy(n, rec, inplace)
        except RuntimeError as exc:
            # An in-place op the name did not reveal: autograd refuses it on a leaf.
            if inplace or "in-place" not in str(exc):
                raise
            self.timer.clear()
            self._measure_copy(n, rec, inplace=True)

    def _measure_copy(self, n: fx.Node, rec: OpRecord, inplace: bool) -> None:
        copies: set[int] = set()

        def prepare(a: fx.Node, value: Any) -> Any:
            if a.op in ("placeholder", "get_attr") or a.name not in self.requires_grad:
                return value
            flags = self.requires_grad[a.name]

            def detach(t: Any, flag: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                leaf = t.detach()
                if inplace:
                    leaf = leaf.clone()
                if flag:
                    leaf.requires_grad_(True)
                    copies.add(id(leaf))
                    if inplace:  # in-place ops refuse leaves that require grad
                        leaf = leaf.clone()
                        self.timer.claimed.add(leaf.grad_fn)
                return leaf

            return pytree.tree_map(detach, value, flags) if flags is not None else value

        self.timer.skip_leaves = copies
        with torch.enable_grad():
            out = self._measure(n, rec, prepare)
        outputs = [t for t in tensors_in(out) if t.requires_grad]
        self.requires_grad[n.name] = pytree.tree_map(
            lambda t: t.requires_grad if isinstance(t, torch.Tensor) else None, out
        )
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        rec.resolve(self.clock)
        self.timer.clear()
        del out, outputs


class SubmoduleProfiler(OpMeter):
    """The fallback's profiler (``Traced.kind == "children"``): the model's own forward runs,
    and each vertex submodule is measured where the forward calls it (its ``forward``
    replaced for the run), as the executor of :mod:`lightning_remat.runtime.hooked` wraps
    it. Safe mode: the forward runs under ``no_grad`` and each submodule is measured
    ``rounds`` times on detached inputs with grad enabled, its own backward included."""

    def __init__(self, traced: Traced, module: nn.Module, device: torch.device,
                 excluded_ptrs: set[int], safe: bool = False, rounds: int = 1,
                 meter: StepMeter | None = None) -> None:
        super().__init__(device, excluded_ptrs, safe, rounds, meter)
        self.traced, self.module = traced, module
        self.labels: dict[int, str] = {}
        """Storage -> the vertex that produced it (or the input)."""
        self.made: dict[int, weakref.ref] = {}
        """Storage -> the vertex output that holds it: a label outlives its tensor once the
        forward around the submodules frees it and the allocator hands its address to a
        tensor no vertex made."""

    def run(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        for t in tensors_in((list(inputs), kwargs)):
            self.labels[storage_of(t)[0]] = INPUT
        with self._measuring():
            return self.module(*inputs, **kwargs)

    @contextmanager
    def _measuring(self) -> Iterator[None]:
        missing = object()
        previous = [(child, child.__dict__.get("forward", missing)) for _, child in self.traced.children]
        for (name, child), (_, before) in zip(self.traced.children, previous):
            inner = before if before is not missing else partial(type(child).forward, child)
            child.forward = self._measured(name, inner)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for child, before in previous:
                child.__dict__.pop("forward", None)
                if before is not missing:
                    child.forward = before  # type: ignore[method-assign]

    def _measured(self, vid: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            labels: dict[int, str] = {}
            for t in tensors_in((list(args), kwargs)):
                ptr = storage_of(t)[0]
                holder = self.made.get(ptr)
                if ptr in self.labels and (holder is None or holder() is not None):
                    labels.setdefault(ptr, self.labels[ptr])
            if self.safe:
                for rec in self.records:
                    self._measure_alone(vid, inner, args, kwargs, labels, rec)
                with torch.no_grad():
                    out = inner(*args, **kwargs)
            else:
                out = self.measure_op(self.records[0], vid, lambda: inner(*args, **kwargs), labels, None)
            for t in tensors_in(out):
                ptr = storage_of(t)[0]
                if ptr not in labels:  # not a view of an input
                    self.labels[ptr] = vid
                    self.made[ptr] = weakref.ref(t)
            return out

        return forward

    def _measure_alone(self, vid: str, inner: Callable[..., Any], args: tuple, kwargs: dict,
                       labels: dict[int, str], rec: OpRecord) -> None:
        try:
            self._measure_copy(vid, inner, args, kwargs, labels, rec, clone=False)
        except RuntimeError as exc:
            if "in-place" not in str(exc) and "leaf" not in str(exc):
                raise
            self.timer.clear()
            self._measure_copy(vid, inner, args, kwargs, labels, rec, clone=True)

    def _measure_copy(self, vid: str, inner: Callable[..., Any], args: tuple, kwargs: dict,
                      labels: dict[int, str], rec: OpRecord, clone: bool) -> None:
        copies: set[int] = set()

        def detach(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            leaf = t.detach()
            source = labels.get(storage_of(t)[0])
            # Under the no-grad forward nothing requires grad: what a submodule's or the
            # forward's own op produced would, an input only if it did.
            wants = t.requires_grad or (source != INPUT and (t.is_floating_point() or t.is_complex()))
            if wants:
                if clone:
                    leaf = leaf.clone()
                leaf.requires_grad_(True)
                copies.add(id(leaf))
                if clone:
                    leaf = leaf.clone()
                    self.timer.claimed.add(leaf.grad_fn)
            return leaf

        copied_args, copied_kwargs = pytree.tree_map(detach, (list(args), kwargs))
        self.timer.skip_leaves = copies
        with torch.enable_grad():
            out = self.measure_op(rec, vid, lambda: inner(*copied_args, **copied_kwargs), labels, None)
        outputs = [t for t in tensors_in(out) if t.requires_grad]
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        rec.resolve(self.clock)
        self.timer.clear()
        del out, outputs


def _looks_inplace(n: fx.Node, root: nn.Module) -> bool:
    if n.op == "call_module":
        return bool(getattr(root.get_submodule(str(n.target)), "inplace", False))
    if n.kwargs.get("inplace"):
        return True
    name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name.startswith("__i")
