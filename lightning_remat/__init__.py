"""lightning-remat: train within a memory budget by recomputing or offloading activations.

``import lightning_remat`` registers ``Trainer(strategy="remat")``, ``"remat_ddp"`` and
``"remat_fsdp"``;
outside Lightning, ``lightning_remat.remat(module, example_input, memory_budget)`` is the
one call.

Importing the package is cheap: the names below are imported on first use (PEP 562), so
``remat()``, the solvers and the command line never load Lightning. The strategies are
registered at once when ``pytorch_lightning`` is already imported, and otherwise right after
it is (:class:`_RegisterWhenLightningLoads`), whichever of the two is imported first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time see __getattr__
    from lightning_remat.budget import format_bytes, parse_budget
    from lightning_remat.errors import RematError, RematInfeasibleError, TraceError
    from lightning_remat.graph.ir import Graph
    from lightning_remat.lightning.batch_size import RematBatchSizeFinder, find_max_batch_size
    from lightning_remat.lightning.fsdp import RematFSDPStrategy
    from lightning_remat.lightning.memory_timeline import MemoryTimelineLogger
    from lightning_remat.lightning.strategy import RematDDPStrategy, RematStrategy
    from lightning_remat.planner import remat
    from lightning_remat.runtime.module import RematModule, apply_plan
    from lightning_remat.solvers import SOLVERS, min_budget, solve
    from lightning_remat.solvers.plan import Plan, Stage

__version__ = "0.1.0"

_EXPORTS = {
    "format_bytes": "budget", "parse_budget": "budget",
    "RematError": "errors", "RematInfeasibleError": "errors", "TraceError": "errors",
    "Graph": "graph.ir",
    "RematBatchSizeFinder": "lightning.batch_size", "find_max_batch_size": "lightning.batch_size",
    "MemoryTimelineLogger": "lightning.memory_timeline", "RematFSDPStrategy": "lightning.fsdp",
    "RematDDPStrategy": "lightning.strategy", "RematStrategy": "lightning.strategy",
    "remat": "planner",
    "RematModule": "runtime.module", "apply_plan": "runtime.module",
    "SOLVERS": "solvers", "min_budget": "solvers", "solve": "solvers",
    "Plan": "solvers.plan", "Stage": "solvers.plan",
}
"""Public name -> the module (under lightning_remat) that defines it."""

__all__ = [
    "SOLVERS", "Graph", "MemoryTimelineLogger", "Plan", "RematBatchSizeFinder", "RematDDPStrategy",
    "RematFSDPStrategy",
    "RematError", "RematInfeasibleError", "RematModule", "RematStrategy", "Stage", "TraceError",
    "__version__", "apply_plan", "find_max_batch_size", "format_bytes", "min_budget",
    "parse_budget", "remat", "solve",
]

_STRATEGIES = ("lightning_remat.lightning.strategy", "lightning_remat.lightning.fsdp")
"""Importing them registers the strategies in pytorch_lightning's registry."""


def _register_strategies() -> None:
    for name in _STRATEGIES:
        importlib.import_module(name)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_remat' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_remat.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _RegistersAfterExec(importlib.abc.Loader):
    """The loader of ``pytorch_lightning``, and then the strategies' registration."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _register_strategies()


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Registers the strategies right after ``pytorch_lightning`` is first imported, and
    leaves ``sys.meta_path`` as it found it at that point (Lightning has no entry point for
    strategies: its registry fills itself from its own package)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "pytorch_lightning":
            return None
        _remove_hook()
        spec = importlib.util.find_spec(fullname)  # the finders after this one decide
        if spec is not None and spec.loader is not None:
            spec.loader = _RegistersAfterExec(spec.loader)
        return spec


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterWhenLightningLoads)]


if "pytorch_lightning" in sys.modules:
    _register_strategies()
elif not any(isinstance(f, _RegisterWhenLightningLoads) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())
