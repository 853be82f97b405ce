"""The graph IR every solver reads: a DAG of tensors produced by the forward, with costs.

Vertices are the values the forward computes (DESIGN.md section 3); an edge ``u -> v`` means
``v`` is computed from ``u``. Inputs and parameters are not vertices: they are resident
before the step starts. Node ids are the names of the ``torch.fx`` nodes they came from, so a
plan over the graph maps back onto the traced module.

JSON form (other tools depend on it; nothing else is written)::

    {"nodes": [{"id": "conv1", "op": "Conv2d", "mem": 1048576, "saved": 1048576,
                "t_fwd": 0.0012, "t_bwd": 0.0025, "ws_fwd": 0, "ws_bwd": 0}],
     "edges": [["conv1", "bn1"]],
     "meta": {"batch_size": 32, "device": "cuda:0", "dtype": "float32"}}

``meta`` is free-form. Keys the profiler writes and the simulator reads when present:

- ``input_bytes``: bytes of the step's inputs (resident, not part of the budget);
- ``param_bytes``: ``{id: bytes}`` of the parameters a vertex's op owns (their gradients are
  allocated during the backward of the first step);
- ``saved_refs``: ``{id: [ids]}`` the vertex outputs whose storage the op saves for backward
  (its own id when it saves its output, e.g. ReLU; an input's id, e.g. Linear). ``saved``
  minus the ``mem`` of these referenced vertices is what the op saves besides (BatchNorm's
  statistics, a dropout mask, max-pool indices);
- ``input_consumers``: ids of the vertices that read the step's inputs;
- ``outputs``: ids of the vertices whose values leave the forward (the loss reads them);
- ``batch_dependent``: ``{id: bool}`` whether a vertex's costs scale with the batch size;
- ``bandwidth_bytes_per_s``: host-device bandwidth, for the offloading solvers.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

NODE_KEYS = ("id", "op", "mem", "saved", "t_fwd", "t_bwd", "ws_fwd", "ws_bwd")
_BYTE_KEYS = ("mem", "saved", "ws_fwd", "ws_bwd")
_TIME_KEYS = ("t_fwd", "t_bwd")


@dataclass
class Node:
    """One tensor the forward produces, with its measured costs."""

    id: str
    op: str
    mem: int = 0
    """Bytes of the output."""
    saved: int = 0
    """Bytes autograd keeps for the backward of the producing op (each storage once)."""
    t_fwd: float = 0.0
    t_bwd: float = 0.0
    ws_fwd: int = 0
    """Temporary bytes the forward op needs beyond its output."""
    ws_bwd: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_node(raw: Any, position: int) -> Node:
    if not isinstance(raw, dict):
        raise ValueError(f"node #{position} is not an object: {raw!r}")
    missing = [k for k in ("id", "op") if k not in raw]
    if missing:
        raise ValueError(f"node #{position} lacks {', '.join(missing)}")
    unknown = sorted(set(raw) - set(NODE_KEYS))
    if unknown:
        raise ValueError(f"node {raw['id']!r} has unknown keys {unknown}; allowed: {list(NODE_KEYS)}")
    if not isinstance(raw["id"], str) or not raw["id"]:
        raise ValueError(f"node #{position} has id {raw['id']!r}; ids are non-empty strings")
    values: dict[str, Any] = {"id": raw["id"], "op": str(raw["op"])}
    for key in _BYTE_KEYS + _TIME_KEYS:
        value = raw.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"node {raw['id']!r}: {key}={value!r} is not a number")
        if value < 0:
            raise ValueError(f"node {raw['id']!r}: negative cost {key}={value}")
        if key in _BYTE_KEYS:
            if value != int(value):
                raise ValueError(f"node {raw['id']!r}: {key}={value} is not a whole number of bytes")
            value = int(value)
        else:
            value = float(value)
        values[key] = value
    return Node(**values)


@dataclass
class Graph:
    """A DAG of forward tensors. ``nodes`` are kept in a topological order."""

    nodes: list[Node]
    edges: list[tuple[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.edges = [(str(u), str(v)) for u, v in self.edges]
        self._validate_and_order()

    # ---- construction and checks ------------------------------------------------------
    def _validate_and_order(self) -> None:
        index: dict[str, Node] = {}
        for node in self.nodes:
            if node.id in index:
                raise ValueError(f"duplicate node id {node.id!r}")
            index[node.id] = node
        seen_edges: set[tuple[str, str]] = set()
        edges: list[tuple[str, str]] = []
        for u, v in self.edges:
            for end in (u, v):
                if end not in index:
                    raise ValueError(f"edge ({u!r}, {v!r}) references unknown node id {end!r}")
            if u == v:
                raise ValueError(f"edge ({u!r}, {v!r}) is a self-loop: the graph has a cycle")
            if (u, v) not in seen_edges:
                seen_edges.add((u, v))
                edges.append((u, v))
        self.edges = edges
        # Kahn's algorithm, stable: ties keep the order the nodes were given in.
        position = {n.id: i for i, n in enumerate(self.nodes)}
        indegree = {n.id: 0 for n in self.nodes}
        succ: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        pred: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for u, v in edges:
            indegree[v] += 1
            succ[u].append(v)
            pred[v].append(u)
        import heapq

        ready = [(position[i], i) for i, d in indegree.items() if d == 0]
        heapq.heapify(ready)
        order: list[str] = []
        while ready:
            _, nid = heapq.heappop(ready)
            order.append(nid)
            for w in succ[nid]:
                indegree[w] -= 1
                if indegree[w] == 0:
                    heapq.heappush(ready, (position[w], w))
        if len(order) != len(self.nodes):
            stuck = sorted(i for i, d in indegree.items() if d > 0)
            raise ValueError(f"the graph has a cycle through {stuck[:8]}")
        self.nodes = [index[i] for i in order]
        self._index = index
        self._pos = {nid: k for k, nid in enumerate(order)}
        self._succ = {k: sorted(v, key=self._pos.__getitem__) for k, v in succ.items()}
        self._pred = {k: sorted(v, key=self._pos.__getitem__) for k, v in pred.items()}

    # ---- queries ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._index

    def __getitem__(self, node_id: str) -> Node:
        return self._index[node_id]

    @property
    def ids(self) -> list[str]:
        """Node ids in topological order."""
        return [n.id for n in self.nodes]

    def position(self, node_id: str) -> int:
        """Index of a node in the topological order."""
        return self._pos[node_id]

    def successors(self, node_id: str) -> list[str]:
        return list(self._succ[node_id])

    def predecessors(self, node_id: str) -> list[str]:
        return list(self._pred[node_id])

    def is_chain(self) -> bool:
        """True when the vertices form one path (each has at most one successor and one
        predecessor, in topological order)."""
        return all(
            self._succ[a] == [b] for a, b in zip(self.ids, self.ids[1:])
        ) and len(self.edges) == max(len(self.nodes) - 1, 0)

    def total(self, key: str, ids: Iterable[str] | None = None) -> float:
        """Sum of one cost over some nodes (all when ``ids`` is None)."""
        nodes = self.nodes if ids is None else (self._index[i] for i in ids)
        return sum(getattr(n, key) for n in nodes)

    def graph_hash(self) -> str:
        """Hash of the structure and the op kinds (not the measured costs): the plan cache's
        key, stable across re-profiling of the same model."""
        digest = hashlib.sha256()
        for node in self.nodes:
            digest.update(f"{node.id}:{node.op};".encode())
        for u, v in sorted(self.edges):
            digest.update(f"{u}>{v};".encode())
        return digest.hexdigest()[:16]

    # ---- transformations ----------------------------------------------------------------
    def scaled(self, batch_size: int) -> Graph:
        """The costs at another batch size: batch-dependent byte and time costs scale
        linearly from the profiled size (``meta['batch_dependent']`` names the vertices
        that do not depend on the batch; by default every vertex does)."""
        base = self.meta.get("batch_size")
        if not base:
            raise ValueError("the graph has no meta['batch_size'] to scale from")
        ratio = batch_size / base
        dependent = self.meta.get("batch_dependent", {})

        def scale(node: Node) -> Node:
            if not dependent.get(node.id, True):
                return replace(node)
            changes = {k: int(round(getattr(node, k) * ratio)) for k in _BYTE_KEYS}
            changes.update({k: getattr(node, k) * ratio for k in _TIME_KEYS})
            return replace(node, **changes)

        meta = dict(self.meta, batch_size=batch_size)
        if "input_bytes" in meta:
            meta["input_bytes"] = int(round(meta["input_bytes"] * ratio))
        return Graph([scale(n) for n in self.nodes], list(self.edges), meta)

    # ---- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [n.to_dict() for n in self.nodes],
            "edges": [list(e) for e in self.edges],
            "meta": self.meta,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(indent=1))

    @classmethod
    def from_dict(cls, data: Any) -> Graph:
        if not isinstance(data, dict):
            raise ValueError("a graph is a JSON object with 'nodes', 'edges' and 'meta'")
        unknown = sorted(set(data) - {"nodes", "edges", "meta"})
        if unknown:
            raise ValueError(f"unknown top-level keys {unknown}; allowed: nodes, edges, meta")
        if not isinstance(data.get("nodes"), list):
            raise ValueError("'nodes' must be a list of node objects")
        raw_edges = data.get("edges", [])
        if not isinstance(raw_edges, list):
            raise ValueError("'edges' must be a list of [from_id, to_id] pairs")
        edges = []
        for e in raw_edges:
            if not (isinstance(e, (list, tuple)) and len(e) == 2):
                raise ValueError(f"edge {e!r} is not a [from_id, to_id] pair")
            edges.append((e[0], e[1]))
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError("'meta' must be an object")
        nodes = [_check_node(raw, i) for i, raw in enumerate(data["nodes"])]
        return cls(nodes, edges, meta)

    @classmethod
    def from_json(cls, text: str) -> Graph:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> Graph:
        return cls.from_json(Path(path).read_text())

    @classmethod
    def chain(
        cls,
        mem: Iterable[int],
        t_fwd: Iterable[float] | None = None,
        t_bwd: Iterable[float] | None = None,
        saved: Iterable[int] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Graph:
        """A linear graph v0 -> v1 -> ... with the given costs (tests and benchmarks).
        ``saved`` defaults to ``mem`` (each op keeps its output) and ``t_bwd`` to twice
        ``t_fwd``."""
        mem = list(mem)
        n = len(mem)
        tf = list(t_fwd) if t_fwd is not None else [1.0] * n
        tb = list(t_bwd) if t_bwd is not None else [2.0 * t for t in tf]
        sv = list(saved) if saved is not None else list(mem)
        nodes = [
            Node(id=f"v{i}", op="op", mem=int(mem[i]), saved=int(sv[i]), t_fwd=float(tf[i]),
                 t_bwd=float(tb[i]))
            for i in range(n)
        ]
        edges = [(f"v{i}", f"v{i + 1}") for i in range(n - 1)]
        return cls(nodes, edges, dict(meta or {}))


def node_fields() -> list[str]:
    """The keys of a node object in the JSON form."""
    return [f.name for f in fields(Node)]
