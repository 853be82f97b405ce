"""A plan compiled once into what each stage does: the schedule both the simulator
(``solvers.simulate``) and the executor (``runtime.stages``) follow.

A :class:`Plan` says which vertices form a stage and the stage's action. What that means
op by op is decided here, once, on the vertex graph (docs/design.md section 5):

- **rewritten**: the in-place ops that must run out of place (or on a clone) so that a
  recomputation starts from the unmodified value and a kept value stays as the forward
  made it. Op ``v`` writing ``t`` is rewritten when they are in different stages and either
  is recomputed (``t`` here is every value made before ``v`` in the storage it writes: an
  Identity or a view between a batch norm and its in-place activation hides none); when another stage reads ``t`` and is recomputed or runs on the other side
  of ``v`` (a reader before ``v`` in program order placed in a later stage, or after it in
  an earlier one); when ``v`` is recomputed in a stage that keeps values (under the
  selective policy, which would hand on a kept value ``v`` then modified) and its result,
  or ``t`` in its own stage, crosses the stage boundary; and when ``t`` is a step input that ``v``'s recomputed stage,
  or another recomputed stage that reads the inputs, would see modified.
- **kept**: a recomputed stage's boundary values (Kusumoto et al.'s ``B(Li)``) and the model
  outputs it makes, kept from the forward and not run again, except random ops (a kept
  random op draws nothing in the recomputation, which would shift the stage's later draws)
  and in-place ops left in place (their result is the tensor they modified), and values
  that live in another value's storage (views, and ops that returned their input: a dropout
  of probability 0, a cast to the dtype it has), whose op makes no tensor of its own for the
  policy to save: they are run again (a view of what the recomputation makes) and hold
  nothing from the forward. Keeping costs
  the executor a selective-checkpoint policy that every op of the stage passes through, in
  the forward and in the recomputation; a stage where plain checkpoint's early stop already
  runs none of its boundary again (each boundary value lies after the stage's last saving
  op, or is that op and it only packs its inputs, see **packed only**) keeps nothing and
  runs under plain checkpoint, with no Python per op.
- **recomputed**: the rest of a recomputed stage, ``Vi \\ B(Li)``, run again in the
  backward in forward order, up to the stage's last op that saves anything for the
  backward: torch's non-reentrant checkpoint stops the recomputation (``early_stop``) when
  that op has saved what the forward's saved, and the ops after it never run again. An op
  saves its inputs before it computes and its outputs after, so when that last op saves
  only what it reads (a convolution, a linear layer) it computes nothing either
  (**packed only**): its inputs are saved again, and the stage's other values go with the
  recomputation's frame.
- **offloaded**: an offloaded stage's saved state leaves the device when its forward ends
  and comes back when its backward starts.
- A recomputed stage none of whose ops saves anything for the backward (adds,
  concatenations, views, scalings, as the profile measured them) runs nothing again:
  torch's non-reentrant checkpoint recomputes a stage when the backward first unpacks what
  it saved. It still keeps its boundary and its inputs until its backward, as the model of
  a recomputed stage says (Kusumoto et al.'s DP folds its stage costs on that).

Op kinds (random, in place) come from ``graph.ops``. Checkmate (Jain et al., "Checkmate:
Breaking the Memory Wall with Optimal Tensor Rematerialization", 2020) compiles its
solution into one linear schedule that its executor replays the same way; :meth:`Schedule.steps`
is that sequence here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

from lightning_remat.graph.ir import Graph
from lightning_remat.graph.ops import inplace_operands, random_vertices
from lightning_remat.solvers.plan import Plan

__all__ = ["Schedule", "ScheduleParts", "StageSchedule", "Step", "data_edges", "make_schedule", "order_note",
           "rewrite_seconds"]


def data_edges(graph: Graph) -> list[tuple[str, str]]:
    """The edges through which a value flows: all but ``meta.shape_edges``. A consumer that
    reads only its input's shape (``x.view(q.size(0), ...)``) holds none of its storage, is
    no reason to keep it at a stage boundary (the executor reads the size in the
    producer's stage) and hands it no gradient; the edge still orders the two."""
    shape = {(u, v) for u, v in graph.meta.shape_edges or ()}
    return [(u, v) for u, v in graph.edges if (u, v) not in shape]


@dataclass(frozen=True)
class ScheduleParts:
    """What every schedule of one graph reads, computed once per graph (solvers that
    score many plans of it share one)."""

    succ: dict[str, list[str]]
    """Successors along :func:`data_edges`, in the graph's order."""
    inplace: dict[str, str | None]
    """In-place op -> the vertex it writes (None: a step input), ``graph.ops``."""
    random: frozenset[str]
    """Vertices whose op draws random numbers, ``graph.ops``."""
    outputs: frozenset[str]
    """The model's outputs."""
    input_readers: frozenset[str]
    """Vertices that read the step's inputs."""
    position: dict[str, int]
    saving: frozenset[str]
    """Vertices whose op saves something for the backward (all, where the graph does not
    say: no profile)."""
    random_recorded: bool = False
    """Whether ``random`` is what the tracer saw the ops draw (else op names guess it)."""
    sharing: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Vertex -> every vertex whose output lives in its storage (views of one tensor and
    in-place results on it, as the profile names them), in order; absent: its own alone."""
    saves_inputs_only: frozenset[str] = frozenset()
    """Saving vertices whose op saves only values it reads (predecessors' storages, step
    inputs), nothing it makes: saved before it computes. Where the profile does not say
    (no ``saved_refs``), none."""
    aliases: frozenset[str] = frozenset()
    """Vertices whose output lives in another vertex's storage, as the profile names them
    (``meta.aliases``: views, in-place results, and ops that returned their input, such as a
    dropout of probability 0 or a cast to the dtype it has)."""

    @cached_property
    def inplace_writes(self) -> tuple[tuple[str, tuple[str, ...] | None, tuple[tuple[str, bool], ...]], ...]:
        """Per in-place op v (``inplace``): the values made before it in the storage it
        writes (None: it writes a step input), and each other reader of those values (of
        the step's inputs) with whether it runs before v in the forward. ``_rewritten``
        reads these for every plan."""
        position = self.position
        writes = []
        for v, t in self.inplace.items():
            if t is None:
                readers = tuple((w, position[w] < position[v]) for w in self.input_readers if w != v)
                writes.append((v, None, readers))
                continue
            held = tuple(x for x in self.sharing.get(t, (t,)) if position[x] < position[v]) or (t,)
            readers = tuple((w, position[w] < position[v]) for x in held for w in self.succ[x] if w != v)
            writes.append((v, held, readers))
        return tuple(writes)

    @classmethod
    def of(cls, graph: Graph, succ: dict[str, list[str]] | None = None) -> ScheduleParts:
        if succ is None:
            succ = {v: [] for v in graph.ids}
            for u, v in data_edges(graph):
                succ[u].append(v)
        outputs = graph.meta.outputs if graph.meta.outputs is not None else graph.ids[-1:]
        meta = graph.meta
        if meta.saved_refs is None:
            saving = frozenset(graph.ids)
        else:
            requires = meta.requires_grad or {}
            saving = frozenset(
                v for v in graph.ids
                if requires.get(v, True) and (graph[v].saved > 0 or meta.saved_refs.get(v)))
        groups: dict[str, list[str]] = {}
        for v, root in (meta.aliases or {}).items():
            groups.setdefault(root, [root]).append(v)
        position = {v: k for k, v in enumerate(graph.ids)}
        sharing = {v: ordered for group in groups.values()
                   if (ordered := tuple(sorted((u for u in group if u in position), key=position.get)))
                   for v in ordered}
        return cls(succ, inplace_operands(graph), frozenset(random_vertices(graph)),
                   frozenset(outputs), frozenset(meta.input_consumers or ()),
                   position, saving, meta.random is not None, sharing,
                   _saves_inputs_only(graph, saving), frozenset(meta.aliases or ()))


@dataclass(frozen=True)
class StageSchedule:
    """What one stage of a plan does."""

    action: str
    """``keep``, ``recompute`` or ``offload``."""
    vertices: tuple[str, ...]
    """The stage's vertices in forward order."""
    kept: frozenset[str] = frozenset()
    """For a recomputed stage: the values kept from the forward, not run again."""
    recomputed: tuple[str, ...] = ()
    """For a recomputed stage: the vertices run again in the backward, in forward order
    (the recomputation stops at the stage's last saving op: none after it)."""
    rewritten: frozenset[str] = frozenset()
    """The stage's in-place ops that run out of place."""
    runs_again: bool = False
    """For a recomputed stage: whether its backward runs it again at all (no: none of its
    ops saves anything, so the backward never asks checkpoint for what it saved)."""
    draws_random: bool = True
    """For a recomputed stage: whether an op it runs again draws random numbers, so that
    checkpoint must stash the generator's state for the recomputation to draw the same
    (``preserve_rng_state``). True where the tracer did not record which ops draw."""
    packed_only: str | None = None
    """For a recomputed stage: its last saving op when that op saves only what it reads and
    is not kept: the recomputation saves its inputs again and stops before it computes."""
    reached: tuple[str, ...] = ()
    """For a recomputed stage that runs again: its vertices up to its last saving op, in
    order (kept ones handed on, the others run again or, the last, packed only)."""

    @property
    def offloaded(self) -> bool:
        """Whether the stage's saved state leaves the device between its forward and backward."""
        return self.action == "offload"


@dataclass(frozen=True)
class Step:
    """One step of the linear schedule: ``phase`` is ``forward``, ``offload`` (a stage's
    saved state leaves), ``loss``, ``recompute``, ``hand_on`` (a kept value handed to the
    recomputation), ``restore`` (offloaded state back) or ``backward``."""

    phase: str
    stage: int
    vertex: str | None = None


@dataclass(frozen=True)
class Schedule:
    """A plan compiled for one graph: per stage what is kept, recomputed, rewritten and
    offloaded (see the module docstring)."""

    stages: tuple[StageSchedule, ...]
    whole_stages: bool = False
    """A recomputed stage runs again whole, its boundary included (the tracing fallback's
    executor, ``runtime.hooked``): nothing is kept or rewritten."""

    @property
    def rewritten(self) -> frozenset[str]:
        """Every in-place op that runs out of place."""
        return frozenset().union(*(s.rewritten for s in self.stages))

    @property
    def kept(self) -> list[frozenset[str]]:
        """Per stage, the values kept from the forward (empty but for recomputed stages)."""
        return [s.kept for s in self.stages]

    @property
    def recomputed(self) -> list[tuple[str, ...]]:
        """Per stage, the vertices run again in the backward (empty but for recomputed stages)."""
        return [s.recomputed for s in self.stages]

    def steps(self) -> Iterator[Step]:
        """The step as one sequence: each stage's forward (an offloaded stage's state
        leaving at its end), the loss, then in reverse each stage's recomputation (kept
        values handed on where they stand) or restore, and its backward."""
        for k, stage in enumerate(self.stages):
            for v in stage.vertices:
                yield Step("forward", k, v)
            if stage.offloaded:
                yield Step("offload", k)
        yield Step("loss", len(self.stages) - 1)
        for k in range(len(self.stages) - 1, -1, -1):
            stage = self.stages[k]
            if stage.action == "recompute" and stage.runs_again:
                for v in stage.reached:
                    yield Step("hand_on" if v in stage.kept else "recompute", k, v)
            elif stage.offloaded:
                yield Step("restore", k)
            for v in reversed(stage.vertices):
                yield Step("backward", k, v)


def make_schedule(graph: Graph, plan: Plan, *, whole_stages: bool = False,
                  parts: ScheduleParts | None = None, keep_boundaries: bool = False) -> Schedule:
    """``plan`` compiled for ``graph`` (``parts``: :meth:`ScheduleParts.of` the graph,
    shared between many plans). ``keep_boundaries``: every recomputed stage keeps its
    boundary, even where plain checkpoint would run none of it again, views and values that
    returned their input included (the stage-cost fold of ``solvers.stage_costs`` counts
    each boundary in the cache, an upper bound on what the executor holds)."""
    parts = parts if parts is not None else ScheduleParts.of(graph)
    position = parts.position
    unknown = [v for s in plan.stages for v in s.nodes if v not in position]
    if unknown:
        raise ValueError(f"the plan names vertices the graph does not have: {unknown[:8]}; "
                         "plan and graph must come from the same trace")
    ordered = [tuple(sorted(s.nodes, key=position.__getitem__)) for s in plan.stages]
    actions = [s.action for s in plan.stages]
    if whole_stages:
        return Schedule(tuple(
            StageSchedule(a, vs, recomputed=vs if a == "recompute" else (), runs_again=a == "recompute",
                          reached=vs if a == "recompute" else ())
            for a, vs in zip(actions, ordered)), whole_stages=True)
    stage_of = {v: k for k, vs in enumerate(ordered) for v in vs}
    always, for_policy = _rewritten(parts, stage_of, actions)
    rewritten = always | for_policy
    plain = set()
    for k, vertices in enumerate(ordered):
        if actions[k] == "recompute" and not keep_boundaries and _plain_checkpoint_is_cheaper(
                graph, vertices, _boundary(parts, stage_of, k, vertices, rewritten),
                _reached(parts, vertices), parts, [v for v in vertices if v in for_policy]):
            plain.add(k)
    if plain:
        # A stage under plain checkpoint keeps no value for the policy to hand on, so only
        # the in-place ops whose overwritten value a recomputation reads run out of place.
        rewritten = always | {v for v in for_policy if stage_of[v] not in plain}
    stages = []
    for k, vertices in enumerate(ordered):
        if actions[k] != "recompute":
            stages.append(StageSchedule(actions[k], vertices,
                                        rewritten=frozenset(v for v in vertices if v in rewritten)))
            continue
        kept = frozenset() if k in plain else _boundary(parts, stage_of, k, vertices, rewritten,
                                                        keep_boundaries)
        reached = _reached(parts, vertices)
        runs_again = bool(reached)
        packed_only = (reached[-1] if reached and reached[-1] not in kept
                       and reached[-1] in parts.saves_inputs_only else None)
        recomputed = tuple(v for v in reached if v not in kept and v != packed_only)
        stages.append(StageSchedule(
            "recompute", vertices, kept, recomputed,
            frozenset(v for v in vertices if v in rewritten), runs_again,
            not parts.random_recorded or any(v in parts.random for v in recomputed), packed_only, reached))
    return Schedule(tuple(stages))


def _boundary(parts: ScheduleParts, stage_of: dict[str, int], k: int, vertices: tuple[str, ...],
              rewritten: set[str], aliases: bool = False) -> frozenset[str]:
    """The values recomputed stage ``k`` keeps under the selective policy (the module
    docstring's **kept**). ``aliases``: values living in another's storage count as kept
    too (the stage-cost fold's upper bound: a later recomputed stage holds such a value
    as its input until its backward, which the fold's cache must count; kept, the storage
    is held until this stage's recomputation, no shorter)."""
    random, inplace, alias = parts.random, parts.inplace, parts.aliases
    return frozenset(
        v for v in vertices
        if v not in random and (v in rewritten or v not in inplace)
        and (aliases or v in inplace or v not in alias) and _crosses(parts, stage_of, v, k))


def _crosses(parts: ScheduleParts, stage_of: dict[str, int], x: str, k: int) -> bool:
    """Whether ``x`` (of stage ``k``) is a model output or read outside its stage."""
    if x in parts.outputs:
        return True
    for w in parts.succ[x]:
        if stage_of[w] != k:
            return True
    return False


def _reached(parts: ScheduleParts, vertices: tuple[str, ...]) -> tuple[str, ...]:
    """A recomputed stage's vertices up to its last saving op (checkpoint's early stop)."""
    savers = [i for i, v in enumerate(vertices) if v in parts.saving]
    return vertices[:savers[-1] + 1] if savers else ()


def _plain_checkpoint_is_cheaper(graph: Graph, vertices: tuple[str, ...], kept: frozenset[str],
                                 reached: tuple[str, ...], parts: ScheduleParts,
                                 policy_rewrites: list[str] | tuple[str, ...] = ()) -> bool:
    """Whether a recomputed stage runs under plain checkpoint rather than keep its boundary
    (the module docstring's **kept**): where plain checkpoint's early stop runs none of the
    kept values again (each lies after the last saving op, or is that op and only packs its
    inputs), or where the forward time of those it would run again is less than what the
    selective policy costs on the stage's ops (``meta.recompute_vertex_seconds`` per
    vertex, docs/design.md section 4.7) and on the in-place ops it alone makes run out of
    place (``policy_rewrites``, each charged as :func:`rewrite_seconds` says). A value run again rather than kept takes no more
    memory: kept, it is held from the forward to the recomputation; run again, it is made
    when the recomputation reaches it, its readers' backward done (a model output, which
    the step may hold to its end, stays kept)."""
    again = [v for v in reached if v in kept
             and not (v == reached[-1] and v in parts.saves_inputs_only)]
    if not again:
        return True
    if any(v in parts.outputs for v in again):
        return False  # the step may hold its outputs: run again, one would be made twice
    per_vertex = float(graph.meta.recompute_vertex_seconds or 0.0)
    policy = per_vertex * len(vertices) + sum(rewrite_seconds(graph, v) for v in policy_rewrites)
    return sum(graph[v].t_fwd for v in again) < policy


def rewrite_seconds(graph: Graph, v: str) -> float:
    """What running the in-place op ``v`` out of place costs beyond running it in place,
    each time it runs (docs/design.md section 4.7): its own forward time, an upper bound.
    The op writes a buffer it allocates rather than the one it reads; on a 2-core CPU, ReLU
    and addition out of place took 0.2 to 0.65 of the in-place op's time more, about
    the time to touch the new buffer's pages."""
    return float(graph[v].t_fwd)


def _saves_inputs_only(graph: Graph, saving: frozenset[str]) -> frozenset[str]:
    """The saving vertices whose op saves only storages it reads (``ScheduleParts``): every
    ``saved_refs`` entry the storage of a value it reads, not of its own output, and no
    saved bytes besides those and the step inputs it saves."""
    meta = graph.meta
    if meta.saved_refs is None:
        return frozenset()
    aliases = meta.aliases or {}

    def root(v: str) -> str:
        while v in aliases:
            v = aliases[v]
        return v

    found = set()
    for v in saving:
        # The profile names a saved storage by its first owner: a view the op reads is
        # saved as the value it views.
        refs = set(meta.saved_refs.get(v, ()))
        read = {root(u) for u in graph.predecessors(v)}
        if not {root(r) for r in refs} <= read or any(root(r) == root(v) for r in refs):
            continue
        referenced = sum(graph[r].mem for r in refs) + int((meta.saved_input_bytes or {}).get(v, 0))
        if graph[v].saved <= referenced:
            found.add(v)
    return frozenset(found)


def _rewritten(parts: ScheduleParts, stage_of: dict[str, int], actions: list[str]) -> tuple[set[str], set[str]]:
    """The in-place ops that run out of place under a plan (the module docstring's rule):
    those rewritten whatever runs its stage, and those rewritten only because their stage
    keeps values under the selective policy (the op's result, or a value in the storage it
    writes, crosses the boundary), which a stage under plain checkpoint runs in place."""
    if not parts.inplace:
        return set(), set()
    recomputed = [a == "recompute" for a in actions]

    def crosses(x: str) -> bool:
        return _crosses(parts, stage_of, x, stage_of[x])

    def moved(w: str, before: bool, s: int) -> bool:
        """Whether reader ``w`` of what op v (in stage ``s``) writes sees it otherwise than
        the forward does: in another stage, recomputed, or run on the other side of v
        (``before``: w runs before v in the forward)."""
        t = stage_of[w]
        return t != s and (recomputed[t] or before != (t < s))

    rewritten: set[str] = set()
    for_policy: set[str] = set()
    for v, held, readers in parts.inplace_writes:
        s = stage_of[v]
        if held is None:  # a step input: a recomputation must read it unmodified
            if recomputed[s] or any(moved(w, before, s) for w, before in readers):
                rewritten.add(v)
            continue
        # v writes t's storage, and so every value made before v that lives there (an
        # Identity or a view between a batch norm and its in-place activation): each is
        # judged as t is.
        if (any(stage_of[x] != s and (recomputed[s] or recomputed[stage_of[x]]) for x in held)
                or any(moved(w, before, s) for w, before in readers)):
            rewritten.add(v)
        elif recomputed[s] and (crosses(v) or any(stage_of[x] == s and crosses(x) for x in held)):
            for_policy.add(v)
    return rewritten, for_policy


def order_note(graph: Graph, plan: Plan) -> str:
    """A note for a plan whose stages run ops out of the forward's order, else "".

    The executor runs the stages one after the other, each in the forward's order; a plan
    whose stage holds an op the forward runs before an op of an earlier stage (a lower set
    of Kusumoto et al.'s DP that is not a prefix of the forward) makes autograd's nodes in
    another order than plain training. The backward takes the ready nodes in the order they
    were made (the latest first), so it can meet the readers of a value in another order
    and sum that value's gradient otherwise: where three or more readers hand it a
    gradient, the sum, and every gradient computed from it (those of the ops before it),
    can differ from plain training's in the last bits (docs/design.md section 5, "Plain's
    order"). The note names the values whose readers run in another order than the
    forward's, the direct cases."""
    position = {v: graph.position(v) for s in plan.stages for v in s.nodes if v in graph}
    order = [v for s in plan.stages for v in sorted((v for v in s.nodes if v in position), key=position.__getitem__)]
    latest, late, first = "", 0, ""
    for v in order:
        if latest and position[v] < position[latest]:
            late += 1
            first = first or f"{v} after {latest}"
        elif not latest or position[v] > position[latest]:
            latest = v
    if not late:
        return ""
    ran = {v: k for k, v in enumerate(order)}
    readers: dict[str, list[str]] = {}
    for u, v in data_edges(graph):
        if u in ran and v in ran:
            readers.setdefault(u, []).append(v)
    moved = [u for u, vs in readers.items() if len(vs) >= 3
             and sorted(vs, key=ran.__getitem__) != sorted(vs, key=position.__getitem__)]
    moved.sort(key=position.__getitem__)
    named = (f"; values read by three or more ops whose readers run out of the forward's order: "
             f"{', '.join(moved[:8])}{' ...' if len(moved) > 8 else ''} ({len(moved)})" if moved else "")
    return (f"order: the stages run {late} ops after ops the forward runs later (the first: {first}); "
            "the backward can then sum the gradient of a value read by three or more ops in another "
            "order than plain training, and that gradient and those before it can differ from plain's "
            f"in the last bits{named}")
