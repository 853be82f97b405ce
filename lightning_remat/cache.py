"""Plans cached on disk, so a restart with the same setup skips profiling and solving.

Every plan is stored beside a :class:`PlanBasis`, the record of everything that decided it
(graph, inputs, device, budget, solver, precision, torch version, world size and sharding). A plan from the cache or
from a checkpoint is used only when its basis equals the current one field by field;
otherwise it is planned again, and :func:`describe_change` names what changed.

One SQLite file holds a row per basis (its digest) with the profiled graph and the plan as
JSON. A file that SQLite cannot read (not a database, a damaged page, a ``plans`` table of
another schema) is moved aside with one warning; the rows that can still be read are copied
into a fresh file, so the plans of other keys survive. An entry whose plan does not fit its
graph is dropped with a warning and never trusted; one that does is still simulated again on
its graph before it is used (:func:`resimulated`), so its prediction is the simulator's, not
the stored number. A cache that cannot be written or opened at
all (a read-only file or folder, a folder path under a file, a full disk) is not moved: one
warning says so and the run goes on without it, its plans made in memory and not stored.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from lightning_remat.errors import warn_caller
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan
from lightning_remat.solvers.scoring import make_plan

__all__ = [
    "CACHE_FOLDER", "CacheEntry", "PlanBasis", "PlanCache", "StoredPlan", "default_cache_dir",
    "describe_change", "is_access_problem", "move_aside", "resimulated", "sqlite_problem",
]

SCHEMA_VERSION = 3
COLUMNS = ("key", "description", "graph", "plan", "created")
_CREATE = ("CREATE TABLE IF NOT EXISTS plans (key TEXT PRIMARY KEY, description TEXT,"
           " graph TEXT NOT NULL, plan TEXT NOT NULL, created REAL NOT NULL)")

CACHE_FOLDER = "lightning_remat_cache"
"""The folder under a run's root that holds the plan cache and the batch-size study. Not
``lightning_remat``: with the root at a checkout of this project (Lightning's default root
is the working directory) that name is the package's own folder."""

_T = TypeVar("_T")


def default_cache_dir(root_dir: str | Path) -> Path:
    """``<root_dir>/lightning_remat_cache`` (see :data:`CACHE_FOLDER`)."""
    return Path(root_dir) / CACHE_FOLDER


@dataclass(frozen=True)
class PlanBasis:
    """Everything that decided a plan; a stored plan is reused only when all of it is equal."""

    graph_hash: str
    """The traced graph's structure (:meth:`Graph.graph_hash`)."""
    input_key: str
    """The call's input key as text: tensor shapes, dtypes, non-tensor values."""
    device_name: str
    budget: str
    """``repr`` of the budget as the user wrote it (``'60%'``, ``'4GiB'``, ``None``)."""
    solver: str
    """The solver's name and options."""
    autocast: str
    """The autocast state at planning time: ``"off"`` or the autocast dtype."""
    param_dtype: str
    """The dtypes of the module's parameters."""
    torch_version: str
    world_size: str = "1"
    """The number of processes training together (1 without torch.distributed)."""
    sharding: str = "none"
    """How the module's parameters are sharded (:func:`~lightning_remat.graph.sharding.sharding_of`):
    a sharded unit's parameters, gradients and gather buffers are part of the profile."""

    def digest(self) -> str:
        text = json.dumps([SCHEMA_VERSION, *asdict(self).values()])
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: Any) -> PlanBasis | None:
        """The basis stored as a dict, or None when it is not one (every field, each a str)."""
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or set(data) != set(names) \
                or not all(isinstance(data[n], str) for n in data):
            return None
        return cls(**data)


_LABELS = {
    "graph_hash": "model graph", "input_key": "inputs", "device_name": "device",
    "budget": "budget", "solver": "solver", "autocast": "autocast",
    "param_dtype": "parameter dtype", "torch_version": "torch", "world_size": "world size",
    "sharding": "sharding",
}


