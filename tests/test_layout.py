"""The package reads as its data flow: every import points down the flow, nothing imports in a
circle, no module reaches for another's private names, and a module over 500 lines says why."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_remat

PACKAGE = Path(lightning_remat.__file__).parent

FLOW: list[tuple[str, ...]] = [
    ("budget",),
    ("errors",),
    ("inputs",),
    ("device", "streams", "imports"),
    ("measure.allocations", "measure.storage"),
    ("measure.peak",),
    ("measure.timeline",),
    ("graph.ir",),
    ("graph.ops",),
    ("graph.calls",),
    ("graph.effects",),
    ("graph.meaning",),
    ("graph.functions",),
    ("graph.export",),
    ("graph.vertices", "graph.sharding"),
    ("graph.trace",),
    ("graph.instruments",),
    ("graph.opmeter",),
    ("graph.profile",),
    ("graph.scale",),
    ("solvers.plan",),
    ("solvers.schedule",),
    ("solvers.step_memory",),
    ("solvers.simulate",),
    ("solvers.stage_costs", "solvers.scoring"),
    ("solvers.feng.linear", "solvers.feng.segments", "solvers.kusumoto.bits",
     "solvers.beaumont.chain"),
    ("solvers.feng.division", "solvers.kusumoto.family", "solvers.beaumont.schedule"),
    ("solvers.feng.arbitrary", "solvers.beaumont.greedy", "solvers.beaumont.dynprog"),
    ("solvers.chen", "solvers.feng", "solvers.hong", "solvers.kusumoto", "solvers.beaumont"),
    ("solvers.auto",),
    ("solvers",),
    ("solvers.policy",),
    ("runtime.stepcheck",),
    ("runtime.inplace",),
    ("runtime.offload", "runtime.stages", "runtime.hooked", "runtime.contexts"),
    ("runtime.module",),
    ("runtime.overhead",),
    ("cache",),
    ("messages",),
    ("step_budget",),
    ("planner.settings",),
    ("planner.first_step", "planner.stores"),
    ("planner",),
    ("planner.api",),
    ("tuning.study",),
    ("tuning.search",),
    ("tuning.predict", "tuning.ranks"),
    ("report",),
    ("registration",),
    ("lightning.memory_timeline", "lightning.synthetic"),
    ("lightning.strategy",),
    ("lightning.fsdp",),
    ("lightning.trial",),
    ("lightning.batch_size",),
    ("unified",),  # the same modules for lightning.pytorch: each runs its twin's source
    ("unified.memory_timeline", "unified.synthetic", "unified.strategy", "unified.fsdp",
     "unified.trial", "unified.batch_size"),
    ("cli",),
    ("",),  # lightning_remat/__init__.py: the public API
]
"""The stages of the flow, upstream first: a module may import from its own stage or above."""

EMPTY_PACKAGES = ("graph", "runtime", "lightning", "tuning", "measure")
"""Package ``__init__`` files that only name their folder (they import nothing)."""

LIGHTNING_FREE = ("budget", "errors", "inputs", "device", "measure", "imports", "graph", "solvers", "runtime",
                  "cache", "messages", "step_budget", "planner", "tuning", "report", "registration")
"""Modules that must work without Lightning (the solvers are algorithms over the graph IR)."""

LONG = 500


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _rank(name: str) -> int:
    for rank, stage in enumerate(FLOW):
        if name in stage:
            return rank
    raise AssertionError(f"lightning_remat.{name} is not placed in the flow: add it to FLOW")


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported package module, imported names, line) for every import of the package,
    lazy ones inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lightning_remat"):
                    found.append((alias.name.removeprefix("lightning_remat").lstrip("."), [], node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_remat"):
            base = node.module.removeprefix("lightning_remat").lstrip(".")
            names = [a.name for a in node.names]
            submodules = [f"{base}.{n}".lstrip(".") for n in names if f"{base}.{n}".lstrip(".") in MODULES]
            if submodules:
                found += [(m, [], node.lineno) for m in submodules]
            else:
                found.append((base, names, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    return {name: {m for m, _, _ in _imports(path)} for name, path in MODULES.items()}


def test_every_module_has_a_place_in_the_flow() -> None:
    for name in MODULES:
        if name not in EMPTY_PACKAGES:
            _rank(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down_the_flow(name: str) -> None:
    imports = _imports(MODULES[name])
    if name in EMPTY_PACKAGES:
        assert not imports, f"lightning_remat.{name} should import nothing"
        return
    upstream = [(m, line) for m, _, line in imports if m not in EMPTY_PACKAGES and _rank(m) > _rank(name)]
    assert not upstream, f"lightning_remat.{name} imports from further down the flow: {upstream}"


def test_nothing_imports_in_a_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or nxt not in graph:
                continue
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_names_across_modules(name: str) -> None:
    private = [(m, n, line) for m, names, line in _imports(MODULES[name]) for n in names
               if n.startswith("_") and m != name]
    assert not private, f"lightning_remat.{name} imports private names: {private}"


@pytest.mark.parametrize("name", [n for n in sorted(MODULES) if n.split(".")[0] in LIGHTNING_FREE])
def test_the_engine_does_not_import_lightning(name: str) -> None:
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                   else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for module in modules:
            assert not module.startswith(("pytorch_lightning", "lightning.", "lightning_fabric")) \
                and module != "lightning", f"lightning_remat.{name} imports {module}"
            assert not module.startswith("lightning_remat.lightning"), \
                f"lightning_remat.{name} imports the Lightning integration"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_long_module_says_why(name: str) -> None:
    source = MODULES[name].read_text()
    if source.count("\n") <= LONG:
        return
    docstring = ast.get_docstring(ast.parse(source)) or ""
    assert "Length:" in docstring, (
        f"lightning_remat.{name} has over {LONG} lines: split it, or say at its top why it is "
        "one module (a 'Length:' paragraph in its docstring)"
    )
