"""The memory timeline a plan predicts, op by op, through the forward and the backward.

The model is PyTorch eager's freeing behaviour, the memory model of Hong et al. section 4
(Algorithm 4, eq. 9-12) generalised from chains to DAGs and to our plans:

- **Reference counting.** A tensor's storage is freed the moment nothing refers to it
  (Hong's observation 1: PyTorch releases ``d_i`` as soon as it is dead, not in batches).
  A forward value is referred to by each forward consumer that has not run yet, by the
  model output until the loss has read it, by every op that saved it for backward
  (``meta.saved_refs``) until that op's backward has run, and by every recomputed stage
  that reads it (non-reentrant checkpoint keeps its inputs) until that stage's backward
  has finished.
- **Extra saved bytes.** What an op saves besides forward values (BatchNorm's statistics, a
  dropout mask, max-pool indices: ``saved`` minus the ``mem`` of its ``saved_refs``) is a
  block allocated with the op and freed after the op's backward.
- **Gradient buffers** (Hong's observation 2). A value's gradient is allocated when the
  first consumer's backward produces it, and the backward of the value's producer runs
  with its input gradient *and* its output gradients live, so the largest gradient of a
  segment is counted twice at that moment (eq. 9's ``max d_k`` term). A second consumer's
  gradient is accumulated: its fresh gradient exists next to the buffer (a transient) and
  is added in place when the buffer is the only owner of its storage
  (``InputBuffer::accumulate``), or out of place (a new buffer) when it is shared.
- **Gradient pass-through.** Ops whose backward hands the incoming gradient on unchanged
  (``add``; views: ``view``, ``reshape``, ``flatten``, ...) allocate nothing: the
  predecessor's gradient aliases the vertex's gradient storage.
- **Aliased outputs.** Views and in-place ops (``meta.aliases``: ``{id: base_id}``, or
  a view op by name) share the storage of their base: no allocation, and the storage lives
  as long as any of the aliases needs it.
- **Parameter gradients** (``meta.param_bytes``): on the first step they are allocated
  by the backward of the op that owns the parameters and stay (they are part of the step's
  peak, unlike the parameters themselves).
- **Workspace** ``ws_fwd``/``ws_bwd``: transient, counted at its op's peak only; a
  composite op's internal gradient (``cross_entropy``: the log-probabilities' gradient) is
  its backward workspace where none was measured (``INTERNAL_GRADIENT_OPS``).

Plans (see ``solvers/plan.py``): stages run in order in the forward and in reverse in the
backward. A ``recompute`` stage runs under non-reentrant ``torch.utils.checkpoint``: in the
forward its ops save nothing (its internal values die when forward-dead, their extra saved
bytes exist only during the op), it keeps its inputs (values of earlier stages it reads)
until its backward has finished, and its outputs read by later stages are ordinary values.
When its backward starts, its forward runs again (phase ``recompute``: values and saved
blocks allocated, values nobody saved freed when dead) and then it is back-propagated. An
``offload`` stage runs as ``keep`` during its forward; when its forward ends, what its ops
saved leaves the device (the device references are dropped), and it comes back as fresh
copies when its backward starts (freed op by op as the backward consumes it).

Without the profiler's meta (hand-built graphs) ``saved`` is one extra block held from an
op's forward to its backward, and values are freed when forward-dead.

What is counted is the step's memory above what is resident before it: inputs and
parameters are not counted (DESIGN.md section 6). Runtime is O(n + e).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_remat.graph.ir import Graph

if TYPE_CHECKING:
    from lightning_remat.solvers.plan import Plan

VIEW_OPS = frozenset({
    "view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose", "permute",
    "t", "getitem", "narrow", "select", "split", "chunk", "unbind", "view_as", "expand",
    "Flatten", "Unflatten", "Identity", "detach", "contiguous",
})
"""Op names whose output shares its input's storage (``contiguous`` is a no-op on the
contiguous tensors a traced forward usually passes it)."""

GRAD_PASSTHROUGH_OPS = frozenset({
    "add", "iadd", "__add__", "__iadd__", "view", "reshape", "flatten", "unflatten", "squeeze",
    "unsqueeze", "transpose", "permute", "t", "view_as", "Flatten", "Unflatten", "Identity",
    "contiguous",
})
"""Op names whose backward passes the incoming gradient on without a new buffer."""

INTERNAL_GRADIENT_OPS = frozenset({"cross_entropy"})
"""Composite ops whose backward runs as several autograd nodes with an internal gradient
between them as large as what they save besides their inputs: ``cross_entropy`` is
``nll_loss(log_softmax(x))``; NLL's backward makes the gradient of the log-probabilities
(the size of the saved log-softmax) and log-softmax's backward then makes the gradient of
``x`` while it is live. Where the profiler measured no backward workspace (on CPU it cannot)
this internal gradient is the op's backward workspace."""


