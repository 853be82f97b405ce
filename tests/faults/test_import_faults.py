"""Importing the package registers the strategies, so ``Trainer(strategy="remat")`` works
whichever of lightning_remat and pytorch_lightning is imported first, with no import hook
(Lightning has no way for another package to register a strategy name later, so the
import loads Lightning and torch); the command line and the solvers still load neither
TensorBoard, Optuna nor SQLAlchemy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_remat.graph.ir import Graph

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("tensorboard", "optuna", "sqlalchemy")
"""What only the search, the dashboards and the plan cache need."""


def _python(code: str, cwd: Path) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


LOADED = f"print(__import__('json').dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"


CLI_CALLS = [
    ["--help"], ["solve", "--help"],
    ["solve", "--graph", "g.json", "--budget", "60%"],
    ["solve", "--graph", "g.json", "--budget", "60%", "--solver", "kusumoto-tc", "--json"],
    ["min-budget", "--graph", "g.json", "--solver", "feng"],
    ["simulate", "--graph", "g.json", "--plans", "p.json"],
    ["simulate", "--graph", "g.json", "--plans", "p.json", "--json"],
]


def test_the_cli_loads_neither_optuna_nor_tensorboard_for_help_and_solving(tmp_path):
    """Every call in one fresh interpreter (each would import torch and Lightning again)."""
    from lightning_remat.solvers import get_solver

    Graph.chain([100] * 8).save(tmp_path / "g.json")
    (tmp_path / "p.json").write_text(get_solver("chen")(Graph.chain([100] * 8), None).to_json(indent=1))
    code = ("import sys, contextlib, io\n"
            "from lightning_remat.cli import main\n"
            f"for argv in {CLI_CALLS!r}:\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try: main(argv)\n"
            "        except SystemExit as exc: assert exc.code == 0, (argv, exc.code)\n"
            + LOADED)
    assert _python(code, tmp_path) == []


def test_the_package_and_the_solvers_import_without_the_searchs_libraries(tmp_path):
    code = ("import sys, lightning_remat, lightning_remat.solvers, lightning_remat.graph.ir, "
            "lightning_remat.budget, lightning_remat.errors\n"
            "lightning_remat.Graph, lightning_remat.solve, lightning_remat.format_bytes\n" + LOADED)
    assert _python(code, tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [
    # lightning_remat and pytorch_lightning in either order: tests/test_strategy.py
    ("lightning_remat.lightning.memory_timeline", "lightning_remat"),  # imports Lightning itself
])
def test_the_strategy_is_registered_whichever_is_imported_first(tmp_path, first, second):
    code = (f"import sys, {first}, {second}\n"
            "import pytorch_lightning as pl, lightning_remat\n"
            "trainer = pl.Trainer(strategy='remat', accelerator='cpu', devices=1, logger=False,\n"
            "                     enable_checkpointing=False, enable_progress_bar=False,\n"
            f"                     default_root_dir={str(tmp_path)!r})\n"
            "hooks = [f for f in sys.meta_path if type(f).__module__ == 'lightning_remat']\n"
            "print(__import__('json').dumps([type(trainer.strategy).__name__,\n"
            "      isinstance(trainer.strategy, lightning_remat.RematStrategy),\n"
            "      'remat_ddp' in pl.strategies.StrategyRegistry, len(hooks)]))")
    assert _python(code, tmp_path) == ["RematStrategy", True, True, 0]


def test_public_names_resolve_lazily_and_unknown_ones_raise():
    import lightning_remat

    assert set(lightning_remat.__all__) <= set(dir(lightning_remat))
    assert set(lightning_remat.__all__) == {*lightning_remat._EXPORTS, "__version__"}
    for name in lightning_remat.__all__:
        assert getattr(lightning_remat, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        lightning_remat.nothing  # noqa: B018
