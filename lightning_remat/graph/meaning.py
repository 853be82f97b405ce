"""What a forward means beyond its ops: grad-mode regions, custom autograd functions and the
Python values it reads (docs/design.md section 3, "What the capture keeps").

``torch.fx`` runs a forward's context managers once while it traces and records nothing of
them, and it traces through ``torch.autograd.Function.apply`` into the function's forward;
non-strict ``torch.export`` keeps neither in a graph this package can run. Both read the
module's Python attributes once and bake what they read into the graph. A graph that passed
the output check of :mod:`lightning_remat.graph.trace` (run without grad) can therefore
still train something else: a teacher under ``torch.no_grad()`` gets gradients, a
straight-through estimator's own backward is replaced by the autograd of its forward.

:func:`lost_meaning` runs the module's own forward and the captured graph's replay on the
example input under :class:`ForwardEvents`, a ``TorchFunctionMode`` that counts the ops whose
autograd meaning depends on more than the op: an op with an input that requires grad run
with grad disabled (``no_grad``, ``set_grad_enabled(False)``), under inference mode, inside
a custom function's forward, or (with grad disabled around the call) run with grad enabled
(``enable_grad``). An op whose inputs require no grad records nothing either way (a rotary
table computed under ``no_grad`` from buffers means the same without it). What the forward
shows and the replay does not is a construct the capture lost; the tracer then takes the
model's own forward instead (which keeps it), or refuses naming the module, the line and
the construct.

:func:`state_reads` records the plain Python values (``bool``, ``int``, ``float``, ``str``,
``None``) the forward reads from the attributes of the module and its submodules, with the
line of the first read: the values a graph captured from this forward is specialised to.
The planner guards on them as Dynamo does: a call where one differs is a new input, captured
and planned again (:meth:`lightning_remat.planner.Planner.key`).
"""

from __future__ import annotations

import linecache
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from lightning_remat.device import is_sharded_unit
from lightning_remat.graph.effects import ModuleState, preserved_state

__all__ = ["ForwardEvents", "MeaningLostError", "StateRead", "guard_owners", "lost_meaning", "read_state",
           "state_reads"]

_SCALARS = (bool, int, float, str, type(None))

_SKIPPED_FILES = (os.path.dirname(torch.__file__) + os.sep,
                  os.path.dirname(os.path.dirname(__file__)) + os.sep)
"""Frames of torch and of this package: a construct's line is the first frame outside them."""


class MeaningLostError(RuntimeError):
    """The captured graph does not replay a construct of the forward (the message names it
    and its line)."""


def _function_forwards() -> dict[Any, str]:
    """The code object of every custom ``torch.autograd.Function`` subclass's ``forward``,
    with the class's name (a frame running one is inside that function's forward)."""
    found: dict[Any, str] = {}
    pending = list(torch.autograd.Function.__subclasses__())
    seen: set[type] = set()
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        pending.extend(cls.__subclasses__())
        forward = cls.__dict__.get("forward")
        code = getattr(getattr(forward, "__func__", forward), "__code__", None)
        if code is not None:
            found.setdefault(code, cls.__qualname__)
    return found


def _line_of(frame: Any) -> str:
    """``file:line: code`` of ``frame`` or, past torch's and this package's frames, of the
    first user frame that called it."""
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_FILES):
        frame = frame.f_back
    if frame is None:
        return "an unknown line"
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" + (f": {code}" if code else "")


class ForwardEvents(TorchFunctionMode):
    """Counts the ops run under it whose autograd meaning depends on the grad mode or on a
    custom function around them (see the module docstring), by construct, with the user's
    line of the first of each."""

    def __init__(self, grad_around: bool) -> None:
        super().__init__()
        self.grad_around = grad_around
        self.counts: Counter[str] = Counter()
        self.lines: dict[str, str] = {}
        self._forwards = _function_forwards()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        grad = torch.is_grad_enabled()
        if grad != self.grad_around or torch.is_inference_mode_enabled():
            tracked = any(isinstance(t, torch.Tensor) and t.requires_grad
                          for t in pytree.tree_leaves((args, kwargs)))
            if tracked:
                self._note(grad)
        return func(*args, **kwargs)

    def _note(self, grad: bool) -> None:
        frame = sys._getframe(2)
        while frame is not None:
            name = self._forwards.get(frame.f_code)
            if name is not None:
                construct = f"the custom autograd function {name} (torch.autograd.Function)"
                self.counts[construct] += 1
                self.lines.setdefault(construct, _line_of(frame.f_back))
                return
            frame = frame.f_back
        if torch.is_inference_mode_enabled():
            construct = "torch.inference_mode()"
        elif grad:
            construct = "torch.enable_grad()"
        else:
            construct = "torch.no_grad() (or set_grad_enabled(False))"
        self.counts[construct] += 1
        self.lines.setdefault(construct, _line_of(sys._getframe(2)))


