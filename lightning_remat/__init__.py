"""lightning-remat: train within a memory budget by recomputing or offloading activations.

``import lightning_remat`` registers ``Trainer(strategy="remat")``; outside Lightning,
``lightning_remat.remat(module, example_input, memory_budget)`` is the one call.
"""

from __future__ import annotations

from typing import Any

from lightning_remat.budget import parse_budget
from lightning_remat.errors import RematError, RematInfeasibleError, TraceError
from lightning_remat.graph.ir import Graph, Node
from lightning_remat.lightning.strategy import RematDDPStrategy, RematStrategy  # registers "remat"
from lightning_remat.solvers.plan import Plan, Stage

__version__ = "0.1.0"

__all__ = [
    "Graph", "Node", "Plan", "RematDDPStrategy", "RematError", "RematStrategy", "RematInfeasibleError", "Stage", "TraceError",
    "__version__", "find_max_batch_size", "parse_budget", "remat",
]


def remat(*args: Any, **kwargs: Any) -> Any:
    """See :func:`lightning_remat.runtime.module.remat`."""
    from lightning_remat.runtime.module import remat as _remat

    return _remat(*args, **kwargs)


def find_max_batch_size(*args: Any, **kwargs: Any) -> Any:
    """See :func:`lightning_remat.lightning.batch_size.find_max_batch_size`."""
    from lightning_remat.lightning.batch_size import find_max_batch_size as _find

    return _find(*args, **kwargs)
