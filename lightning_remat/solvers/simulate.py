"""The memory timeline a plan predicts, op by op, through the forward and the backward.

The model is PyTorch's eager behaviour (Hong et al. section 4): a tensor is freed as soon as
nothing needs it; what an op saves for backward lives until that op's backward has run;
a value's gradient buffer is allocated when the first consumer's backward produces it and
freed once the value's own backward has consumed it; parameter gradients appear during the
backward and stay. Recomputed stages keep only their inputs through the forward and run
their forward again just before their backward; offloaded stages keep nothing on the
device between their forward and backward.

What is counted is the step's memory above what is resident before it: inputs and
parameters are not counted (DESIGN.md section 6).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_remat.graph.ir import Graph

if TYPE_CHECKING:
    from lightning_remat.solvers.plan import Plan


@dataclass
class Event:
    phase: str
    """``forward``, ``recompute`` or ``backward``."""
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


class _Memory:
    """Named live blocks and the running total."""

    def __init__(self) -> None:
        self.blocks: dict[tuple, int] = {}
        self.live = 0

    def alloc(self, key: tuple, nbytes: int) -> None:
        if key not in self.blocks:
            self.blocks[key] = nbytes
            self.live += nbytes

    def free(self, key: tuple) -> None:
        nbytes = self.blocks.pop(key, None)
        if nbytes is not None:
            self.live -= nbytes


def simulate(graph: Graph, plan: Plan | None = None) -> Timeline:
    """Predicted live bytes after every op of one training step under ``plan`` (the plain
    keep-everything plan when None)."""
    ids = graph.ids
    if not ids:
        return Timeline()
    if plan is None:
        stage_of = dict.fromkeys(ids, 0)
        action = dict.fromkeys(ids, "keep")
        stages = [ids]
    else:
        stage_of = plan.stage_of()
        action = plan.action_of()
        stages = [sorted(s.nodes, key=graph.position) for s in plan.stages]
    meta = graph.meta
    saved_refs: dict[str, list[str]] | None = meta.get("saved_refs")
    param_bytes: dict[str, int] = meta.get("param_bytes", {})
    outputs = set(meta.get("outputs", [ids[-1]]))

    def refs(v: str) -> list[str]:
        return [r for r in (saved_refs or {}).get(v, []) if r in graph]

    def extra_saved(v: str) -> int:
        if saved_refs is None:
            return graph[v].saved
        return max(graph[v].saved - sum(graph[r].mem for r in set(refs(v))), 0)

    # Which ops (by id) hold a value for their backward.
    holders: dict[str, set[str]] = {v: set() for v in ids}
    for v in ids:
        for r in refs(v):
            holders[r].add(v)

    mem = _Memory()
    timeline = Timeline()
    consumers_left = {v: len(graph.successors(v)) for v in ids}

    def held_for_backward(u: str, done_bwd: set[str]) -> bool:
        """Whether some op whose saved tensors are still on the device holds u."""
        for h in holders[u]:
            if h in done_bwd:
                continue
            if action[h] == "keep" or (action[h] == "recompute" and h in recomputed):
                return True
        return False

    def crosses_stage(u: str) -> bool:
        return any(stage_of[w] != stage_of[u] for w in graph.successors(u))

    # ---- forward ------------------------------------------------------------------------
    recomputed: set[str] = set()
    done_bwd: set[str] = set()
    for v in ids:
        node = graph[v]
        mem.alloc(("val", v), node.mem)
        if action[v] == "keep":
            mem.alloc(("extra", v), extra_saved(v))
        peak = mem.live + node.ws_fwd
        for u in graph.predecessors(v):
            consumers_left[u] -= 1
        for u in [*graph.predecessors(v), v]:
            if consumers_left[u] > 0 or u in outputs:
                continue
            # A checkpointed stage keeps its inputs: values crossing into a recomputed stage.
            kept_as_input = crosses_stage(u) and any(
                action[w] == "recompute" and stage_of[w] != stage_of[u] for w in graph.successors(u)
            )
            if kept_as_input or held_for_backward(u, done_bwd):
                continue
            mem.free(("val", u))
        timeline.events.append(Event("forward", v, mem.live, peak, stage_of[v]))

    # ---- backward -----------------------------------------------------------------------
    grad_needed = {v: len(graph.successors(v)) for v in ids}
    for k in range(len(stages) - 1, -1, -1):
        stage = stages[k]
        in_stage = set(stage)
        if stage and action[stage[0]] == "recompute":
            for v in stage:
                node = graph[v]
                recomputed.add(v)
                mem.alloc(("val", v), node.mem)
                mem.alloc(("extra", v), extra_saved(v))
                peak = mem.live + node.ws_fwd
                timeline.events.append(Event("recompute", v, mem.live, peak, k))
            # Values of the stage nobody holds any more (not saved, not an output) go.
            for v in stage:
                if not held_for_backward(v, done_bwd) and v not in outputs and not any(
                    w not in in_stage for w in graph.successors(v)
                ):
                    mem.free(("val", v))
        for v in reversed(stage):
            node = graph[v]
            if v in outputs:
                mem.alloc(("grad", v), node.mem)
            new_grads = 0
            for u in graph.predecessors(v):
                if ("grad", u) not in mem.blocks:
                    mem.alloc(("grad", u), graph[u].mem)
                    new_grads += graph[u].mem
            if ("param_grad", v) not in mem.blocks and param_bytes.get(v):
                mem.alloc(("param_grad", v), int(param_bytes[v]))
            peak = mem.live + node.ws_bwd
            done_bwd.add(v)
            mem.free(("grad", v))
            mem.free(("extra", v))
            for u in [*graph.predecessors(v), v]:
                if u in in_stage or stage_of[u] < k:
                    still_needed = held_for_backward(u, done_bwd) or (
                        u not in done_bwd and stage_of[u] < k and any(
                            action[w] == "recompute" and w not in done_bwd
                            for w in graph.successors(u)
                        )
                    )
                    if not still_needed and (u == v or saved_refs is not None or u in done_bwd):
                        mem.free(("val", u))
            if saved_refs is None:
                mem.free(("val", v))
            timeline.events.append(Event("backward", v, mem.live, peak, k))
            del new_grads
    return timeline
