"""The one Plan type every solver returns.

A plan cuts the graph's vertices into stages in forward order. Each stage has an action:

- ``keep``: run as usual; autograd keeps what the ops save;
- ``recompute``: run under non-reentrant checkpoint; only the stage's inputs are kept and the
  stage's forward runs again during the backward;
- ``offload``: run as usual, but what the ops save goes to host memory and comes back for
  the backward.

JSON form (exactly these keys)::

    {"stages": [{"nodes": ["conv1", "bn1"], "action": "recompute"}, ...],
     "stored": ["relu1", ...], "predicted_peak_bytes": 123, "predicted_extra_seconds": 0.01,
     "solver": "kusumoto-tc", "feasible": true, "margin_bytes": 960}

``margin_bytes`` (optional when read: older plans lack it) is the known error of the model
of a step that the budget must still cover (``solvers.simulate.model_margin``): a plan
fits a budget when ``predicted_peak_bytes + margin_bytes`` is within it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from lightning_remat.graph.ir import Graph

ACTIONS = ("keep", "recompute", "offload")
PLAN_KEYS = ("stages", "stored", "predicted_peak_bytes", "predicted_extra_seconds", "solver", "feasible")
OPTIONAL_PLAN_KEYS = ("margin_bytes",)
"""Keys a plan may lack (plans written before they existed): ``margin_bytes`` reads as 0."""


def _vertex_ids(label: str, value: Any) -> list[str]:
    """A JSON list of vertex ids (strings), as a plan names vertices."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{label} must be a list of vertex ids (strings), got {value!r:.80}")
    return list(value)


@dataclass
class Stage:
    nodes: list[str]
    action: str = "keep"

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"stage action {self.action!r} is not one of {ACTIONS}")

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "action": self.action}


@dataclass
class Plan:
    stages: list[Stage]
    stored: list[str]
    predicted_peak_bytes: int
    predicted_extra_seconds: float
    solver: str
    feasible: bool
    notes: list[str] = field(default_factory=list, compare=False)
    """Why the solver chose this plan (not part of the JSON form)."""
    margin_bytes: int = 0
    """What the budget must hold beyond the predicted peak: the known error of the model
    of a step on the graph's device (``solvers.simulate.model_margin``)."""

    @property
    def guaranteed_peak_bytes(self) -> int:
        """The predicted peak plus the margin: what a budget must be to hold this plan."""
        return int(self.predicted_peak_bytes) + int(self.margin_bytes)

    # ---- derived views ------------------------------------------------------------------
    def action_of(self) -> dict[str, str]:
        """Each vertex's action."""
        return {nid: stage.action for stage in self.stages for nid in stage.nodes}

    def stage_of(self) -> dict[str, int]:
        """Each vertex's stage index."""
        return {nid: k for k, stage in enumerate(self.stages) for nid in stage.nodes}

    def count(self, action: str) -> int:
        """How many stages have an action."""
        return sum(1 for s in self.stages if s.action == action)

    # ---- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "stages": [s.to_dict() for s in self.stages],
            "stored": list(self.stored),
            "predicted_peak_bytes": int(self.predicted_peak_bytes),
            "predicted_extra_seconds": float(self.predicted_extra_seconds),
            "solver": self.solver,
            "feasible": bool(self.feasible),
            "margin_bytes": int(self.margin_bytes),
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        if not isinstance(data, dict):
            raise ValueError("a plan is a JSON object")
        missing = [k for k in PLAN_KEYS if k not in data]
        unknown = sorted(set(data) - set(PLAN_KEYS) - set(OPTIONAL_PLAN_KEYS))
        if missing or unknown:
            raise ValueError(f"plan keys: missing {missing}, unknown {unknown}; expected "
                             f"{list(PLAN_KEYS)} and optionally {list(OPTIONAL_PLAN_KEYS)}")
        if not isinstance(data["stages"], list):
            raise ValueError("stages must be a list of {'nodes': [...], 'action': ...} objects")
        stages = [Stage(_vertex_ids(f"stage {k} nodes", s["nodes"]), s["action"])
                  for k, s in enumerate(data["stages"])]
        extra_seconds = float(data["predicted_extra_seconds"])
        if not math.isfinite(extra_seconds):
            raise ValueError(f"predicted_extra_seconds={extra_seconds!r} is not a finite number")
        return cls(
            stages=stages,
            stored=_vertex_ids("stored", data["stored"]),
            predicted_peak_bytes=int(data["predicted_peak_bytes"]),
            predicted_extra_seconds=extra_seconds,
            solver=str(data["solver"]),
            feasible=bool(data["feasible"]),
            margin_bytes=int(data.get("margin_bytes", 0)),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    # ---- checks -------------------------------------------------------------------------
    def validate(self, graph: Graph) -> None:
        """Raise ValueError unless the stages cover every vertex once, in an order the
        edges allow (no edge runs from a later stage to an earlier one)."""
        seen: dict[str, int] = {}
        for k, stage in enumerate(self.stages):
            if not stage.nodes:
                raise ValueError(f"stage {k} is empty")
            for nid in stage.nodes:
                if nid not in graph:
                    raise ValueError(f"stage {k} names unknown vertex {nid!r}")
                if nid in seen:
                    raise ValueError(f"vertex {nid!r} is in stages {seen[nid]} and {k}")
                seen[nid] = k
        missing = [nid for nid in graph.ids if nid not in seen]
        if missing:
            raise ValueError(f"vertices in no stage: {missing[:8]}")
        for u, v in graph.edges:
            if seen[u] > seen[v]:
                raise ValueError(f"edge {u!r} -> {v!r} runs from stage {seen[u]} back to {seen[v]}")
        unknown = [nid for nid in self.stored if nid not in graph]
        if unknown:
            raise ValueError(f"stored names unknown vertices {unknown[:8]}")


def boundary(graph: Graph, stages: list[Stage]) -> list[str]:
    """Vertices whose value crosses from one stage into a later one (the stored boundary)."""
    stage_of = {nid: k for k, stage in enumerate(stages) for nid in stage.nodes}
    return [
        nid for nid in graph.ids
        if any(stage_of[w] > stage_of[nid] for w in graph.successors(nid))
    ]
