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
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["CACHE_OFF_NOTE", "cache_configs", "caches_off"]

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


@contextlib.contextmanager
def caches_off(configs: list[tuple[str, Any]]) -> Iterator[None]:
    """Every config of ``configs`` reads ``use_cache=False`` inside, what it held after."""
    held = [(config, config.use_cache) for _, config in configs]
    try:
        for config, _ in held:
            config.use_cache = False
        yield
    finally:
        for config, value in held:
            config.use_cache = value
