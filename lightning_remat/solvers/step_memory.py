"""The memory of one simulated step (``solvers.simulate``): reference-counted storages and
their running total, the gradients a backward leaves, the timeline of events, and what the
step knows of each vertex before it runs (:class:`VertexFacts`, read from the graph's costs
and meta once per graph and per set of rewritten in-place ops)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_remat.graph.ir import Graph
from lightning_remat.graph.ops import VIEW_OPS
from lightning_remat.solvers.schedule import (
    data_edges,
)

__all__ = [
    "GRADIENT_KINDS", "MAPPED_BUFFER_BYTES", "Event", "Gradients", "Storages", "Timeline", "VertexFacts",
    "adjacency", "is_gradient", "rng_state_bytes",
]


def adjacency(graph: Graph) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Successors and predecessors along :func:`~lightning_remat.solvers.schedule.data_edges`,
    in the graph's order."""
    succ: dict[str, list[str]] = {v: [] for v in graph.ids}
    pred: dict[str, list[str]] = {v: [] for v in graph.ids}
    for u, v in data_edges(graph):
        succ[u].append(v)
        pred[v].append(u)
    return succ, pred


@dataclass(slots=True)
class Event:
    phase: str
    """``forward``, ``recompute``, ``restore`` (an offloaded stage's saved state back on
    the device) or ``backward``."""
    node: str
    live_bytes: int
    """Bytes live after the op."""
    peak_bytes: int
    """Bytes live at the op's own peak (outputs and workspace allocated, nothing yet freed)."""
    stage: int


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)
    mapped_buffers: int = 0
    """The most storages of at least ``meta.mapped_buffer_bytes`` live at once."""

    @property
    def peak_bytes(self) -> int:
        return max((e.peak_bytes for e in self.events), default=0)

    def series(self) -> list[int]:
        return [e.live_bytes for e in self.events]


class Storages:
    """Reference-counted storages and the running total of live bytes."""

    __slots__ = ("grad_live", "live", "mapped", "mapped_peak", "refs", "size", "threshold")

    def __init__(self, threshold: int) -> None:
        self.live = 0
        self.grad_live = 0  # of which gradients (of values and of parameters)
        self.mapped = self.mapped_peak = 0  # storages the C library maps on their own pages
        self.threshold = threshold
        self.refs: dict[object, int] = {}
        self.size: dict[object, int] = {}

    def alloc(self, key: object, nbytes: int, refs: int) -> None:
        """A new storage with ``refs`` owners (0: freed by the caller's next ``settle``)."""
        self.size[key] = nbytes
        self.refs[key] = refs
        self.live += nbytes
        if key[0] in GRADIENT_KINDS:  # type: ignore[index]
            self.grad_live += nbytes
        if nbytes >= self.threshold:
            self.mapped += 1
            self.mapped_peak = max(self.mapped_peak, self.mapped)

    def is_live(self, key: object) -> bool:
        return key in self.refs

    def hold(self, key: object) -> None:
        self.refs[key] += 1

    def release(self, key: object) -> None:
        refs = self.refs
        count = refs[key] - 1
        if count > 0:
            refs[key] = count
            return
        # Freed here, not in a method of its own: the simulator releases storages several
        # times per op.
        del refs[key]
        nbytes = self.size.pop(key)
        self.live -= nbytes
        if key[0] in GRADIENT_KINDS:  # type: ignore[index]
            self.grad_live -= nbytes
        if nbytes >= self.threshold:
            self.mapped -= 1

    def settle(self, key: object) -> None:
        """Free a storage allocated with no owner (a value nothing reads)."""
        if self.refs.get(key) == 0:
            self.refs[key] = 1  # its only reference, the op's own, goes
            self.release(key)


MAPPED_BUFFER_BYTES = 128 * 2**10
"""glibc's mmap threshold where the graph does not record the profiled process's own
(``meta.mapped_buffer_bytes``)."""
GRADIENT_KINDS = frozenset({"grad", "param_grad"})  # every storage key is (kind, name)


def is_gradient(key: object) -> bool:
    return isinstance(key, tuple) and key[0] in GRADIENT_KINDS