def describe_change(old: PlanBasis | None, new: PlanBasis, source: str) -> str:
    """One line saying why a stored plan (from ``source``: "checkpoint", "plan cache") is
    not used: the fields of ``old`` that differ from ``new``."""
    if old is None:
        return f"lightning-remat: the {source}'s plan does not record what decided it: planning again"
    was, now = [], []
    for name, label in _LABELS.items():
        a, b = getattr(old, name), getattr(new, name)
        if a != b:
            was.append(f"{label} {a}")
            now.append(f"{label} {b}")
    return (f"lightning-remat: the {source}'s plan was made for {', '.join(was)}, this run asks "
            f"for {', '.join(now)}: planning again")


@dataclass
class CacheEntry:
    graph: Graph
    plan: Plan


@dataclass(frozen=True)
class StoredPlan:
    """A plan as a checkpoint keeps it: graph and plan JSON beside the basis that decided it
    (None when the basis cannot be read: never reused)."""

    graph_json: str
    plan_json: str
    basis: PlanBasis | None

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph_json, "plan": self.plan_json,
                # Plain str (no str subclass such as TorchVersion): checkpoints load with
                # torch.load(weights_only=True).
                "basis": None if self.basis is None else {k: str(v) for k, v in asdict(self.basis).items()}}

    @classmethod
    def from_stored(cls, value: Any) -> StoredPlan:
        """A stored plan from its dict (:meth:`to_dict`); ValueError when it is not one, or
        its plan does not fit its graph."""
        if not (isinstance(value, dict) and isinstance(value.get("graph"), str)
                and isinstance(value.get("plan"), str)):
            raise ValueError(f"not a stored plan: {type(value).__name__}")
        stored = cls(value["graph"], value["plan"], PlanBasis.from_dict(value.get("basis")))
        Plan.from_json(stored.plan_json).validate(Graph.from_json(stored.graph_json))
        return stored


def resimulated(graph: Graph, plan: Plan, budget_bytes: int | None, whole_stages: bool = False,
                plain_fits: bool = False) -> Plan:
    """A stored plan (cache or checkpoint) as the simulator scores it on its own graph:
    stages, stored set and solver as stored, the predicted peak, margin and feasibility
    recomputed (:func:`~lightning_remat.solvers.scoring.make_plan`; ``whole_stages`` for a
    plan whose submodules are checkpointed on their own). A stored number is never trusted:
    a plan edited on disk, or made by another version's simulator, is scored as it would
    run. Raises ValueError saying why when the plan does not cover its graph, or when its
    guaranteed peak is over ``budget_bytes``; ``plain_fits``: the plain step was measured
    within the budget, so a plan that keeps everything is accepted on that measurement,
    as the planner's ``auto`` accepts it (docs/design.md section 4.7)."""
    checked = make_plan(graph, plan.stages, plan.solver, budget_bytes, stored=plan.stored,
                        extra_seconds=plan.predicted_extra_seconds, notes=plan.notes,
                        whole_stages=whole_stages)
    keeps_all = all(stage.action == "keep" for stage in checked.stages)
    if budget_bytes is not None and checked.guaranteed_peak_bytes > budget_bytes \
            and not (keeps_all and plain_fits):
        raise ValueError(f"simulated on its graph it peaks at {checked.guaranteed_peak_bytes} bytes "
                         f"(margin included), over the budget of {budget_bytes} bytes; it recorded "
                         f"{plan.guaranteed_peak_bytes}")
    if keeps_all and plain_fits:
        checked.feasible = True
    return checked


