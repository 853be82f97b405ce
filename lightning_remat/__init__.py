"""lightning-remat: train within a memory budget by recomputing or offloading activations.

``import lightning_remat`` registers ``Trainer(strategy="remat")`` and ``"remat_ddp"``;
outside Lightning, ``lightning_remat.remat(module, example_input, memory_budget)`` is the
one call.
"""

from __future__ import annotations

from lightning_remat.budget import format_bytes, parse_budget
from lightning_remat.errors import RematError, RematInfeasibleError, TraceError
from lightning_remat.graph.ir import Graph
from lightning_remat.lightning.batch_size import RematBatchSizeFinder, find_max_batch_size
from lightning_remat.lightning.memory_timeline import MemoryTimelineLogger
from lightning_remat.lightning.strategy import RematDDPStrategy, RematStrategy
from lightning_remat.planner import remat
from lightning_remat.runtime.module import RematModule, apply_plan
from lightning_remat.solvers import SOLVERS, min_budget, solve
from lightning_remat.solvers.plan import Plan, Stage

__version__ = "0.1.0"

__all__ = [
    "SOLVERS", "Graph", "MemoryTimelineLogger", "Plan", "RematBatchSizeFinder", "RematDDPStrategy",
    "RematError", "RematInfeasibleError", "RematModule", "RematStrategy", "Stage", "TraceError",
    "__version__", "apply_plan", "find_max_batch_size", "format_bytes", "min_budget",
    "parse_budget", "remat", "solve",
]
