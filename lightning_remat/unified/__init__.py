"""The same integration for the unified ``lightning`` package (``import lightning as L``).

``lightning.pytorch`` is Lightning's copy of ``pytorch_lightning`` (Lightning builds one
from the other by rewriting the imports), with a ``Trainer``, a ``StrategyRegistry`` and
``Strategy`` and ``Callback`` classes of its own: a ``pytorch_lightning`` strategy is no
``lightning.pytorch`` strategy. Each module here runs the source of the module of the same
name in :mod:`lightning_remat.lightning` with its imports rewritten the same way
(:func:`exec_twin`): ``pytorch_lightning`` -> ``lightning.pytorch``, ``lightning_fabric`` ->
``lightning.fabric``, ``lightning_remat.lightning`` -> ``lightning_remat.unified``. Both
packages run one implementation, and the classes here subclass ``lightning.pytorch``'s::

    import lightning as L
    import lightning_remat  # "remat", "remat_ddp", "remat_fsdp" in both packages' registries
    from lightning_remat.unified import RematStrategy

    L.Trainer(strategy="remat")
    L.Trainer(strategy=RematStrategy(memory_budget="50%"))

Importing a module here imports ``lightning``, which must be installed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what IDEs and type checkers see
    from lightning_remat.lightning.batch_size import RematBatchSizeFinder, find_max_batch_size
    from lightning_remat.lightning.fsdp import RematFSDPStrategy
    from lightning_remat.lightning.memory_timeline import MemoryTimelineLogger
    from lightning_remat.lightning.strategy import RematDDPStrategy, RematStrategy

__all__ = ["MemoryTimelineLogger", "RematBatchSizeFinder", "RematDDPStrategy", "RematFSDPStrategy",
           "RematStrategy", "exec_twin", "find_max_batch_size"]

_EXPORTS = {
    "RematStrategy": "strategy", "RematDDPStrategy": "strategy", "RematFSDPStrategy": "fsdp",
    "MemoryTimelineLogger": "memory_timeline", "RematBatchSizeFinder": "batch_size",
    "find_max_batch_size": "batch_size",
}
"""Public name -> the module here that defines it (imported on first use, PEP 562)."""

RENAMED = {
    "pytorch_lightning": "lightning.pytorch",
    "lightning_fabric": "lightning.fabric",
    "lightning_remat.lightning": __name__,
}
"""The imports :func:`exec_twin` rewrites: a module named here, or one inside it."""

TWINNED = "lightning_remat.lightning"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def renamed(module: str) -> str:
    """``module`` as imported here (:data:`RENAMED`)."""
    for old, new in RENAMED.items():
        if module == old or module.startswith(old + "."):
            return new + module[len(old):]
    return module


class _RenameImports(ast.NodeTransformer):
    def __init__(self, filename: str) -> None:
        self.filename = filename

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom:
        if node.level == 0 and node.module:
            node.module = renamed(node.module)
        return node

    def visit_Import(self, node: ast.Import) -> ast.Import:
        for alias in node.names:
            new = renamed(alias.name)
            if new == alias.name:
                continue
            if alias.asname is None and "." in new:
                if "." in alias.name:  # `import a.b` binds `a`, which no rewrite can keep
                    raise ImportError(f"{self.filename}:{node.lineno}: write `import {alias.name} as NAME` "
                                      "(lightning_remat.unified rewrites the module it names)")
                alias.asname = alias.name  # `import pytorch_lightning` still binds that name
            alias.name = new
        return node


def exec_twin(namespace: dict[str, Any]) -> None:
    """Run, in ``namespace`` (a module here), the source of its twin in
    :mod:`lightning_remat.lightning` with the imports rewritten (:data:`RENAMED`). The code
    keeps the twin's file name and line numbers, so tracebacks show the lines that ran."""
    if importlib.util.find_spec("lightning") is None:
        raise ModuleNotFoundError(
            f"{namespace['__name__']} is lightning-remat for the `lightning` package, which is not "
            "installed: `pip install lightning`, or use lightning_remat's classes with pytorch_lightning",
            name="lightning")
    twin = TWINNED + namespace["__name__"][len(__name__):]
    spec = importlib.util.find_spec(twin)
    assert spec is not None and spec.origin is not None, twin
    source = Path(spec.origin).read_text(encoding="utf-8")
    tree = _RenameImports(spec.origin).visit(ast.parse(source, spec.origin))
    exec(compile(tree, spec.origin, "exec", dont_inherit=True), namespace)  # noqa: S102