@dataclass
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

    @property
    def peak_bytes(self) -> int:
        return max((e.peak_bytes for e in self.events), default=0)

    def series(self) -> list[int]:
        return [e.live_bytes for e in self.events]


class _Storages:
    """Reference-counted storages and the running total of live bytes."""

    __slots__ = ("live", "refs", "size")

    def __init__(self) -> None:
        self.live = 0
        self.refs: dict[object, int] = {}
        self.size: dict[object, int] = {}

    def alloc(self, key: object, nbytes: int, refs: int) -> None:
        """A new storage with ``refs`` owners (0: freed by the caller's next ``settle``)."""
        self.size[key] = nbytes
        self.refs[key] = refs
        self.live += nbytes

    def is_live(self, key: object) -> bool:
        return key in self.refs

    def hold(self, key: object) -> None:
        self.refs[key] += 1

    def release(self, key: object) -> None:
        count = self.refs[key] - 1
        if count > 0:
            self.refs[key] = count
        else:
            del self.refs[key]
            self.live -= self.size.pop(key)

    def settle(self, key: object) -> None:
        """Free a storage allocated with no owner (a value nothing reads)."""
        if self.refs.get(key) == 0:
            del self.refs[key]
            self.live -= self.size.pop(key)


def simulate(graph: Graph, plan: Plan | None = None) -> Timeline:
    """Predicted live bytes after every op of one training step under ``plan`` (the plain
    keep-everything plan when None): a forward, the loss, ``loss.backward()``."""
    ids = graph.ids
    timeline = Timeline()
    if not ids:
        return timeline
    if plan is None:
        stages: list[list[str]] = [ids]
        actions = ["keep"]
    else:
        stages = [sorted(s.nodes, key=graph.position) for s in plan.stages]
        actions = [s.action for s in plan.stages]
    stage_of = {v: k for k, stage in enumerate(stages) for v in stage}
    meta = graph.meta
    saved_refs_meta = meta.saved_refs
    has_refs = saved_refs_meta is not None
    param_bytes = {k: int(b) for k, b in (meta.param_bytes or {}).items()}
    outputs = [o for o in (meta.outputs if meta.outputs is not None else [ids[-1]]) if o in graph]
    output_set = set(outputs)
    # The profiler names aliases itself (views and in-place results); op names are the
    # fallback for graphs that lack the key.
    alias_meta = meta.aliases
    guess_views = alias_meta is None and has_refs
    alias_meta = alias_meta or {}
    # Outputs that are views of the step's inputs or parameters allocate nothing.
    resident_views = set(meta.resident_views or ())
    saved_input = meta.saved_input_bytes or {}

    node = {v: graph[v] for v in ids}
    succ = {v: graph.successors(v) for v in ids}
    pred = {v: graph.predecessors(v) for v in ids}

    # The vertex whose storage each vertex's output lives in (itself unless a view or an
    # in-place op); only with the profiler's meta, a hand-built graph's vertices own theirs.
    base: dict[str, str] = {}
    for v in ids:
        target = alias_meta.get(v)
        if target is None and guess_views and node[v].op in VIEW_OPS and len(pred[v]) == 1:
            target = pred[v][0]
        if target is not None and target in base:
            base[v] = base[target]
        else:
            base[v] = v

    def refs_of(v: str) -> list[str]:
        """Vertices whose storages v's op keeps for backward (each storage once)."""
        if not has_refs:
            return []
        seen: dict[str, None] = {}
        for r in saved_refs_meta.get(v, ()):
            if r in base:
                seen.setdefault(base[r])
        return list(seen)

    # Which vertices autograd records: those with parameters and those computed from one
    # (the step's inputs need no gradient). Others save nothing and get no gradient. A
    # graph without ``param_bytes`` is taken to need gradients everywhere.
    if meta.param_bytes is not None:
        requires = {}
        for v in ids:
            requires[v] = bool(param_bytes.get(v)) or any(requires[u] for u in pred[v])
    else:
        requires = dict.fromkeys(ids, True)

    saved_refs = {v: refs_of(v) if requires[v] else [] for v in ids}

    def extra_saved(v: str) -> int:
        if not requires[v]:
            return 0
        if not has_refs:
            return node[v].saved
        # Saved step inputs are resident before the step: not part of its memory.
        referenced = sum(node[r].mem for r in saved_refs[v]) + int(saved_input.get(v, 0))
        return max(node[v].saved - referenced, 0)

    extra = {v: extra_saved(v) for v in ids}
    size = {v: 0 if v in resident_views else node[v].mem for v in ids}

    # ---- reference counts of the forward values --------------------------------------------
    # A storage's forward owners: the consumers of every vertex living in it (each edge one
    # reference), and the loss for model outputs. Consumers inside the same storage (a view
    # of a view) do not count: they run in the middle of its life, not at its end.
    fwd_refs: dict[str, int] = dict.fromkeys(ids, 0)
    for v in ids:
        b = base[v]
        fwd_refs[b] += sum(1 for w in succ[v] if base[w] != b)
        if v in output_set:
            fwd_refs[b] += 1
        if b != v:
            # An alias holds its storage until its own op has run (and saved it if it does).
            fwd_refs[b] += 1

    mem = _Storages()
    events = timeline.events
    held: dict[str, list[object]] = {v: [] for v in ids}  # storages v's saved state holds
    closure: list[list[object]] = [[] for _ in stages]  # inputs a recomputed stage keeps
    offloaded: list[list[str]] = [[] for _ in stages]  # holders whose saved state left

    def val(v: str) -> tuple[str, str]:
        return ("val", base[v])

    # ---- forward ----------------------------------------------------------------------------
    for k, stage in enumerate(stages):
        action = actions[k]
        in_closure: set[object] = set()
        for v in stage:
            n = node[v]
            if base[v] == v:
                mem.alloc(val(v), size[v], fwd_refs[v])
            transient = n.ws_fwd
            if action == "recompute":
                # Checkpoint's pack hook drops what the op saves: its extra saved bytes
                # exist only while the op runs, and it holds no forward values.
                transient += extra[v]
                for u in pred[v]:
                    key = val(u)
                    if stage_of[u] != k and key not in in_closure:
                        in_closure.add(key)
                        mem.hold(key)
                        closure[k].append(key)
            else:
                if extra[v]:
                    mem.alloc(("extra", v), extra[v], 1)
                    held[v].append(("extra", v))
                for r in saved_refs[v]:
                    key = val(r)
                    mem.hold(key)
                    held[v].append(key)
            peak = mem.live + transient
            own = val(v)
            for u in pred[v]:
                if base[u] != base[v]:
                    mem.release(val(u))
            if base[v] != v:
                mem.release(own)
            mem.settle(own)
            events.append(Event("forward", v, mem.live, peak, k))
        if action == "offload":
            # What the stage saved is copied to the host: the device references go.
            for v in stage:
                for key in held[v]:
                    mem.release(key)
                held[v] = []
                offloaded[k].append(v)

    # ---- the loss: it drops its references to the outputs (the step's locals are gone
    # when ``loss.backward()`` starts), then the outputs' gradients appear ------------------
    for o in outputs:
        mem.release(val(o))
    grad_of: dict[str, object] = {}
    for o in outputs:
        if requires[o]:
            grad_of[o] = ("grad", o)
            mem.alloc(("grad", o), node[o].mem, 1)

    # ---- backward ---------------------------------------------------------------------------
    fresh = 0  # serial number of gradient storages
    for k in range(len(stages) - 1, -1, -1):
        stage = stages[k]
        action = actions[k]
        if action == "recompute":
            # Non-reentrant checkpoint re-runs the stage's forward when its backward starts;
            # values it does not save die as soon as the recomputation no longer reads them.
            re_refs = {v: sum(1 for w in succ[v] if stage_of[w] == k and base[w] != base[v])
                       for v in stage}
            for v in stage:
                if base[v] != v and stage_of[base[v]] == k:
                    re_refs[base[v]] += re_refs[v] + 1
            rkey = {v: (("rval", base[v]) if stage_of[base[v]] == k else val(v)) for v in stage}
            for v in stage:
                n = node[v]
                if base[v] == v:
                    mem.alloc(rkey[v], size[v], re_refs[v])
                if extra[v]:
                    mem.alloc(("extra", v), extra[v], 1)
                    held[v].append(("extra", v))
                for r in saved_refs[v]:
                    key = rkey[r] if stage_of[r] == k else val(r)
                    mem.hold(key)
                    held[v].append(key)
                peak = mem.live + n.ws_fwd
                for u in pred[v]:
                    if stage_of[base[u]] == k and base[u] != base[v]:
                        mem.release(rkey[u])
                if base[v] != v and stage_of[base[v]] == k:
                    mem.release(rkey[v])
                mem.settle(rkey[v])
                events.append(Event("recompute", v, mem.live, peak, k))
        elif action == "offload":
            # The saved state comes back to the device as fresh copies (each storage once).
            restored: dict[object, int] = {}
            for v in offloaded[k]:
                if extra[v]:
                    mem.alloc(("extra", v), extra[v], 1)
                    held[v].append(("extra", v))
                for r in saved_refs[v]:
                    key = ("restored", base[r])
                    if key in restored:
                        mem.hold(key)
                    else:
                        restored[key] = 1
                        mem.alloc(key, size[r], 1)
                    held[v].append(key)
            if restored or offloaded[k]:
                events.append(Event("restore", stage[-1], mem.live, mem.live, k))

        for v in reversed(stage):
            n = node[v]
            my_grad = grad_of.pop(v, None)
            transient = n.ws_bwd
            if n.op in INTERNAL_GRADIENT_OPS:
                transient = max(transient, extra[v])
            peak_extra = 0
            if my_grad is not None:
                passthrough = n.op in GRAD_PASSTHROUGH_OPS
                for u in pred[v]:
                    if not requires[u]:
                        continue
                    if passthrough:
                        incoming: object = my_grad
                        mem.hold(incoming)
                    else:
                        fresh += 1
                        incoming = ("grad", fresh)
                        mem.alloc(incoming, node[u].mem, 1)
                    old = grad_of.get(u)
                    if old is None:
                        grad_of[u] = incoming
                    elif mem.refs[old] == 1 and incoming != old:
                        # In-place accumulation into the sole owner; the incoming gradient
                        # was live until the add (counted at this op's peak).
                        peak_extra += mem.size[incoming] if mem.refs[incoming] == 1 else 0
                        mem.release(incoming)
                    else:
                        # Shared buffer: old + new is a new buffer.
                        fresh += 1
                        summed = ("grad", fresh)
                        mem.alloc(summed, node[u].mem, 1)
                        peak_extra += mem.size[incoming] if mem.refs[incoming] == 1 else 0
                        mem.release(old)
                        mem.release(incoming)
                        grad_of[u] = summed
                pb = param_bytes.get(v, 0)
                if pb:
                    # The first step's parameter gradients: allocated here, kept.
                    mem.alloc(("param_grad", v), pb, 1)
            peak = mem.live + transient + peak_extra
            if my_grad is not None:
                mem.release(my_grad)
            for key in held[v]:
                mem.release(key)
            held[v] = []
            events.append(Event("backward", v, mem.live, peak, k))
        if closure[k]:
            # The checkpointed stage's frame, and the inputs it kept, go with its last op.
            for key in closure[k]:
                mem.release(key)
            closure[k] = []
            events[-1].live_bytes = mem.live
    return timeline
