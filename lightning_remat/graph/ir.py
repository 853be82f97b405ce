"""The graph IR every solver reads: a DAG of tensors produced by the forward, with costs.

Vertices are the values the forward computes (docs/design.md section 3); an edge ``u -> v``
means ``v`` is computed from ``u``. Inputs and parameters are not vertices: they are resident
before the step starts. Node ids are the names of the ``torch.fx`` nodes they came from, so a
plan over the graph maps back onto the traced module.

JSON form (other tools depend on it; nothing else is written)::

    {"nodes": [{"id": "conv1", "op": "Conv2d", "mem": 1048576, "saved": 1048576,
                "t_fwd": 0.0012, "t_bwd": 0.0025, "ws_fwd": 0, "ws_bwd": 0}],
     "edges": [["conv1", "bn1"]],
     "meta": {"batch_size": 32, "device": "cuda:0", "dtype": "float32"}}

``meta`` is a :class:`GraphMeta`: named fields, each absent (None, and left out of the JSON)
unless a writer set it; other keys are kept as they are in ``GraphMeta.extra``. Counts
(bytes, sizes) are whole and not negative, times and rates finite and not negative, as are
the vertices' costs. The tracer
(``graph/trace.py``) writes the structure:

- ``input_consumers``: ids of the vertices that read the step's inputs;
- ``outputs``: ids of the vertices whose values leave the forward (the loss reads them).
  Absent, the simulator takes the last vertex; empty, no vertex;
- ``param_bytes``: ``{id: bytes}`` of the parameters a vertex's op owns that train (their
  gradients are allocated during the backward of the first step; a frozen parameter,
  ``requires_grad=False``, has none and is not counted). Absent, the simulator takes every
  vertex to need a gradient; present (even empty), only those computed from a parameter;
- ``param_grad_bytes``: ``{id: bytes}`` of the parameter gradients a vertex's backward
  allocates, each parameter's at its last op in the forward (a tied weight's at its last
  reader, not its owner). Absent, at the owner;
- ``shape_edges``: ``[[u, v], ...]`` the edges through which only ``u``'s shape flows
  (``v`` does not need ``u``'s value alive);
- ``inplace``: ``{id: operand}`` each op that writes its first argument in place and the
  vertex it writes (an id not in the graph: a step input), ``graph/ops.py``;
- ``random``: ids of the vertices whose op draws random numbers (an aten op tagged
  ``nondeterministic_seeded`` ran under it), ``graph/ops.py``.

The profiler (``graph/profile.py``) adds the setting and the measurements:

- ``batch_size``: the profiled batch size (absent when the inputs have no batch dimension);
- ``device``, ``dtype``: where and in which floating type it ran (``"cuda:0"``, ``"float32"``);
- ``input_bytes``: bytes of the step's inputs (resident, not part of the budget);
- ``plain_peak_bytes``: the measured peak of one plain step, from a state without gradients
  (absent in safe mode);
- ``loss_peak_bytes``: the measured peak of the loss alone, from the outputs to their
  gradients, above what the forward holds (the step's own loss, or without one the
  cross-entropy the profile stands in for it: a cross-entropy over a vocabulary takes
  several times the logits; absent in safe mode);
- ``outputs_held``: whether the step holds its outputs until it ends (the loop people
  write, profiled without a ``loss_fn``: ``out = model(x); loss = f(out); loss.backward()``)
  rather than dropping them once the loss has read them;
- ``step_seconds``: the plain step's time (CUDA: the metered plain step; CPU: the fastest timed
  instrumented step's wall time; in safe mode the sum of the vertex times);
- ``batch_dependent``: ``{id: bool}`` whether a vertex's costs scale with the batch size
  (absent: every vertex's do);
- ``saved_refs``: ``{id: [ids]}`` the vertex outputs whose storage the op saves for backward
  (its own id when it saves its output, e.g. ReLU; an input's id, e.g. Linear). ``saved``
  minus the ``mem`` of these referenced vertices is what the op saves besides (BatchNorm's
  statistics, a dropout mask, max-pool indices). Absent, the simulator holds each op's whole
  ``saved`` as one block of its own; present (even empty), it counts shared storages once;
- ``saved_input_bytes``: ``{id: bytes}`` of the step's inputs the op saves (resident anyway);
- ``aliases``: ``{id: base_id}`` the earlier vertex whose storage this output shares (views
  and in-place ops). Present (even empty), the simulator takes the map as complete; absent,
  it guesses views from the op names on a graph with ``saved_refs`` and assumes none on a
  hand-built graph without. Every chain of aliases ends at a vertex that owns its storage
  (a cycle is refused);
- ``requires_grad``: ``{id: bool}`` whether autograd records the vertex's output;
- ``resident_views``: ids whose output is a view of an input, parameter or buffer (no new
  memory);
- ``safe``: whether the memory-safe mode measured the costs (op by op, no whole step).

The planner (``planner.py``) adds ``bandwidth_bytes_per_s``: the host-device bandwidth, the
offloading solvers' beta; and ``recompute_stage_seconds`` and ``recompute_vertex_seconds``:
what the executor itself costs per recomputed stage and per vertex in one, over the
recomputation (measured once per device on a chain of small ops, then both on the
model's own step where that tells them apart from noise, ``recompute_stage_measured`` and
``recompute_vertex_measured``); and
``measured_excess_bytes``: what the first training step under a plan measured above its
prediction (the model's margin covers it from then on); and on the CPU
``scratch_buffers``: the most buffers the C library maps on their own pages that one op
held at once, and from the profile ``mapped_buffer_bytes`` and
``page_bytes``, the C library's mmap threshold and the page size where it was measured. Keys are
written in the order above, then those of ``extra`` (``model``, the description the
benchmarks add; ``costs`` on a graph whose costs were estimated, not measured).

Length: the vertices, the typed meta every writer and reader shares, and the JSON form
they round-trip through are one format, so they stay in one module.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

NODE_KEYS = ("id", "op", "mem", "saved", "t_fwd", "t_bwd", "ws_fwd", "ws_bwd")
_BYTE_KEYS = ("mem", "saved", "ws_fwd", "ws_bwd")
_TIME_KEYS = ("t_fwd", "t_bwd")



def stable_topological_order(successors: Mapping[Any, Iterable[Any]], indegree: dict[Any, int],
                             rank: Callable[[Any], Any]) -> list[Any]:
    """Kahn's algorithm, stable: of the items ready at once, the least ``rank`` first.
    ``indegree`` (each item's count of predecessors) is used up; an item left out of the
    order lies on a cycle (its count stays above 0)."""
    ready = [(rank(i), i) for i, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[Any] = []
    while ready:
        _, item = heapq.heappop(ready)
        order.append(item)
        for w in successors[item]:
            indegree[w] -= 1
            if indegree[w] == 0:
                heapq.heappush(ready, (rank(w), w))
    return order

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
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"node {raw['id']!r}: {key}={value!r} is not a number")
        if not math.isfinite(value):
            raise ValueError(f"node {raw['id']!r}: {key}={value!r} is not a finite number; costs "
                             "are bytes and seconds, never NaN or infinity")
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


# ---- graph metadata -------------------------------------------------------------------------
def _whole(label: str, value: Any) -> int:
    """A count (bytes, a batch size): whole and not negative (``is_integer`` is False for
    NaN and infinity)."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole:
        raise ValueError(f"meta {label} must be a whole number, got {value!r:.80}")
    if value < 0:
        raise ValueError(f"meta {label} must not be negative, got {value!r:.80}; it counts bytes "
                         "or items")
    return int(value)


def _number(label: str, value: Any) -> float:
    """A measured rate or time: finite and not negative."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"meta {label} must be a number, got {value!r:.80}")
    if not math.isfinite(value):
        raise ValueError(f"meta {label} must be a finite number, got {value!r:.80}")
    if value < 0:
        raise ValueError(f"meta {label} must not be negative, got {value!r:.80}")
    return float(value)


def _text(label: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"meta {label} must be a string, got {value!r:.80}")
    return value


def _flag(label: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"meta {label} must be true or false, got {value!r:.80}")
    return value


def _ids(label: str, value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"meta {label} must be a list of node ids, got {value!r:.80}")
    return list(value)


def _pairs(label: str, value: Any) -> list[list[str]]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, str) for v in p)
        for p in value
    ):
        raise ValueError(f"meta {label} must be a list of [from_id, to_id] pairs, "
                         f"got {value!r:.80}")
    return [list(p) for p in value]


def _per_node(check: Callable[[str, Any], Any]) -> Callable[[str, Any], dict[str, Any]]:
    """The check of a ``{node id: value}`` object, from the check of one value."""

    def checked(label: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"meta {label} must be an object keyed by node id, got {value!r:.80}")
        return {k: check(f"{label} entry {k!r}", v) for k, v in value.items()}

    return checked


def _alias_map(label: str, value: Any) -> dict[str, str]:
    """``{id: base_id}`` whose chains end: each storage has an owner, so following aliases
    from any vertex reaches one that aliases nothing (a cycle has no owner to charge)."""
    aliases = _per_node(_text)(label, value)
    done: set[str] = set()
    for start in aliases:
        path: dict[str, int] = {}  # vertex -> its place on this chain
        vertex = start
        while vertex in aliases and vertex not in done:
            if vertex in path:
                cycle = list(path)[path[vertex]:] + [vertex]
                raise ValueError(f"meta {label} form a cycle {' -> '.join(map(repr, cycle[:9]))}; "
                                 "each chain of aliases must end at a vertex that owns its storage")
            path[vertex] = len(path)
            vertex = aliases[vertex]
        done.update(path)
    return aliases


# A GraphMeta field's annotation (a string, with postponed annotations) picks its check; a
# check returns the value it keeps: whole floats as int, rates as float, containers copied.
_CHECK_BY_TYPE: dict[str, Callable[[str, Any], Any]] = {
    "int | None": _whole,
    "float | None": _number,
    "str | None": _text,
    "bool | None": _flag,
    "list[str] | None": _ids,
    "list[list[str]] | None": _pairs,
    "dict[str, int] | None": _per_node(_whole),
    "dict[str, bool] | None": _per_node(_flag),
    "dict[str, str] | None": _per_node(_text),
    "dict[str, list[str]] | None": _per_node(_ids),
}


@dataclass
class GraphMeta:
    """What a graph carries besides its vertices' costs (the module docstring says who
    writes each field). None means absent: the readers tell an absent field from an empty
    one (the simulator does for ``saved_refs``, ``aliases``, ``param_bytes`` and
    ``outputs``). The field order is the key order of the JSON form."""

    # ---- structure, from the tracer --------------------------------------------------------
    input_consumers: list[str] | None = None
    """Ids of the vertices that read the step's inputs."""
    outputs: list[str] | None = None
    """Ids of the vertices whose values leave the forward (None: the last vertex)."""
    param_bytes: dict[str, int] | None = None
    """``{id: bytes}`` of the parameters each vertex's op owns."""
    param_grad_bytes: dict[str, int] | None = None
    """``{id: bytes}`` of the parameter gradients each vertex's backward allocates: each
    parameter's at its last op in the forward (None: at its owner, ``param_bytes``)."""
    shape_edges: list[list[str]] | None = None
    """``[[u, v], ...]``: edges through which only ``u``'s shape flows."""
    inplace: dict[str, str] | None = None
    """``{id: operand}``: in-place ops and the vertex each writes (another id: a step input)."""
    random: list[str] | None = None
    """Ids of the vertices whose op draws random numbers (torch's op tags)."""
    # ---- the profiled step -------------------------------------------------------------------
    batch_size: int | None = None
    """The profiled batch size (None when the inputs have no batch dimension)."""
    device: str | None = None
    """Where the costs were measured (``"cuda:0"``, ``"cpu"``)."""
    dtype: str | None = None
    """The module's floating type (``"float32"``)."""
    input_bytes: int | None = None
    """Bytes of the step's inputs (resident, not part of the budget)."""
    plain_peak_bytes: int | None = None
    """Measured peak of one plain step (None in safe mode)."""
    loss_peak_bytes: int | None = None
    """Measured peak of the loss alone, from the outputs to their gradients (None: not
    measured)."""
    output_grad_bytes: int | None = None
    """Bytes of the gradients the loss sends to the outputs, measured with the loss (a
    sum's broadcast scalar takes none, a cross-entropy's as much as the logits; None: not
    measured, each output's gradient as large as the output)."""
    outputs_held: bool | None = None
    """Whether the step holds the outputs until it ends (``out = model(x); loss =
    f(out); loss.backward()``, the loop profiled without a ``loss_fn``) rather than
    dropping them when the loss has read them (``loss_fn(model(x)).backward()``)."""
    step_seconds: float | None = None
    """Median plain step (in safe mode the sum of the vertex times)."""
    batch_dependent: dict[str, bool] | None = None
    """``{id: bool}`` whether a vertex's costs scale with the batch size (None: all do)."""
    saved_refs: dict[str, list[str]] | None = None
    """``{id: [ids]}`` the vertex outputs whose storage the op saves for backward."""
    saved_input_bytes: dict[str, int] | None = None
    """``{id: bytes}`` of the step's inputs the op saves."""
    aliases: dict[str, str] | None = None
    """``{id: base_id}`` whose storage a view or in-place output shares (None: unknown)."""
    requires_grad: dict[str, bool] | None = None
    """``{id: bool}`` whether autograd records the vertex's output."""
    resident_views: list[str] | None = None
    """Ids whose output is a view of an input, parameter or buffer."""
    safe: bool | None = None
    """Whether the memory-safe mode measured the costs."""
    # ---- added by the planner ----------------------------------------------------------------
    bandwidth_bytes_per_s: float | None = None
    """Host-device bandwidth, the offloading solvers' beta."""
    recompute_stage_seconds: float | None = None
    """The executor's own time per recomputed stage (checkpoint, policy, context), in its
    forward and backward together, measured on the device (docs/design.md section 4.7)."""
    recompute_vertex_seconds: float | None = None
    """The executor's own time per vertex of a recomputed stage: each op of the stage passes
    the selective-checkpoint policy in the forward and again in the recomputation."""
    recompute_stage_measured: bool | None = None
    """Whether ``recompute_stage_seconds`` was measured on this model's own step (a plan of
    plain-checkpoint stages timed against the plain step) rather than on the calibration
    chain of small ops (docs/design.md section 4.7)."""
    recompute_vertex_measured: bool | None = None
    """Whether ``recompute_vertex_seconds`` was measured on this model's own step (a plan of
    stages under the selective policy) rather than on the calibration chain."""
    measured_excess_bytes: int | None = None
    """What the first training step under a plan measured above its prediction, which the
    model's margin then covers (docs/design.md section 4.7)."""
    scratch_buffers: int | None = None
    """CPU: the most buffers the C library maps on pages of their own (its mmap threshold
    and over) that one op allocated and held at once, its output and scratch (a grouped
    convolution through im2col: one per group); each may take a page more than its size."""
    mapped_buffer_bytes: int | None = None
    """CPU: the smallest buffer the C library of the profiled process maps on pages of its
    own (glibc's mmap threshold; None: its default, 128 KiB), so the simulator reads no
    environment of the process that plans."""
    page_bytes: int | None = None
    """CPU: the page size of the profiled machine (None: this machine's)."""
    grads_resident: bool | None = None
    """Whether the parameters' gradients exist before the step, so are resident
    (``zero_grad(set_to_none=False)``; docs/design.md section 4.7)."""
    # ---- anything else -----------------------------------------------------------------------
    extra: dict[str, Any] = field(default_factory=dict)
    """Other keys of the JSON form, kept as they are (``model``, ``costs``, ...)."""

    def __post_init__(self) -> None:
        if not isinstance(self.extra, dict):
            raise ValueError(f"GraphMeta.extra must be a dict, got {self.extra!r:.80}")
        clash = sorted(set(self.extra) & set(_META_CHECKS))
        if clash:
            raise ValueError(f"meta keys {clash} are fields of GraphMeta, not extra keys")
        for name, check in _META_CHECKS.items():
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, check(repr(name), value))

    @classmethod
    def from_dict(cls, data: Any) -> GraphMeta:
        """The meta of a graph's JSON form: known keys become fields (a null is absent),
        the others go to ``extra``."""
        if not isinstance(data, dict):
            raise ValueError("'meta' must be an object")
        known = {k: v for k, v in data.items() if k in _META_CHECKS}
        extra = {k: v for k, v in data.items() if k not in _META_CHECKS}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the fields that are set, in field order, then ``extra``."""
        out = {name: getattr(self, name) for name in _META_CHECKS}
        out = {k: v for k, v in out.items() if v is not None}
        out.update(self.extra)
        return out

    def copy(self) -> GraphMeta:
        """A copy whose fields and ``extra`` can be set without touching this one."""
        return replace(self, extra=dict(self.extra))


_META_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    f.name: _CHECK_BY_TYPE[str(f.type)] for f in fields(GraphMeta) if f.name != "extra"
}
"""Field name -> its check, in field order (a field with an unlisted type fails here)."""
_META_CHECKS["aliases"] = _alias_map  # the type's check, and chains that end


@dataclass
class Graph:
    """A DAG of forward tensors. ``nodes`` are kept in a topological order. ``meta`` may be
    given as a plain dict (the JSON form's ``meta``); it is kept as a :class:`GraphMeta`."""

    nodes: list[Node]
    edges: list[tuple[str, str]]
    meta: GraphMeta = field(default_factory=GraphMeta)

    def __post_init__(self) -> None:
        if not isinstance(self.meta, GraphMeta):
            self.meta = GraphMeta.from_dict(self.meta)
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
        order = stable_topological_order(succ, indegree, position.__getitem__)
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
        linearly from the profiled size (``meta.batch_dependent`` names the vertices that
        do not depend on the batch; by default every vertex does)."""
        base = self.meta.batch_size
        if not base:
            raise ValueError("the graph has no meta.batch_size to scale from")
        ratio = batch_size / base
        dependent = self.meta.batch_dependent or {}

        def scale(node: Node) -> Node:
            if not dependent.get(node.id, True):
                return replace(node)
            changes = {k: int(round(getattr(node, k) * ratio)) for k in _BYTE_KEYS}
            changes.update({k: getattr(node, k) * ratio for k in _TIME_KEYS})
            return replace(node, **changes)

        meta = self.meta.copy()
        meta.batch_size = batch_size
        if meta.input_bytes is not None:
            meta.input_bytes = int(round(meta.input_bytes * ratio))
        return Graph([scale(n) for n in self.nodes], list(self.edges), meta)

    # ---- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [n.to_dict() for n in self.nodes],
            "edges": [list(e) for e in self.edges],
            "meta": self.meta.to_dict(),
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
        meta = GraphMeta.from_dict(data.get("meta", {}))
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
        meta: GraphMeta | dict[str, Any] | None = None,
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
        if meta is None:
            meta = GraphMeta()
        elif isinstance(meta, GraphMeta):
            meta = meta.copy()
        return cls(nodes, edges, meta)
