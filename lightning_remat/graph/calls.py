"""What a planned module's calls run with, where it differs from what the module holds.

A forward that takes ``use_cache`` and whose ``config`` turns the cache on (Hugging Face's
decoders: ``use_cache=True`` by default) returns a cache of past keys and values beside its
output. The cache is for generation: a training step never reads it, ``torch.export``
cannot capture it (a ``DynamicCache`` in the output), and a forward recomputed in the
backward would fill it twice. Hugging Face's own gradient checkpointing turns it off in
training. A planned module's calls do the same: while one runs, every such config in the
module (the root's or a submodule's, where a LightningModule holds the model) reads
``use_cache=False``, and reads what it held again after; a call that passes ``use_cache``
itself still decides for itself, as Hugging Face reads the argument before the config
(docs/design.md section 3).

The capture of a call by ``torch.export`` is the exception (:func:`caches_as_configured`):
it runs the forward with the cache as the config sets it, as plain training runs it, and
drops the cache from the captured output (:func:`without_caches`), so the graph holds the
ops of plain training's forward: with the cache off, Hugging Face's decoders look for packed
sequences in their position ids, a test on the ids' values that a capture on fake tensors
cannot make, and take the explicit attention mask where plain training passes none
(docs/design.md section 3, "Plain's ops").
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["CACHE_OFF_NOTE", "cache_configs", "caches_as_configured", "caches_off", "without_caches"]

CACHE_OFF_NOTE = (
    "{names} keep{s} a cache of past keys and values (config.use_cache=True), which a step "
    "under a plan cannot capture and a training step never reads; its calls run with "
    "use_cache=False, as Hugging Face's gradient checkpointing does in training (a call "
    "that passes use_cache=True still gets the cache, and is captured coarsely in training)"
)


def cache_configs(module: nn.Module) -> list[tuple[str, Any]]:
    """``(module name, config)`` for each config in ``module`` (itself included) that turns
    a cache on for a forward taking ``use_cache``; a config shared by several modules once."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if id(config) in seen or getattr(config, "use_cache", False) is not True:
            continue
        try:
            takes = "use_cache" in inspect.signature(type(sub).forward).parameters
        except (TypeError, ValueError):
            takes = False
        if takes:
            seen.add(id(config))
            found.append((f"{name} ({type(sub).__name__})" if name else type(sub).__name__, config))
    return found


_turned_off: list[list[tuple[Any, Any]]] = []
"""What each :func:`caches_off` now entered turned off, outermost first: (config, the value
it held)."""


@contextlib.contextmanager
def caches_off(configs: list[tuple[str, Any]]) -> Iterator[None]:
    """Every config of ``configs`` reads ``use_cache=False`` inside, what it held after."""
    held = [(config, config.use_cache) for _, config in configs]
    _turned_off.append(held)
    try:
        for config, _ in held:
            config.use_cache = False
        yield
    finally:
        del _turned_off[next(i for i, entry in enumerate(_turned_off) if entry is held)]
        for config, value in held:
            config.use_cache = value


@contextlib.contextmanager
def caches_as_configured() -> Iterator[bool]:
    """Inside :func:`caches_off`: every config it turned off reads the value it held before
    (the user's), and ``use_cache=False`` again after. Yields whether any config changed."""
    first: dict[int, tuple[Any, Any]] = {}
    for held in _turned_off:  # outermost first: an inner one saw the outer's False
        for config, value in held:
            first.setdefault(id(config), (config, value))
    now = [(config, config.use_cache) for config, _ in first.values()]
    changed = [(config, value) for config, value in first.values() if config.use_cache != value]
    try:
        for config, value in changed:
            config.use_cache = value
        yield bool(changed)
    finally:
        for config, value in now:
            config.use_cache = value


def _is_cache(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face cache of past keys and values (a
    ``transformers.cache_utils.Cache``; transformers is not imported for the check)."""
    caches = sys.modules.get("transformers.cache_utils")
    cache_type = getattr(caches, "Cache", None)
    return isinstance(cache_type, type) and isinstance(value, cache_type)


def without_caches(outputs: Any) -> Any:
    """``outputs`` with every Hugging Face cache in it replaced by None (a ``ModelOutput``
    rebuilt without its ``past_key_values``, as a call with the cache off returns it)."""
    if not any(_is_cache(leaf) for leaf in pytree.tree_leaves(outputs, is_leaf=_is_cache)):
        return outputs
    return pytree.tree_map(lambda leaf: None if _is_cache(leaf) else leaf, outputs, is_leaf=_is_cache)
