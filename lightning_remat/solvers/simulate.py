"""The memory timeline a plan predicts, op by op, through the forward and the backward.

The model is PyTorch eager's freeing behaviour, the memory model of Hong et al. section 4
(Algorithm 4, eq. 9-12) generalised from chains to DAGs and to our plans:

- **Reference counting.** A tensor's storage is freed the moment nothing refers to it
  (Hong's observation 1: PyTorch releases ``d_i`` as soon as it is dead, not in batches).
  A forward value is referred to by each forward consumer that has not run yet, by the
  model output until the loss has read it (until the step ends where the step holds its
  outputs, ``meta.outputs_held``: the loop people write), by every op that saved it for backward
  (``meta.saved_refs``) until that op's backward has run, and by every recomputed stage
  that reads it (non-reentrant checkpoint keeps its inputs) until that stage's backward
  has finished, and by every other stage that reads it until that stage's forward has
  returned (the executor passes a stage the values it reads as arguments).
- **The random-number state.** ``torch.utils.checkpoint`` (``preserve_rng_state=True``, as
  the executors run a stage that draws random numbers, the schedule's ``draws_random``)
  stashes the CPU generator's state (``torch.get_rng_state()``, a
  host tensor of a few kilobytes) when a recomputed stage's forward starts, for its
  recomputation to draw the same numbers; it is freed with the stage's frame when its
  backward has finished. It is device memory on the CPU only (on CUDA the stash is host
  memory), and it is part of the cache the stage holds for the stages after it. The
  recomputation runs under ``torch.random.fork_rng``, which copies the generator's state
  again for the recomputation's length.
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
- **Parameter gradients** (``meta.param_bytes``): allocated by the backward of the op that
  owns the parameters and kept (part of the step's peak, unlike the parameters), unless
  they exist before the step (``meta.grads_resident``: a loop that keeps them), when the
  backward adds into them in place and they are resident like the parameters.
- **Workspace** ``ws_fwd``/``ws_bwd``: transient, counted at its op's peak only; a
  composite op's internal gradient (``cross_entropy``: the log-probabilities' gradient) is
  its backward workspace where none was measured (``INTERNAL_GRADIENT_OPS``).

Plans (see ``solvers/plan.py``): stages run in order in the forward and in reverse in the
backward. A ``recompute`` stage runs under non-reentrant ``torch.utils.checkpoint`` with a
selective policy that keeps its boundary (docs/design.md section 5): in the forward its ops
save nothing (its internal values die when forward-dead, their extra saved bytes exist only
during the op) except its kept boundary values (the schedule's ``kept``: the values later
stages or the output read, less random and unrewritten in-place ops and values that live in
another's storage, views and ops that returned their input, which the policy has no op of
to save), which stay with their ops' extra saved bytes until the recomputation; it keeps its
inputs (values of earlier stages it reads) until its backward has finished. When its
backward starts, the rest of its forward runs again (phase ``recompute``, the schedule's
``recomputed``: values and saved blocks allocated, values nobody saved freed when dead, but
a value the stage returns, read by a later stage, held by the recomputation's frame until it
ends, as the stage's program returns it), the kept values are handed on to the recomputed
ops that read them, and then it is back-propagated. In-place ops the
executor rewrites (the schedule's ``rewritten``) own their storage. ``whole_stages=True``
models the tracing fallback instead, which runs a recomputed stage again whole.

The peak is also a fold over stages (``solvers.stage_costs``), the form Kusumoto et al.'s DP
uses (``solvers.kusumoto``). An
``offload`` stage runs as ``keep`` during its forward; when its forward ends, what its ops
saved leaves the device (the device references are dropped), and it comes back as fresh
copies when its backward starts (freed op by op as the backward consumes it).

Without the profiler's meta (hand-built graphs) ``saved`` is one extra block held from an
op's forward to its backward, and values are freed when forward-dead.

What is counted is the step's memory above what is resident before it: inputs and
parameters are not counted (docs/design.md section 6). Runtime is O(n + e).

Length: the simulator is the one model of a step (what every solver's plan is scored by,
``solvers.scoring``); split, its forward, recomputation and backward would share their
storage bookkeeping across modules.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from lightning_remat.graph.ir import Graph
from lightning_remat.graph.ops import CAST_OPS, GRAD_PASSTHROUGH_OPS, INTERNAL_GRADIENT_OPS
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.schedule import (
    Schedule,
    ScheduleParts,
    StageSchedule,
    make_schedule,
)
from lightning_remat.solvers.step_memory import (
    MAPPED_BUFFER_BYTES,
    Event,
    Gradients,
    Storages,
    Timeline,
    VertexFacts,
    adjacency,
    is_gradient,
    rng_state_bytes,
)


class SharedSteps:
    """What every simulation of one graph shares (its adjacency and the per-vertex data,
    the latter per set of in-place ops a plan rewrites; the gradients the backward of a
    kept tail leaves), for callers that simulate many plans of it (Kusumoto's DP with the
    simulator's stage costs)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.node = {v: graph[v] for v in graph.ids}
        self.position = {v: k for k, v in enumerate(graph.ids)}
        self.succ, self.pred = adjacency(graph)
        self.vertices: dict[frozenset[str], dict[str, Any]] = {}
        self.parts = ScheduleParts.of(graph, self.succ)
        self.inplace, self.outputs = self.parts.inplace, self.parts.outputs
        self.tails: dict[tuple[tuple[str, ...], ...], Gradients] = {}
        # StepSimulation._skip_tail: the references a kept tail drops, per tail and
        # rewritten in-place ops.
        self.tail_releases: dict[tuple, list[tuple[str, str]]] = {}
        self.prefixes: dict[tuple, dict[str, Any]] = {}  # StepSimulation.forward_state
        self.rng_state_bytes = rng_state_bytes(graph)

    def tail_gradients(self, tail: list[list[str]]) -> Gradients:
        """The gradients left when the kept stages ``tail`` (the step's last, in order) have
        been back-propagated. They depend on nothing before the tail: the backward runs in
        one order whatever the plan, and a gradient's size is its value's."""
        key = tuple(tuple(stage) for stage in tail)
        found = self.tails.get(key)
        if found is None:
            in_tail = {v for stage in tail for v in stage}
            head = [v for v in self.graph.ids if v not in in_tail]
            plan = Plan([Stage(head, "recompute"), *(Stage(list(s), "keep") for s in tail)],
                        [], 0, 0.0, "", True)
            sim = StepSimulation(self.graph, plan, shared=self)
            sim.run(stop_after=1)
            mem = sim.mem
            found = self.tails[key] = Gradients(
                [(k, mem.size[k], mem.refs[k]) for k in mem.refs if is_gradient(k)],
                dict(sim.grad_of), sim.fresh)
        return found


_UNCHANGED: ContextVar[dict[int, tuple[Graph, dict[str, Any]]] | None] = ContextVar("unchanged_graphs", default=None)
"""The graphs a running :func:`unchanged` scope holds, by identity, each with what its
simulations share."""


@contextmanager
def unchanged(graph: Graph) -> Iterator[None]:
    """While this runs, ``graph`` is not changed (a solver, a pure function over it, plans
    for one budget): every simulation of it shares one :class:`SharedSteps` and one
    simulated plain step (:func:`shared_steps`, :func:`plain_simulated`), as a DP's own
    loops already do. Nested scopes over the same graph are one."""
    held = _UNCHANGED.get() or {}
    if held.get(id(graph), (None,))[0] is graph:
        yield
        return
    token = _UNCHANGED.set({**held, id(graph): (graph, {})})
    try:
        yield
    finally:
        _UNCHANGED.reset(token)


def _once_in_scope(graph: Graph, name: str, make: Callable[[], Any]) -> Any:
    """``make()``, kept under ``name`` for the :func:`unchanged` scope ``graph`` is in (made
    anew outside one)."""
    entry = (_UNCHANGED.get() or {}).get(id(graph))
    if entry is None or entry[0] is not graph:
        return make()
    held = entry[1]
    if name not in held:
        held[name] = make()
    return held[name]


def shared_steps(graph: Graph) -> SharedSteps:
    """The :class:`SharedSteps` of ``graph``: an :func:`unchanged` scope's, else a new one."""
    return _once_in_scope(graph, "steps", lambda: SharedSteps(graph))


def plain_simulated(graph: Graph) -> Timeline:
    """:func:`simulate` of the plain plan, once per :func:`unchanged` scope (a caller must
    not change the timeline)."""
    return _once_in_scope(graph, "plain", lambda: simulate(graph))


def simulate(graph: Graph, plan: Plan | None = None, *, whole_stages: bool = False,
             schedule: Schedule | None = None) -> Timeline:
    """Predicted live bytes after every op of one training step under ``plan`` (the plain
    keep-everything plan when None): a forward, the loss, ``loss.backward()``, following
    ``schedule`` (default: :func:`~lightning_remat.solvers.schedule.make_schedule` of the
    plan, as the executor runs it). ``whole_stages``: a recomputed stage runs again whole,
    its boundary included (the tracing fallback's executor, ``runtime.hooked``), instead of
    keeping its boundary."""
    if not graph.ids:
        return Timeline()
    return StepSimulation(graph, plan, whole_stages, shared=shared_steps(graph), schedule=schedule).run()


class StepSimulation(VertexFacts):
    """One training step under a plan, op by op, as the module docstring describes: the
    per-vertex data is read from the graph once, then the forward runs stage by stage, the
    loss, and the backward stage by stage in reverse (a recomputed stage's forward, or an
    offloaded stage's saved state, first).

    Storage keys: ``("val", base)`` a forward value, ``("rval", base)`` its recomputed copy,
    ``("restored", base)`` its copy back from the host, ``("extra", v)`` what v's op saves
    besides values, ``("grad", v | n)`` a gradient, ``("param_grad", v)`` v's parameters'
    gradients."""

    def __init__(self, graph: Graph, plan: Plan | None, whole_stages: bool = False,
                 shared: SharedSteps | None = None, schedule: Schedule | None = None) -> None:
        shared = shared if shared is not None else SharedSteps(graph)
        if plan is None:
            plan = Plan([Stage(graph.ids, "keep")], [], 0, 0.0, "plain", True)
        if schedule is None:
            schedule = make_schedule(graph, plan, whole_stages=whole_stages, parts=shared.parts)
        self.schedule = schedule
        self.stages: list[list[str]] = [list(s.vertices) for s in schedule.stages]
        self.actions = [s.action for s in schedule.stages]
        self.kept: list[frozenset[str]] = schedule.kept
        self.own_storage: frozenset[str] = schedule.rewritten
        self.stage_of = {v: k for k, stage in enumerate(self.stages) for v in stage}
        self.shared = shared
        self.node, self.succ, self.pred = shared.node, shared.succ, shared.pred
        prepared = shared.vertices.get(frozenset(self.own_storage))
        if prepared is None:
            before = set(self.__dict__)
            self._prepare_vertices(graph)
            prepared = shared.vertices[frozenset(self.own_storage)] = {
                name: value for name, value in self.__dict__.items() if name not in before}
        else:
            self.__dict__.update(prepared)  # read-only while the step runs

        self.mem = Storages(int(graph.meta.mapped_buffer_bytes or MAPPED_BUFFER_BYTES))
        self.timeline = Timeline()
        # The storages v's saved state holds; the inputs a recomputed stage keeps; the
        # vertices of an offloaded stage whose saved state left the device.
        self.held: defaultdict[str, list[object]] = defaultdict(list)
        self.closure: list[list[object]] = [[] for _ in self.stages]
        # A recomputed stage's kept boundary values: the storage each holds, until its
        # recomputation hands them on.
        self.kept_held: dict[str, object] = {}
        self.frame_kept: list[object] = []  # values a running recomputation's frame holds
        self.frame_returns: set[str] = set()  # the values it returns that it runs again
        self.kept_bytes = [0] * len(self.stages)  # what each stage adds to the cache
        # Per vertex: gradients (of values and parameters) and transients at its backward's
        # peak; the same under every plan (the backward runs in one order).
        self.gradient_peak: dict[str, int] = {}
        self._kept_storages: set[object] = set()
        self.offloaded: list[list[str]] = [[] for _ in self.stages]
        self.grad_of: dict[str, object] = {}  # the gradient storage of each value, until consumed
        self.fresh = 0  # serial number of gradient storages
        self.forward_done = 0  # stages whose forward has run (resume_forward)

    def forward_state(self) -> dict[str, Any]:
        """A copy of what the forward of the stages run so far left (no events): the same
        for every plan that begins with those stages and rewrites the same in-place ops."""
        mem = self.mem
        return {"refs": dict(mem.refs), "size": dict(mem.size), "live": mem.live,
                "grad_live": mem.grad_live, "forward_done": self.forward_done,
                "held": {v: list(keys) for v, keys in self.held.items()},
                "closure": [list(c) for c in self.closure[:self.forward_done]],
                "kept_held": dict(self.kept_held),
                "kept_bytes": self.kept_bytes[:self.forward_done],
                "_kept_storages": set(self._kept_storages),
                "offloaded": [list(o) for o in self.offloaded[:self.forward_done]]}

    def resume_forward(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`forward_state` of a plan with the same first stages."""
        mem = self.mem
        mem.refs, mem.size = dict(state["refs"]), dict(state["size"])
        mem.live, mem.grad_live = state["live"], state["grad_live"]
        done = self.forward_done = state["forward_done"]
        self.held = defaultdict(list, {v: list(keys) for v, keys in state["held"].items()})
        self.closure[:done] = [list(c) for c in state["closure"]]
        self.kept_held = dict(state["kept_held"])
        self.kept_bytes[:done] = state["kept_bytes"]
        self._kept_storages = set(state["_kept_storages"])
        self.offloaded[:done] = [list(o) for o in state["offloaded"]]

    def run(self, stop_after: int | None = None, skip_tail: bool = False) -> Timeline:
        """The step's events; ``stop_after``: stop when that stage's backward ends;
        ``skip_tail``: the stages after it (all kept) are not simulated, only their effect
        on it (:meth:`_skip_tail`)."""
        last = len(self.stages) - 1
        if skip_tail and stop_after is not None and stop_after < last:
            last = stop_after
        for k in range(self.forward_done, last + 1):
            self.forward_stage(k)
        if last < len(self.stages) - 1:
            self._skip_tail(last)
        else:
            self._loss()
        for k in range(last, -1, -1):
            if self.actions[k] == "recompute":
                if self.schedule.stages[k].runs_again:
                    self._recompute_stage(k)
                else:  # nothing of it runs again: its kept values go to their readers' backward
                    for v in self.stages[k]:
                        if v in self.kept_held:
                            self.mem.release(self.kept_held.pop(v))
            elif self.actions[k] == "offload":
                self._restore_stage(k)
            self._backward_stage(k)
            if k == stop_after:
                break
        else:
            if self.outputs_held and self.timeline.events:
                # The step ends: its locals, the outputs among them, go.
                for o in self.outputs:
                    self.mem.release(self._val(o))
                self.timeline.events[-1].live_bytes = self.mem.live
        self.timeline.mapped_buffers = self.mem.mapped_peak
        return self.timeline

    def _val(self, v: str) -> tuple[str, str]:
        return ("val", self.base[v])

    def _save_extra(self, v: str) -> None:
        """Allocate what v's op saves besides forward values, held until its backward."""
        if self.extra[v]:
            self.mem.alloc(("extra", v), self.extra[v], 1)
            self.held[v].append(("extra", v))

    def _save_for_backward(self, v: str, keys: list[object]) -> None:
        """v's op saves its extra block and holds the storages ``keys`` until its backward."""
        self._save_extra(v)
        for key in keys:
            self.mem.hold(key)
            self.held[v].append(key)

    # ---- forward and loss ------------------------------------------------------------------
    def forward_stage(self, k: int) -> None:
        # Hot: Kusumoto's DP simulates one stage per pair of lower sets, so the per-op work
        # reads everything through locals bound once per stage.
        self.forward_done = k + 1
        in_closure: set[object] = set()
        recompute = self.actions[k] == "recompute"
        if recompute and self.shared.rng_state_bytes and self.schedule.stages[k].draws_random:
            # Checkpoint's stash of the random-number state, until the stage's frame goes.
            key = ("rng", k)
            self.mem.alloc(key, self.shared.rng_state_bytes, 1)
            self.closure[k].append(key)
            self.kept_bytes[k] += self.shared.rng_state_bytes
        mem, base, stage_of, held = self.mem, self.base, self.stage_of, self.held
        alloc, release, refs = mem.alloc, mem.release, mem.refs
        size, fwd_refs, later_saves, actions = self.size, self.fwd_refs, self.later_saves, self.actions
        node, pred, extra, saved_refs = self.node, self.pred, self.extra, self.saved_refs
        kept, closure, events = self.kept[k], self.closure[k], self.timeline.events
        for v in self.stages[k]:
            bv = base[v]
            own = ("val", bv)
            if bv == v:
                alloc(own, size[v], fwd_refs[v])
                savers = later_saves.get(v)
                if savers:
                    for saver in savers:
                        if actions[stage_of[saver]] != "recompute":
                            refs[own] += 1
                            held[saver].append(own)
            transient = node[v].ws_fwd
            preds = pred[v]
            if recompute:
                # Checkpoint's pack hook drops what the op saves: its extra saved bytes exist
                # only while the op runs, and it holds no forward values. A kept boundary op's
                # outputs (its value and its extra outputs, e.g. BatchNorm's statistics) are
                # held until the recomputation.
                if v in kept:
                    self._save_extra(v)
                    self.kept_held[v] = own
                    refs[own] += 1
                    self.kept_bytes[k] += extra[v]
                    if own not in self._kept_storages:
                        self._kept_storages.add(own)
                        self.kept_bytes[k] += mem.size[own]
                else:
                    transient += extra[v]
                for u in preds:
                    key = ("val", base[u])
                    if stage_of[u] != k and key not in in_closure:
                        in_closure.add(key)
                        refs[key] += 1
                        closure.append(key)
            else:
                if extra[v]:
                    alloc(("extra", v), extra[v], 1)
                    held[v].append(("extra", v))
                for r in saved_refs[v]:
                    key = ("val", base[r])
                    refs[key] += 1
                    held[v].append(key)
                for u in preds:
                    key = ("val", base[u])
                    if stage_of[u] != k and key not in in_closure:
                        in_closure.add(key)  # held by the stage's call (below)
                        refs[key] += 1
            peak = mem.live + transient
            for u in preds:
                bu = base[u]
                if bu != bv:
                    release(("val", bu))
            if bv != v:
                release(own)
            if refs.get(own) == 0:
                mem.settle(own)
            events.append(Event("forward", v, mem.live, peak, k))
        if not recompute:
            # The executor calls a stage with the values it reads from earlier stages as
            # arguments (runtime.module): they are held until the stage returns, not only
            # until the stage's last op that reads them.
            for key in in_closure:
                release(key)
        if self.actions[k] == "offload":
            # What the stage saved is copied to the host: the device references go.
            for v in self.stages[k]:
                for key in held[v]:
                    release(key)
                held[v] = []
                self.offloaded[k].append(v)

    def _loss(self) -> None:
        """The loss runs on top of everything the forward holds, to its measured peak
        (``meta.loss_peak_bytes``, counted at the last forward op so that the events stay
        one per op); it drops its references to the outputs (the step's locals are gone
        when ``loss.backward()`` starts) unless the step holds them to its end
        (``meta.outputs_held``), then the outputs' gradients appear."""
        if self.loss_bytes and self.timeline.events:
            last = self.timeline.events[-1]
            last.peak_bytes = max(last.peak_bytes, self.mem.live + self.loss_bytes)
        if not self.outputs_held:
            for o in self.outputs:
                self.mem.release(self._val(o))
        for o in self.outputs:
            if self.requires[o]:
                self.grad_of[o] = ("grad", o)
                self.mem.alloc(("grad", o), self.output_grad[o], 1)

    def _skip_tail(self, k: int) -> None:
        """The state when stage k's backward starts, where the stages after k are kept: the
        references their forward and the loss would have dropped on earlier storages are
        dropped (what they saved, their backward gave back), and the gradients their
        backward leaves (:meth:`SharedSteps.tail_gradients`) are live."""
        tail = self.stages[k + 1:]
        key = (tuple(tuple(stage) for stage in tail), self.own_storage)
        dropped = self.shared.tail_releases.get(key)
        if dropped is None:
            base, stage_of, pred = self.base, self.stage_of, self.pred
            dropped = []
            for stage in tail:
                for v in stage:
                    bv = base[v]
                    for u in pred[v]:
                        bu = base[u]
                        if bu != bv and stage_of[bu] <= k:
                            dropped.append(("val", bu))
                    if bv != v and stage_of[bv] <= k:
                        dropped.append(("val", bv))
            for o in self.outputs:
                if stage_of[base[o]] <= k and not self.outputs_held:
                    dropped.append(("val", base[o]))
            # The same for every plan whose stages after k are these (each storage an
            # earlier stage made is one of theirs), under the same rewritten ops.
            self.shared.tail_releases[key] = dropped
        release = self.mem.release
        for storage in dropped:
            release(storage)
        gradients = self.shared.tail_gradients(tail)
        mem = self.mem
        for storage, nbytes, refs in gradients.storages:
            mem.alloc(storage, nbytes, refs)
        self.grad_of = dict(gradients.grad_of)
        self.fresh = gradients.fresh

    # ---- before a stage's backward ---------------------------------------------------------
    def _recompute_stage(self, k: int) -> None:
        """Non-reentrant checkpoint re-runs the stage's forward when its backward starts;
        values it does not save die as soon as the recomputation no longer reads them."""
        stage, base, stage_of, kept = self.stages[k], self.base, self.stage_of, self.kept[k]
        succ, pred = self.succ, self.pred
        re_refs: dict[str, int] = {}
        for v in stage:
            bv = base[v]
            count = 0
            for w in succ[v]:
                if stage_of[w] == k and base[w] != bv:
                    count += 1
            re_refs[v] = count
        for v in stage:
            if base[v] != v and stage_of[base[v]] == k and v not in kept:
                re_refs[base[v]] += re_refs[v] + 1
        # A value recomputed in the stage lives in a new storage, unless it is a view of a
        # kept value: then it is a view of the kept storage.
        rkey: dict[str, object] = {}
        for v in stage:
            bv = base[v]
            rkey[v] = ("rval", bv) if stage_of[bv] == k and v not in kept and bv not in kept else ("val", bv)
        # A kept op whose output turned out to share the storage of a value recomputed in
        # the stage (a dropout of probability 0, a cast to the dtype it has, return their
        # input): what its readers save of that storage is the kept one; the recomputed
        # value is a fresh storage only its other readers read.
        kept_aliases: dict[str, set[str]] = {}
        for v in kept:
            if base[v] != v and base[v] in rkey and base[v] not in kept:
                kept_aliases.setdefault(base[v], set()).add(v)
        # The values the stage's program returns (read by later stages, or model outputs)
        # that run again: the recomputation's frame holds each until it ends, as it holds
        # the kept ones it hands on (its early stop raises before the program returns).
        outputs = self.shared.outputs
        schedule = self.schedule.stages[k]
        frame_returns = self.frame_returns = {
            v for v in schedule.reached
            if v not in kept and (v in outputs or any(stage_of[w] != k for w in succ[v]))}
        fork = ("rng_fork", k)
        stash = self.shared.rng_state_bytes if schedule.draws_random else 0
        mem = self.mem
        if stash:
            # fork_rng's copy of the generator's state, for the recomputation's length.
            mem.alloc(fork, stash, 1)
        alloc, release, refs = mem.alloc, mem.release, mem.refs
        saved_refs, extra, held, later_saves = self.saved_refs, self.extra, self.held, self.later_saves
        node, size, events, frame_kept = self.node, self.size, self.timeline.events, self.frame_kept
        packed_only = schedule.packed_only
        for v in schedule.reached:
            # What v's op saves: values of the stage as recomputed (a kept alias's storage
            # where v reads the kept alias), others as the forward made them.
            saved: list[object] = []
            for r in saved_refs[v]:
                if stage_of[r] != k or (kept_aliases and any(u in kept_aliases.get(r, ()) for u in pred[v])):
                    saved.append(("val", base[r]))
                else:
                    saved.append(rkey[r])
            if v in kept:
                self._hand_on_kept(k, v, rkey, re_refs, saved)
                continue
            if v == packed_only:
                self._save_for_backward(v, saved)
                events.append(Event("recompute", v, mem.live, mem.live, k))
                continue
            bv = base[v]
            mine = rkey[v]
            if bv == v:
                alloc(mine, size[v], re_refs[v])
                savers = later_saves.get(v)
                if savers:
                    for saver in savers:
                        if stage_of[saver] == k:
                            refs[mine] += 1
                            held[saver].append(mine)
            if extra[v]:
                alloc(("extra", v), extra[v], 1)
                held[v].append(("extra", v))
            for key in saved:
                refs[key] += 1
                held[v].append(key)
            if v in frame_returns:
                refs[mine] += 1
                frame_kept.append(mine)
            peak = mem.live + node[v].ws_fwd
            for u in pred[v]:
                bu = base[u]
                if bu != bv and stage_of[bu] == k:
                    release(rkey[u])
            if bv != v and stage_of[bv] == k:
                release(mine)
            if refs.get(mine) == 0:
                mem.settle(mine)
            events.append(Event("recompute", v, mem.live, peak, k))
        self._end_recomputation(k, schedule, rkey)
        if stash:
            mem.release(fork)
            events[-1].live_bytes = mem.live

    def _end_recomputation(self, k: int, schedule: StageSchedule, rkey: dict[str, object]) -> None:
        """The recomputation ends, at the stage's last saving op (``Schedule``), and its
        frame goes: the kept values it handed on (the program's return value), and, where
        it stopped early, the references the ops after that one, and a packed-only one,
        would have released when they read their inputs. Kept values no op reached are
        never handed on."""
        mem, base, stage_of = self.mem, self.base, self.stage_of
        for key in self.frame_kept:
            mem.release(key)
        self.frame_kept = []
        if len(schedule.reached) == len(schedule.vertices) and schedule.packed_only is None:
            if self.timeline.events:
                self.timeline.events[-1].live_bytes = mem.live
            return
        done = set(schedule.reached) - {schedule.packed_only}
        for w in schedule.vertices:
            if w in done:
                continue
            if w in self.kept_held:
                mem.release(self.kept_held.pop(w))
            for u in self.pred[w]:
                # Its read of u was counted on u's storage when u was handed on (kept) or
                # when the storage u lives in was recomputed.
                bu = base[u]
                if bu != base[w] and stage_of[bu] == k and (u if u in schedule.kept else bu) in done:
                    mem.release(rkey[u])
            bw = base[w]
            if bw != w and w not in schedule.kept and stage_of[bw] == k and bw in done:
                mem.release(rkey[w])
        if self.timeline.events:
            self.timeline.events[-1].live_bytes = mem.live

    def _hand_on_kept(self, k: int, v: str, rkey: dict[str, object],
                      re_refs: dict[str, int], saved: list[object]) -> None:
        """A kept boundary op does not run again: its kept outputs become the recomputed
        stage's (held by its readers in the stage and by what its own backward saves, the
        storages ``saved``), and the checkpoint's own reference goes to the recomputation's
        frame."""
        mem = self.mem
        key = self.kept_held.pop(v)
        for _ in range(re_refs[v]):
            mem.hold(key)
        extra = self.held[v]  # its extra outputs, kept since the forward
        self.held[v] = []
        for held in extra:
            self.held[v].append(held)
        for ref in saved:
            mem.hold(ref)
            self.held[v].append(ref)
        for u in self.pred[v]:
            if self.stage_of[self.base[u]] == k and self.base[u] != self.base[v]:
                mem.release(rkey[u])
        # The stage's program returns its boundary: it holds the value until the
        # recomputation ends (``_end_recomputation``).
        self.frame_kept.append(key)
        self.timeline.events.append(Event("recompute", v, mem.live, mem.live, k))

    def _restore_stage(self, k: int) -> None:
        """An offloaded stage's saved state comes back to the device as fresh copies (each
        storage once)."""
        restored: set[object] = set()
        for v in self.offloaded[k]:
            self._save_extra(v)
            for r in self.saved_refs[v]:
                key = ("restored", self.base[r])
                if key in restored:
                    self.mem.hold(key)
                else:
                    restored.add(key)
                    self.mem.alloc(key, self.size[r], 1)
                self.held[v].append(key)
        if restored or self.offloaded[k]:
            live = self.mem.live
            self.timeline.events.append(Event("restore", self.stages[k][-1], live, live, k))

    # ---- backward --------------------------------------------------------------------------
    def _backward_stage(self, k: int) -> None:
        # Hot (see forward_stage): locals bound once per stage.
        mem, node, grad_of, held, events = self.mem, self.node, self.grad_of, self.held, self.timeline.events
        pred, requires, base, gradient_peak = self.pred, self.requires, self.base, self.gradient_peak
        extra, param_grad_at = self.extra, ({} if self.grads_resident else self.param_grad_at)
        alloc, release, refs, accumulate = mem.alloc, mem.release, mem.refs, self._accumulate
        for v in reversed(self.stages[k]):
            n = node[v]
            my_grad = grad_of.pop(v, None)
            transient = n.ws_bwd
            op = n.op
            if op in INTERNAL_GRADIENT_OPS:
                transient = max(transient, extra[v])
            peak_extra = 0
            if my_grad is not None:
                # v's backward hands a gradient to each predecessor that needs one; what
                # is added into an existing gradient is live only at this op's peak.
                passthrough = op in GRAD_PASSTHROUGH_OPS
                cast = op in CAST_OPS
                for u in pred[v]:
                    if not requires[u]:
                        continue
                    if passthrough or (cast and base[u] == base[v]):
                        incoming = my_grad
                        refs[incoming] += 1
                    else:
                        self.fresh += 1
                        incoming = ("grad", self.fresh)
                        alloc(incoming, node[u].mem, 1)
                    peak_extra += accumulate(u, incoming)
                pb = param_grad_at.get(v, 0)
                if pb:
                    # The first step's parameter gradients: allocated here, kept.
                    alloc(("param_grad", v), pb, 1)
            peak = mem.live + transient + peak_extra
            gradient_peak[v] = mem.grad_live + peak_extra + transient
            if my_grad is not None:
                release(my_grad)
            saved = held.pop(v, None)
            if saved:
                for key in saved:
                    release(key)
            events.append(Event("backward", v, mem.live, peak, k))
        if self.closure[k]:
            # The checkpointed stage's frame, and the inputs it kept, go with its last op.
            for key in self.closure[k]:
                release(key)
            self.closure[k] = []
            events[-1].live_bytes = mem.live

    def _new_grad(self, nbytes: int) -> object:
        self.fresh += 1
        key = ("grad", self.fresh)
        self.mem.alloc(key, nbytes, 1)
        return key

    def _accumulate(self, u: str, incoming: object) -> int:
        """Add ``incoming`` into u's gradient; returns the bytes of ``incoming`` that were
        live only until the add."""
        old = self.grad_of.get(u)
        if old is None:
            self.grad_of[u] = incoming
            return 0
        mem = self.mem
        if mem.refs[old] == 1 and incoming != old and mem.size[old] >= mem.size[incoming]:
            # In-place accumulation into the sole owner (not into a broadcast one: a sum's
            # gradient, expanded from one element, is summed into a buffer of its own).
            transient = mem.size[incoming] if mem.refs[incoming] == 1 else 0
            mem.release(incoming)
            return transient
        # Shared buffer: old + new is a new buffer.
        summed = self._new_grad(self.node[u].mem)
        transient = mem.size[incoming] if mem.refs[incoming] == 1 else 0
        mem.release(old)
        mem.release(incoming)
        self.grad_of[u] = summed
        return transient
