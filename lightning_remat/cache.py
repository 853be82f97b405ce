"""Plans cached on disk, so a restart with the same setup skips profiling and solving.

One SQLite file; a row per key (graph hash, input shapes, dtype, device name, budget,
solver) holding the profiled graph and the plan as JSON. An entry that cannot be read back,
or whose plan does not fit the graph it is looked up for, is dropped with a warning and
never trusted.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
import warnings
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan

SCHEMA_VERSION = 2


@dataclass(frozen=True)
class CacheKey:
    """Everything that decided a cached plan."""

    graph_hash: str
    """The traced graph's structure (:meth:`Graph.graph_hash`)."""
    input_key: str
    """The call's input key as text: tensor shapes, dtypes, non-tensor values."""
    device_name: str
    budget: str
    """The budget as the user wrote it (``"60%"``, ``"4GiB"``, ``"None"``)."""
    solver: str
    """The solver's name and options."""

    def digest(self) -> str:
        text = json.dumps([SCHEMA_VERSION, self.graph_hash, self.input_key, self.device_name,
                           self.budget, self.solver])
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class CacheEntry:
    graph: Graph
    plan: Plan


class PlanCache:
    """A SQLite table of plans. Safe to share between runs; writes are atomic."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with closing(self._connect()) as db, db:
                db.execute(
                    "CREATE TABLE IF NOT EXISTS plans (key TEXT PRIMARY KEY, description TEXT,"
                    " graph TEXT NOT NULL, plan TEXT NOT NULL, created REAL NOT NULL)"
                )
        except sqlite3.DatabaseError as exc:
            # A file that is not a database: keep it aside, start a fresh one.
            aside = self.path.with_suffix(self.path.suffix + ".corrupt")
            warnings.warn(
                f"plan cache {self.path} is unreadable ({exc}); moved it to {aside} and started "
                "a new one", stacklevel=2,
            )
            self.path.replace(aside)
            with closing(self._connect()) as db, db:
                db.execute(
                    "CREATE TABLE plans (key TEXT PRIMARY KEY, description TEXT,"
                    " graph TEXT NOT NULL, plan TEXT NOT NULL, created REAL NOT NULL)"
                )

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30)

    def get(self, key: CacheKey) -> CacheEntry | None:
        """The entry for ``key``, or None when absent, unreadable or inconsistent."""
        with closing(self._connect()) as db:
            row = db.execute("SELECT graph, plan FROM plans WHERE key = ?", (key.digest(),)).fetchone()
        if row is None:
            return None
        try:
            graph = Graph.from_json(row[0])
            plan = Plan.from_json(row[1])
            plan.validate(graph)
            if graph.graph_hash() != key.graph_hash:
                raise ValueError("the stored graph has a different structure")
        except (ValueError, KeyError, TypeError) as exc:
            warnings.warn(f"ignoring a corrupted or stale plan cache entry in {self.path}: {exc}",
                          stacklevel=2)
            self.delete(key)
            return None
        return CacheEntry(graph, plan)

    def put(self, key: CacheKey, graph: Graph, plan: Plan) -> None:
        description: dict[str, Any] = {
            "graph_hash": key.graph_hash, "input_key": key.input_key, "device": key.device_name,
            "budget": key.budget, "solver": key.solver,
        }
        with closing(self._connect()) as db, db:
            db.execute(
                "INSERT OR REPLACE INTO plans VALUES (?, ?, ?, ?, ?)",
                (key.digest(), json.dumps(description), graph.to_json(), plan.to_json(), time.time()),
            )

    def delete(self, key: CacheKey) -> None:
        with closing(self._connect()) as db, db:
            db.execute("DELETE FROM plans WHERE key = ?", (key.digest(),))

    def __len__(self) -> int:
        with closing(self._connect()) as db:
            return int(db.execute("SELECT COUNT(*) FROM plans").fetchone()[0])