@dataclass
class Gradients:
    """The gradient storages live when the backward of the stages after some stage has
    finished (keyed as in ``StepSimulation``), and which value each belongs to."""

    storages: list[tuple[object, int, int]]
    """(key, bytes, references) of each live gradient storage."""
    grad_of: dict[str, object]
    fresh: int


def rng_state_bytes(graph: Graph) -> int:
    """Device bytes of the random-number state ``torch.utils.checkpoint`` stashes for each
    recomputed stage (module docstring): the CPU generator's state on the CPU, none on other
    devices (the stash lives on the host) or for a graph no profile measured (its own exact
    model, no device)."""
    device = graph.meta.device
    if device is None or not str(device).startswith("cpu"):
        return 0
    global _CPU_RNG_STATE_BYTES
    if _CPU_RNG_STATE_BYTES is None:
        import torch

        _CPU_RNG_STATE_BYTES = int(torch.get_rng_state().nbytes)
    return _CPU_RNG_STATE_BYTES


_CPU_RNG_STATE_BYTES: int | None = None
"""Bytes of ``torch.get_rng_state()`` (read once: the generator's state has a fixed size)."""


class VertexFacts:
    """The per-vertex data of :class:`~lightning_remat.solvers.simulate.StepSimulation`, which
    holds the plan's schedule and storage choices these read."""

    def _prepare_vertices(self, graph: Graph) -> None:
        """What the step needs to know of each vertex, from its costs and the graph's meta."""
        ids, meta = graph.ids, graph.meta
        self.param_bytes = {k: int(b) for k, b in (meta.param_bytes or {}).items()}
        # Where each parameter's gradient is allocated: its last op's backward (tied weights).
        self.param_grad_at = ({k: int(b) for k, b in meta.param_grad_bytes.items()}
                              if meta.param_grad_bytes is not None else self.param_bytes)
        # Gradients kept between steps are resident: the backward adds into them in place.
        self.grads_resident = bool(meta.grads_resident)
        outputs = meta.outputs if meta.outputs is not None else [ids[-1]]
        self.outputs = [o for o in outputs if o in graph]
        self.loss_bytes = int(meta.loss_peak_bytes or 0)
        # The loop people write holds its outputs until the step ends.
        self.outputs_held = bool(meta.outputs_held)
        # The outputs' gradients: as measured with the loss (a sum's take nothing), shared
        # out in proportion to the outputs' sizes; unmeasured, each as large as its output.
        sizes = sum(self.node[o].mem for o in self.outputs)
        share = (1.0 if meta.output_grad_bytes is None or not sizes
                 else min(meta.output_grad_bytes / sizes, 1.0))
        self.output_grad = {o: int(round(self.node[o].mem * share)) for o in self.outputs}
        # The profiler names aliases itself (views and in-place results); op names are the
        # fallback for graphs that lack them.
        guess_views = meta.aliases is None and meta.saved_refs is not None
        self.aliases = meta.aliases or {}
        self.base = self._storage_bases(ids, meta.aliases or {}, guess_views)
        self.requires = self._requires_grad(ids, meta.param_bytes is not None)
        self.last_read = self._last_reads(ids)
        self.saved_refs = {v: self._refs_of(v, meta.saved_refs) if self.requires[v] else []
                           for v in ids}
        saved_input = meta.saved_input_bytes or {}
        self.extra = {v: self._extra_saved(v, meta.saved_refs is not None, saved_input)
                      for v in ids}
        # An op that returns several tensors is the vertex of its first part, and may save a
        # later part (``torch.max(x, dim)`` saves its indices): that storage is held for it
        # from when the part's vertex makes it.
        position = self.shared.position
        self.later_saves: dict[str, list[str]] = {}
        for v in ids:
            later = [r for r in self.saved_refs[v] if position[r] > position[v]]
            if later:
                self.saved_refs[v] = [r for r in self.saved_refs[v] if position[r] <= position[v]]
                for r in later:
                    self.later_saves.setdefault(r, []).append(v)
        # Outputs that are views of the step's inputs or parameters allocate nothing.
        resident_views = set(meta.resident_views or ())
        self.size = {v: 0 if v in resident_views and v not in self.own_storage else self.node[v].mem
                     for v in ids}
        self.fwd_refs = self._forward_refs(ids)

    def _storage_bases(self, ids: list[str], aliases: dict[str, str],
                       guess_views: bool) -> dict[str, str]:
        """The vertex whose storage each vertex's output lives in (itself unless a view or an
        in-place op); only with the profiler's meta, a hand-built graph's vertices own theirs."""
        base: dict[str, str] = {}
        for v in ids:
            target = None if v in self.own_storage else aliases.get(v)
            if (target is None and guess_views and self.node[v].op in VIEW_OPS
                    and len(self.pred[v]) == 1):
                target = self.pred[v][0]
            if target is not None:
                # The profile names a storage by its first owner; a view of an in-place op
                # the executor rewrote is a view of that op's own storage.
                for u in self.pred[v]:
                    if u in base and aliases.get(u, u) == target:
                        target = u
                        break
            base[v] = base[target] if target is not None and target in base else v
        return base

    def _requires_grad(self, ids: list[str], has_params: bool) -> dict[str, bool]:
        """Which vertices autograd records: those with parameters and those computed from one
        (the step's inputs need no gradient). Others save nothing and get no gradient. A
        graph without ``param_bytes`` is taken to need gradients everywhere."""
        if not has_params:
            return dict.fromkeys(ids, True)
        requires: dict[str, bool] = {}
        for v in ids:
            requires[v] = bool(self.param_bytes.get(v)) or any(requires[u] for u in self.pred[v])
        return requires

    def _refs_of(self, v: str, saved_refs: dict[str, list[str]] | None) -> list[str]:
        """Vertices whose storages v's op keeps for backward (each storage once)."""
        if saved_refs is None:
            return []
        seen: dict[str, None] = {}
        aliases = self.aliases
        for r in saved_refs.get(v, ()):
            # The profile names a storage by its first owner; an in-place op the executor
            # rewrote owns a storage of its own, which v saves when it reads that op.
            # So does a view of it (its base is that op's, ``_storage_bases``).
            for reader_input in (v, *self.pred[v]):
                if (aliases.get(reader_input) == r
                        and self.base.get(reader_input, r) != self.base.get(r, r)):
                    r = reader_input
                    break
            if r in self.base and self._live_at(r, v):
                seen.setdefault(self.base[r])
        return list(seen)

    def _last_reads(self, ids: list[str]) -> dict[str, float]:
        """Each storage's last reader's position in the plain forward (an output's storage:
        never released in the forward)."""
        position, outputs = self.shared.position, set(self.outputs)
        last: dict[str, float] = {}
        for v in ids:
            b = self.base[v]
            reads = [position[w] for w in self.succ[v]] + [position[v]]
            last[b] = max(last.get(b, 0), *reads, math.inf if v in outputs else 0)
        return last

    def _live_at(self, r: str, v: str) -> bool:
        """Whether r's storage is still alive when v runs. A profile that names a storage by
        its address can name one freed before v (its address reused by a tensor no vertex
        made, in a forward run around its submodules): v's op saved that newer tensor, which
        counts as v's own saved bytes."""
        position = self.shared.position
        return position[r] > position[v] or self.last_read[self.base[r]] >= position[v]

    def _extra_saved(self, v: str, has_refs: bool, saved_input: dict[str, int]) -> int:
        """Bytes v's op saves besides forward values (all of ``saved`` without refs)."""
        if not self.requires[v]:
            return 0
        if not has_refs:
            return self.node[v].saved
        # Saved step inputs are resident before the step: not part of its memory.
        referenced = sum(self.node[r].mem for r in self.saved_refs[v]) + int(saved_input.get(v, 0))
        return max(self.node[v].saved - referenced, 0)

    def _forward_refs(self, ids: list[str]) -> dict[str, int]:
        """A storage's forward owners: the consumers of every vertex living in it (each edge
        one reference), and the loss for model outputs. Consumers inside the same storage (a
        view of a view) do not count: they run in the middle of its life, not at its end."""
        output_set = set(self.outputs)
        fwd_refs = dict.fromkeys(ids, 0)
        for v in ids:
            b = self.base[v]
            fwd_refs[b] += sum(1 for w in self.succ[v] if self.base[w] != b)
            if v in output_set:
                fwd_refs[b] += 1
            if b != v:
                # An alias holds its storage until its own op has run (and saved it if it does).
                fwd_refs[b] += 1
        return fwd_refs
