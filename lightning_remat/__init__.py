"""lightning-remat: train within a memory budget by recomputing or offloading activations.

``import lightning_remat`` registers ``Trainer(strategy="remat")``, ``"remat_ddp"`` and
``"remat_fsdp"``;
outside Lightning, ``lightning_remat.remat(module, example_input, memory_budget)`` is the
one call.

The strategies are registered in the ``StrategyRegistry`` of ``pytorch_lightning`` and of the
unified ``lightning`` package (``lightning.pytorch``), whichever is imported first
(:mod:`lightning_remat.registration`); importing this package imports neither. The public
names below are imported on first use (PEP 562): they are ``pytorch_lightning`` classes;
:mod:`lightning_remat.unified` holds the same classes for ``lightning.pytorch``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_remat import registration as _registration

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time see __getattr__
    from lightning_remat import remat
    from lightning_remat.budget import format_bytes, parse_budget
    from lightning_remat.errors import (
        RematError,
        RematInfeasibleError,
        SearchStoppedError,
        SolverDeclinedError,
        TraceError,
    )
    from lightning_remat.graph.ir import Graph
    from lightning_remat.lightning.batch_size import RematBatchSizeFinder, find_max_batch_size
    from lightning_remat.lightning.fsdp import RematFSDPStrategy
    from lightning_remat.lightning.memory_timeline import MemoryTimelineLogger
    from lightning_remat.lightning.strategy import RematDDPStrategy, RematStrategy
    from lightning_remat.runtime.module import RematModule, apply_plan
    from lightning_remat.solvers import SOLVERS, min_budget, solve
    from lightning_remat.solvers.plan import Plan, Stage

__version__ = "0.1.0"

_EXPORTS = {
    "format_bytes": "budget", "parse_budget": "budget",
    "RematError": "errors", "RematInfeasibleError": "errors", "SolverDeclinedError": "errors",
    "SearchStoppedError": "errors", "TraceError": "errors",
    "Graph": "graph.ir",
    "RematBatchSizeFinder": "lightning.batch_size", "find_max_batch_size": "lightning.batch_size",
    "MemoryTimelineLogger": "lightning.memory_timeline", "RematFSDPStrategy": "lightning.fsdp",
    "RematDDPStrategy": "lightning.strategy", "RematStrategy": "lightning.strategy",
    "remat": "planner.api",
    "RematModule": "runtime.module", "apply_plan": "runtime.module",
    "SOLVERS": "solvers", "min_budget": "solvers", "solve": "solvers",
    "Plan": "solvers.plan", "Stage": "solvers.plan",
}
"""Public name -> the module (under lightning_remat) that defines it."""

__all__ = [
    "SOLVERS", "Graph", "MemoryTimelineLogger", "Plan", "RematBatchSizeFinder", "RematDDPStrategy",
    "RematFSDPStrategy",
    "RematError", "RematInfeasibleError", "RematModule", "RematStrategy", "SearchStoppedError",
    "SolverDeclinedError", "Stage", "TraceError",
    "__version__", "apply_plan", "find_max_batch_size", "format_bytes", "min_budget",
    "parse_budget", "remat", "solve",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_remat' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_remat.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


# "remat", "remat_ddp" and "remat_fsdp" in the StrategyRegistry of pytorch_lightning and of
# lightning.pytorch: now for a package already imported, else as soon as it is (Lightning
# reads strategy names from its registry only; it has no entry point for strategies).
_registration.register_when_imported()