def sqlite_problem(path: str | Path) -> str | None:
    """Why SQLite cannot read ``path`` (None: it can, or the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        # Read-write: a journal left by a killed writer is rolled back first, as on any open.
        with closing(sqlite3.connect(path, timeout=30)) as db:
            verdict = db.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        if _is_busy(exc):
            return None
        return str(exc)
    return None if verdict == "ok" else str(verdict).splitlines()[0]


def move_aside(path: str | Path, reason: str, what: str) -> Path:
    """Move an unreadable SQLite file (and its journal) to ``<name>.corrupt`` (numbered when
    that exists) with one warning; returns where it went."""
    path = Path(path)
    aside = path.with_name(path.name + ".corrupt")
    number = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.corrupt{number}")
        number += 1
    path.replace(aside)
    # A journal left beside a new file of the same name would be replayed into it.
    for suffix in ("-journal", "-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.replace(aside.with_name(aside.name + suffix))
    warn_caller(f"lightning-remat: {what} {path} cannot be read ({reason}); moved it to {aside} "
                "and started a new one")
    return aside


def _is_busy(exc: sqlite3.DatabaseError) -> bool:
    """A lock held by another process: the file is fine, this access is not."""
    text = str(exc).lower()
    return "locked" in text or "busy" in text


_ACCESS_PROBLEMS = ("readonly", "read-only", "unable to open", "disk i/o error", "disk is full",
                    "permission denied", "not a directory", "file exists")


def is_access_problem(reason: str) -> bool:
    """Whether SQLite's or the OS's ``reason`` is about reaching or writing the file rather
    than its content: moving such a file aside would not help (and may not be possible)."""
    text = reason.lower()
    return any(words in text for words in _ACCESS_PROBLEMS)


class _Unreadable(Exception):
    """The file's content cannot be read back (SQLite or JSON)."""


