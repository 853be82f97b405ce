"""Imports that an interrupt cannot leave half done.

Planning and the first recomputed step reach modules torch imports on first use: tracing
reaches ``torch._dynamo`` and ``torch.export``, selective checkpointing reaches
``torch.fx.experimental.symbolic_shapes``, and all of them import ``sympy``, which takes
about a second. A ``KeyboardInterrupt`` (Ctrl-C) inside that import leaves ``sys.modules``
half filled: Python removes the packages whose code was running (``sympy``), but keeps the
subpackages already loaded (``sympy.logic``); the next ``import sympy`` makes a new
``sympy`` module without them as attributes, and every later use of ``sympy.logic`` in
torch fails with ``module 'sympy' has no attribute 'logic'`` for the rest of the process.
:func:`sympy_imported` imports sympy whole before the block that would import it, or
leaves ``sys.modules`` as it was.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType

__all__ = ["import_whole", "sympy_imported"]

_WHOLE = ("sympy", "mpmath")
"""Pure Python packages :func:`sympy_imported` imports whole (sympy and what it imports)."""


def _drop_orphans(packages: tuple[str, ...]) -> None:
    """Remove the subpackages of ``packages`` whose package is not imported (left by an
    import interrupted before this module guarded it): imported again, they are whole."""
    for name in [n for n in sys.modules if n.partition(".")[0] in packages and "." in n]:
        if name.partition(".")[0] not in sys.modules:
            del sys.modules[name]


def import_whole(name: str, packages: tuple[str, ...] | None = None) -> ModuleType:
    """``importlib.import_module(name)``, all or nothing: where the import raises (an
    interrupt included), every module it added under a top-level package that was not
    imported before is removed again, so a later import starts afresh. ``packages``: the
    top-level packages it may clean up orphans of first (default: ``name``'s own)."""
    top = name.partition(".")[0]
    _drop_orphans(packages or (top,))
    before = set(sys.modules)
    tops_before = {n.partition(".")[0] for n in before}
    try:
        return importlib.import_module(name)
    except BaseException:
        for added in set(sys.modules) - before:
            if added.partition(".")[0] not in tops_before:
                sys.modules.pop(added, None)
        raise


@contextlib.contextmanager
def sympy_imported() -> Iterator[None]:
    """Inside, ``sympy`` is imported whole (:func:`import_whole`), and where this imported
    it the warning filters it adds are removed again on exit, with any the block adds (the
    library changes no global state)."""
    if "sympy" in sys.modules:
        yield
        return
    with warnings.catch_warnings():
        with contextlib.suppress(ImportError):  # without sympy, torch says so where it needs it
            import_whole("sympy", _WHOLE)
        yield