def _events(module: nn.Module, run: Callable[[], Any], grad_around: bool, devices: Sequence[torch.device],
            reads: dict[tuple[str, str], StateRead] | None = None) -> ForwardEvents:
    """``run()`` under :class:`ForwardEvents` with grad as ``grad_around``, the module's
    state, buffers and RNG put back afterwards; with ``reads``, the attribute values the run
    reads are added to it (:func:`state_reads`)."""
    events = ForwardEvents(grad_around)
    with preserved_state(module, devices), torch.set_grad_enabled(grad_around):
        state = ModuleState(module, skip=is_sharded_unit)
        try:
            if reads is None:
                with events:
                    run()
            else:
                with state_reads(module) as found, events:
                    run()
                reads.update(found)
        finally:
            state.restore()
    return events


def lost_meaning(module: nn.Module, run_forward: Callable[[], Any], run_replay: Callable[[], Any],
                 devices: Sequence[torch.device]) -> tuple[list[str], list[StateRead]]:
    """The constructs of ``module``'s forward (``run_forward()``) that the captured graph's
    replay (``run_replay()``) does not keep, each as ``"<construct> at <line>"`` (empty when
    it keeps them all), and the plain Python values the forward read from the module's
    attributes (:func:`state_reads`). The replay runs only when the forward shows such a
    construct."""
    lost: list[str] = []
    reads: dict[tuple[str, str], StateRead] = {}
    for grad_around in (True, False):
        forward = _events(module, run_forward, grad_around, devices, reads if grad_around else None)
        if not forward.counts:
            continue
        replay = _events(module, run_replay, grad_around, devices)
        for construct, count in forward.counts.items():
            if replay.counts[construct] < count:
                lost.append(f"{construct} at {forward.lines[construct]}")
    return list(dict.fromkeys(lost)), list(reads.values())


@dataclass(frozen=True)
class StateRead:
    """A plain Python value the forward read from a module attribute."""

    module: str
    """Qualified name of the module (``""``: the root)."""
    attribute: str
    value: Any
    where: str = field(default="", compare=False)


_EXCLUDED = frozenset(nn.Module().__dict__) | frozenset(vars(nn.Module)) | {"forward"}
"""Not guarded: torch's own tables and class attributes, the training flag among them (the executor handles a
plan's mode: outside training the module's own forward or the graph's leaves read it live)."""


def _reading_class(cls: type, record: Callable[[nn.Module, str, Any], None]) -> type:
    def __getattribute__(self: nn.Module, name: str) -> Any:  # noqa: N807 - the hook's name
        value = cls.__getattribute__(self, name)
        if isinstance(value, _SCALARS) and name not in _EXCLUDED:
            record(self, name, value)
        return value

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__})


@contextmanager
def state_reads(module: nn.Module) -> Iterator[dict[tuple[str, str], StateRead]]:
    """Within the block, each plain Python value read from an attribute of ``module`` or a
    submodule (sharded units and script modules aside) is recorded, the first read of each
    ``(module name, attribute)`` kept, with the user's line. Each module's class is swapped
    for a subclass that records its reads for the block and put back after it."""
    names = {id(m): name for name, m in module.named_modules()}
    reads: dict[tuple[str, str], StateRead] = {}

    def record(owner: nn.Module, attribute: str, value: Any) -> None:
        name = names.get(id(owner))
        key = (name, attribute)
        if name is not None and key not in reads:
            reads[key] = StateRead(key[0], attribute, value, _line_of(sys._getframe(2)))

    swapped: list[tuple[nn.Module, type]] = []
    made: dict[type, type] = {}
    try:
        for sub in module.modules():
            cls = type(sub)
            if is_sharded_unit(sub) or isinstance(sub, torch.jit.ScriptModule) or "__slots__" in cls.__dict__:
                continue
            try:
                if cls not in made:
                    made[cls] = _reading_class(cls, record)
                sub.__class__ = made[cls]
            except TypeError:  # a class that cannot be subclassed or swapped: its reads go unseen
                continue
            swapped.append((sub, cls))
        yield reads
    finally:
        for sub, cls in swapped:
            sub.__class__ = cls


def guard_owners(module: nn.Module, reads: Sequence[StateRead]) -> list[tuple[nn.Module | None, str]]:
    """Each read's module (None where ``module`` has no such submodule now) and attribute,
    resolved once for :func:`read_state`."""
    owners: list[tuple[nn.Module | None, str]] = []
    for read in reads:
        try:
            owners.append((module.get_submodule(read.module) if read.module else module, read.attribute))
        except AttributeError:
            owners.append((None, read.attribute))
    return owners


def read_state(owners: Sequence[tuple[nn.Module | None, str]]) -> tuple[str, ...]:
    """The current value of each attribute of :func:`guard_owners` (``repr``; a read that
    raises now gives the exception's type), for the planner's key."""
    values = []
    for owner, attribute in owners:
        try:
            values.append(repr(getattr(owner, attribute)))
        except Exception as exc:  # noqa: BLE001 - a property may raise outside training
            values.append(f"<{type(exc).__name__}>")
    return tuple(values)
