"""``Trainer(strategy="remat")`` in both Lightning packages, whichever is imported first.

``pytorch_lightning`` and the unified ``lightning`` package (``lightning.pytorch``) each keep
a ``StrategyRegistry`` of their own, the only place their ``Trainer`` looks a strategy name
up (Lightning reads no entry point for strategies). :func:`register_when_imported` (run by
``import lightning_remat``) puts ``"remat"``, ``"remat_ddp"`` and ``"remat_fsdp"`` in the
registry of each package already imported, and in that of each package installed but not
imported yet as soon as its import finishes (:class:`AfterImport`). No Lightning package is
imported here.

A registry entry is :class:`StrategyClass`, which imports the strategy's module on first
use (the registry calls an entry with the Trainer's arguments): registering never imports
this project's Lightning code, so no import order can meet a partly imported module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["AfterImport", "PACKAGES", "STRATEGIES", "StrategyClass", "register", "register_when_imported"]

PACKAGES = {"pytorch_lightning": "lightning_remat.lightning", "lightning.pytorch": "lightning_remat.unified"}
"""Each Lightning package -> the package of this project's classes for it."""

STRATEGIES = {
    "remat": ("strategy", "RematStrategy", "Single-device training within a memory budget."),
    "remat_ddp": ("strategy", "RematDDPStrategy",
                  "Distributed data parallel within a memory budget."),
    "remat_fsdp": ("fsdp", "RematFSDPStrategy",
                   "Fully sharded data parallel (torch FSDP2) within a memory budget per rank."),
}
"""Strategy name -> (module, class, description)."""


class StrategyClass:
    """A registry entry: calling it imports ``module`` and builds its ``name`` class."""

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    def resolve(self) -> type:
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


def register(package: str) -> None:
    """Register the strategies in ``package``'s ``StrategyRegistry`` (replacing earlier
    entries of the same names); ``package`` is a key of :data:`PACKAGES`, already imported."""
    registry = importlib.import_module(f"{package}.strategies").StrategyRegistry
    ours = PACKAGES[package]
    for name, (module, cls, description) in STRATEGIES.items():
        if name in registry:
            registry.remove(name)
        registry.register(name, StrategyClass(f"{ours}.{module}", cls), description=description)


def _imported(name: str) -> bool:
    """``name`` is imported and has finished importing."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # the parent package is missing or broken
        return False


class _ThenLoader(importlib.abc.Loader):
    """The loader of a watched module: runs the real loader, then the callback."""

    def __init__(self, loader: importlib.abc.Loader, then: Callable[[], None]) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self.loader.exec_module(module)  # type: ignore[attr-defined]
        finally:  # the module keeps its own loader, as if no one had watched
            module.__loader__ = self.loader
            if module.__spec__ is not None:
                module.__spec__.loader = self.loader
        self.then()

    def __getattr__(self, name: str) -> Any:  # get_data, get_resource_reader, ...
        return getattr(self.loader, name)


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback when a module finishes importing (a post-import hook, as ``wrapt``'s
    ``when_imported``): the finder wraps the module's loader, and leaves ``sys.meta_path``
    once every watched module has been imported."""

    def __init__(self) -> None:
        self.pending: dict[str, Callable[[], None]] = {}

    @classmethod
    def installed(cls) -> AfterImport:
        """The one instance in ``sys.meta_path`` (put first there when missing)."""
        for finder in sys.meta_path:
            if type(finder).__name__ == cls.__name__ and hasattr(finder, "pending"):
                return finder  # type: ignore[return-value]
        finder = cls()
        sys.meta_path.insert(0, finder)
        return finder

    def watch(self, name: str, then: Callable[[], None]) -> None:
        self.pending[name] = then

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        then = self.pending.get(fullname)
        if then is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, lambda: self._fire(fullname))
        return spec

    def _fire(self, name: str) -> None:
        then = self.pending.pop(name, None)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        if then is None:
            return
        try:
            then()
        except Exception as exc:  # the user's import goes on; only the names are missing
            warnings.warn(f"lightning-remat could not register its strategies in {name}: {exc!r}",
                          stacklevel=2)


def register_when_imported() -> None:
    """Register the strategies in each Lightning package imported, and in each one installed
    as soon as it is imported."""
    for package in PACKAGES:
        if _imported(package):
            register(package)
        elif _installed(package.partition(".")[0]):
            AfterImport.installed().watch(package, lambda package=package: register(package))