class PlanCache:
    """A SQLite table of plans. Safe to share between runs; writes are atomic.

    A cache that cannot be used (:func:`is_access_problem`) warns once and then holds nothing:
    :meth:`get` finds no plan and :meth:`put` stores none, so planning goes on in memory.
    ``unusable`` says why (None while the cache works)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.unusable: str | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            problem = sqlite_problem(self.path) or self._schema_problem()
        except (OSError, sqlite3.Error) as exc:
            self._give_up(str(exc))
            return
        if problem is not None and is_access_problem(problem):
            self._give_up(problem)
        elif problem is not None:
            self._recover(problem)
        else:
            self._guarded(lambda db: db.execute(_CREATE), None)

    def _give_up(self, reason: str) -> None:
        """Stop using the cache for this run, with one warning."""
        if self.unusable is not None:
            return
        self.unusable = reason
        warn_caller(f"lightning-remat: plan cache {self.path} cannot be used ({reason}); training "
                    "goes on without it: plans are made in memory and not stored. Pass a writable "
                    "cache_dir to keep them")

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30)

    def _schema_problem(self) -> str | None:
        if not self.path.exists():
            return None
        try:
            with closing(self._connect()) as db:
                columns = tuple(row[1] for row in db.execute("PRAGMA table_info(plans)"))
        except sqlite3.DatabaseError as exc:
            return None if _is_busy(exc) else str(exc)
        if columns and columns != COLUMNS:
            return f"its plans table has columns {list(columns)}, not {list(COLUMNS)}"
        return None

    def _guarded(self, operation: Callable[[sqlite3.Connection], _T], default: _T) -> _T:
        """``operation`` in one transaction; a file SQLite cannot read is moved aside (and
        ``default`` returned), a lock held too long only skips the cache this time, a file that
        cannot be opened or written stops the cache for the run (:meth:`_give_up`)."""
        if self.unusable is not None:
            return default
        try:
            with closing(self._connect()) as db, db:
                return operation(db)
        except sqlite3.DatabaseError as exc:
            if _is_busy(exc):
                warn_caller(f"lightning-remat: plan cache {self.path} is busy ({exc}); not "
                            "using it for this plan")
            elif is_access_problem(str(exc)):
                self._give_up(str(exc))
            else:
                self._recover(str(exc))
            return default
        except OSError as exc:
            self._give_up(str(exc))
            return default

    def _recover(self, reason: str) -> None:
        """Move the file aside and start a new one holding every row still readable; when
        either cannot be done, go on without the cache."""
        try:
            aside = move_aside(self.path, reason, "plan cache")
            rows = _readable_rows(aside)
            with closing(self._connect()) as db, db:
                db.execute(_CREATE)
                db.executemany("INSERT OR REPLACE INTO plans VALUES (?, ?, ?, ?, ?)", rows)
        except (OSError, sqlite3.Error) as exc:
            self._give_up(f"{reason}; then {exc}")

    def get(self, key: PlanBasis) -> CacheEntry | None:
        """The entry for ``key``, or None when absent, unreadable or inconsistent."""
        row = self._guarded(
            lambda db: db.execute("SELECT description, graph, plan FROM plans WHERE key = ?",
                                  (key.digest(),)).fetchone(), None)
        if row is None:
            return None
        try:
            graph_json, plan_json, basis = _parse(row)
        except _Unreadable as exc:
            self._recover(str(exc))
            return None
        try:
            graph, plan = Graph.from_json(graph_json), Plan.from_json(plan_json)
            if basis != key:
                raise ValueError(f"it records {basis}, not {key}")
            plan.validate(graph)
            if graph.graph_hash() != key.graph_hash:
                raise ValueError("the stored graph has a different structure")
        except (ValueError, KeyError, TypeError) as exc:
            warn_caller(f"lightning-remat: ignoring a stale plan cache entry in {self.path}: "
                        f"{exc}")
            self.delete(key)
            return None
        return CacheEntry(graph, plan)

    def bases(self) -> list[PlanBasis]:
        """The bases of the stored plans, newest first (unreadable descriptions skipped)."""
        rows = self._guarded(
            lambda db: db.execute("SELECT description FROM plans ORDER BY created DESC").fetchall(), [])
        out = []
        for (description,) in rows:
            try:
                basis = PlanBasis.from_dict(json.loads(description))
            except (TypeError, ValueError):
                basis = None
            if basis is not None:
                out.append(basis)
        return out

    def put(self, key: PlanBasis, graph: Graph, plan: Plan) -> None:
        row = (key.digest(), json.dumps(asdict(key)), graph.to_json(), plan.to_json(), time.time())
        self._guarded(lambda db: db.execute("INSERT OR REPLACE INTO plans VALUES (?, ?, ?, ?, ?)", row),
                      None)

    def delete(self, key: PlanBasis) -> None:
        self._guarded(lambda db: db.execute("DELETE FROM plans WHERE key = ?", (key.digest(),)), None)

    def __len__(self) -> int:
        return int(self._guarded(lambda db: db.execute("SELECT COUNT(*) FROM plans").fetchone()[0], 0))


def _parse(row: tuple[str, str, str]) -> tuple[str, str, PlanBasis | None]:
    """Graph JSON, plan JSON and basis of a row; :class:`_Unreadable` when its text is damaged."""
    description, graph_json, plan_json = row
    try:
        basis = PlanBasis.from_dict(json.loads(description)) if description else None
        json.loads(graph_json), json.loads(plan_json)
    except (TypeError, ValueError) as exc:
        raise _Unreadable(f"an entry is not valid JSON: {exc}") from None
    return graph_json, plan_json, basis


def _readable_rows(path: Path) -> list[tuple[Any, ...]]:
    """The rows of a damaged cache file that read back whole, plan and graph included."""
    rows: list[tuple[Any, ...]] = []
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            cursor = db.execute("SELECT key, description, graph, plan, created FROM plans")
            while True:
                row = cursor.fetchone()
                if row is None:
                    break
                try:
                    graph_json, plan_json, basis = _parse(row[1:4])
                    Plan.from_json(plan_json).validate(Graph.from_json(graph_json))
                except (_Unreadable, ValueError, KeyError, TypeError):
                    continue
                if basis is not None and basis.digest() == row[0]:
                    rows.append(row)
    except sqlite3.DatabaseError:
        pass  # as many rows as could be read
    return rows
