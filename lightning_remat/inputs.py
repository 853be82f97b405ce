"""The input key: what a plan depends on in one call of the module.

A plan is made for one key and reused for every call with that key (docs/design.md section
4.7): every tensor's shape, dtype and device type, every other argument's value, the
containers they come in, and the precision the step runs at. The containers are walked by
``torch.utils._pytree`` (tuples, lists, dicts, named tuples, ordered dicts and whatever
else is registered with it); the key holds the tree's structure as one line of text beside
a description of each leaf, so that it pickles (the ranks gather keys), hashes and reads
the same in every process.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = [
    "InputKey", "autocast_state", "input_key", "is_precision", "key_changes", "masks_leaf", "moved_state",
    "precision_leaf", "same_values", "shapes_of", "stored_key", "unpadded_masks", "without_precision",
]

InputKey = tuple
"""What a plan depends on in a call: the precision (:func:`precision_leaf`), the structure
of the arguments, every tensor's shape, dtype and device type and every other argument's
value, with the forward's defaults filled in."""

_TENSOR = "tensor"
_PRECISION = "precision"
_STRUCTURE = "structure"
_MASKS = "unpadded attention masks"


def input_key(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> InputKey:
    """The arguments' part of an :data:`InputKey` for a call of a forward with ``signature``
    (None: unknown, the arguments are taken as given). ``f(x)`` and ``f(x, flag=True)``
    share a key when ``True`` is the default; keyword arguments given in another order
    share one too."""
    values: Any = (args, dict(sorted(kwargs.items())))
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            pass
        else:
            bound.apply_defaults()
            # Named parameters come in the signature's order; **kwargs in the caller's: sorted.
            arguments = [dict(sorted(value.items())) if signature.parameters[name].kind is
                         inspect.Parameter.VAR_KEYWORD else value
                         for name, value in bound.arguments.items()]
            values = (tuple(arguments), {})
    leaves, spec = pytree.tree_flatten(values)
    return ((_STRUCTURE, _structure_text(spec)), *(_describe(leaf) for leaf in leaves))


@functools.lru_cache(maxsize=64)
def _structure_text(spec: pytree.TreeSpec) -> str:
    """The spec on one line: the same text in every process for the same structure (the key
    is computed at every call; a run meets few structures)."""
    return " ".join(str(spec).split())


def _describe(leaf: Any) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return (_TENSOR, tuple(leaf.shape), str(leaf.dtype), leaf.device.type)
    return repr(leaf)


def autocast_state(device: torch.device) -> str:
    """``"off"``, or the dtype autocast computes in on ``device``'s type (read at planning
    time: the strategy plans inside ``training_step``, where Lightning's precision plugin
    has already entered autocast)."""
    device_type = torch.device(device).type
    try:
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # torch < 2.4: per-device functions
        if device_type == "cpu":
            enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        else:
            enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return str(dtype) if enabled else "off"


def precision_leaf(module: nn.Module) -> Hashable:
    """The precision a step of ``module`` runs at now, as the first leaf of its keys: the
    autocast state on the CPU and on CUDA and the parameters' dtype (a step at another
    precision is another input: its plan was profiled at other costs)."""
    first = next(module.parameters(), None)
    return (_PRECISION, autocast_state(torch.device("cpu")), autocast_state(torch.device("cuda")),
            "none" if first is None else str(first.dtype))


def is_precision(leaf: Hashable) -> bool:
    """Whether ``leaf`` is a key's :func:`precision_leaf`."""
    return isinstance(leaf, tuple) and leaf[:1] == (_PRECISION,)


def without_precision(key: InputKey) -> InputKey:
    """The key less its precision (which a plan's basis records on its own)."""
    return tuple(leaf for leaf in key if not is_precision(leaf))


def stored_key(key: InputKey) -> str:
    """The text a stored plan (a checkpoint's, the cache's basis) is filed under: the key
    less the guarded attribute values, which a fresh process learns only when it captures;
    the stored graph's hash, checked against the new capture's, tells the branches apart."""
    return repr(tuple(leaf for leaf in key if not (_is_state(leaf) or _is_masks(leaf))))


def unpadded_masks(args: tuple, kwargs: dict) -> frozenset[tuple[int, ...]]:
    """The shapes of the call's attention masks (tensors passed as, or held in a container
    under, a name ending in ``attention_mask``) that pad no token (every entry nonzero),
    less the shapes of those that do: Hugging Face's forwards skip such a mask for sdpa's
    own causal or full attention, a choice on its values that a capture on fake tensors
    cannot make (:func:`lightning_remat.graph.export.as_plain_training`)."""
    unpadded: set[tuple[int, ...]] = set()
    padded: set[tuple[int, ...]] = set()
    for path, leaf in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        name = next((str(entry.key) for entry in reversed(path) if isinstance(entry, pytree.MappingKey)), "")
        if isinstance(leaf, torch.Tensor) and name.endswith("attention_mask") and leaf.dim() == 2:
            (unpadded if bool(leaf.all()) else padded).add(tuple(leaf.shape))
    return frozenset(unpadded - padded)


def masks_leaf(args: tuple, kwargs: dict) -> Hashable:
    """A key's leaf for a planner whose capture was specialised to attention masks that
    pad no token (:func:`unpadded_masks`): a call with padding is planned on its own."""
    return (_MASKS, tuple(sorted(unpadded_masks(args, kwargs))))


def _is_masks(leaf: Hashable) -> bool:
    return isinstance(leaf, tuple) and leaf[:1] == (_MASKS,)


def _is_tensor(leaf: Hashable) -> bool:
    return isinstance(leaf, tuple) and leaf[:1] == (_TENSOR,)


def same_values(key_a: InputKey, key_b: InputKey) -> bool:
    """Whether two input keys differ in tensor shapes only (same structure, same non-tensor
    values)."""
    if len(key_a) != len(key_b):
        return False
    return all((_is_tensor(a) and _is_tensor(b) and a[2:] == b[2:]) or a == b
               for a, b in zip(key_a, key_b))


def shapes_of(key: InputKey) -> list[list[int]]:
    """The tensor shapes in an input key, in order."""
    return [list(leaf[1]) for leaf in key if _is_tensor(leaf)]


def key_changes(old: InputKey, new: InputKey) -> dict[str, str]:
    """What differs between two input keys, by kind (``"shapes"``, ``"dtypes"``,
    ``"precision"``, ``"masks"``, ``"state"``, else ``"arguments"``: the non-tensor values or
    the structure), briefly."""
    tensors_old = [leaf[1:3] for leaf in old if _is_tensor(leaf)]
    tensors_new = [leaf[1:3] for leaf in new if _is_tensor(leaf)]
    changes = {}
    if [t[0] for t in tensors_old] != [t[0] for t in tensors_new]:
        changes["shapes"] = f"shapes {[list(t[0]) for t in tensors_old]} -> {[list(t[0]) for t in tensors_new]}"
    if [t[1] for t in tensors_old] != [t[1] for t in tensors_new]:
        changes["dtypes"] = f"dtypes {[t[1] for t in tensors_old]} -> {[t[1] for t in tensors_new]}"
    precision_old = [leaf for leaf in old if is_precision(leaf)]
    precision_new = [leaf for leaf in new if is_precision(leaf)]
    if precision_old != precision_new:
        def show(leaves: list) -> str:
            return "/".join(leaves[0][1:]) if leaves else "unknown"
        changes["precision"] = (f"precision (autocast on cpu/cuda, parameters) {show(precision_old)} "
                                f"-> {show(precision_new)}")
    masks_old = [leaf for leaf in old if _is_masks(leaf)]
    masks_new = [leaf for leaf in new if _is_masks(leaf)]
    if masks_old and masks_new and masks_old != masks_new:
        changes["masks"] = (f"attention masks padding no token: shapes {[list(s) for s in masks_old[0][1]]} -> "
                            f"{[list(s) for s in masks_new[0][1]]}")
    moved = moved_state(old, new)
    if moved:
        changes["state"] = "the module's attributes its forward read when captured: " + ", ".join(
            f"{name} {before} -> {after}" for name, (before, after) in moved.items())
    return changes or {"arguments": "non-tensor arguments"}


def moved_state(old: InputKey, new: InputKey) -> dict[str, tuple[str, str]]:
    """The guarded attributes (the planner's key) whose values differ between two keys:
    name -> (value in ``old``, value in ``new``)."""
    state_old = [leaf for leaf in old if _is_state(leaf)]
    state_new = [leaf for leaf in new if _is_state(leaf)]
    if not state_old or not state_new:
        return {}
    before = dict(zip(state_old[0][1], state_old[0][2]))
    return {name: (before[name], value) for name, value in zip(state_new[0][1], state_new[0][2])
            if name in before and before[name] != value}


def _is_state(leaf: Hashable) -> bool:
    """A key's leaf of guarded attribute values (the planner's :meth:`key`)."""
    return isinstance(leaf, tuple) and leaf[:1] == ("state",)
