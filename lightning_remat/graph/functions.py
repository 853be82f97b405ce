"""Custom ``torch.autograd.Function`` calls captured as one vertex each (docs/design.md
section 3, "What the capture keeps").

Non-strict ``torch.export`` traces through ``Function.apply`` into the function's forward
and records its ATen ops: a replay of that graph differentiates the forward's ops and drops
the function's own backward (a straight-through estimator's, a fused kernel's). While
:func:`opaque_functions` is entered, ``apply`` of a function defined outside torch is
recorded instead as one call of the custom op ``lightning_remat::autograd_function`` over
the call's tensors (its fake kernel runs the function's forward on the fake inputs for the
output shapes). :func:`replay_call` turns that op back into a :class:`FunctionCall`, which
runs ``Function.apply`` itself: the vertex runs the function's forward and, in the
backward, its backward, kept or recomputed whole like any other op.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = ["FunctionCall", "opaque_functions", "replay_call"]


class FunctionCall:
    """``cls.apply`` on one call site's arguments: the graph passes the call's tensors in
    order, the other arguments are the values the capture saw. Returns the function's
    output leaves as a tuple (the graph reads them with ``getitem``)."""

    fresh_outputs = True
    """The outputs are the function's own new tensors, not views of an operand
    (:func:`lightning_remat.graph.ops.viewed_operand`)."""

    def __init__(self, cls: type, spec: pytree.TreeSpec, constants: list[Any], is_tensor: list[bool],
                 out_spec: pytree.TreeSpec | None = None) -> None:
        self.cls = cls
        self.spec = spec
        self.constants = constants
        self.is_tensor = is_tensor
        self.out_spec = out_spec
        self.__name__ = cls.__name__
        self.__qualname__ = cls.__qualname__
        self.__module__ = cls.__module__

    def arguments(self, tensors: list[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        tensor_leaves, constant_leaves = iter(tensors), iter(self.constants)
        leaves = [next(tensor_leaves) if t else next(constant_leaves) for t in self.is_tensor]
        return pytree.tree_unflatten(leaves, self.spec)

    def __call__(self, tensors: list[torch.Tensor]) -> tuple[Any, ...]:
        args, kwargs = self.arguments(list(tensors))
        leaves, self.out_spec = pytree.tree_flatten(_original_apply(self.cls, *args, **kwargs))
        return tuple(leaves)

    def __repr__(self) -> str:
        return f"{self.cls.__qualname__}.apply"


_APPLY = torch.autograd.Function.__dict__["apply"]
"""``Function.apply`` as torch defines it (a classmethod, in C in recent versions)."""


def _original_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    return _APPLY.__get__(None, cls)(*args, **kwargs)

_calls: dict[int, FunctionCall] = {}
_keys = itertools.count()


@functools.cache
def _opaque_op() -> Any:
    """The custom op ``lightning_remat::autograd_function(key, tensors)``, registered on
    first use (importing the package registers nothing). Its kernels run the recorded
    function's forward; export runs only the fake one, and the captured graph calls
    :class:`FunctionCall` instead."""
    op = torch.library.custom_op("lightning_remat::autograd_function", _forward, mutates_args=())
    op.register_fake(_forward)
    return torch.ops.lightning_remat.autograd_function.default


def _forward(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    call = _calls[key]
    with torch.no_grad():
        outputs = call(tensors)
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        raise NotImplementedError(f"{call.cls.__qualname__}.forward returns a value that is not a tensor")
    # An op's outputs may not alias its inputs; only their shapes matter here.
    return [o.clone() for o in outputs]


def _is_users(cls: type) -> bool:
    return not cls.__module__.startswith("torch.")


@contextlib.contextmanager
def opaque_functions() -> Iterator[dict[int, FunctionCall]]:
    """While entered, a call of a custom ``Function``'s ``apply`` (one defined outside
    torch) on tensors is one ``lightning_remat::autograd_function`` op; yields the calls
    recorded, by key."""
    recorded: dict[int, FunctionCall] = {}

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        if not _is_users(cls) or not any(is_tensor):
            return _original_apply(cls, *args, **kwargs)
        call = FunctionCall(cls, spec, [x for x, t in zip(leaves, is_tensor) if not t], is_tensor)
        key = next(_keys)
        _calls[key] = recorded[key] = call
        outputs = _opaque_op()(key, [x for x, t in zip(leaves, is_tensor) if t])
        return pytree.tree_unflatten(list(outputs), call.out_spec)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
    try:
        yield recorded
    finally:
        torch.autograd.Function.apply = _APPLY  # type: ignore[method-assign]
        for key in recorded:
            _calls.pop(key, None)


def replay_call(node: fx.Node, recorded: dict[int, FunctionCall]) -> FunctionCall | None:
    """The :class:`FunctionCall` an exported ``lightning_remat::autograd_function`` node
    stands for, or None for any other node."""
    if node.op != "call_function" or not recorded or node.target is not _opaque_op():
        return None
    return recorded[int(node.args[0])]  # type: ignore[arg-type]
